#!/usr/bin/env bash
# One device call on nvidia-h200-x2: all-reduce tests + benchmark, then the single-GPU issue-2 suite.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -x tests/test_allreduce.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/pytest_allreduce.txt"
timeout 200 python3 -m fastdecode bench allreduce --world 2 --out "$OUT/allreduce.json" > "$OUT/bench_allreduce.txt" 2>&1
grep -E "^all_reduce" "$OUT/bench_allreduce.txt" | head -70
if [ "${ISSUE2:-1}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python3 -m pytest -q -x tests/test_norm.py tests/test_activation_quant.py tests/test_backend.py \
      tests/test_gpu_integration.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest_issue2.txt"
  timeout 240 python3 -m fastdecode.bench.norm_activation_quant norm silu quant --out "$OUT/norm_activation_quant.json" > "$OUT/bench_norm.txt" 2>&1
  tail -3 "$OUT/bench_norm.txt"
fi
