#!/usr/bin/env bash
# Device call: int4 GPU tests (the fast-conversion ones first), a quick int4 tuning run (writes the
# dispatcher table), the int4 benchmark. Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown} TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
timeout 120 python3 -m pytest -q -x tests/test_int4_gpu.py -p no:cacheprovider \
  -k "fast_conversion or bf16_real_sizes or every_group or tuner" 2>&1 | tail -15 > "$OUT/pytest_int4.txt"
tail -3 "$OUT/pytest_int4.txt"
timeout 230 python3 -m fastdecode tune int4 --quick --no-fp8 --out "$OUT/int4_linear_nvidia_h200.json" > "$OUT/tune_int4.txt" 2>&1
tail -3 "$OUT/tune_int4.txt"
cp "$OUT/int4_linear_nvidia_h200.json" src/fastdecode/configs/ 2>/dev/null
timeout 150 python3 -m fastdecode bench int4 --out "$OUT/int4_linear.json" > "$OUT/bench_int4.txt" 2>&1
tail -3 "$OUT/bench_int4.txt"
