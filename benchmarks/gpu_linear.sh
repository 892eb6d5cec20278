#!/usr/bin/env bash
# Device call: skinny-GEMM GPU tests, tuning (configs as data), benchmark vs cuBLAS. Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -x tests/test_linear_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_linear.txt"
timeout 150 python3 -m fastdecode tune linear > "$OUT/tune.txt" 2>&1; tail -5 "$OUT/tune.txt"
cp src/fastdecode/configs/linear_*.json "$OUT/" 2>/dev/null
timeout 150 python3 -m fastdecode bench linear --out "$OUT/linear.json" > "$OUT/bench_linear.txt" 2>&1
tail -40 "$OUT/bench_linear.txt"
