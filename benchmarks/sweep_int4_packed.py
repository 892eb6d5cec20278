"""PACKED (``kernels.int4_packed``, the int4 FMA kind in packed 16-bit pairs) against the table's choice, one GPU,
one process.

    python benchmarks/sweep_int4_packed.py --out DIR/sweep_int4_packed.json [--ms 1,2] [--shapes 8b.qkv,...]
        [--table DIR/int4_linear_<gpu>.json]

Per shape and M (graph replays of 20 calls, rotated weights, median of 30; ``harness.time_cuda``), zero-point
weights as the engine quantises them (group 128, bf16), the 8B projections, 70B-TP2 gate_up and the 8B head (an int4
head with ``--quant-head int4``):

* ``dispatch``: ``int4_linear`` as the engine calls it (the tuned table);
* ``table + PACKED``: the table's tile with PACKED, where it is an fma tile of BLOCK_K 256 (SCALE_PF dropped);
* ``packed bn.. w.. sk..[ pf2]``: a grid of PACKED fma tiles (``bench.int4.PACKED_TILES``, the tuner's; splits 1-8;
  PREFETCH 1 and, session 39, 2: two steps' words in flight, ~40 KB a SM against ~24 KB at the best tiles' counted
  registers),
  each checked against the fp32 reference before it is timed (``err_rel``: the max error over the reference's
  largest value; an ``error`` key where it misses);
* ``... unroll`` (session 42): the fastest ``REFINE`` PREFETCH 2 tiles of the grid, and the table's tile where it is
  one (``table + unroll``), again with PF_UNROLL (two buffers, the loop unrolled by two, instead of the rotated
  triple buffer: fewer register copies a step in the sm_90 SASS), and ``... unroll sum16`` with SUM16 too (a
  thread's four words summed in 16-bit pairs before the fp32 fold: fewer instructions, more rounding, its
  ``err_rel`` in the row); an ``int4_packed_unroll`` row per pair gives both times and the speed-up;
* baselines: ``cublas_bf16`` (``torch.mm`` on the dequantised weight) and ``tinygemm`` (``_weight_int4pack_mm``).

The summary rows (``op: int4_packed_summary``): the table's time, the best PACKED tile's, the speed-up.

``--table PATH``: where the best PACKED tile beats the table's choice, it replaces that (shape, M) entry of the
``int4_linear`` section in a copy of the table in use at PATH (``FASTDECODE_CONFIG_DIR=DIR`` then runs the step on
it: ``gpu.py int4-packed``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fastdecode.bench.harness import make_row, print_table  # noqa: E402
from fastdecode.bench.int4 import PACKED_TILES, ZERO_MODE, _Operands  # noqa: E402
from fastdecode.bench.int4_scripts import (  # noqa: E402
    baseline_rows, dispatch_row, flush_rows, pick_shapes, timed_configs, write_best_configs,
)
from fastdecode.kernels.compile import precompile  # noqa: E402
from fastdecode.ops.int4 import int4_linear_with_config  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "70b_tp2.gate_up": (28672, 8192), "8b.head": (128256, 4096)}  # the head: --quant-head int4
SPLITS = (1, 2, 4, 8)
MIN_GAIN = 0.02  # --table: a PACKED tile replaces the table's entry only when it is this much faster
REFINE = 4  # the fastest PREFETCH 2 tiles timed again with PF_UNROLL


PREFETCHES = (True, 2)  # the next step's words in flight, or the next two (more bytes in flight a thread)


def grid(M: int) -> list[dict]:
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    return [{"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk, "num_warps": nw,
             "num_stages": 1, "PREFETCH": pf, "PACKED": True}
            for bn, nw in PACKED_TILES for sk in SPLITS for pf in PREFETCHES]


def with_packed(cfg: dict) -> dict | None:
    """The table's tile with PACKED, where it is an fma tile of one layout tile a step (SCALE_PF dropped)."""
    if cfg.get("kind") != "fma" or cfg.get("BLOCK_K") != 256:
        return None
    return {**{k: v for k, v in cfg.items() if k != "SCALE_PF"}, "PACKED": True}


def _name(c: dict) -> str:
    return (f"packed bn{c['BLOCK_N']} w{c['num_warps']} sk{c['SPLIT_K']}" + (" pf2" if c["PREFETCH"] == 2 else "")
            + (" unroll" if c.get("PF_UNROLL") else "") + (" sum16" if c.get("SUM16") else ""))


