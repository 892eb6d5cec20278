"""Development sweep (GPU): W8A16 (``ops.w8a16``) launch configs at the shapes the ``fp8_a16`` switch sends to it.

The question (benchmarks/NOTES.md, session 24): on the H100 the 8B FP8 step's ``down`` family took 716 us with W8A8
and 844 us with W8A16 + SiLU-and-mul in the loads (``profile-switches``, b4eea1f): ~4 us a layer more, where the two
launches it removes save ~5.8 us a layer. Is that the config (the FMA heuristic, or the FP8 table's W8A8 FMA entry)
or the SiLU computed in every program's loads?

Per shape and M, median of graph replays, rotated weights (one process, the baselines beside it):

* ``w8a8_pair``: what the default step runs: the activation kernel (per-token FP8 quantisation before ``wo``, FP8
  SiLU-and-mul before ``w2``) then ``linear_fp8`` (the dispatcher's config); ``w8a8_gemm``: ``linear_fp8`` alone
  (for qkv and gate_up the norm emits the FP8 input: no kernel to save there, only the GEMV's time);
* ``w8a16_dispatch``: ``linear_w8a16`` with its current config (``get_w8a16_config``);
* ``w8a16`` with each FMA candidate (BLOCK_N, BLOCK_K, warps, split) and a few tensor-core (dot) tiles, every one
  checked against the reference first;
* ``glu_apart``: for ``w2``, the bf16 SiLU-and-mul kernel then the best W8A16 config without ``glu``: what the
  SiLU in the loads costs against a launch of its own.

``--table PATH`` writes the best config per (M, N, K) into the ``w8a16`` section of that linear table (a copy:
``FASTDECODE_CONFIG_DIR``), which ``get_w8a16_config`` reads.

    PYTHONPATH=src python benchmarks/sweep_w8a16.py --ms 1 2 4 --out rows.json [--table DIR/linear_<gpu>.json]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from fastdecode.bench.harness import make_row, rotation_count, time_cuda, write_rows, write_table_section
from fastdecode.constants import SCALE_NONE, SCALE_VECTOR
from fastdecode.ops._common import table_path
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_fp8
from fastdecode.ops.gemm import linear_fp8, linear_with_config
from fastdecode.ops.quant import quantize_fp8
from fastdecode.ops.w8a16 import TABLE_SECTION, get_w8a16_config, linear_w8a16, linear_w8a16_ref, table_key

FP8 = torch.float8_e4m3fn
# name: (N, K, glu): the 8B wo and w2 (w2's input is [gate | up], 2K wide), the 70B-TP2 ones;
# and the 8B qkv and gate_up (W8A8 in the step: whether a bf16-input GEMV would stream them faster too)
SHAPES = {"8b_o": (4096, 4096, False), "8b_down": (4096, 14336, True),
          "8b_qkv": (6144, 4096, False), "8b_gate_up": (28672, 4096, False),
          "70b_tp2_o": (8192, 4096, False), "70b_tp2_down": (8192, 14336, True)}


REFINE_TOP = 4  # the best FMA tiles timed again with each of
REFINEMENTS = ({"X_LAYOUT": True}, {"PREFETCH": True}, {"PREFETCH": 2}, {"X_LAYOUT": True, "PREFETCH": True},
               {"X_LAYOUT": True, "PREFETCH": 2})


def candidates(M: int, N: int, K: int, num_sms: int) -> list[dict]:
    """FMA tiles of 16-byte weight loads: BLOCK_K 512-4096 bytes a row step, BLOCK_N 1-16, 4 or 8 warps, 1-16
    programs an SM; and dot tiles of 64 columns, 1-4 splits."""
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    out = []
    # BLOCK_N 16: with glu each program computes SiLU-and-mul of the whole row; more columns a program share it
    for warps, bk, bn in itertools.product((4, 8), (512, 1024, 2048, 4096), (1, 2, 4, 8, 16)):
        if bk < 16 * 32 * warps // 4 or bk > K or bn * bk * bm // (32 * warps) > 256 or bn * bk // (32 * warps) < 16:
            continue
        kb = -(-K // bk)
        tiles = -(-N // bn) * -(-M // bm)
        for per in (1, 2, 4, 8, 16):
            s = max(1, min(kb, -(-per * num_sms // tiles), 32))
            s = -(-kb // -(-kb // s))  # no empty split (kernels.gemm.split_k_blocks)
            c = {"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": warps,
                 "num_stages": 1}
            if c not in out:
                out.append(c)
    # tensor-core tiles (the FP8 table's W8A8 kind at M = 1 on the larger shapes): the weight widened to bf16, a bf16
    # MMA of 16 padded rows; 1-4 splits of K
    for bk, s in itertools.product((128, 256), (1, 2, 3, 4)):
        if s <= -(-K // bk):
            out.append({"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": 4,
                        "num_stages": 4, "EVICT": True})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shapes", default="8b_o,8b_down")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table", type=Path, default=None, help="a linear table to write the w8a16 section into")
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows, best = [], {}
    for name in a.shapes.split(","):
        N, K, glu = SHAPES[name]
        n_rot = rotation_count(N * K)
        ws = [(torch.randn(N, K, device=dev) * 0.05).to(FP8) for _ in range(n_rot)]
        scale = torch.rand(N, device=dev) * 0.02 + 0.01
        for M in a.ms:
            xin = torch.randn(M, 2 * K if glu else K, device=dev).bfloat16()
            outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in ws]
            ref = linear_w8a16_ref(xin, ws[0], scale, glu=glu)
            shape = {"name": name, "M": M, "N": N, "K": K, "glu": glu}
            wb = N * K

            def timed(impl, fns, **extra):
                t = time_cuda(fns, graph=True)
                rows.append(make_row("sweep_w8a16", impl, shape, t, bytes_moved=wb,
                                     weight_tbps=round(wb / (t.median_us * 1e-6) / 1e12, 3), **extra))
                print(f"{name} M={M} {impl:16s} {t.median_us:8.2f} us  {extra.get('config', '')}", flush=True)
                return t.median_us

            if glu:
                def pair(w):
                    q, s = silu_and_mul_fp8(xin)
                    return linear_fp8(q, s, w, scale)
            else:
                def pair(w):
                    q, s = quantize_fp8(xin, per_token=True)
                    return linear_fp8(q, s, w, scale)
            timed("w8a8_pair", [lambda w=w: pair(w) for w in ws])
            xq, xs = silu_and_mul_fp8(xin) if glu else quantize_fp8(xin, per_token=True)
            timed("w8a8_gemm", [lambda w=w: linear_fp8(xq, xs, w, scale) for w in ws])  # its input made elsewhere
            cur = get_w8a16_config(M, N, K, dev, glu)
            timed("w8a16_dispatch", [lambda w=w, o=o: linear_w8a16(xin, w, scale, glu=glu, out=o)
                                     for w, o in zip(ws, outs)], config=cur)
            results = []

            def attempt(cfg):
                """Check ``cfg`` against the reference on a poisoned output, then time it into ``results``."""
                try:
                    o = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                    linear_with_config(xin, ws[0], None, None, SCALE_NONE, scale, SCALE_VECTOR, o, cfg, glu=glu)
                    torch.cuda.synchronize()
                    err = float((o.float() - ref.float()).abs().max() / ref.float().abs().max())
                    if not err < 2e-2:
                        rows.append(make_row("sweep_w8a16", "w8a16", shape, None, error=f"rel err {err}", config=cfg))
                        return
                    us = timed("w8a16", [lambda w=w, o=o, cfg=cfg: linear_with_config(
                        xin, w, None, None, SCALE_NONE, scale, SCALE_VECTOR, o, cfg, glu=glu)
                        for w, o in zip(ws, outs)], config=cfg)
                    results.append((us, cfg))
                except Exception as e:  # a config that does not launch (resources): recorded, skipped
                    rows.append(make_row("sweep_w8a16", "w8a16", shape, None, error=repr(e)[:300], config=cfg))

            for cfg in candidates(M, N, K, sms):
                attempt(cfg)
            results.sort(key=lambda r: r[0])
            # the best FMA tiles again (session 40, neither ever timed here): with the weights in x's register layout
            # (X_LAYOUT: no shared-memory round trip of x a step) and / or their tiles loaded one and two steps ahead
            # (PREFETCH: ~2.4 instructions a weight more in the sm_90 loop on FP8 weights): time decides
            for _, cfg in [r for r in results if r[1]["kind"] == "fma"][:REFINE_TOP]:
                for extra in REFINEMENTS:
                    attempt({**cfg, **extra})
            results.sort(key=lambda r: r[0])
            if results:
                best[(M, N, K, glu)] = results[0]
                print(f"{name} M={M} best {results[0][0]:.2f} us {results[0][1]}", flush=True)
                if glu:  # the SiLU in a kernel of its own, then the best plain config (K: the GEMM's input width)
                    bcfg = dict(results[0][1])
                    hs = [torch.empty(M, K, device=dev, dtype=torch.bfloat16) for _ in ws]
                    timed("glu_apart", [lambda w=w, o=o, h=h: (silu_and_mul(xin, out=h), linear_with_config(
                        h, w, None, None, SCALE_NONE, scale, SCALE_VECTOR, o, bcfg)) for w, o, h in zip(ws, outs, hs)],
                          config=bcfg)
    if a.out:
        write_rows(rows, a.out)
    if a.table and best:
        entries: dict = {}
        for (M, N, K, glu), (us, cfg) in sorted(best.items()):
            entries.setdefault(table_key(N, K, glu), {})[str(M)] = {"config": cfg, "us": round(us, 3)}
        write_table_section(a.table, TABLE_SECTION, entries, table_path("linear", torch.cuda.get_device_name(dev)))
        print(f"wrote {len(best)} entries into {a.table} [{TABLE_SECTION}]")


if __name__ == "__main__":
    main()
