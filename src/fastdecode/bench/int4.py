"""Benchmark and tuner of the int4-weight linear (W4A16, W4A8) against cuBLAS BF16, same process.

* ``tune(out_path=None, ...)`` times a small list of Triton configs (fma / dot, split-K) and the dequant + cuBLAS
  path per (N, K, group, M), writes ``configs/int4_linear_<gpu>.json`` (``int4_linear``, ``int4_linear_fp8``).
* ``run(out_path, quick=False)`` times, on the eight Llama projections (8B and 70B-TP2), group 128
  with the engine's zero mode (``ZERO_MODE``): ``int4_linear`` through the dispatcher, ``int4_linear_fp8``
  (per-token scales) and cuBLAS BF16 (``torch.mm``) on the unquantised (dequantised) weight; writes JSON rows and
  summary rows against the issue's targets (speed-up geomeans per M, worst shape up to M=4096, W4A8 vs W4A16).

GPU only. Method (harness.py): CUDA-graph replay of back-to-back calls, weights rotated over enough copies to read
~3x the L2 per round, median of 30 replays. Bytes counted for the int4 kernel: packed weight (N*K/2) + scales
(N*K/g*2) + x + out; ``weight_tbps`` counts the packed weight alone.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from fastdecode.bench.harness import (
    env_info, geomean, make_row, print_table, rotation_count, start_table, time_cuda, write_rows,
)
from fastdecode.bench.gemm import SHAPES  # the eight Llama projections (N x K), as the GEMM benchmark's
from fastdecode.kernels.compile import precompile
from fastdecode.quant.formats import INT4_SYMMETRIC

MS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
QUICK_MS = (1, 4, 16, 64, 256)
SMALL_MS = (1, 2, 4, 8, 16)  # issue 18's decode sizes
TUNE_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TUNE_MS = (1, 2, 4, 16, 64, 256, 1024, 4096)
GROUP = 128
# issue 18's targets: geomean speed-up over cuBLAS BF16 (M = 1-16 together, and M = 64), never below 0.9x at any
# M; at M = 1-16 every shape >= 3.0 TB/s effective (packed weight + scales + x + out); >= 1.5x tinygemm at M = 1
TARGET_SMALL_M, TARGET_M64, FLOOR_ANY_M = 2.5, 1.5, 0.9
TARGET_TBPS, TARGET_TINYGEMM = 3.0, 1.5
TINYGEMM_MAX_M = 16  # tinygemm (the gpt-fast / torchao decode kernel) is timed at the decode sizes only
W4A8_OVER_W4A16 = 1.3  # at M >= 256
FP8 = torch.float8_e4m3fn
log = logging.getLogger("fastdecode")
# the weights are quantised as the engine quantises them (``quant.formats.INT4_SYMMETRIC``: zero points, "zero")
# unless told otherwise: until session 20 the tuner and this benchmark timed "sym" weights while the engine ran
# "zero" ones, and configs that won on "sym" lost in the 8B int4 step (benchmarks/NOTES.md, session 20)
ZERO_MODE = "sym" if INT4_SYMMETRIC else "zero"
ZERO_MODES = ("zero", "sym")


class _Operands:
    """Rotated packed weights, their bf16 dequantisations (cuBLAS baseline), x and out, for one shape."""

    def __init__(self, N: int, K: int, group: int, max_m: int, zero_mode: str = ZERO_MODE):
        from fastdecode.quant.int4 import dequantize_int4, quantize_int4

        if zero_mode not in ZERO_MODES:
            raise ValueError(f"zero_mode must be one of {ZERO_MODES}, got {zero_mode!r}")
        dev = torch.device("cuda")
        self.N, self.K, self.group = N, K, group
        g = torch.Generator(device=dev).manual_seed(0)
        w0 = torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        p0 = quantize_int4(w0, group, symmetric=zero_mode == "sym")
        self.int4_bytes = p0.nbytes()
        self.rot = rotation_count(self.int4_bytes)
        self.rot_bf16 = rotation_count(N * K * 2)
        # copies of one packed weight: same values, distinct memory (defeats the L2 like real layers)
        self.packed = [p0] + [_clone(p0) for _ in range(self.rot - 1)]
        wd = dequantize_int4(p0, torch.bfloat16)
        self.w_bf16 = [wd] + [wd.clone() for _ in range(self.rot_bf16 - 1)]
        self.x_all = torch.randn(max_m, K, device=dev, generator=g, dtype=torch.bfloat16)
        from fastdecode.quant import quantize_activation_fp8

        self.xq_all, self.xs_all = quantize_activation_fp8(self.x_all)
        n_out = max(self.rot, self.rot_bf16)
        self.out_all = [torch.empty(max_m, N, device=dev, dtype=torch.bfloat16) for _ in range(n_out)]

    def tinygemm(self) -> list:
        """``self.rot`` tinygemm linears (``bench.peers.TinygemmLinear``, group 128) of the dequantised weight, made
        on first use."""
        if not hasattr(self, "_tinygemm"):
            from fastdecode.bench.peers import TinygemmLinear

            lin = TinygemmLinear.from_dense(self.w_bf16[0], group_size=GROUP).requires_grad_(False)
            self._tinygemm = [lin] + [TinygemmLinear(lin.packed.clone(), lin.scales_and_zeros.clone(), lin.in_features,
                                                     lin.padded_in_features, lin.out_features, lin.group_size, None,
                                                     lin.dtype).requires_grad_(False) for _ in range(self.rot - 1)]
        return self._tinygemm

    def bytes_int4(self, M: int, fp8: bool = False) -> int:
        return self.int4_bytes + M * self.K * (1 if fp8 else 2) + M * self.N * 2 + (4 * M if fp8 else 0)

    def bytes_bf16(self, M: int) -> int:
        return self.N * self.K * 2 + M * self.K * 2 + M * self.N * 2

    def calls(self, M: int, impl: str, config: Optional[dict] = None) -> list:
        """impl: 'cublas' | 'dispatch' | 'dispatch_fp8' | 'triton' / 'triton_fp8' (explicit config) | 'dequant'."""
        from fastdecode.ops.int4 import (
            int4_linear, int4_linear_dequant_cublas, int4_linear_fp8, int4_linear_with_config,
        )

        x, xq, xs = self.x_all[:M], self.xq_all[:M], self.xs_all[:M]
        fns = []
        if impl == "tinygemm":  # torch's _weight_int4pack_mm on its own packing of the same dequantised weight
            return [lambda lin=lin: lin(x) for lin in self.tinygemm()]
        if impl == "cublas":
            for i in range(self.rot_bf16):
                w, out = self.w_bf16[i], self.out_all[i][:M]
                fns.append(lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out))
            return fns
        for i in range(self.rot):
            p, out = self.packed[i], self.out_all[i][:M]
            if impl == "dispatch":
                fn = lambda p=p, out=out: int4_linear(x, p, out=out)  # noqa: E731
            elif impl == "dispatch_fp8":
                fn = lambda p=p, out=out: int4_linear_fp8(xq, xs, p, out=out)  # noqa: E731
            elif impl == "triton":
                fn = lambda p=p, out=out: int4_linear_with_config(x, p, None, out, config)  # noqa: E731
            elif impl == "triton_fp8":
                fn = lambda p=p, out=out: int4_linear_with_config(xq, p, None, out, config, xs.reshape(-1))  # noqa: E731
            elif impl == "dequant":
                fn = lambda p=p, out=out: int4_linear_dequant_cublas(x, p, None, out)  # noqa: E731
            else:
                raise ValueError(f"unknown impl {impl!r}")
            fns.append(fn)
        return fns

    def warm(self, M: int, config: dict, fp8: bool = False) -> None:
        """Compile (only) the kernel of ``config`` for these operands (``kernels.compile.precompile``)."""
        from fastdecode.ops.int4 import int4_linear_with_config

        x, xs = (self.xq_all[:M], self.xs_all[:M].reshape(-1)) if fp8 else (self.x_all[:M], None)
        int4_linear_with_config(x, self.packed[0], None, self.out_all[0][:M], config, xs, warmup=True)

    def reference(self, M: int, fp8: bool = False) -> torch.Tensor:
        w = self.w_bf16[0].float()
        if fp8:
            return (self.xq_all[:M].float() * self.xs_all[:M]) @ w.t()
        return self.x_all[:M].float() @ w.t()


def _clone(p):
    from fastdecode.quant.int4 import Int4Weight

    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return Int4Weight(c(p.qweight), c(p.scales), c(p.zeros), c(p.mins), p.group_size, p.zero_mode, c(p.perm),
                      p.K, p.layout)


def _time(calls, M: int):
    return time_cuda(calls, graph=True, calls_per_graph=20 if M <= 256 else 4, reps=30 if M <= 256 else 15)


def max_error(ops: _Operands, M: int, impl: str, config=None, fp8: bool = False) -> tuple[float, float]:
    """(max |out - ref|, max |ref|): ``impl``'s output (poisoned first), first weight, against the fp32 reference."""
    out = ops.out_all[0][:M].fill_(float("nan"))
    got = ops.calls(M, impl, config)[0]()  # tinygemm returns its own output
    torch.cuda.synchronize()
    ref = ops.reference(M, fp8)
    return ((got if isinstance(got, torch.Tensor) else out).float() - ref).abs().max().item(), ref.abs().max().item()


