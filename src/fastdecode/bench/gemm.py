"""Benchmark and tuner of the skinny linear: ours vs cuBLAS (torch.mm / torch._scaled_mm), same process.

* ``tune(...)`` times a small list of Triton configs and cuBLAS per (dtype, N, K, M) and writes the
  dispatcher table ``fastdecode/configs/linear_<gpu>.json`` (``fastdecode tune linear``).
* ``run(out_path, quick=False)`` times, on the Llama-3.1-8B and 70B-TP2 projections, our kernel
  through the dispatcher, our kernel forced, and cuBLAS, and writes JSON rows
  (``fastdecode bench linear``), ending with summary rows against the issue's targets.

Method (harness.py): CUDA-graph replay of back-to-back calls, weights rotated over enough copies to
read ~3x the L2 per round, median of 30 replays. Bytes counted: weight + x + out (+ scales);
``weight_tbps`` counts the weight alone (the quantity a weight stream is limited by).
FP8 runs with the engine's scales on both sides: per-token activation and per-channel weight scales
(``_scaled_mm``'s row-wise mode, about half the speed of its per-tensor mode at M=1: tuning against the
per-tensor mode sent the engine's qkv and gate_up calls to a cuBLAS path twice as slow as ours).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from fastdecode.bench.harness import geomean, make_row, rotation_count, start_table, time_cuda, write_rows
from fastdecode.kernels.host import next_pow2

SHAPES = {  # name: (N, K)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "70b_tp2.qkv": (5120, 8192), "70b_tp2.o": (8192, 4096), "70b_tp2.gate_up": (28672, 8192),
    "70b_tp2.down": (8192, 14336),
}
TARGET_MS = (1, 2, 4, 8, 16)
DISPATCH_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TUNE_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DTYPES = ("bf16", "fp8")
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"



def parse_shapes(text: str) -> dict:
    """CLI form -> shapes dict: "6144x4096,4096x14336" (N x K) or names of SHAPES ("8b.o,8b.down")."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item in SHAPES:
            out[item] = SHAPES[item]
            continue
        try:
            n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r} is neither NxK (e.g. 4096x14336) nor one of {sorted(SHAPES)}") from None
        out[f"{n}x{k}"] = (n, k)
    return out


def _shapes(shapes) -> dict:
    if shapes is None:
        return dict(SHAPES)
    if isinstance(shapes, str):
        return parse_shapes(shapes)
    if isinstance(shapes, dict):
        return dict(shapes)
    return {f"{n}x{k}": (int(n), int(k)) for n, k in shapes}


# ----------------------------------------------------------------------------- operands


