"""Diagnostic (GPU): w13's norm and FP8 quantisation inside its W8A8 GEMM (``ops.norm_linear_fp8``, the
``fp8_norm_gemm`` switch) against the two kernels it replaces, per shape at one token.

Rows (median of graph replays, rotated weights, PDL off as ``bench.harness.time_cuda`` times; one process):

* ``norm_then_gemm``: ``rms_norm_fp8`` (the norm kernel with FP8 output, one scale a row) then ``linear_fp8``: what the
  default FP8 step runs before gate_up;
* ``gemm``: ``linear_fp8`` alone on a ready FP8 input (its config from the table);
* ``gemm_q128``: ``linear_fp8`` with the fused op's tile (BLOCK_K 128, one split): what the tile costs by itself;
* ``fused``: ``rms_norm_linear_fp8`` (the package's config).

    PYTHONPATH=src python benchmarks/diag_norm_fp8.py --out rows.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fastdecode.bench.harness import make_row, rotation_count, time_cuda, write_rows
from fastdecode.constants import SCALE_VECTOR
from fastdecode.ops.gemm import linear_fp8, linear_with_config
from fastdecode.ops.norm import rms_norm_fp8
from fastdecode.ops.norm_linear_fp8 import get_norm_fp8_config, rms_norm_linear_fp8, rms_norm_linear_fp8_ref

# name: (N, K): the 8B gate_up and qkv, the 70B-TP2 gate_up
SHAPES = {"8b_gate_up": (28672, 4096), "8b_qkv": (6144, 4096), "70b_tp2_gate_up": (28672, 8192)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        shape = {"name": name, "M": 1, "N": N, "K": K}
        wb = N * K
        ws = [(torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(rotation_count(wb))]
        scale = torch.rand(N, device=dev) * 1e-3 + 2e-4
        h = torch.randn(1, K, device=dev).bfloat16() * 3
        g = (torch.rand(K, device=dev) + 0.5).bfloat16()
        ref = rms_norm_linear_fp8_ref(h, g, ws[0], scale)
        got = rms_norm_linear_fp8(h, g, ws[0], scale)
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        outs = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in ws]

        def timed(impl, calls, **extra):
            t = time_cuda(calls, graph=True)
            rows.append(make_row("diag_norm_fp8", impl, shape, t, bytes_moved=wb,
                                 weight_tbps=round(wb / (t.median_us * 1e-6) / 1e12, 3), **extra))
            print(f"{name} {impl:16s} {t.median_us:8.2f} us", flush=True)

        timed("norm_then_gemm", [lambda w=w: linear_fp8(*rms_norm_fp8(h, g, 1e-6), w, scale) for w in ws])
        xq, xs = rms_norm_fp8(h, g, 1e-6)
        timed("gemm", [lambda w=w: linear_fp8(xq, xs, w, scale) for w in ws])
        cfg = get_norm_fp8_config(1, N, K, dev)
        timed("gemm_q128", [lambda w=w, o=o: linear_with_config(xq, w, None, xs.reshape(1), SCALE_VECTOR, scale,
                                                                 SCALE_VECTOR, o, cfg) for w, o in zip(ws, outs)],
              config=cfg)
        timed("fused", [lambda w=w, o=o: rms_norm_linear_fp8(h, g, w, scale, out=o) for w, o in zip(ws, outs)],
              config=cfg, rel_err=round(err, 6))
    if a.out:
        write_rows(rows, a.out)


if __name__ == "__main__":
    main()
