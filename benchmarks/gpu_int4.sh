#!/usr/bin/env bash
# Device call: int4 GPU tests, a quick int4 tuning run (writes the dispatcher table), the int4
# benchmark, then the FP8 decode benchmark (Llama-3.1-8B shapes, batch 1). Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown} TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
timeout 170 python3 -m pytest -q -x tests/test_int4_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_int4.txt"
timeout 270 python3 -m fastdecode tune int4 --quick --out "$OUT/int4_linear_nvidia_h200.json" > "$OUT/tune_int4.txt" 2>&1
tail -5 "$OUT/tune_int4.txt"
cp "$OUT/int4_linear_nvidia_h200.json" src/fastdecode/configs/ 2>/dev/null
timeout 150 python3 -m fastdecode bench int4 --out "$OUT/int4_linear.json" > "$OUT/bench_int4.txt" 2>&1
grep -E "summary|geomean|pass" "$OUT/bench_int4.txt" | tail -12; tail -3 "$OUT/bench_int4.txt"
timeout 120 python3 -m fastdecode bench decode --preset llama-3.1-8b --quant fp8 --batch 1 --iters 30 \
  --impl fastdecode-graph --out "$OUT/decode_fp8_b1.json" > "$OUT/decode_fp8.txt" 2>&1; tail -6 "$OUT/decode_fp8.txt"
