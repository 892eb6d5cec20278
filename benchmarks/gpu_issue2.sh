#!/usr/bin/env bash
# One device call for the foundation issue: GPU tests, config sweep, benchmark. Results under $OUT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FASTDECODE_GIT_SHA=${FASTDECODE_GIT_SHA:-unknown}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -x tests/test_norm.py tests/test_activation_quant.py tests/test_backend.py \
    tests/test_gpu_integration.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest.txt"
if [ "${SWEEP:-1}" = 1 ]; then
  timeout 150 python3 benchmarks/sweep_norm_configs.py --out "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  tail -3 "$OUT/sweep.txt"
fi
timeout 300 python3 -m fastdecode bench kernels --out "$OUT/norm_activation_quant.json" 2>&1 | tail -80 > "$OUT/bench.txt"
cat "$OUT/bench.txt"
