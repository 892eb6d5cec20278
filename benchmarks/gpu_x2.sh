#!/usr/bin/env bash
# One device call on nvidia-h200-x2: all-reduce tests + benchmark, then single-GPU sweeps. Results in $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi topo -m 2>&1 | head -5 | tee "$OUT/topo.txt"
timeout 200 python3 -m pytest -q -x tests/test_allreduce.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/pytest_allreduce.txt"
timeout 200 python3 -m fastdecode bench allreduce --world 2 --out "$OUT/allreduce.json" > "$OUT/bench_allreduce.txt" 2>&1
tail -60 "$OUT/bench_allreduce.txt"
if [ "${SWEEP:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/sweep_norm_configs.py --out "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  tail -3 "$OUT/sweep.txt"
fi