def _ok(ops: _Operands, M: int, impl: str, config=None, fp8: bool = False, errors: Optional[dict] = None):
    """None where ``impl`` is within 2 % of the reference's top, else why; ``errors`` gets ``err_rel`` (error/top)."""
    err, top = max_error(ops, M, impl, config, fp8)
    if errors is not None:
        errors["err_rel"] = float(f"{err / top:.4g}") if top else err
    tol = 2e-2 * max(1.0, top)
    return None if err <= tol else f"max error {err:.3g} > {tol:.3g}"

# ----------------------------------------------------------------------------- tuning


MMA_MAX_M = 64
KINDS = ("fma", "mma", "dot")


# PACKED's fma tiles (BLOCK_N, num_warps): session 38's best at M = 1 on the H100, 32 rows on 4 warps and 128 on 8,
# had few words a thread; 16 rows and 32 or 64 on 8 warps (4-8 words a thread) were not timed then
PACKED_TILES = ((16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8))


def candidates(M: int, N: int, K: int, fp8: bool = False, quick: bool = False,
               smem_limit: Optional[int] = None, small_m_dot: bool = False,
               kinds: Sequence[str] = KINDS, group_size: Optional[int] = None) -> list[dict]:
    """A small config list per M: fma tiles for M <= 8, mma tiles for M <= 64 (W4A16), dot tiles for M >= 8,
    split-K 1..16; ``kinds``: only these kinds.

    mma (``kernels.int4_mma``): tokens padded to BLOCK_M = 16 (32, 64 above), 64-256 weight rows a program
    (256 on 8 warps: 4 warps spill there), 2-4 pipeline stages; and tiles of fewer than 4 warps (16 weight rows
    on 1 warp, 32 or 64 on 2), which triton compiles to Ampere-style ``mma.sync`` (wgmma needs a warpgroup of 4
    warps and 64 rows for each): no ``wgmma.wait_group`` after each shift's dot, the limit session 11 found on
    the 64-row wgmma tiles (benchmarks/NOTES.md, session 14; not timed yet). Not 32 rows on 4 warps: triton
    spreads those warps over the tokens too, and each weight value is converted twice.

    Not dot tiles below M = 8 (``small_m_dot``, off by default): timed alone they beat the fma tiles at
    M = 1-4 on most shapes (up to 2x at M = 4), yet the 8B int4 decode step with that table ran at 3407 us
    against 3203 us with the fma table (H200, benchmarks/NOTES.md, session 6); not explained yet.

    fma tiles keep BLOCK_K = 256 (one layout tile: the per-group scaling of the kernel needs it; BLOCK_K 1024 lost on
    every SmolLM2 shape, session 31) and take 4-128 weight rows (4 and 8 on 1, 2 or 4 warps); the one-split tiles of
    up to 16 rows also with PREFETCH 2 and / or SCALE_PF (the kernel's options for the loop's load latency);
    ``quick``: the wide fma tiles on 4 warps, the small ones on 2, fewer dot tiles (a tuning run that fits a few
    device minutes).
    ``group_size``: where given and PACKED applies (W4A16, M <= 2, ``kernels.int4_packed.groups_fit``), ``PACKED_TILES``
    with PACKED too (session 38, H100, 8B at M = 1: 1.17-1.26x the fma tiles, a tie with gate_up's mma tile, a loss
    at M = 4).
    ``smem_limit`` (bytes, ``fastdecode.ops.int4.smem_limit(device)``): configs whose shared-memory
    estimate (``ops.int4.smem_bytes``) exceeds it are not proposed; None keeps them all."""
    from fastdecode.kernels.int4_packed import groups_fit
    from fastdecode.ops.int4 import smem_bytes

    out = []
    splits = (1, 2, 4, 8, 16)
    if M <= 8:
        bm = min(4, 1 << max(M - 1, 0).bit_length())
        # tiles of 4-8 weight rows on 1-4 warps: more programs on small N (session 31, H100, SmolLM2's Q4_1 shapes
        # at M = 1: qkv 3.61 -> 3.35 us at 4 rows on 2 warps, gate_up 5.93 -> 5.15, o 3.51 -> 3.10 at 8 rows)
        small = ((4, 2), (8, 2)) if quick else ((4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4))
        wide = [(bn, nw) for bn in (16, 32, 64, 128) for nw in ((4,) if quick else (4, 8))]
        for (bn, nw), pf in itertools.product(small + tuple(wide), (True,) if quick else (True, False)):
            if bm * bn * 256 // 8 // (32 * nw) > 128:  # accumulator registers per thread
                continue
            for sk in splits:
                out.append({"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk,
                            "num_warps": nw, "num_stages": 1, "PREFETCH": pf})
        # one split, up to 16 rows: the words of two steps ahead (PREFETCH 2) and the next step's scales with its
        # words (SCALE_PF). Session 32, H100, SmolLM2's Q4_1 shapes at M = 1: qkv 3.55 -> 3.15 us (16 rows on 4
        # warps, PREFETCH 2), gate_up 5.93 -> 4.43 (8 on 2, SCALE_PF), o 3.49 -> 2.81 (8 on 4, SCALE_PF)
        for (bn, nw), (pf, spf) in itertools.product(small + ((16, 4),) + (() if quick else ((16, 8),)),
                                                     ((2, False), (True, True)) + (() if quick else ((2, True),))):
            out.append({"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": 1,
                        "num_warps": nw, "num_stages": 1, "PREFETCH": pf, "SCALE_PF": spf})
        if group_size is not None and M <= 2 and not fp8 and groups_fit(group_size, K):
            for (bn, nw), sk in itertools.product(PACKED_TILES, splits[:4]):
                out.append({"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk,
                            "num_warps": nw, "num_stages": 1, "PREFETCH": True, "PACKED": True})
    if M < 8 and not small_m_dot:
        bms = []
    else:
        bms = [16] if M <= 16 else ([16, 32] if M <= 32 else ([16, 32, 64] if M <= 64 else [64, 128]))
    for bm, bn, st, pf in itertools.product(bms, (64, 128) if quick else (32, 64, 128),
                                            (3,) if quick else (2, 3, 4), (True, False)):
        if bm == 128 and bn == 128:
            st = 2  # 3 stages of 128 x 128 x 256 exceed the 227 KB of shared memory
        if pf and bm > 32:
            continue  # the register double buffer is for the weight-streaming tiles
        nw = 8 if bm * bn >= 128 * 128 else 4
        for sk in (splits if M < 8 else splits[:4] if M <= 256 else (1,)):
            c = {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk,
                 "num_warps": nw, "num_stages": st, "PREFETCH": pf}
            if c not in out:
                out.append(c)
    if M <= MMA_MAX_M and not fp8:
        bm = max(16, 1 << max(M - 1, 0).bit_length())
        tiles = (((32, 2), (64, 2), (64, 4), (128, 4), (256, 8)) if quick
                 else ((16, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8)))
        for (bn, nw), st in itertools.product(tiles, (2, 3) if quick else (2, 3, 4)):
            for sk in (splits if M <= 16 else splits[:4]):
                # CVT1: one shift converted at a time (72 registers a thread instead of 114-168 on the sm_90
                # compile: more programs an SM); MASK_X: the padding tokens are not loaded (NOTES, session 19)
                out.append({"kind": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk,
                            "num_warps": nw, "num_stages": st, "MASK_X": True, "CVT1": True})
    out = [c for c in out if c["kind"] in kinds]
    if smem_limit is not None:
        out = [c for c in out if smem_bytes(c, 1 if fp8 else 2) <= smem_limit]
    return out


