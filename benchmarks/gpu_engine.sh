#!/usr/bin/env bash
# Device call: engine GPU tests and the decode benchmark (input 1, output 128). Results in $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -x tests/test_engine_gpu.py tests/test_attention.py -m gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_engine.txt"
B="python3 -m fastdecode bench decode --preset llama-3.1-8b --input-len 1 --output-len 128"
timeout 200 $B --batch 1 --iters 30 --impl torch-graph torch-compile fastdecode-graph-cublas fastdecode-graph \
   --out "$OUT/decode_b1.json" --plot "$OUT/decode_b1.png" > "$OUT/decode_b1.txt" 2>&1; tail -12 "$OUT/decode_b1.txt"
timeout 60 $B --batch 1 --iters 3 --impl torch-eager --out "$OUT/decode_eager.json" > "$OUT/decode_eager.txt" 2>&1; tail -4 "$OUT/decode_eager.txt"
timeout 150 $B --batch 8 32 --iters 10 --impl torch-graph fastdecode-graph --out "$OUT/decode_b8_32.json" > "$OUT/decode_b8_32.txt" 2>&1; tail -8 "$OUT/decode_b8_32.txt"