class _Operands:
    """Rotated weights (enough copies to defeat the L2) and one x / out per copy, for one shape."""

    def __init__(self, N: int, K: int, dkey: str, max_m: int):
        dev = torch.device(DEVICE)
        self.N, self.K, self.dkey = N, K, dkey
        elem = 1 if dkey == "fp8" else 2
        self.w_bytes = N * K * elem
        self.rot = rotation_count(self.w_bytes)
        g = torch.Generator(device=dev).manual_seed(0)
        if dkey == "fp8":
            # the engine's scales: per output channel (weights) and per token (activations), fp32
            self.w = [(torch.randn(N, K, device=dev, generator=g) * 8).to(FP8) for _ in range(self.rot)]
            self.ws = torch.rand(N, device=dev, generator=g) * 2e-3 + 1e-3
            self.x_all = (torch.randn(max_m, K, device=dev, generator=g) * 8).to(FP8)
            self.xs_all = torch.rand(max_m, device=dev, generator=g) * 1e-2 + 5e-3
        else:
            self.w = [torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
                      for _ in range(self.rot)]
            self.x_all = torch.randn(max_m, K, device=dev, generator=g, dtype=torch.bfloat16)
        self.out_all = [torch.empty(max_m, N, device=dev, dtype=torch.bfloat16) for _ in range(self.rot)]

    def bytes_moved(self, M: int) -> int:
        x_elem = 1 if self.dkey == "fp8" else 2
        scales = 4 * (M + self.N) if self.dkey == "fp8" else 0
        return self.w_bytes + M * self.K * x_elem + M * self.N * 2 + scales

    def calls(self, M: int, impl: str, config: Optional[dict] = None) -> list:
        """One closure per rotated copy. impl: 'cublas' | 'triton' (explicit config) | 'dispatch'."""
        from fastdecode.ops.gemm import linear_with_config, linear, linear_fp8

        x = self.x_all[:M]
        fns = []
        for i in range(self.rot):
            w, out = self.w[i], self.out_all[i][:M]
            if self.dkey == "fp8":
                xs, ws = self.xs_all[:M], self.ws
                if impl == "cublas":  # _scaled_mm's row-wise mode: what the dispatcher would call
                    def fn(x=x, w=w, out=out):
                        return torch._scaled_mm(x, w.t(), xs.reshape(M, 1), ws.reshape(1, -1),
                                                out_dtype=torch.bfloat16, out=out)
                elif impl == "triton":
                    fn = lambda x=x, w=w, out=out: linear_with_config(x, w, None, xs, 2, ws, 2, out, config)  # noqa: E731
                else:
                    fn = lambda x=x, w=w, out=out: linear_fp8(x, xs.reshape(M, 1), w, ws, out=out)  # noqa: E731
            else:
                if impl == "cublas":
                    fn = lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out)  # noqa: E731
                elif impl == "triton":
                    fn = lambda x=x, w=w, out=out: linear_with_config(x, w, None, None, 0, None, 0, out, config)  # noqa: E731
                else:
                    fn = lambda x=x, w=w, out=out: linear(x, w, out=out)  # noqa: E731
            fns.append(fn)
        return fns

    def reference(self, M: int) -> torch.Tensor:
        """fp32 result of copy 0 (what a candidate must reproduce)."""
        x = self.x_all[:M].float()
        if self.dkey == "fp8":
            return (x @ self.w[0].float().t()) * self.xs_all[:M, None] * self.ws[None, :]
        return x @ self.w[0].float().t()


def _time(calls, M: int):
    # large M: fewer calls per graph, the launch gap is negligible there
    return time_cuda(calls, graph=True, calls_per_graph=20 if M <= 256 else 4, reps=30 if M <= 256 else 15)


def _check(ops: _Operands, M: int, config: dict) -> Optional[str]:
    """Run a candidate once and compare with the fp32 reference; returns an error text or None."""
    ops.out_all[0][:M].fill_(float("nan"))
    ops.calls(M, "triton", config)[0]()
    got, ref = ops.out_all[0][:M].float(), ops.reference(M)
    err = ((got - ref).abs() / (ref.abs().amax() + 1e-6)).max().item()
    if not err < 1e-2:  # bf16 output: ~4e-3 relative to the row range at worst; NaN fails too
        return f"wrong result: max error {err:.3g} of the output range"
    return None


# ----------------------------------------------------------------------------- tuning


def candidates(M: int, N: int, K: int, dkey: str, num_sms: int) -> list[dict]:
    """The small config list the tuner sweeps (kept short: every entry is a compile on the GPU)."""
    from fastdecode.ops.gemm import fma_tile, with_split_k

    elem = 1 if dkey == "fp8" else 2
    out = []
    if M <= 4:  # FMA (weight-stationary GEMV): 64 or 32 accumulator registers, 4 or 2 warps
        for warps, regs in ((4, 64), (4, 32), (2, 64)):
            base = fma_tile(M, elem, warps, regs)
            out += [with_split_k(base, M, N, K, num_sms, s) for s in (3, 6)]
    if M >= 2 or dkey == "fp8":  # swap-AB tensor-core dot, BLOCK_M = the MMA's narrow side (FP8: at M=1
        # too; FP8 operands go straight into the MMA, while the FMA path converts every weight)
        bm = min(max(next_pow2(M), 16), 64)
        tiles = ((64, 256, 4, 4), (128, 256, 8, 3), (64, 128, 4, 5)) if dkey == "fp8" else \
                ((64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 6))
        if M >= 128:
            tiles = tiles[:1]
        for bn, bk, warps, stages in tiles:
            base = {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                    "num_stages": stages, "DOT_FP8": dkey == "fp8"}
            out += [with_split_k(base, M, N, K, num_sms, s) for s in ((2, 4) if M < 128 else (2,))]
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


