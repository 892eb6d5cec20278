# Source before benchmarks/gpu.py on a device machine: on any GPU but the H200, the H200's tuned tables are
# copied under this GPU's name into /tmp/cfg and FASTDECODE_CONFIG_DIR points there (the rows record it), so an
# H100 runs the configs the package ships for the H200 instead of the untuned heuristics. Since session 33 the package
# does that by itself for every sm_90 GPU without its own tables (fastdecode.ops._common.table_path); this script
# only makes it explicit in the rows (config_dir) and keeps runs comparable with those of sessions 24-32.
_fd_gpu=$(python3 -c "import torch; from fastdecode.ops._common import gpu_key; print(gpu_key(torch.cuda.get_device_name(0)))")
if [ "$_fd_gpu" != "nvidia_h200" ]; then
    mkdir -p /tmp/cfg
    for _fd_fam in linear int4_linear allreduce; do
        cp "src/fastdecode/configs/${_fd_fam}_nvidia_h200.json" "/tmp/cfg/${_fd_fam}_${_fd_gpu}.json"
    done
    export FASTDECODE_CONFIG_DIR=/tmp/cfg
fi
echo "GPU ${_fd_gpu}; FASTDECODE_CONFIG_DIR=${FASTDECODE_CONFIG_DIR:-<package tables>}"
