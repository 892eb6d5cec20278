"""Development sweep: the int4 FMA kind's tiles on SmolLM2's small shapes at one token (GPU), as the embedded
model's ``norm_gemm`` step runs them, against the bf16 GEMVs of the same step.

Session 31's profile of the embedded GGUF step (Q4_1: group 32, "min", fp16 scales; H100, PDL off) put each int4
GEMV at 4.1-5.3 us of kernel time against 2.6-3.8 us for the bf16 GEMV of the same shape, though it reads a
quarter of the bytes: ~1.5 us a call, ~170 us a step over 120 calls. The tuned tables' tiles on these shapes are
BLOCK_N 16 (36-192 programs) and BLOCK_K 256 (K = 576 pads to 768: three steps); the bf16 kernel's are BLOCK_N
4-8 and BLOCK_K 1024 (one step, 144-768 programs). ``bench.int4.candidates`` proposed no fma tile below
BLOCK_N 16 or under 4 warps until session 31, and none above BLOCK_K 256. This times, per shape, the op the step runs
(``int4_rms_norm_linear``'s kernel for qkv / gate_up, ``int4_add_linear_``'s for o / down) with the table's tile
and with a grid of smaller tiles (BLOCK_N 4-16, 1-4 warps, split-K 1-4; at 04d59ae also BLOCK_K 1024), and
with PREFETCH 2 and SCALE_PF (session 31's kernel options for the loop's load latency); on the norm shapes every
one-split tile also with NORM_LOOP (row suffix ``_nl``; session 32); down with SiLU-and-mul inside, as the step runs
it (``int4_glu``; ``--no-glu``: without). Each is checked against its fp32 reference first, then timed in one process
on rotated weights (CUDA graphs, PDL off: ``bench.harness.time_cuda``); the bf16 op on the same shape is the
baseline row.

    PYTHONPATH=src python benchmarks/sweep_int4_small_fma.py --out rows.json
    PYTHONPATH=src python benchmarks/sweep_int4_small_fma.py --grid table --shapes 8b.qkv,8b.o --out rows.json

``--grid table`` times the table's own tile with the same options instead (session 32: the 8B shapes, g128).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_int4_norm_gemv import EPS, SHAPES  # noqa: E402

from fastdecode.bench.harness import make_row, time_cuda, write_rows  # noqa: E402
from fastdecode.bench.int4_fused import FusedOperands, op_of  # noqa: E402
from fastdecode.kernels.int4 import split_k_blocks  # noqa: E402
from fastdecode.ops.int4 import get_int4_config  # noqa: E402
from fastdecode.ops.norm_linear import add_linear_, rms_norm_linear  # noqa: E402

SMALL = [name for name in SHAPES if name.startswith("smollm2.")]


def tiles(K: int) -> list[dict]:
    """The grid: fma tiles of 4-16 weight rows on 1-4 warps (at least one weight word a thread), BLOCK_K 256
    with split-K 1, 2, 4 (fewer where K has fewer steps); then four one-split tiles with PREFETCH 2, four with
    SCALE_PF and two with both."""
    out = []
    # BLOCK_K 1024 (no per-group scaling there: SPG 0) lost on every shape at 04d59ae and is no longer tried
    for bn, nw, sk in itertools.product((4, 8, 16), (1, 2, 4), (1, 2, 4)):
        if bn * 256 // 8 < 32 * nw or sk > -(-K // 256):  # fewer words than threads, or more splits than steps
            continue
        out.append({"kind": "fma", "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk, "num_warps": nw,
                    "num_stages": 1, "PREFETCH": True})
    # PREFETCH 2 (the words of two steps ahead in flight) and SCALE_PF (the next step's scales and mins with its
    # words), session 31, not timed yet, on the one-split tiles that won
    for (bn, nw), pf, spf in [(t, 2, False) for t in ((4, 2), (8, 2), (8, 4), (16, 4))] + \
            [(t, 1, True) for t in ((4, 2), (8, 2), (8, 4), (16, 4))] + [(t, 2, True) for t in ((8, 2), (16, 4))]:
        out.append({"kind": "fma", "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": nw,
                    "num_stages": 1, "PREFETCH": pf, "SCALE_PF": spf})
    return out


def table_variants(table_cfg: dict) -> list[dict]:
    """``--grid table`` (the 8B shapes; session 32): the table's fma tile and the same tile on half its rows, each with
    PREFETCH 1 or 2 and with or without SCALE_PF (the table's own tile is the "table" row); for a table tile of
    another kind, fma tiles of 64 rows on 4 warps with one and two splits, the same four ways."""
    if table_cfg.get("kind") == "fma":
        bases = [table_cfg, {**table_cfg, "BLOCK_N": max(4, table_cfg["BLOCK_N"] // 2)}]
    else:
        bases = [{"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": sk, "num_warps": 4,
                  "num_stages": 1} for sk in (1, 2)]
    out = []
    for b, (pf, spf) in itertools.product(bases, ((True, False), (2, False), (True, True), (2, True))):
        c = {**b, "PREFETCH": pf, "SCALE_PF": spf}
        if c != {**table_cfg, "SCALE_PF": False}:  # the table's own tile: its own row
            out.append(c)
    return out


def with_norm_loop(cands: list[tuple[str, dict]], K: int) -> list[tuple[str, dict]]:
    """The norm side: each candidate of one effective split again with NORM_LOOP (the loop sums the rows' squares
    instead of a pass before it; opt-in since session 32, whose step showed its effect depends on the tile)."""
    return cands + [(impl + "_nl", {**c, "NORM_LOOP": True}) for impl, c in cands
                    if c.get("kind") == "fma" and split_k_blocks(K, c)[1] == 1]


def _name(cfg: dict) -> str:
    pf = ("_pf2" if cfg.get("PREFETCH") == 2 else "") + ("_spf" if cfg.get("SCALE_PF") else "")
    return f"fma_n{cfg['BLOCK_N']}_k{cfg['BLOCK_K']}_s{cfg['SPLIT_K']}_w{cfg['num_warps']}{pf}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SMALL))
    p.add_argument("--grid", choices=("small", "table"), default="small",
                   help="small: the grid of small tiles (SmolLM2); table: the table's tile with PREFETCH 2 / SCALE_PF")
    p.add_argument("--no-glu", action="store_true",
                   help="down without SiLU-and-mul inside (the step runs it with, int4_glu, where K <= 4096)")
    p.add_argument("--out")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a smoke run (tests)
    p.add_argument("--max-tiles", type=int, default=0, help=argparse.SUPPRESS)  # smoke runs: the first n tiles
    a = p.parse_args()
    dev, dt, M = torch.device(a.device), torch.bfloat16, 1
    rows = []
    for name in a.shapes.split(","):
        N, K, g, fmt, side = SHAPES[name]
        # the op the step runs; down: [gate | up] rows and SiLU-and-mul inside (int4_glu; bf16: add_linear_'s glu)
        op = op_of(name, K)
        if a.no_glu and op == "int4_add_linear_glu":
            op = "int4_add_linear"
        glu = op == "int4_add_linear_glu"
        ops = FusedOperands(op, N, K, g, fmt, M, dev)  # rotated weights, inputs, outputs, the fp32 reference
        w0, n_rot = ops.w[0], len(ops.w)
        wbytes = N * K // 2 + sum(t.numel() * t.element_size() for t in (w0.scales, w0.zeros, w0.mins) if t is not None)
        dense = [(torch.randn(N, K, device=dev) * 0.02).to(dt) for _ in range(n_rot)]
        xs, nw, out, res = ops.x, ops.norm_weight, ops.out, ops.res
        # the tile the step runs: the fused op's own table entry, else the plain GEMV's (ops.int4.FUSED_OPS)
        table = get_int4_config(M, N, K, g, dev, op=op)
        shape = {"M": M, "N": N, "K": K, "group": g, "format": fmt, "name": name, "dtype": "bfloat16",
                 "table": list(table), "side": "glu" if glu else side}
        if side == "norm":
            bf16 = [lambda i=i: rms_norm_linear(xs[i], nw, dense[i], eps=EPS, out=out) for i in range(n_rot)]
        else:
            bf16 = [lambda i=i: add_linear_(res[i], xs[i], dense[i], glu=glu) for i in range(n_rot)]
        cands = [("table", table[1])] if table[0] == "triton" else []
        grid = tiles(K) if a.grid == "small" else table_variants(table[1])
        cands += [(_name(c), c) for c in grid[:a.max_tiles or None]]
        if side == "norm":
            cands = with_norm_loop(cands, K)
        base = None
        for impl, cfg in [("bf16", None)] + cands:
            try:
                calls = bf16 if cfg is None else ops.calls(cfg)
                if cfg is not None:  # checked once on fresh inputs (the add side restores its residual)
                    err = ops.check(cfg)
                    if err:
                        raise AssertionError(f"{err}, against the reference")
                if dev.type != "cuda":
                    continue
                t = time_cuda(calls, graph=True)
            except Exception as e:  # recorded, not timed
                rows.append(make_row("sweep_int4_small_fma", impl, shape, None, error=e, config=cfg))
                print(f"{name:>16} {impl:<24} FAILED {e}", flush=True)
                continue
            base = base or t.median_us
            rows.append(make_row("sweep_int4_small_fma", impl, shape, t, bytes_moved=wbytes, config=cfg,
                                 vs_bf16=round(t.median_us / base, 3)))
            print(f"{name:>16} {impl:<24} {t.median_us:7.2f} us  x{t.median_us / base:.3f} of bf16", flush=True)
        best = min((r for r in rows if r["shape"] == shape and r["median_us"] and r["impl"] != "bf16"),
                   key=lambda r: r["median_us"], default=None)
        if best is not None:
            print(f"{name:>16} best {best['impl']} {best['median_us']:.2f} us", flush=True)
        if a.out:  # after each shape: a run cut short keeps the shapes it finished
            write_rows(rows, a.out)


if __name__ == "__main__":
    main()