def _compile_job(job) -> int:
    """Worker: compile (by running once on tiny tensors) the kernels of one (dtype, K) group.

    Only Triton's specialisation must match the real calls: K (hence EVEN_K and the split flag),
    divisibility by 16 of N and the strides, dtypes and scale modes; N is shrunk to 64.
    """
    dkey, items = job
    import torch

    from fastdecode.ops.gemm import linear_with_config

    n, done = 64, 0
    for K, M, cfg in items:
        try:
            out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
            if dkey == "fp8":
                x, w = torch.zeros(M, K, device="cuda").to(FP8), torch.zeros(n, K, device="cuda").to(FP8)
                # row-wise scales (mode 2), as _Operands times them: the same compiled kernel
                xs, ws = torch.ones(M, device="cuda"), torch.ones(n, device="cuda")
                linear_with_config(x, w, None, xs, 2, ws, 2, out, cfg)
            else:
                x = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
                w = torch.zeros(n, K, device="cuda", dtype=torch.bfloat16)
                linear_with_config(x, w, None, None, 0, None, 0, out, cfg)
            done += 1
        except Exception:  # the tuner reports (and skips) configs that do not compile
            pass
    torch.cuda.synchronize()
    return done


def precompile(shapes, ms, dtypes, num_sms: int, *, pdl: bool = False, workers: Optional[int] = None) -> int:
    """Compile every candidate kernel of a tuning run in parallel processes (Triton's on-disk cache
    then serves the tuner): ~80 kernels take ~2 min one after another, a fraction of that here."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    from fastdecode.kernels.gemm import split_k_blocks

    groups: dict = {}
    for dkey in dtypes:
        for N, K in set(_shapes(shapes).values()):
            for M in ms:
                for cfg in candidates(M, N, K, dkey, num_sms):
                    variants = [cfg]
                    if cfg["kind"] == "fma":
                        variants.append({**cfg, "PREFETCH": True})
                    if pdl:
                        variants += [{**v, "PDL": True} for v in list(variants)]
                    for v in variants:  # one compile per constexpr set (N, K values are not in the key)
                        key = json.dumps({k: x for k, x in v.items() if k != "SPLIT_K"}, sort_keys=True)
                        key += f"|{split_k_blocks(K, v)[1] > 1}|{K % v['BLOCK_K'] == 0}"
                        groups.setdefault(dkey, {})[key] = (K, min(M, 64), v)
    chunks = [(dkey, items[i:i + 4]) for dkey, g in groups.items()
              for items in [list(g.values())] for i in range(0, len(items), 4)]
    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2, len(chunks)))
    t0 = time.time()
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            done = sum(ex.map(_compile_job, chunks))
    except Exception as e:  # no harm: the tuner compiles whatever is missing itself
        print(f"precompile failed ({type(e).__name__}: {e}); compiling serially instead", flush=True)
        return 0
    print(f"precompiled {done} kernels in {time.time() - t0:.0f}s with {workers} processes", flush=True)
    return done


def tune(out_path=None, *, shapes=None, ms: Sequence[int] = TUNE_MS,
         dtypes: Sequence[str] = DTYPES, quick: bool = False, pdl: bool = False,
         parallel_compile: bool = True, verbose: bool = True) -> dict:
    """Time candidates + cuBLAS per (dtype, N, K, M); write and return the dispatcher table.

    ``out_path``: defaults to ``fastdecode/configs/linear_<gpu>.json``; an existing file is updated
    (entries for other shapes are kept), a new one starts from the table in use (``ops._common.table_path``).
    ``shapes``: None (the 8 Llama projections), a dict {name: (N, K)}, a list of (N, K) or a "NxK,..." string.
    ``dtypes``: "bf16" and/or "fp8" (fp16 uses the bf16 entries). ``quick``: fewer M values (1, 4, 16, 64, 256).
    Above the largest tuned M the dispatcher uses cuBLAS: keep 256 (or more) in ``ms``.
    ``pdl``: also try the best config with programmatic dependent launch (one more timing per M).
    Back-to-back calls of the same kernel then overlap launch and tail, which flatters a benchmark
    of repeated linears more than a model step (whose other kernels must also use PDL to gain).
    ``parallel_compile``: compile all candidates first in worker processes (see ``precompile``).
    """
    from fastdecode.ops._common import table_path
    from fastdecode.ops.gemm import clear_config_cache, config_path

    if not torch.cuda.is_available():
        raise RuntimeError("tune needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = Path(out_path) if out_path else config_path(gpu)
    # an existing table is updated; a new one starts from the table in use (an H100's: the H200's, ops._common)
    table = start_table(path, gpu, num_sms, True, ("linear",), base=table_path("linear", gpu))
    lin = table["linear"]
    shapes = _shapes(shapes)
    ms = (1, 4, 16, 64, 256) if quick else tuple(sorted(set(int(m) for m in ms)))
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtypes must be among {DTYPES}, got {d!r}")
    t0 = time.time()
    if parallel_compile:
        precompile(shapes, ms, dtypes, num_sms, pdl=pdl)
    for dkey in dtypes:
        for name, (N, K) in shapes.items():
            ops = _Operands(N, K, dkey, max(ms))
            entries = lin.setdefault(dkey, {}).setdefault(f"{N},{K}", {})
            for M in ms:
                cublas_us = _time(ops.calls(M, "cublas"), M).median_us
                best, best_us, tried = None, math.inf, 0
                for cfg in candidates(M, N, K, dkey, num_sms):
                    try:
                        err = _check(ops, M, cfg)
                        if err:
                            print(f"  skip {cfg}: {err}", flush=True)
                            continue
                        us = _time(ops.calls(M, "triton", cfg), M).median_us
                    except Exception as e:  # e.g. out of shared memory / registers for this tile
                        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    tried += 1
                    if us < best_us:
                        best, best_us = cfg, us
                # refinements of the winner: register double buffer (FMA; 2: two tiles ahead), programmatic launch
                extra = []
                if best is not None and best["kind"] == "fma":
                    extra += [{**best, "PREFETCH": True}, {**best, "PREFETCH": 2}]
                if best is not None:  # weights evict_first (1-2% on some FP8 shapes in the sweep)
                    extra.append({**best, "EVICT": True})
                if best is not None and pdl:
                    extra.append({**best, "PDL": True})
                    if best["kind"] == "fma":
                        extra.append({**best, "PDL": True, "PREFETCH": True})
                for cfg in extra:
                    try:
                        err = _check(ops, M, cfg)
                        us = _time(ops.calls(M, "triton", cfg), M).median_us if not err else math.inf
                    except Exception as e:
                        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    tried += 1
                    if us < best_us:
                        best, best_us = cfg, us
                impl = "triton" if best is not None and best_us < cublas_us else "cublas"
                entries[str(M)] = {"impl": impl, "config": best, "us": round(best_us, 3) if best else None,
                                   "cublas_us": round(cublas_us, 3)}
                if verbose:
                    print(f"[{time.time() - t0:6.1f}s] {dkey} {name} M={M}: triton {best_us:.2f} us "
                          f"({tried} configs), cublas {cublas_us:.2f} us -> {impl}", flush=True)
            del ops
            torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    clear_config_cache()
    if verbose:
        print(f"wrote {path} in {time.time() - t0:.0f}s", flush=True)
    return table


# ----------------------------------------------------------------------------- benchmark


def _tuned_triton_config(dkey: str, N: int, K: int, M: int) -> Optional[dict]:
    """The tuner's best Triton config at exactly this M (also where cuBLAS won), or the heuristic."""
    from fastdecode.ops._common import load_config_table, table_path
    from fastdecode.ops.gemm import heuristic_config

    table = load_config_table(str(table_path("linear", torch.cuda.get_device_name()))) or {}
    entry = table.get("linear", {}).get(dkey, {}).get(f"{N},{K}", {}).get(str(M))
    if entry and entry.get("config"):
        return entry["config"]
    if M > 256:
        return None
    return heuristic_config(M, N, K, dkey, torch.cuda.get_device_properties(0).multi_processor_count)