def _is_pf2(c: dict) -> bool:
    return bool(c.get("PACKED")) and c.get("kind") == "fma" and c.get("PREFETCH") == 2 and not c.get("PF_UNROLL")


def unrolled(rows: list[dict], table: dict) -> list[tuple[str, dict, dict]]:
    """(name, config, the row it unrolls): PF_UNROLL forms, without and with SUM16, of the fastest ``REFINE`` correct
    PREFETCH 2 rows of ``rows`` (one shape and M) and of the table's row where its tile is one."""
    pf2 = sorted((r for r in rows if "error" not in r and r.get("median_us") and r["impl"].startswith("packed bn")
                  and _is_pf2(r["config"])), key=lambda r: r["median_us"])[:REFINE]
    bases = [(r["impl"], r) for r in pf2]
    if "error" not in table and _is_pf2(table["config"]):
        bases.append(("table +", table))
    return [(f"{name} {tag}", dict(r["config"], PF_UNROLL=True, **extra), r) for name, r in bases
            for tag, extra in (("unroll", {}), ("unroll sum16", {"SUM16": True}))]


def sweep(out_path: Path | None, shapes, ms) -> list[dict]:
    rows = []
    for sname in shapes:
        N, K = SHAPES[sname]
        ops = _Operands(N, K, 128, max(ms), ZERO_MODE)
        for M in ms:
            shape = {"name": sname, "M": M, "N": N, "K": K, "group": 128}
            rows += baseline_rows("int4_packed", ops, M, shape)
            table = dispatch_row("int4_packed", ops, M, shape)
            rows.append(table)
            table_cfg = table["config"]
            cands = [("table + PACKED", c) for c in [with_packed(table_cfg)] if c] + [(_name(c), c) for c in grid(M)]
            x, w0, out0 = ops.x_all[:M], ops.packed[0], ops.out_all[0][:M]

            def warm(c, x=x, w0=w0, out0=out0):
                int4_linear_with_config(x, w0, None, out0, c, warmup=True)

            precompile(warm, [c for _, c in cands])
            best = timed_configs("int4_packed", ops, M, shape, cands, rows)
            pairs = unrolled([r for r in rows if r["shape"] == shape], table)
            precompile(warm, [c for _, c, _ in pairs])
            for name, c, base in pairs:
                r = timed_configs("int4_packed", ops, M, shape, [(name, c)], rows)
                if r is None:
                    continue
                rows.append(make_row("int4_packed_unroll", name, shape, None, rotated_us=base["median_us"],
                                     unrolled_us=r["median_us"], speedup=round(base["median_us"] / r["median_us"], 3),
                                     config=c))
                if best is None or r["median_us"] < best["median_us"]:
                    best = r
            if best is not None:
                rows.append(dict(best, impl="packed best", variant=best["impl"]))
                rows.append(make_row("int4_packed_summary", "packed vs table", shape, None,
                                     table_us=table["median_us"], packed_us=best["median_us"],
                                     speedup=round(table["median_us"] / best["median_us"], 3),
                                     table_err_rel=table.get("err_rel"), packed_err_rel=best.get("err_rel"),
                                     table_config=table_cfg, best_config=best["config"]))
            print_table([r for r in rows if r["shape"] == shape and not r["impl"].startswith("packed bn")],
                        ("impl", "median_us", "tbps", "err_rel", "variant"))
        del ops
        flush_rows(rows, ZERO_MODE, out_path)
    return rows


def write_table(path: Path, rows: list[dict]) -> dict:
    """The (shape, M) entries where the best PACKED tile beats the table's choice by ``MIN_GAIN``, into the
    ``int4_linear`` section of the table at ``path`` (the table in use when ``path`` is new)."""
    return write_best_configs(path, "int4_linear", rows, "int4_packed_summary", "packed_us",
                              keep=lambda r: r["speedup"] >= 1 + MIN_GAIN)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--ms", default="1,2")
    p.add_argument("--table", type=Path, default=None,
                   help="the PACKED tiles that win into a copy of the int4_linear table at this path")
    a = p.parse_args(argv)
    rows = sweep(a.out, pick_shapes(p, a.shapes, SHAPES), [int(m) for m in a.ms.split(",")])
    if a.table:
        write_table(a.table, rows)
    print_table([r for r in rows if r["op"] == "int4_packed_summary"],
                ("shape", "table_us", "packed_us", "speedup", "table_err_rel", "packed_err_rel"))
    print_table([r for r in rows if r["op"] == "int4_packed_unroll"], ("shape", "impl", "rotated_us", "unrolled_us",
                                                                       "speedup"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
