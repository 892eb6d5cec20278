#!/usr/bin/env bash
# Device call: engine int4 GPU tests, per-kernel profiles of the 8B decode step (bf16, fp8, int4), the
# int4 decode benchmark with its int4-GEMM ablation. Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown} TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -x tests/test_engine_int4.py -m gpu -p no:cacheprovider 2>&1 | tail -6 > "$OUT/pytest_engine_int4.txt"
tail -2 "$OUT/pytest_engine_int4.txt"
for q in none fp8 int4; do
  a=""; [ $q != none ] && a="--quant $q"
  timeout 100 python3 benchmarks/profile_decode.py $a --out "$OUT/profile_$q.json" > "$OUT/profile_$q.txt" 2>&1
  head -14 "$OUT/profile_$q.txt"
done
timeout 150 python3 -m fastdecode bench decode --preset llama-3.1-8b --quant int4 --batch 1 --iters 30 \
  --impl fastdecode-graph fastdecode-graph-no-int4_gemm --out "$OUT/decode_int4_b1.json" > "$OUT/decode_int4.txt" 2>&1
tail -5 "$OUT/decode_int4.txt"