def run(out_path=None, quick: bool = False, *, shapes=None) -> list[dict]:
    """Benchmark rows (and summary rows against the issue's targets); written to ``out_path``.

    ``quick``: 3 shapes, M in (1, 4, 16, 64, 256, 4096). Run ``tune`` first on a new GPU.
    """
    from fastdecode.ops.gemm import get_linear_config

    if not torch.cuda.is_available():
        raise RuntimeError("the linear benchmark needs a CUDA GPU")
    shapes = _shapes(shapes) if shapes is not None else (dict(list(SHAPES.items())[::3]) if quick else SHAPES)
    dispatch_ms = (1, 4, 16, 64, 256, 4096) if quick else DISPATCH_MS
    target_ms = (1, 4, 16) if quick else TARGET_MS
    all_ms = sorted(set(dispatch_ms) | set(target_ms))
    rows = []
    for dkey in DTYPES:
        op = "linear_fp8" if dkey == "fp8" else "linear"
        wdtype = FP8 if dkey == "fp8" else torch.bfloat16
        for name, (N, K) in shapes.items():
            ops = _Operands(N, K, dkey, max(all_ms))
            for M in all_ms:
                shape = {"M": M, "N": N, "K": K, "name": name}
                kw = dict(bytes_moved=ops.bytes_moved(M), flops=2 * M * N * K)
                impl, cfg = get_linear_config(M, N, K, wdtype, "cuda")
                if impl == "cublas":  # our kernel forced, with its best tuned config at this M
                    cfg = _tuned_triton_config(dkey, N, K, M)
                t_cub = _time(ops.calls(M, "cublas"), M)
                t_dis = _time(ops.calls(M, "dispatch"), M)
                t_tri = _time(ops.calls(M, "triton", cfg), M) if cfg is not None and M <= 256 else None
                best = min(t_cub.median_us, t_tri.median_us if t_tri else math.inf)
                common = dict(dispatch=impl, weight_bytes=ops.w_bytes, target=M in target_ms)
                rows.append(make_row(op, "cublas", shape, t_cub, **kw, speedup_vs_cublas=1.0,
                                     weight_tbps=round(ops.w_bytes / t_cub.median_us / 1e6, 3), **common))
                if t_tri is not None:
                    rows.append(make_row(op, "triton", shape, t_tri, **kw, config=cfg,
                                         speedup_vs_cublas=round(t_cub.median_us / t_tri.median_us, 3),
                                         weight_tbps=round(ops.w_bytes / t_tri.median_us / 1e6, 3), **common))
                rows.append(make_row(op, "fastdecode", shape, t_dis, **kw,
                                     speedup_vs_cublas=round(t_cub.median_us / t_dis.median_us, 3),
                                     vs_best=round(best / t_dis.median_us, 3),
                                     weight_tbps=round(ops.w_bytes / t_dis.median_us / 1e6, 3), **common))
                print(f"{op} {name} M={M}: cublas {t_cub.median_us:.2f} us, "
                      f"triton {t_tri.median_us if t_tri else float('nan'):.2f} us, "
                      f"dispatch({impl}) {t_dis.median_us:.2f} us = {rows[-1]['speedup_vs_cublas']}x cublas, "
                      f"{rows[-1]['weight_tbps']} TB/s of weight", flush=True)
            del ops
            torch.cuda.empty_cache()
    rows += summarize(rows)
    if out_path:
        write_rows(rows, out_path)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Summary rows: the issue's targets (geomean speed-ups, worst shape, FP8 bandwidth, dispatcher)."""
    out = []
    for op, need_geo in (("linear", 1.15), ("linear_fp8", 1.3)):
        ours = [r for r in rows if r["op"] == op and r["impl"] == "fastdecode"]
        tgt = [r for r in ours if r.get("target")]
        if not ours:
            continue
        sp = [r["speedup_vs_cublas"] for r in tgt]
        s = make_row(op, "summary", {"M": "1-16 (targets)"}, None,  # no timing of its own: median_us None
                     geomean_speedup_vs_cublas=round(geomean(sp), 3), geomean_target=need_geo,
                     min_speedup_vs_cublas=min(sp) if sp else None,
                     min_weight_tbps=min(r["weight_tbps"] for r in tgt) if tgt else None,
                     dispatch_min_vs_best=min(r["vs_best"] for r in ours),
                     dispatch_worst=min(ours, key=lambda r: r["vs_best"])["shape"])
        s["pass"] = bool(s["geomean_speedup_vs_cublas"] >= need_geo and s["dispatch_min_vs_best"] >= 0.97
                         and (op == "linear_fp8" and s["min_weight_tbps"] is not None and s["min_weight_tbps"] >= 3.5
                              or op == "linear" and sp and s["min_speedup_vs_cublas"] >= 0.97))
        out.append(s)
        print(json.dumps(s), flush=True)
    return out
