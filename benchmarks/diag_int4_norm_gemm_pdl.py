"""Development check (GPU): why the 8B int4 decode step with its norms inside the int4 GEMMs got slower with PDL.

Session 18 (c13d239, every W4A16 block on the ``norm_gemm`` path, every kernel kind fused) measured the 8B int4
step at 3431.1 us with PDL and 3189.2 without, against 2619.2 unfused with PDL: the sweep of the ops
(``sweep_int4_norm_gemv.py``) explains ~+365 us, PDL the rest. ``models.norm_gemm`` now keeps the 8B on the
unfused step (its gate_up runs on the mma kind). This builds the 8B int4 model once per mode and, in one process:

* ``--mode every-kind``: ``norm_gemm`` on every int4 block and the norm inside every kernel kind (c13d239's step);
* ``--mode fallback``: ``norm_gemm`` on every int4 block, the norm kernel before the tensor-core kinds (the op's
  rule since a927d60): qkv / o / down fused on the FMA kind at M = 1, gate_up as norm kernel + mma;

and for each, ``bench decode`` rows (``fastdecode-graph``, ``-no-pdl``, ``-no-norm_gemm``: median of 30 against
the unfused step in the same process) and ``bench decode --profile`` rows (per-kernel time with and without PDL).

    PYTHONPATH=src python benchmarks/diag_int4_norm_gemm_pdl.py --mode fallback every-kind --out rows.json
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager


@contextmanager
def int4_norm_gemm(mode: str):
    """Every int4 block on the norm_gemm path (``models.norm_gemm._supported`` accepting any W4A16 ``Int4Linear``
    of a 16-bit model); ``every-kind``: the norm inside the tensor-core kinds too."""
    import fastdecode.ops.int4_norm_linear as ops
    from fastdecode.models import norm_gemm
    from fastdecode.models.int4 import INT4_ACT_DTYPES, Int4Linear

    saved = norm_gemm._supported, ops._FUSED_KINDS
    norm_gemm._supported = lambda p, dtype, batch, op: norm_gemm._dense(p) or (
        isinstance(p, Int4Linear) and dtype in INT4_ACT_DTYPES)
    if mode == "every-kind":
        ops._FUSED_KINDS = ("fma", "dot", "mma")
    try:
        yield
    finally:
        norm_gemm._supported, ops._FUSED_KINDS = saved


def main(argv=None) -> int:
    from fastdecode.bench.decode import bench_decode
    from fastdecode.bench.harness import write_rows
    from fastdecode.bench.profile import profile_decode

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", nargs="+", choices=("fallback", "every-kind"), default=["fallback", "every-kind"])
    p.add_argument("--no-profile", action="store_true", help="the timed rows only")
    p.add_argument("--out", default=None, help="all rows as JSON")
    a = p.parse_args(argv)
    rows = []
    for mode in a.mode:
        with int4_norm_gemm(mode):
            got = bench_decode("llama-3.1-8b", quant="int4", iters=30, impls=(
                "fastdecode-graph", "fastdecode-graph-no-pdl", "fastdecode-graph-no-norm_gemm"))
            rows += [dict(r, diag_mode=mode) for r in got]
            if not a.no_profile:
                got = profile_decode("llama-3.1-8b", quant="int4",
                                     impls=("fastdecode-graph-no-pdl", "fastdecode-graph"))
                rows += [dict(r, diag_mode=mode, profile=True) for r in got]
    for r in rows:
        if "median_us" in r:
            print(f"{r['diag_mode']:>10} {r['impl']:<32} {r['median_us']:9.1f} us")
    if a.out:
        write_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
