"""Development check (GPU): the int4 ``norm_gemm`` step's rule at more than one token, before and after session 34.

``models.norm_gemm.applies(model, B)`` takes the fused step where every int4 projection's tile is an fma tile. Until
session 34 it asked for the tile at one token whatever B was, and for w2 the ``int4_add_linear`` section even where w2
runs as ``int4_add_linear_glu``. Since then it asks for each projection's own op at B rows (``rule="rows"``). On the
H200's table the embedded SmolLM2's gate_up and down take dot tiles from 8 rows, so a batch of 8 now runs the unfused
step, where the old rule (``rule="one-token"``) ran the fused one with the norm and SiLU-and-mul kernels before those
two tensor-core tiles (the ops' fallback). This times both rules and the unfused step, per batch, in one process::

    PYTHONPATH=src python benchmarks/diag_norm_gemm_batch_rule.py --model model.gguf --batch 1 4 8 --out rows.json
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

RULES = ("rows", "one-token")


@contextmanager
def batch_rule(rule: str):
    """``norm_gemm._supported`` as the rule ``rule`` has it (``rows``: as shipped; ``one-token``: before session 34)."""
    from fastdecode.models import norm_gemm

    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    saved = norm_gemm._supported
    if rule == "one-token":
        norm_gemm._supported = lambda p, dtype, batch, op: saved(
            p, dtype, 1, "int4_add_linear" if op == "int4_add_linear_glu" else op)
    try:
        yield
    finally:
        norm_gemm._supported = saved


def main(argv=None) -> int:
    from fastdecode.bench.decode import bench_decode
    from fastdecode.bench.harness import write_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint (the embedded GGUF) or a preset")
    p.add_argument("--quant", default=None, help="for a preset: int4")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="all rows as JSON")
    a = p.parse_args(argv)
    rows = []
    for b in a.batch:
        for rule in RULES:
            with batch_rule(rule):
                impls = ("fastdecode-graph",) + (("fastdecode-graph-no-norm_gemm",) if rule == RULES[0] else ())
                got = bench_decode(a.model, batch=b, iters=a.iters, impls=impls, quant=a.quant)
                rows += [dict(r, diag_rule=rule) for r in got]
    for r in rows:
        if "median_us" in r:
            print(f"batch {r['shape']['batch']:>2} {r['diag_rule']:>9} {r['impl']:<30} {r['median_us']:9.2f} us")
    if a.out:
        write_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
