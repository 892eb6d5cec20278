#!/usr/bin/env bash
# Issue 8, one device call on nvidia-h200-x4 or -x8 (NOT RUN YET: those kinds were withheld in every
# session so far). WORLD = the GPUs of the machine. Results in $OUT:
#   1. multi-GPU all-reduce tests at every world size up to WORLD (10,000-replay stress included);
#   2. the all-reduce benchmark at WORLD (H 4096/8192/16384, M 1..4096, 8 KB..64 MB) with
#      --write-config: the crossovers for WORLD ranks land in src/fastdecode/configs/allreduce_*.json
#      (copy $OUT/allreduce_config.json back and commit it);
#   3. decode, Llama-3.1-70B shapes at TP=WORLD, FP8 and BF16, fused all-reduce on and off;
#      Llama-3.1-405B shapes FP8 at TP=8 (WORLD=8 only).
# Usage (device): FASTDECODE_GIT_SHA=<sha> WORLD=4 bash benchmarks/gpu_multi.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
WORLD=${WORLD:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
timeout 240 python3 -m pytest -q -x tests/test_allreduce.py -m multigpu -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/pytest_allreduce.txt"
timeout 240 python3 -m fastdecode bench allreduce --world "$WORLD" --write-config --out "$OUT/allreduce.json" \
  > "$OUT/bench_allreduce.txt" 2>&1; grep -E "^crossovers|Error" "$OUT/bench_allreduce.txt"
cp src/fastdecode/configs/allreduce_nvidia_h200.json "$OUT/allreduce_config.json"
B="python3 -m fastdecode bench decode --batch 1 --iters 30 --tp $WORLD --impl fastdecode-graph fastdecode-graph-no-fused_allreduce"
for q in fp8 none; do
  Q=$([ "$q" = none ] && echo "" || echo "--quant $q")
  timeout 200 $B --preset llama-3.1-70b $Q --out "$OUT/decode_70b_tp${WORLD}_$q.json" > "$OUT/decode_70b_$q.txt" 2>&1
  grep -E "us/step|Error" "$OUT/decode_70b_$q.txt"
done
if [ "$WORLD" = 8 ]; then
  timeout 300 $B --preset llama-3.1-405b --quant fp8 --out "$OUT/decode_405b_tp8_fp8.json" > "$OUT/decode_405b.txt" 2>&1
  grep -E "us/step|Error" "$OUT/decode_405b.txt"
fi
