"""Development sweep: FP8 W8A8 GEMV launch configs at decode M against ``torch._scaled_mm`` (GPU).

Per-token activation scales x per-channel weight scales, as the engine calls it (the issue's
baseline: ``_scaled_mm`` with the same row-wise scales; per-tensor ``_scaled_mm`` is printed too).
The question it answers: does a whole K slice in flight per program (BLOCK_K up to 8192, one or
two loop steps, SPLIT_K to fill the SMs) stream the weight closer to the copy rate than the tuned
table's 1-2 KB per step, and what do ``evict_first`` and the register double buffer add.

    PYTHONPATH=src python benchmarks/sweep_gemv.py --ms 1 4 --out rows.json

Candidates are compiled first in parallel processes (Triton's disk cache then serves the sweep).
At M <= 4 both the FMA tiles and the FP8 tensor-core path (tokens padded to 16) are tried.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import os
import time

import torch

from fastdecode.bench.harness import make_row, time_cuda, write_rows
from fastdecode.bench.gemm import SHAPES, _check, _compile_job, _Operands


def fma_candidates(M: int, N: int, K: int, num_sms: int) -> list[dict]:
    """Whole-slice FMA tiles: BLOCK_K 2048-8192, BLOCK_N 1-8, 4 or 8 warps, 2-16 programs per SM."""
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    out = []
    for warps, bk, bn in itertools.product((4, 8), (2048, 4096, 8192), (1, 2, 4, 8)):
        if bk > K or bn * bk * bm // (32 * warps) > 256 or bn * bk // (32 * warps) < 16:
            continue  # > 256 raw bytes per thread: registers; < 16: not one 16-byte load per row
        kb = -(-K // bk)
        tiles = -(-N // bn) * -(-M // bm)
        splits = sorted({max(1, min(kb, -(-per * num_sms // tiles))) for per in (2, 4, 8, 16)})
        for s in splits:
            s = -(-kb // -(-kb // s))  # no empty split (kernels.gemm.split_k_blocks)
            out.append({"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s,
                        "num_warps": warps, "num_stages": 1})
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


def dot_candidates(M: int, N: int, K: int, num_sms: int) -> list[dict]:
    bm = max(16, 1 << (M - 1).bit_length())
    out = []
    for bn, bk, warps, stages in ((64, 256, 4, 4), (128, 256, 8, 3), (64, 512, 4, 3), (32, 512, 4, 4),
                                  (64, 128, 4, 6)):
        kb = -(-K // bk)
        tiles = -(-N // bn)
        for per in (2, 4, 8):
            s = max(1, min(kb // 2, -(-per * num_sms // tiles)))
            s = -(-kb // -(-kb // s))
            c = {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": warps,
                 "num_stages": stages, "DOT_FP8": True}
            if c not in out:
                out.append(c)
    return out


def precompile(jobs: dict, workers: int) -> None:
    """The tuner's own parallel compile (``bench.gemm._compile_job``: the same row-wise scale modes)."""
    items = list(jobs.values())
    chunks = [("fp8", items[i:i + 6]) for i in range(0, len(items), 6)]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        done = sum(ex.map(_compile_job, chunks))
    print(f"precompiled {done}/{len(items)} kernels in {time.time() - t0:.0f} s with {workers} processes", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    p.add_argument("--top", type=int, default=3, help="best configs per shape re-timed with EVICT / PREFETCH")
    a = p.parse_args()
    from fastdecode.kernels.gemm import split_k_blocks

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {n: SHAPES[n] for n in a.shapes.split(",")}
    plan = {}
    jobs = {}
    for name, (N, K) in shapes.items():
        for M in a.ms:
            # M <= 4: FMA tiles, and the FP8 tensor-core path with the tokens padded to 16 (FP8 MMAs need no
            # conversion of the weight, the FMA path converts every byte)
            cands = (fma_candidates(M, N, K, sms) if M <= 4 else []) + dot_candidates(M, N, K, sms)
            variants = list(cands)
            if M <= 4:  # the second pass's variants, compiled up front too
                variants += [{**c, "EVICT": True} for c in cands]
                variants += [{**c, "PREFETCH": True} for c in cands if c["kind"] == "fma"]
            plan[(name, M)] = cands
            for v in variants:
                key = json.dumps({k: x for k, x in v.items() if k != "SPLIT_K"}, sort_keys=True)
                key += f"|{split_k_blocks(K, v)[1] > 1}|{K % v['BLOCK_K'] == 0}|{M}"
                jobs[key] = (K, M, v)
    precompile(jobs, max(1, min(16, (os.cpu_count() or 2) - 1)))

    rows, summary = [], []
    for name, (N, K) in shapes.items():
        ops = _Operands(N, K, "fp8", max(a.ms))  # the tuner's operands: rotated weights, row-wise scales
        for M in a.ms:
            x, xs, wb = ops.x_all[:M], ops.xs_all[:M], ops.w_bytes
            shape = {"M": M, "N": N, "K": K, "name": name}

            def timed(impl, fns, **extra):
                t = time_cuda(fns, graph=True)
                rows.append(make_row("sweep_linear_fp8", impl, shape, t, bytes_moved=ops.bytes_moved(M),
                                     weight_tbps=round(wb / (t.median_us * 1e-6) / 1e12, 3), **extra))
                return t.median_us

            per_tensor = [(lambda w=w, o=o: torch._scaled_mm(x, w.t(), xs[0].reshape(()), ops.ws[0].reshape(()),
                                                            out_dtype=torch.bfloat16, out=o[:M]))
                          for w, o in zip(ops.w, ops.out_all)]
            base = {"scaled_mm_rowwise": timed("scaled_mm_rowwise", ops.calls(M, "cublas")),
                    "scaled_mm_tensor": timed("scaled_mm_tensor", per_tensor),
                    "dispatch": timed("fastdecode_dispatch", ops.calls(M, "dispatch"))}
            results = []

            def run_cfg(cfg, tag):
                err = _check(ops, M, cfg)
                if err:
                    rows.append(make_row("sweep_linear_fp8", tag, shape, None, error=err, config=cfg))
                    return
                results.append((timed(tag, ops.calls(M, "triton", cfg), config=cfg), cfg))

            for cfg in plan[(name, M)]:
                try:
                    run_cfg(cfg, "triton")
                except Exception as e:  # a config that does not launch (resources): recorded, skipped
                    rows.append(make_row("sweep_linear_fp8", "triton", shape, None, error=e, config=cfg))
            if M <= 4:
                for us, cfg in sorted(results, key=lambda r: r[0])[: a.top]:
                    for extra in ({"EVICT": True}, {"PREFETCH": True}) if cfg["kind"] == "fma" else ({"EVICT": True},):
                        try:
                            run_cfg({**cfg, **extra}, "triton")
                        except Exception as e:
                            rows.append(make_row("sweep_linear_fp8", "triton", shape, None, error=e, config=cfg))
            best_us, best_cfg = min(results, key=lambda r: r[0]) if results else (float("nan"), None)
            summary.append((name, M, wb / best_us / 1e6, best_us, base, best_cfg))
            print(f"{name:>16} M={M:<3} best {best_us:7.2f} us {wb / best_us / 1e6:5.2f} TB/s | rowwise "
                  f"{base['scaled_mm_rowwise']:7.2f} tensor {base['scaled_mm_tensor']:7.2f} dispatch "
                  f"{base['dispatch']:7.2f} | {best_cfg}", flush=True)
        ops = None  # free the rotated weights before the next shape
        torch.cuda.empty_cache()
    if a.out:
        write_rows(rows, a.out)
    print("\nweight TB/s of the best config vs the targets (M<=4: 3.5 on >= 30 MB, 3.0 on 8b.qkv/o):")
    for name, M, tbps, us, base, cfg in summary:
        print(f"  {name:>16} M={M:<3} {tbps:5.2f} TB/s  {us:6.2f} us  x{base['scaled_mm_rowwise'] / us:4.2f} rowwise "
              f"x{base['dispatch'] / us:4.2f} dispatch")


if __name__ == "__main__":
    main()
