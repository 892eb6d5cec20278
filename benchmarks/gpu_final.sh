#!/usr/bin/env bash
# Device call: int4 fast-path GPU tests, the int4 benchmark, and the 8B decode benchmark at batch 1:
# bf16 / fp8 / int4 through the dispatcher, and every GEMM forced onto Triton or cuBLAS. Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown} TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -x tests/test_int4_gpu.py -p no:cacheprovider \
  -k "fast_conversion or (bf16_real_sizes and 6144)" 2>&1 | tail -4 > "$OUT/pytest_int4.txt"; tail -1 "$OUT/pytest_int4.txt"
timeout 120 python3 -m fastdecode bench int4 --out "$OUT/int4_linear.json" > "$OUT/bench_int4.txt" 2>&1; tail -2 "$OUT/bench_int4.txt"
B="python3 -m fastdecode bench decode --preset llama-3.1-8b --batch 1 --iters 30"
timeout 100 $B --quant fp8 --impl fastdecode-graph fastdecode-graph-triton fastdecode-graph-cublas --out "$OUT/decode_fp8_b1.json" > "$OUT/decode_fp8.txt" 2>&1; grep "us/step" "$OUT/decode_fp8.txt"
timeout 60 $B --quant int4 --impl fastdecode-graph --out "$OUT/decode_int4_b1.json" > "$OUT/decode_int4.txt" 2>&1; grep "us/step" "$OUT/decode_int4.txt"
