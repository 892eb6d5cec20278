"""Tuner of the fused int4 ops' table sections (``fastdecode.ops.int4.FUSED_OPS``), GPU.

The decode step of an int4 Llama runs its four projections as fused kernels (``models.norm_gemm``): qkv and
gate_up with the RMSNorm inside (``int4_rms_norm_linear``), o with the residual add (``int4_add_linear``), down
with SiLU-and-mul and the add (``int4_add_linear_glu``; K <= ``INT4_GLU_MAX_K``, else ``int4_add_linear``). Each
fused op reads its own table section where the table has an entry for the shape and M, else the plain GEMV's
(``int4_linear``, which ``fastdecode.bench.int4.tune`` fills). The plain GEMV's tile is not the fused op's best: in
session 32 (H100) the same tile ran the embedded step 46 us apart depending on how the norm ran inside it, and in
session 33 the fastest fused tiles of a sweep, in these sections, ran the embedded step 28 us (4.5 %) under the
plain tiles (benchmarks/NOTES.md).

This times, per shape and M, the fused op as the step runs it (the int4 kernel's fma kind, the only kind
``norm_gemm`` fuses) on the tuner's fma candidates (``bench.int4.candidates``; on g128 shapes PACKED's tiles with
PREFETCH 1 and 2 too, session 45), on the norm op each one-split tile
also with NORM_LOOP (the in-loop norm, opt-in), plus the tile the table gives the op now, of any kind (on a
tensor-core tile the op runs the norm or SiLU-and-mul kernel first; where that wins, the section keeps that tile and
the model the unfused step; session 34's H100 left 8B gate_up's mma tile out and the fused step it then took was
55-102 us slower than the unfused one, benchmarks/NOTES.md); each is checked against
the op's fp32 reference first, then timed on rotated weights (CUDA graphs, ``bench.harness.time_cuda``). The
fastest goes into the op's section of the table at ``--out`` (``bench.harness.write_table_section``: a missing
file starts from the table in use), whose other sections and entries stay. For the GLU op above ``INT4_GLU_MAX_K``
(``8b.down_glu``), where an entry turns the GLU on in the step, only if it beats w2 without it (the SiLU-and-mul
kernel, then the add op's tile): in session 46 (H100) it did not, and the step on that entry ran 152-194 us slower.

    python -m fastdecode.bench.int4_fused --shapes smollm2 --ms 1 --out DIR/int4_linear_<gpu>.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger("fastdecode")

EPS = 1e-5
MAX_M = 8  # the tuner proposes fma tiles up to here (bench.int4.candidates); norm_gemm fuses the fma kind only
# the engine's shapes: (N, K, group, weight format); "min": GGUF Q4_1 (q * d + m, fp16 d and m), the embedded
# model's; "zero": the engine's RTN int4 (quant.formats)
SHAPES = {
    "smollm2.qkv": (960, 576, 32, "min"), "smollm2.o": (576, 576, 32, "min"),
    "smollm2.gate_up": (3072, 576, 32, "min"), "smollm2.down": (576, 1536, 32, "min"),
    "8b.qkv": (6144, 4096, 128, "zero"), "8b.o": (4096, 4096, 128, "zero"),
    "8b.gate_up": (28672, 4096, 128, "zero"), "8b.down": (4096, 14336, 128, "zero"),
    # the 8B's w2 with SiLU-and-mul inside, above INT4_GLU_MAX_K: the step takes it only on this op's own entry
    # (models.norm_gemm._int4_glu), written only where it beats w2 without the GLU (tune_fused)
    "8b.down_glu": (4096, 14336, 128, "zero"),
}
ALIASES = {"smollm2": [s for s in SHAPES if s.startswith("smollm2.")], "8b": [s for s in SHAPES if s.startswith("8b.")]}


def op_of(name: str, K: int) -> str:
    """The fused op a projection runs as in the step (``models.norm_gemm``)."""
    from fastdecode.models.norm_gemm import INT4_GLU_MAX_K

    proj = name.rsplit(".", 1)[-1]
    if proj in ("qkv", "gate_up"):
        return "int4_rms_norm_linear"
    if (proj == "down" and K <= INT4_GLU_MAX_K) or proj == "down_glu":
        return "int4_add_linear_glu"
    if proj in ("o", "down"):
        return "int4_add_linear"
    raise ValueError(f"no fused op for {name!r}: the projections are qkv, o, gate_up, down, down_glu")


def parse_shapes(spec: str) -> list[str]:
    """Comma-separated shape names of ``SHAPES`` or the aliases ``smollm2`` and ``8b``."""
    out = []
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        if s not in SHAPES and s not in ALIASES:
            raise ValueError(f"unknown shape {s!r}: one of {sorted(SHAPES)} or {sorted(ALIASES)}")
        out += [n for n in ALIASES.get(s, [s]) if n not in out]
    if not out:
        raise ValueError("no shapes given")
    return out


def parse_ms(spec: str) -> list[int]:
    """Comma-separated token counts, each from 1 to ``MAX_M`` (the fma kind's tiles)."""
    ms = [int(m) for m in spec.split(",")]
    if not all(1 <= m <= MAX_M for m in ms):
        raise ValueError(f"--ms: token counts from 1 to {MAX_M}, got {spec!r}")
    return ms


def make_weight(N: int, K: int, group: int, fmt: str, device, generator: Optional[torch.Generator] = None):
    """A random packed int4 weight of format ``fmt`` ("min": GGUF Q4_1's codes, fp16 scales and mins; "zero": the
    engine's RTN with zero points) on ``device``."""
    from fastdecode.quant.int4 import prepack, quantize_int4

    if fmt == "zero":
        return quantize_int4(torch.randn(N, K, device=device, generator=generator) * 0.02, group, symmetric=False)
    if fmt != "min":
        raise ValueError(f"weight format must be 'min' or 'zero', got {fmt!r}")
    cpu = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=generator, device=device)))
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=cpu)
    d = (torch.rand(N, K // group, generator=cpu) * 0.004 + 0.001).half()
    m = (-8 * d.float() + torch.randn(N, K // group, generator=cpu) * 1e-3).half()
    return prepack(q, d, group_size=group, mins=m).to(device)


class FusedOperands:
    """One shape's operands as the step's fused op sees them: ``rot`` copies of the packed weight (distinct memory,
    as real layers; 1 off CUDA), the inputs (x, or ``[gate | up]`` for the GLU op; the norm's weight), the outputs
    (the residual the add ops accumulate into) and the fp32 reference of the first copy's call."""

    def __init__(self, op: str, N: int, K: int, group: int, fmt: str, M: int, device, rot: Optional[int] = None):
        from fastdecode.bench.harness import rotation_count
        from fastdecode.bench.int4 import _clone
        from fastdecode.ops.int4_norm_linear import int4_add_linear_ref, int4_rms_norm_linear_ref

        dev = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(0)
        self.op, self.N, self.K, self.group, self.M = op, N, K, group, M
        self.glu = op == "int4_add_linear_glu"
        w0 = make_weight(N, K, group, fmt, dev, g)
        if rot is None:
            rot = rotation_count(w0.nbytes()) if dev.type == "cuda" else 1
        self.w = [w0] + [_clone(w0) for _ in range(rot - 1)]
        dt = torch.bfloat16
        self.x = [(torch.randn(M, 2 * K if self.glu else K, device=dev, generator=g) * 3).to(dt) for _ in range(rot)]
        self.norm_weight = (1 + 0.1 * torch.randn(K, device=dev, generator=g)).to(dt)
        self.res = [(torch.randn(M, N, device=dev, generator=g) * 3).to(dt) for _ in range(rot)]
        self.r0 = self.res[0].clone()
        self.out = torch.empty(M, N, device=dev, dtype=dt)
        if op == "int4_rms_norm_linear":
            self.ref = int4_rms_norm_linear_ref(self.x[0], self.norm_weight, w0, eps=EPS).float()
        else:
            self.ref = int4_add_linear_ref(self.r0, self.x[0], w0, glu=self.glu).float()

    def calls(self, cfg: dict, warmup: bool = False, glu_inside: bool = True) -> list[Callable[[], None]]:
        """One call per weight copy of the op on ``cfg`` as the op runs it (``ops.int4_norm_linear``): on an fma
        tile the norm or SiLU-and-mul inside; on a tensor-core tile the norm kernel (SiLU-and-mul kernel) first.
        ``glu_inside=False`` (the GLU op): the SiLU-and-mul kernel first on any tile, then the add op: w2 as the step
        runs it without the GLU."""
        from fastdecode.ops.activation import silu_and_mul
        from fastdecode.ops.int4 import int4_linear_with_config
        from fastdecode.ops.norm import rms_norm

        inside = cfg.get("kind") == "fma"
        if self.op == "int4_rms_norm_linear":
            outs = [self.out] * len(self.w)
            pre = None if inside else (lambda x: rms_norm(x, self.norm_weight, EPS, backend="triton"))
            kw = dict(norm_weight=self.norm_weight, eps=EPS, x_norm=True) if inside else {}
        else:
            outs = self.res
            glu_in = self.glu and inside and glu_inside
            pre = (lambda x: silu_and_mul(x, backend="triton")) if self.glu and not glu_in else None
            kw = dict(accumulate=True, glu=glu_in)
        return [lambda i=i: int4_linear_with_config(pre(self.x[i]) if pre else self.x[i], self.w[i], None, outs[i],
                                                    cfg, warmup=warmup, **kw) for i in range(len(self.w))]

    def check(self, cfg: dict, glu_inside: bool = True) -> Optional[str]:
        """One call on a poisoned output (the add ops: the residual restored first); None when it matches the
        reference within 2 % of the output's largest value, else what was wrong."""
        self.out.fill_(float("nan"))
        self.res[0].copy_(self.r0)
        self.calls(cfg, glu_inside=glu_inside)[0]()
        got = (self.out if self.op == "int4_rms_norm_linear" else self.res[0]).float()
        err = float((got - self.ref).abs().max() / self.ref.abs().max())
        return None if err < 2e-2 else f"max error {err:.3g} of the output's largest value"


def fused_candidates(op: str, M: int, N: int, K: int, quick: bool = False, smem_limit: Optional[int] = None,
                     incumbent: Optional[dict] = None, group_size: Optional[int] = None) -> list[dict]:
    """The tuner's fma candidates (``bench.int4.candidates``), on the norm op each tile of one effective split also
    with NORM_LOOP, and ``incumbent`` (the tile the table gives the op now, of any kind: on a tensor-core tile the
    op runs the norm or SiLU-and-mul kernel first, ``FusedOperands.calls``) where it is not among them. An
    incumbent that stays keeps its kind in the section, and a tensor-core tile there keeps the model on the
    unfused step (``models.norm_gemm``).

    ``group_size``: where PACKED applies (``bench.int4.candidates``: M <= 2, groups of a multiple of 128 columns,
    so the 8B shapes and not the embedded model's g32), its tiles with PREFETCH 1 and 2. The 8B sections were tuned
    in session 34, before PACKED existed, when every fused fma tile lost to the unfused step; PACKED with PREFETCH 2
    is now every M = 1 entry of the plain GEMV's tables (both cards) and 1.2-1.4x the fma tiles of then."""
    from fastdecode.bench.int4 import candidates
    from fastdecode.kernels.int4 import split_k_blocks

    if M > MAX_M:
        raise ValueError(f"the fused ops are tuned up to M = {MAX_M} (the fma kind's tiles), got M = {M}")
    cands = candidates(M, N, K, quick=quick, smem_limit=smem_limit, kinds=("fma",), group_size=group_size)
    cands += [{**c, "PREFETCH": 2} for c in cands if c.get("PACKED")]
    if op == "int4_rms_norm_linear":
        cands += [{**c, "NORM_LOOP": True} for c in cands if split_k_blocks(K, c)[1] == 1]
    if incumbent is not None and incumbent not in cands:
        cands.append(dict(incumbent))
    return cands


def _claim(path: Path, base: Path, gpu: str) -> None:
    """Start the table at ``path`` as this GPU's: a copy of ``base`` where there is none; a table of the GPU whose
    tables this one reads is named this GPU's, ``based_on`` that one (``bench.harness.adopt_table``, as the tuners'
    ``start_table`` does); a table of another GPU is refused."""
    import json

    from fastdecode.bench.harness import adopt_table

    src = path if path.is_file() else base
    table = json.loads(src.read_text()) if src.is_file() else {}
    mine = adopt_table(table, gpu, src, "not writing into it")
    if mine is table and src == path:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mine, indent=1) + "\n")


def tune_fused(out_path, *, shapes: Sequence[str] = tuple(ALIASES["smollm2"]), ms: Sequence[int] = (1,),
               quick: bool = False, device="cuda", timer: Optional[Callable[[list], float]] = None,
               max_candidates: Optional[int] = None, rot: Optional[int] = None) -> dict:
    """Time each shape's fused op at each M and write its fastest tile into the op's section of the table at
    ``out_path`` (a missing file starts from the table in use for this GPU). Returns ``{op: {key: {M: entry}}}``
    of what was written. ``timer(calls)``: microseconds a call (default ``time_cuda`` with graphs, CUDA);
    ``device``, ``max_candidates``, ``rot``: the CPU tests' small run under the interpreter."""
    from fastdecode.bench.harness import time_cuda, write_table_section
    from fastdecode.bench.int4 import fastest
    from fastdecode.models import norm_gemm
    from fastdecode.ops._common import table_path
    from fastdecode.ops._tuned import clear_config_cache, device_info
    from fastdecode.ops.int4 import get_int4_config, smem_limit, table_key

    dev = torch.device(device)
    if timer is None:
        if dev.type != "cuda":
            raise ValueError("timing needs a CUDA device (or a timer)")
        timer = lambda calls: time_cuda(calls, graph=True).median_us  # noqa: E731
    path = Path(out_path)
    gpu = device_info(dev)[0]
    base = table_path("int4_linear", gpu)
    _claim(path, base, gpu)
    written: dict = {}
    for name in shapes:
        N, K, group, fmt = SHAPES[name]
        op = op_of(name, K)
        for M in ms:
            clear_config_cache()  # the table at path as the last shape left it
            impl, cfg = get_int4_config(M, N, K, group, dev, op=op, path=str(path) if path.is_file() else None)
            incumbent = cfg if impl == "triton" else None
            cands = fused_candidates(op, M, N, K, quick, smem_limit(dev), incumbent, group_size=group)
            if max_candidates is not None:
                cands = cands[:max_candidates] + ([incumbent] if incumbent in cands[max_candidates:] else [])
            ops = FusedOperands(op, N, K, group, fmt, M, dev, rot)
            what = f"{op} {name} g{group} M={M}"
            times: dict = {}

            def time(c):
                times[repr(c)] = timer(ops.calls(c))
                return times[repr(c)]

            best = fastest(cands, ops.check, time, what,
                           warm=(lambda c: ops.calls(c, warmup=True)[0]()) if dev.type == "cuda" else None)
            if best is None:
                log.warning(f"fastdecode tune int4 fused: {what}: no candidate ran; the section keeps its entry")
                continue
            apart = (_glu_apart_us(ops, M, N, K, group, dev, path, timer)
                     if op == "int4_add_linear_glu" and K > norm_gemm.INT4_GLU_MAX_K else None)
            ops = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if apart is not None and apart <= best[0]:
                # no entry (one the table had is removed): the step keeps w2 without the GLU (norm_gemm._int4_glu)
                write_table_section(path, op, {table_key(N, K, group): {str(M): None}}, base=base)
                print(f"{what}: {best[0]:.2f} us {best[1]}, but the SiLU-and-mul kernel and then int4_add_linear's "
                      f"tile took {apart:.2f} us: no entry", flush=True)
                continue
            entry = {"impl": "triton", "config": best[1], "us": round(best[0], 3)}
            written.setdefault(op, {}).setdefault(table_key(N, K, group), {})[str(M)] = entry
            write_table_section(path, op, {table_key(N, K, group): {str(M): entry}}, base=base)
            now = times.get(repr(incumbent)) if incumbent is not None else None
            print(f"{what}: {best[0]:.2f} us {best[1]}" + (f" (the table's tile: {now:.2f} us)" if now else ""),
                  flush=True)
    clear_config_cache()
    return written


def _glu_apart_us(ops: FusedOperands, M: int, N: int, K: int, group: int, dev, path: Path,
                  timer: Callable[[list], float]) -> Optional[float]:
    """Microseconds a call of w2 without the GLU, as the step would run it: the SiLU-and-mul kernel, then the add
    op on its tile (its own section's entry in the table at ``path`` where this run or an earlier one wrote it, else
    the plain GEMV's). A GLU entry above ``INT4_GLU_MAX_K`` turns the GLU on in the step (``models.norm_gemm``), so
    it must beat this: in session 46 (H100) the tuner's fastest GLU tile on the 8B w2 took 23.17 us against 15.96 for
    the add op's, and the step with it ran 152-194 us slower. None where that tile fails its check."""
    from fastdecode.ops.int4 import get_int4_config

    _, cfg = get_int4_config(M, N, K, group, dev, op="int4_add_linear", path=str(path) if path.is_file() else None)
    if ops.check(cfg, glu_inside=False) is not None:
        return None
    if dev.type == "cuda":
        ops.calls(cfg, warmup=True, glu_inside=False)[0]()
    return timer(ops.calls(cfg, glu_inside=False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode.bench.int4_fused", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2", help=f"comma-separated names of {sorted(SHAPES)} or "
                   f"{sorted(ALIASES)} (default smollm2)")
    p.add_argument("--ms", default="1", help=f"comma-separated token counts up to {MAX_M} (default 1)")
    p.add_argument("--quick", action="store_true", help="the tuner's quick candidate list")
    p.add_argument("--out", required=True, help="the int4 table to write into (int4_linear_<gpu>.json)")
    a = p.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes)
        ms = parse_ms(a.ms)
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA GPU")
    tune_fused(a.out, shapes=shapes, ms=ms, quick=a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