def _out_of_resources(e: BaseException) -> bool:
    """Triton's OutOfResources: the config asks for more shared memory (or registers) than the GPU has.
    Imported here, not at module import: importing fastdecode must not import triton (_common.py)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return False
    return isinstance(e, OutOfResources)


def try_config(check, cfg: dict, what: str) -> bool:
    """Run ``check(cfg)`` (one launch; returns None, or what was wrong with the values). False, with one
    log line naming the config and the reason, when the config cannot launch on this GPU (Triton's
    OutOfResources: the safety net behind the shared-memory estimate) or gave wrong values; any other
    error propagates."""
    try:
        err = check(cfg)
    except Exception as e:
        if not _out_of_resources(e):
            raise
        err = str(e)
    if err:
        log.warning(f"fastdecode tune int4: {what}: skipping {cfg}: {err}")
        return False
    return True


def fastest(cands, check, time, what: str, warm=None) -> Optional[tuple[float, dict]]:
    """(time, config) of the fastest candidate that launches and is right (``try_config``), or None.
    ``time(cfg)``: microseconds, called only for the configs that passed ``check``; ``warm(cfg)``: a
    compile-only launch (``kernels.compile.precompile``), or None."""
    best = None
    cands = list(cands)
    if warm is not None:  # every candidate's compile in parallel threads first
        precompile(warm, cands)
    for cfg in cands:
        if not try_config(check, cfg, what):
            continue
        t = time(cfg)
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def tune(out_path=None, *, shapes=None, ms: Optional[Sequence[int]] = None, groups=(GROUP,), fp8: bool = True,
         max_candidates: Optional[int] = None, quick: bool = False, merge: bool = False,
         small_m_dot: bool = False, kinds: Sequence[str] = KINDS, zero_mode: str = ZERO_MODE) -> dict:
    """Time candidates per (N, K, group, M) and write the dispatcher table (returns it).

    Candidates over this GPU's shared memory (by ``ops.int4.smem_bytes``) are not tried; one that still
    cannot launch, or gives wrong values, is skipped with one log line (``try_config``). ``merge``: start
    from the table already at ``out_path`` (same GPU; where there is none, the table in use, a sibling GPU's too:
    ``ops._common.table_path``) and replace only the (shape, M) entries tuned here,
    e.g. a run over ``ms=(1, 2, 4, 8)``; the table's ``env`` then names this run. ``kinds``: only candidates of
    these kinds, plus the (shape, M) entry already in the table (timed again in this run, so that the entry
    kept is the faster of the two side by side). ``zero_mode``: of the weights timed (default the engine's; the
    table is keyed by shape and group only, so it holds the configs of that mode; ``tuned_zero_mode``)."""
    from fastdecode.ops._common import table_path
    from fastdecode.ops.int4 import clear_config_cache, config_path, smem_limit, table_key

    shapes = dict(SHAPES) if shapes is None else shapes
    ms = tuple(ms or (QUICK_TUNE_MS if quick else TUNE_MS))
    name = torch.cuda.get_device_name()
    path = Path(out_path) if out_path else config_path(name)
    table = start_table(path, name, torch.cuda.get_device_properties(0).multi_processor_count, merge,
                        ("int4_linear", "int4_linear_fp8"), base=table_path("int4_linear", name))
    table["tuned_zero_mode"] = zero_mode
    limit = smem_limit(torch.device("cuda"))
    path.parent.mkdir(parents=True, exist_ok=True)
    for (sname, (N, K)), g in itertools.product(shapes.items(), groups):
        ops = _Operands(N, K, g, max(ms), zero_mode)
        for op, is_fp8 in (("int4_linear", False), ("int4_linear_fp8", True)):
            if is_fp8 and not fp8:
                continue
            entries = table[op].setdefault(table_key(N, K, g), {})
            impl = "triton_fp8" if is_fp8 else "triton"
            for M in ms:
                cands = candidates(M, N, K, is_fp8, quick, smem_limit=limit, small_m_dot=small_m_dot, kinds=kinds,
                                   group_size=g)
                old = entries.get(str(M))
                if old and old.get("impl") == "triton" and old.get("config") and old["config"] not in cands:
                    cands.append(dict(old["config"]))  # the incumbent, timed again beside the new kinds
                if max_candidates is not None and len(cands) > max_candidates:
                    log.warning(f"fastdecode tune int4: {op} {sname} M={M}: timing the first {max_candidates} "
                                f"of {len(cands)} candidates")
                    cands = cands[:max_candidates]
                best = fastest(cands, lambda cfg: _ok(ops, M, impl, cfg, is_fp8),
                               lambda cfg: _time(ops.calls(M, impl, cfg), M).median_us, f"{op} {sname} g{g} M={M}",
                               warm=lambda cfg: ops.warm(M, cfg, is_fp8))
                best = None if best is None else (best[0], "triton", best[1])
                if not is_fp8 and (M >= 128 or (old or {}).get("impl") == "dequant"):
                    t = _time(ops.calls(M, "dequant"), M).median_us
                    if best is None or t < best[0]:
                        best = (t, "dequant", best[2] if best else None)
                if best is not None:
                    entries[str(M)] = {"impl": best[1], "config": best[2], "us": round(best[0], 3)}
                    print(f"{op} {sname} g{g} M={M}: {best[1]} {best[0]:.2f} us {best[2]}", flush=True)
        ops = None  # release the operands (the closures above still name ops)
        torch.cuda.empty_cache()
        path.write_text(json.dumps(table, indent=1) + "\n")  # after every shape: a cut-off run keeps its data
    clear_config_cache()
    return table


# ----------------------------------------------------------------------------- benchmark


def run(out_path=None, quick: bool = False, *, shapes=None, ms: Optional[Sequence[int]] = None,
        zero_mode: str = ZERO_MODE) -> list[dict]:
    """Benchmark rows + summary rows against the issue's targets; written to ``out_path`` if given. Every row
    names the weights' ``zero_mode``."""
    shapes = dict(SHAPES) if shapes is None else shapes
    ms = tuple(ms or (QUICK_MS if quick else MS))
    rows = []
    for sname, (N, K) in shapes.items():
        ops = _Operands(N, K, GROUP, max(ms), zero_mode)
        for M in ms:
            shape = {"name": sname, "M": M, "N": N, "K": K, "group": GROUP}
            flops = 2 * M * N * K
            tb = _time(ops.calls(M, "cublas"), M)
            rows.append(make_row("int4_linear", "cublas_bf16", shape, tb, bytes_moved=ops.bytes_bf16(M), flops=flops))
            tt = None
            if M <= TINYGEMM_MAX_M:
                tt = _time(ops.calls(M, "tinygemm"), M)
                rows.append(make_row("int4_linear", "tinygemm", shape, tt, bytes_moved=ops.bytes_int4(M), flops=flops))
            for impl, fp8 in (("dispatch", False), ("dispatch_fp8", True)):
                err = _ok(ops, M, impl, fp8=fp8)
                t = _time(ops.calls(M, impl), M)
                extra = {} if fp8 or tt is None else {"speedup_vs_tinygemm": round(tt.median_us / t.median_us, 3)}
                r = make_row("int4_linear_fp8" if fp8 else "int4_linear", impl, shape, t,
                             bytes_moved=ops.bytes_int4(M, fp8), flops=flops,
                             speedup_vs_cublas=round(tb.median_us / t.median_us, 3),
                             weight_tbps=round(ops.int4_bytes / (t.median_us * 1e-6) / 1e12, 3), **extra)
                if err:
                    r["error"] = err
                rows.append(r)
            print_table(rows[-4 if tt else -3:], ("op", "impl", "shape", "median_us", "tbps", "speedup_vs_cublas"))
        del ops
        torch.cuda.empty_cache()
    rows += summarize(rows)
    for r in rows:
        r["zero_mode"] = zero_mode
    if out_path:
        write_rows(rows, out_path)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Summary rows against issue 18's targets: per M the geomean speed-up over cuBLAS BF16 and the worst shape;
    M = 1-16 together (speed-up geomean, the slowest TB/s), M = 64, every M >= 0.9x; tinygemm at M = 1; W4A8 over
    W4A16 at M >= 256."""
    out = []
    w4 = [r for r in rows if r["op"] == "int4_linear" and r["impl"] == "dispatch" and r.get("median_us")]
    ms = sorted({r["shape"]["M"] for r in w4})
    for M in ms:
        sp = [r["speedup_vs_cublas"] for r in w4 if r["shape"]["M"] == M]
        s = {"op": "int4_linear", "impl": "summary", "shape": {"M": M, "group": GROUP},
             "geomean_speedup_vs_cublas": round(geomean(sp), 3), "min_speedup": round(min(sp), 3),
             "target_min": FLOOR_ANY_M}
        if M == 64:
            s["target"] = TARGET_M64
        ok = s["min_speedup"] >= FLOOR_ANY_M and s["geomean_speedup_vs_cublas"] >= s.get("target", 0)
        tg = [r["speedup_vs_tinygemm"] for r in w4 if r["shape"]["M"] == M and "speedup_vs_tinygemm" in r]
        if tg:
            s["geomean_speedup_vs_tinygemm"] = round(geomean(tg), 3)
            if M == 1:
                s["target_vs_tinygemm"] = TARGET_TINYGEMM
                ok = ok and s["geomean_speedup_vs_tinygemm"] >= TARGET_TINYGEMM
        s["pass"] = bool(ok)
        out.append({**s, **env_info()})
    small = [r for r in w4 if r["shape"]["M"] in SMALL_MS]
    if small:
        g = geomean([r["speedup_vs_cublas"] for r in small])
        worst = min(small, key=lambda r: r["tbps"])
        out.append({"op": "int4_linear", "impl": "summary", "shape": {"M": "1-16", "group": GROUP},
                    "geomean_speedup_vs_cublas": round(g, 3), "target": TARGET_SMALL_M,
                    "min_tbps": worst["tbps"], "min_tbps_shape": worst["shape"], "target_tbps": TARGET_TBPS,
                    "pass": bool(g >= TARGET_SMALL_M and worst["tbps"] >= TARGET_TBPS), **env_info()})
    w8 = {(r["shape"]["name"], r["shape"]["M"]): r["median_us"] for r in rows
          if r["op"] == "int4_linear_fp8" and r["impl"] == "dispatch_fp8"}
    ratios = [r["median_us"] / w8[(r["shape"]["name"], r["shape"]["M"])] for r in w4
              if r["shape"]["M"] >= 256 and (r["shape"]["name"], r["shape"]["M"]) in w8]
    if ratios:
        g = geomean(ratios)
        out.append({"op": "int4_linear_fp8", "impl": "summary", "shape": {"M": ">=256", "group": GROUP},
                    "geomean_speedup_vs_w4a16": round(g, 3), "target": W4A8_OVER_W4A16,
                    "pass": bool(g >= W4A8_OVER_W4A16), **env_info()})
    return out


def main(argv=None) -> int:
    """``python -m fastdecode.bench.int4 bench [--out F] [--quick]`` or ``... tune --out F [--ms 1,2,4,8]
    [--shapes 960x576,...] [--groups 32] [--merge] [--quick] [--no-fp8] [--small-m-dot] [--kinds mma]``
    (``benchmarks/gpu.py``'s int4 suites)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fastdecode.bench.int4", description=main.__doc__)
    p.add_argument("what", choices=["bench", "tune"])
    p.add_argument("--out", default=None, help="bench: rows (default benchmarks/results/int4_linear.json); "
                                               "tune: the table (default the package's)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ms", default=None, help="tune: comma-separated token counts (default all)")
    p.add_argument("--merge", action="store_true", help="tune: replace only the entries tuned, keep the rest")
    p.add_argument("--no-fp8", action="store_true", help="tune: skip the W4A8 section")
    p.add_argument("--small-m-dot", action="store_true", help="tune: also time dot tiles below M = 8 (see candidates)")
    p.add_argument("--shapes", default=None, help='tune: "NxK,..." or names of the Llama shapes (default those)')
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="tune: comma-separated kernel kinds to time (default all; with --merge the table's entry "
                        "is timed again beside them)")
    p.add_argument("--groups", default=str(GROUP), help=f"tune: comma-separated group sizes (default {GROUP}; "
                                                        "GGUF Q4_0 / Q4_1 use 32)")
    p.add_argument("--zero-mode", default=ZERO_MODE, choices=ZERO_MODES,
                   help=f"the weights' zero mode (default {ZERO_MODE}, the engine's RTN quantisation)")
    a = p.parse_args(argv)
    if a.what == "tune":
        from fastdecode.bench.gemm import parse_shapes

        ms = tuple(int(m) for m in a.ms.split(",")) if a.ms else None
        groups = tuple(int(g) for g in a.groups.split(","))
        tune(a.out, shapes=parse_shapes(a.shapes) if a.shapes else None, groups=groups, ms=ms, quick=a.quick,
             merge=a.merge, fp8=not a.no_fp8, small_m_dot=a.small_m_dot, kinds=tuple(a.kinds.split(",")),
             zero_mode=a.zero_mode)
    else:
        run(a.out or "benchmarks/results/int4_linear.json", quick=a.quick, zero_mode=a.zero_mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
