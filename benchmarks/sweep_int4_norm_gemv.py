"""Development sweep: the RMSNorm and the residual add inside the int4 GEMMs (``ops.int4_norm_linear``; GPU).

The ``norm_gemm`` step (``models.norm_gemm``) replaces, in each int4 block, the norm kernel + int4
GEMM by one ``int4_rms_norm_linear`` (qkv, gate_up) and the int4 GEMM + the fused add-and-norm's add by
``int4_add_linear_`` (o, down). Each program of the fused kernel first sums its rows' squares over the whole of K:
one extra pass over x (L2) before the weights' loop, for one launch less. This times, for the 8B (RTN group 128
with zeros) and SmolLM2-135M (GGUF Q4_1: group 32, "min", fp16 scales) shapes at M = 1 and 4, on the same rotated
weights in one process (CUDA graphs, PDL off: ``bench.harness.time_cuda``):

* ``int4_linear``: the GEMM alone (the dispatcher's pick), the floor of any fused variant;
* ``rms_norm+int4_linear`` / ``int4_linear+add``: the two kernels the unfused step runs (the add as ``add_`` here;
  in the model it is the fused add-and-norm that follows);
* ``int4_rms_norm_linear`` / ``int4_add_linear_``: one kernel.

Every variant is checked against its fp32 reference first.

    PYTHONPATH=src python benchmarks/sweep_int4_norm_gemv.py --out rows.json
"""

from __future__ import annotations

import argparse

import torch

from fastdecode.bench.harness import make_row, rotation_count, time_cuda, write_rows
from fastdecode.bench.int4_fused import EPS, SHAPES as FUSED_SHAPES, make_weight as _weight, op_of
from fastdecode.ops.int4 import get_int4_config, int4_linear
from fastdecode.ops.int4_norm_linear import (
    int4_add_linear_, int4_add_linear_ref, int4_rms_norm_linear, int4_rms_norm_linear_ref,
)
from fastdecode.ops.norm import rms_norm

# name: (N, K, group, format, side) of the fused ops' tuner's shapes (fastdecode.bench.int4_fused): "norm" shapes
# take the norm before them, "add" shapes the residual after
SHAPES = {name: (*FUSED_SHAPES[name], "norm" if op_of(name, FUSED_SHAPES[name][1]) == "int4_rms_norm_linear" else "add")
          for name in ("8b.qkv", "8b.gate_up", "8b.o", "8b.down",
                       "smollm2.qkv", "smollm2.gate_up", "smollm2.o", "smollm2.down")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ms", default="1,4")
    p.add_argument("--out")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a smoke run (tests)
    a = p.parse_args()
    dev, dt = torch.device(a.device), torch.bfloat16
    rows = []
    for name in a.shapes.split(","):
        N, K, g, fmt, side = SHAPES[name]
        w0 = _weight(N, K, g, fmt, dev)
        wbytes = N * K // 2 + sum(t.numel() * t.element_size() for t in (w0.scales, w0.zeros, w0.mins) if t is not None)
        n_rot = rotation_count(wbytes)
        ws = [w0] + [_weight(N, K, g, fmt, dev) for _ in range(n_rot - 1)]
        nw = (1 + 0.1 * torch.randn(K, device=dev)).to(dt)
        for M in (int(m) for m in a.ms.split(",")):
            xs = [(torch.randn(M, K, device=dev) * 3).to(dt) for _ in range(n_rot)]
            out = torch.empty(M, N, device=dev, dtype=dt)
            normed = torch.empty(M, K, device=dev, dtype=dt)
            res = [(torch.randn(M, N, device=dev) * 3).to(dt) for _ in range(n_rot)]
            shape = {"M": M, "N": N, "K": K, "group": g, "format": fmt, "name": name, "dtype": "bfloat16",
                     "table": list(get_int4_config(M, N, K, g, dev))}
            plain = [lambda i=i: int4_linear(xs[i], ws[i], out=out) for i in range(n_rot)]
            if side == "norm":
                ref = int4_rms_norm_linear_ref(xs[0], nw, ws[0], eps=EPS).float()
                variants = [
                    ("int4_linear", plain, None),
                    ("rms_norm+int4_linear", [lambda i=i: int4_linear(rms_norm(xs[i], nw, EPS, out=normed), ws[i],
                                                                      out=out) for i in range(n_rot)], ref),
                    ("int4_rms_norm_linear", [lambda i=i: int4_rms_norm_linear(xs[i], nw, ws[i], eps=EPS, out=out)
                                              for i in range(n_rot)], ref),
                ]
                got = {"rms_norm+int4_linear": lambda: out, "int4_rms_norm_linear": lambda: out}
            else:
                r0 = res[0].clone()
                ref = int4_add_linear_ref(r0, xs[0], ws[0]).float()
                variants = [
                    ("int4_linear", plain, None),
                    ("int4_linear+add", [lambda i=i: res[i].add_(int4_linear(xs[i], ws[i], out=out))
                                         for i in range(n_rot)], ref),
                    ("int4_add_linear_", [lambda i=i: int4_add_linear_(res[i], xs[i], ws[i]) for i in range(n_rot)],
                     ref),
                ]
                got = {"int4_linear+add": lambda: res[0], "int4_add_linear_": lambda: res[0]}
            base = None
            for impl, calls, r in variants:
                try:
                    if r is not None:  # checked once on fresh inputs (the add side restores its residual)
                        if side == "add":
                            res[0].copy_(r0)
                        calls[0]()
                        torch.cuda.synchronize()
                        err = float((got[impl]().float() - r).abs().max() / r.abs().max())
                        if not err < 2e-2:
                            raise AssertionError(f"max error {err:.3g} of the output's max against the reference")
                    else:
                        err = None
                    t = time_cuda(calls, graph=True)
                except Exception as e:  # recorded, not timed
                    rows.append(make_row("sweep_int4_norm_gemv", impl, shape, None, error=e))
                    print(f"{name:>16} M={M} {impl:<22} FAILED {e}", flush=True)
                    continue
                base = base or t.median_us
                rows.append(make_row("sweep_int4_norm_gemv", impl, shape, t, bytes_moved=wbytes,
                                     vs_int4_linear=round(t.median_us / base, 3),
                                     max_rel_err=None if err is None else round(err, 5)))
                print(f"{name:>16} M={M} {impl:<22} {t.median_us:8.2f} us {wbytes / t.median_us / 1e6:5.2f} TB/s "
                      f"x{t.median_us / base:.3f} of int4_linear", flush=True)
        ws = None
        torch.cuda.empty_cache()
    if a.out:
        write_rows(rows, a.out)


if __name__ == "__main__":
    main()
