"""Development sweep: launch configs of the norm / SiLU kernels on the GPU (feeds the heuristics).

Times each candidate as CUDA-graph replays with rotated inputs; prints one line per config.
Run: PYTHONPATH=src python benchmarks/sweep_norm_configs.py [--out rows.json]
     PYTHONPATH=src python benchmarks/sweep_norm_configs.py --silu-ms 256,1024 [--silu-is 14336,28672]: SiLU-and-mul
     only, each shape beside torch.compile (issue 18: >= 3.8 TB/s from M = 256 up, never slower than torch.compile)
"""

import argparse
import itertools

import torch

from fastdecode.bench.harness import make_row, rotation_count, time_cuda, write_rows
from fastdecode.kernels.activation import launch_silu_and_mul
from fastdecode.constants import OUT_FP8_DYNAMIC, OUT_NATIVE
from fastdecode.kernels.norm import launch_rms_norm


def sweep_norm(rows, M, H, mode):
    e = 2
    nb = M * H * 3 * e + M * H * (e if mode == OUT_NATIVE else 1)
    sets = [(torch.randn(M, H, device="cuda", dtype=torch.bfloat16),
             torch.randn(M, H, device="cuda", dtype=torch.bfloat16)) for _ in range(rotation_count(nb))]
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, H, device="cuda", dtype=torch.bfloat16 if mode == OUT_NATIVE else torch.float8_e4m3fn)
    scale = torch.empty(M, 1, device="cuda")
    bh = triton_np2(H)
    for block_m, warps in itertools.product([1, 2, 4], [1, 2, 4, 8, 16, 32]):
        if (block_m > 1 and M < 4096) or warps * 32 * 4 > bh * block_m or (block_m == 4 and warps < 4):
            continue
        cfg = {"BLOCK_M": block_m, "BLOCK_H": bh, "num_warps": warps}
        calls = [lambda x=x, r=r: launch_rms_norm(x, r, w, out, scale, 1e-6, mode, cfg) for x, r in sets]
        t = time_cuda(calls, graph=True)
        rows.append(make_row("sweep_add_rms_norm", f"mode{mode}", {"M": M, "H": H, **cfg}, t, bytes_moved=nb))
        print(rows[-1]["shape"], rows[-1]["median_us"], rows[-1]["tbps"], flush=True)


def sweep_silu(rows, M, I, mode, compile_baseline=False):
    nb = M * I * 4 + M * I * (2 if mode == OUT_NATIVE else 1)
    sets = [torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16) for _ in range(rotation_count(nb))]
    out = torch.empty(M, I, device="cuda", dtype=torch.bfloat16 if mode == OUT_NATIVE else torch.float8_e4m3fn)
    scale = torch.empty(M, 1, device="cuda")
    blocks = [512, 1024, 2048, 4096, 8192] if mode == OUT_NATIVE else [triton_np2(I)]
    for block, warps in itertools.product(blocks, [2, 4, 8, 16, 32]):
        if (mode == OUT_NATIVE and warps * 32 * 2 > block) or (mode != OUT_NATIVE and warps < 8):
            continue
        cfg = {"BLOCK": block, "num_warps": warps}
        calls = [lambda x=x: launch_silu_and_mul(x, out, scale, mode, cfg) for x in sets]
        t = time_cuda(calls, graph=True)
        rows.append(make_row("sweep_silu_and_mul", f"mode{mode}", {"M": M, "I": I, **cfg}, t, bytes_moved=nb))
        print(rows[-1]["shape"], rows[-1]["median_us"], rows[-1]["tbps"], flush=True)
    if compile_baseline and mode == OUT_NATIVE:  # the bar: never slower than torch.compile
        ref = torch.compile(lambda x: torch.nn.functional.silu(x[:, :I]) * x[:, I:])
        calls = [lambda x=x: ref(x) for x in sets]
        t = time_cuda(calls, graph=True)
        rows.append(make_row("sweep_silu_and_mul", "torch_compile", {"M": M, "I": I}, t, bytes_moved=nb))
        print(rows[-1]["shape"], "torch.compile", rows[-1]["median_us"], rows[-1]["tbps"], flush=True)


def triton_np2(n):
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--silu-ms", default=None,
                   help="only SiLU-and-mul (native output) at these comma-separated M, beside torch.compile")
    p.add_argument("--silu-is", default="14336", help="with --silu-ms: comma-separated intermediate sizes")
    a = p.parse_args()
    rows = []
    if a.silu_ms:
        for M in (int(m) for m in a.silu_ms.split(",")):
            for I in (int(i) for i in a.silu_is.split(",")):
                sweep_silu(rows, M, I, OUT_NATIVE, compile_baseline=True)
                torch.cuda.empty_cache()
        if a.out:
            write_rows(rows, a.out)
        raise SystemExit(0)
    for M in (1, 16, 4096, 32768):
        for H in (4096, 8192):
            sweep_norm(rows, M, H, OUT_NATIVE)
            if M in (1, 32768):
                sweep_norm(rows, M, H, OUT_FP8_DYNAMIC)
        torch.cuda.empty_cache()
    for M in (1, 32768):
        for I in (14336, 28672):
            sweep_silu(rows, M, I, OUT_NATIVE)
            if M == 32768:
                sweep_silu(rows, M, I, OUT_FP8_DYNAMIC)
            torch.cuda.empty_cache()
    if a.out:
        write_rows(rows, a.out)
