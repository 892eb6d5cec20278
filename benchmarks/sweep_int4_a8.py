"""W4A8 with int8 activations (``ops.int4_a8``) against the W4A16 int4 kernels and the baselines, one H200, one process.

    python benchmarks/sweep_int4_a8.py --out DIR/sweep_int4_a8.json [--ms 1,2,4] [--shapes 8b.qkv,...] [--quick]
        [--table DIR/int4_linear_<gpu>.json]

Per shape and M (graph replays of 20 calls, rotated weights, median of 30; ``harness.time_cuda``), zero-point
weights as the engine quantises them (group 128, bf16):

* ``w4a16 dispatch``: ``int4_linear`` as the engine calls it (the tuned table);
* ``a8 quant``: the activation's quantisation kernel alone; ``a8 gemv <config>``: the dp4a GEMV alone, a sweep of
  BLOCK_N, warps and splits (each checked against the reference first), the best four again with PREFETCH 2
  (``pf2``); ``a8 gemv best`` / ``a8 gemv heuristic``;
  ``a8 op``: ``int4_linear_a8`` as the engine calls it (quantisation + GEMV, the config of ``get_a8_config``: the
  package table's ``int4_linear_a8`` section, else the heuristic);
  ``a8 quant+best``: the two kernels with the sweep's best config;
* ``probe``: the packed words streamed by a kernel that only XORs them (``diag_int4_gemv.py``: the access
  pattern's ceiling), at M = 1;
* baselines: ``cublas_bf16`` (``torch.mm`` on the dequantised weight), ``tinygemm`` (``_weight_int4pack_mm``).

GB/s count the packed weight + scales + zeros + the activation (int8 + its scales and sums for a8) + out. The
summary rows (``op: int4_a8_summary``) give each (shape, M): the W4A16 and a8 times and the speed-up.

``--table PATH``: the best config of each (shape, M) into the ``int4_linear_a8`` section of the int4_linear table at
PATH (merged into what PATH holds, which must come from the same GPU; ``FASTDECODE_CONFIG_DIR=DIR`` then runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fastdecode.bench.harness import make_row, print_table, time_cuda  # noqa: E402
from fastdecode.bench.int4 import ZERO_MODE, _Operands  # noqa: E402
from fastdecode.bench.int4_scripts import (  # noqa: E402
    baseline_rows, dispatch_row, flush_rows, pick_shapes, write_best_configs,
)
from fastdecode.kernels.compile import precompile  # noqa: E402
from fastdecode.ops import int4_a8 as A  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "8b.head": (128256, 4096), "70b_tp2.qkv": (5120, 8192), "70b_tp2.gate_up": (28672, 8192),
          "70b_tp2.down": (8192, 14336)}
DEFAULT_SHAPES = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down", "8b.head")


def configs(M: int, quick: bool = False) -> list[dict]:
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    bns = {1: (32, 64, 128), 2: (32, 64), 4: (16, 32, 64)}[bm]
    warps = (4,) if quick or bm == 4 else (4, 8)
    splits = (1, 2, 4) if quick else (1, 2, 4, 8)
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw}
            for bn in bns for nw in warps for sk in splits]


class _A8:
    """The a8 operands beside ``bench.int4._Operands``: the quantised activation of its x, outputs."""

    def __init__(self, ops: _Operands, M: int):
        self.ops, self.M = ops, M
        self.x = ops.x_all[:M]
        self.q, self.s, self.sums = A.quantize_act_int8(self.x)
        self.ref = A.int4_linear_a8_ref(self.x, ops.packed[0]).float()

    def gemv_calls(self, cfg):
        return [lambda p=p, out=out: A.a8_with_config(self.q, self.s, self.sums, p, None, out, cfg)
                for p, out in zip(self.ops.packed, (o[:self.M] for o in self.ops.out_all))]

    def op_calls(self):
        return [lambda p=p, out=out: A.int4_linear_a8(self.x, p, out=out)
                for p, out in zip(self.ops.packed, (o[:self.M] for o in self.ops.out_all))]

    def pair_calls(self, cfg):
        def pair(p, out):
            q, s, sums = A.quantize_act_int8(self.x)
            A.a8_with_config(q, s, sums, p, None, out, cfg)
        outs = (o[:self.M] for o in self.ops.out_all)
        return [lambda p=p, out=out: pair(p, out) for p, out in zip(self.ops.packed, outs)]

    def quant_calls(self):
        return [lambda: A.quantize_act_int8(self.x)]

    def check(self, cfg) -> str | None:
        out = self.ops.out_all[0][:self.M]
        out.fill_(float("nan"))
        self.gemv_calls(cfg)[0]()
        torch.cuda.synchronize()
        err = (out.float() - self.ref).abs().max().item()
        tol = 1e-2 * max(1e-3, self.ref.abs().max().item())
        return None if err <= tol else f"max error {err:.3g} > {tol:.3g}"

    def bytes(self) -> int:
        Kp = self.q.shape[1]
        return self.ops.int4_bytes + self.M * (Kp + Kp // 128 * 8) + self.M * self.ops.N * 2


REFINE = 4  # the sweep's best tiles timed again with PREFETCH 2


def _time_config(a8: _A8, c: dict, shape: dict, ab: int, rows: list[dict]) -> list[dict]:
    """Check and time one GEMV config; its row into ``rows``; [the row] when it is correct and ran, else []."""
    try:
        err = a8.check(c)
        t = time_cuda(a8.gemv_calls(c), graph=True)
    except Exception as e:  # noqa: BLE001  (out of resources: the row says so)
        rows.append(make_row("int4_a8", "a8 gemv", shape, None, config=c, error=e))
        return []
    pf = f" pf{c['PREFETCH']}" if c.get("PREFETCH", 1) != 1 else ""
    r = make_row("int4_a8", f"a8 gemv bn{c['BLOCK_N']} w{c['num_warps']} sk{c['SPLIT_K']}{pf}", shape, t,
                 bytes_moved=ab, config=c, **({"error": err} if err else {}))
    rows.append(r)
    return [] if err else [r]


def sweep(out_path: Path | None, shapes, ms, quick: bool = False) -> list[dict]:
    from diag_int4_gemv import probe_calls

    rows = []
    for sname in shapes:
        N, K = SHAPES[sname]
        ops = _Operands(N, K, 128, max(ms), ZERO_MODE)
        for M in ms:
            shape = {"name": sname, "M": M, "N": N, "K": K, "group": 128}
            a8 = _A8(ops, M)
            nbytes = ops.bytes_int4(M)
            rows += baseline_rows("int4_a8", ops, M, shape)
            w16 = dispatch_row("int4_a8", ops, M, shape, "w4a16 dispatch")
            rows.append(w16)
            if M == 1:
                pc = {"BLOCK_N": 16, "BW": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
                t = time_cuda(probe_calls(ops, pc), graph=True)
                rows.append(make_row("int4_a8", "probe bn16 bw128", shape, t, bytes_moved=nbytes, config=pc))
            ab = a8.bytes()
            tq = time_cuda(a8.quant_calls(), graph=True)
            rows.append(make_row("int4_a8", "a8 quant", shape, tq, bytes_moved=M * K * 2 + ab - ops.int4_bytes
                                 - M * N * 2))
            w0, out0 = ops.packed[0], ops.out_all[0][:M]

            def warm(c, w0=w0, out0=out0, a8=a8):
                A.a8_with_config(a8.q, a8.s, a8.sums, w0, None, out0, c, warmup=True)

            cands = configs(M, quick)
            precompile(warm, cands)
            timed = []
            for c in cands:
                timed += _time_config(a8, c, shape, ab, rows)
            # the best REFINE tiles again with PREFETCH 2 (the next two steps' words in flight)
            refine = [dict(r["config"], PREFETCH=2) for r in sorted(timed, key=lambda r: r["median_us"])[:REFINE]]
            precompile(warm, refine)
            for c in refine:
                timed += _time_config(a8, c, shape, ab, rows)
            best = min(timed, key=lambda r: r["median_us"], default=None)
            heur = A.heuristic_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
            err = a8.check(heur)
            th = time_cuda(a8.gemv_calls(heur), graph=True)
            rows.append(make_row("int4_a8", "a8 gemv heuristic", shape, th, bytes_moved=ab, config=heur,
                                 **({"error": err} if err else {})))
            top = {"impl": "a8 gemv best", "config": None, "median_us": None}
            if best is not None:
                top = dict(best, impl="a8 gemv best", variant=best["impl"])
                rows.append(top)
                t = time_cuda(a8.pair_calls(best["config"]), graph=True)
                rows.append(make_row("int4_a8", "a8 quant+best", shape, t, bytes_moved=ab, config=best["config"]))
            top_op = time_cuda(a8.op_calls(), graph=True)
            rows.append(make_row("int4_a8", "a8 op", shape, top_op, bytes_moved=ab, config=heur))
            rows.append(make_row("int4_a8_summary", "a8 vs w4a16", shape, None, w4a16_us=w16["median_us"],
                                 a8_op_us=round(top_op.median_us, 3), a8_gemv_best_us=top["median_us"],
                                 a8_quant_us=round(tq.median_us, 3),
                                 op_speedup=round(w16["median_us"] / top_op.median_us, 3),
                                 gemv_best_speedup=(round(w16["median_us"] / top["median_us"], 3)
                                                    if top["median_us"] else None),
                                 best_config=top["config"]))
            print_table([r for r in rows if r["shape"] == shape and not r["impl"].startswith("a8 gemv bn")],
                        ("impl", "median_us", "tbps", "variant"))
        del ops
        flush_rows(rows, ZERO_MODE, out_path)
    return rows


def write_table(path: Path, rows: list[dict]) -> dict:
    """The sweep's best configs as the ``int4_linear_a8`` section of the int4_linear table at ``path`` (the rest of
    the table as it was, or as the table in use when ``path`` is new; ``int4_linear_a8_env``: this run's GPU and
    commit, as the section's own record)."""
    return write_best_configs(path, A.TABLE_SECTION, rows, "int4_a8_summary", "a8_gemv_best_us")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--ms", default="1,2,4")
    p.add_argument("--quick", action="store_true", help="fewer configs (4 warps, splits 1-4)")
    p.add_argument("--table", type=Path, default=None,
                   help="write each (shape, M)'s best config into this int4_linear table (section int4_linear_a8)")
    a = p.parse_args(argv)
    rows = sweep(a.out, pick_shapes(p, a.shapes, SHAPES), [int(m) for m in a.ms.split(",")], a.quick)
    if a.table:
        write_table(a.table, rows)
    print_table([r for r in rows if r["op"] == "int4_a8_summary"],
                ("shape", "w4a16_us", "a8_op_us", "a8_gemv_best_us", "a8_quant_us", "op_speedup", "gemv_best_speedup"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
