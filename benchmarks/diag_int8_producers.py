"""Development check (GPU): what the int8-output producers of ``int4_a8`` cost at one token, against their native
and FP8 forms.

Why (benchmarks/NOTES.md, session 24): in the 8B int4 step with ``int4_a8`` on the H100 (``profile-switches``,
b4eea1f, PDL off) the 65 RMSNorm kernels took 450.9 us a step (~6.9 us each) against 132.7 us (~2.0 us) in the
W4A16 step and 176.7 us (~2.7 us) for the FP8 norms; SiLU-and-mul with int8 output 2.47 us against 1.29 us. The
a8 GEMVs saved 365 us a step and these took 356 us back. This times each producer alone (median of CUDA-graph
replays of 20 calls, PDL off, one process), at M = 1, H = 4096 and I = 14336 (8B), in bf16:

* the norm: native (bf16 out), FP8 (per-token scale), int8 (the op's config, then every num_warps of 4-32), the
  two-kernel path (native norm, then ``quantize_act_int8``), and an ablation kernel with parts of the int8 epilogue
  switched off or changed (the q store's byte order, the sums, a reciprocal for the division, the row's shape);
* ``quantize_act_int8`` alone with 1-8 groups a program;
* SiLU-and-mul: native, FP8, int8 with BLOCK 256-2048 and 1-8 warps.

    PYTHONPATH=src python benchmarks/diag_int8_producers.py [--out rows.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from fastdecode.bench.harness import make_row, time_cuda, write_rows
from fastdecode.constants import OUT_INT8_GROUPS
from fastdecode.kernels.activation import launch_silu_and_mul
from fastdecode.kernels.int4_a8 import launch_act_quant
from fastdecode.kernels.norm import launch_rms_norm
from fastdecode.ops import int4_a8 as A
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_fp8
from fastdecode.ops.norm import fused_add_rms_norm, fused_add_rms_norm_fp8, norm_config

DEV = "cuda"
DT = torch.bfloat16


@triton.jit
def _norm_int8_ablation(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, H, eps, BLOCK_H: tl.constexpr,
                        STORE: tl.constexpr, SUMS: tl.constexpr, RECIP: tl.constexpr, RESHAPE: tl.constexpr):
    """The fused add + RMSNorm + int8 path of ``kernels.norm`` for one row, with parts switched: STORE 0 the
    kernel byte order (as ``_store_act_int8``), 1 natural order (contiguous), 2 no q at all; SUMS the int32 sums;
    RECIP multiply by 127 / amax instead of dividing by amax / 127; RESHAPE 0 loads the row as [groups, 128] tiles
    (no reshape of a [1, H] row)."""
    NGB: tl.constexpr = BLOCK_H // 128
    if RESHAPE:
        cols = tl.arange(0, BLOCK_H)
    else:
        cols = tl.reshape(tl.arange(0, NGB)[:, None] * 128 + tl.arange(0, 128)[None, :], (BLOCK_H,))
    m = cols < H
    x = tl.load(x_ptr + cols, mask=m, other=0.0)
    r = tl.load(res_ptr + cols, mask=m, other=0.0)
    sres = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(res_ptr + cols, sres, mask=m)
    v = sres.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = (v * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    y3 = tl.reshape(y, (NGB, 128))
    amax = tl.max(tl.abs(y3), axis=1)
    sc = tl.maximum(amax / 127.0, 1e-30)
    if RECIP:
        v3 = y3 * (127.0 / tl.maximum(amax, 1e-30))[:, None]
    else:
        v3 = y3 / sc[:, None]
    q = tl.minimum(tl.maximum((v3 + 12582912.0) - 12582912.0, -127.0), 127.0).to(tl.int32)
    g = tl.arange(0, NGB)
    c = tl.arange(0, 128)
    if STORE == 0:
        p = c // 32
        pos = (c % 32) * 4 + (p % 2) * 2 + p // 2
        tl.store(q_ptr + g[:, None] * 128 + pos[None, :], q.to(tl.int8))
    elif STORE == 1:
        tl.store(q_ptr + g[:, None] * 128 + c[None, :], q.to(tl.int8))
    tl.store(s_ptr + g, sc)
    if SUMS:
        tl.store(sum_ptr + g, tl.sum(q, axis=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--I", type=int, default=14336)
    a = p.parse_args()
    rows = []

    def timed(op, impl, fn, **extra):
        t = time_cuda([fn], graph=True)
        rows.append(make_row(op, impl, {"M": 1, "H": a.H, "I": a.I}, t, **extra))
        print(f"{op:22s} {impl:28s} {t.median_us:7.2f} us  {extra or ''}", flush=True)

    H, I = a.H, a.I
    x = torch.randn(1, H, device=DEV, dtype=DT)
    res = torch.randn(1, H, device=DEV, dtype=DT)
    w = (torch.rand(H, device=DEV) + 0.5).to(DT)
    q, s, sums = A._act_buffers((1,), H, DEV)
    eps = 1e-5

    # the int8 norm's output against the two-kernel reference before any timing
    r0 = res.clone()
    got = A.fused_add_rms_norm_int8(x, r0, w, eps)
    ref = A.fused_add_rms_norm_int8_ref(x, res.clone(), w, eps)[0]
    print("int8 norm: scales equal to the reference:", bool(torch.allclose(got[1], ref[1], rtol=1e-6, atol=0)),
          "q codes apart:", int((got[0].int() - ref[0].int()).abs().gt(0).sum()), flush=True)

    timed("norm", "bf16", lambda: fused_add_rms_norm(x, res, w, eps), config=norm_config(1, H))
    timed("norm", "fp8", lambda: fused_add_rms_norm_fp8(x, res, w, eps), config=norm_config(1, H, True))
    timed("norm", "int8_op", lambda: A.fused_add_rms_norm_int8(x, res, w, eps), config=norm_config(1, H))
    for warps in (4, 8, 16, 32):
        cfg = dict(norm_config(1, H), num_warps=warps)
        timed("norm", f"int8_w{warps}", lambda cfg=cfg: launch_rms_norm(x, res, w, q, s, eps, OUT_INT8_GROUPS, cfg,
                                                                        sums=sums), config=cfg)
    for store, sums_on, recip, reshape in ((0, True, False, True), (1, True, False, True), (2, True, False, True),
                                           (0, False, False, True), (2, False, False, True), (0, True, True, True),
                                           (0, True, False, False), (2, False, True, False)):
        for warps in (8, 16):
            tag = f"ablate_st{store}_sum{int(sums_on)}_rcp{int(recip)}_rs{int(reshape)}_w{warps}"
            timed("norm", tag, lambda store=store, sums_on=sums_on, recip=recip, reshape=reshape, warps=warps:
                  _norm_int8_ablation[(1,)](x, res, w, q, s, sums, H, eps, BLOCK_H=triton.next_power_of_2(H),
                                            STORE=store, SUMS=sums_on, RECIP=recip, RESHAPE=reshape,
                                            num_warps=warps))
    y = torch.empty_like(x)

    def two_kernels(gpp):
        fused_add_rms_norm(x, res, w, eps, out=y)
        launch_act_quant(y, q, s, sums, groups_per_program=gpp)

    for gpp in (1, 2, 4, 8):
        timed("norm", f"bf16_then_quant_gpp{gpp}", lambda gpp=gpp: two_kernels(gpp))
        timed("act_quant", f"gpp{gpp}", lambda gpp=gpp: launch_act_quant(x, q, s, sums, groups_per_program=gpp))

    h = torch.randn(1, 2 * I, device=DEV, dtype=DT)
    qi, si, sumsi = A._act_buffers((1,), I, DEV)
    timed("silu_and_mul", "bf16", lambda: silu_and_mul(h))
    timed("silu_and_mul", "fp8", lambda: silu_and_mul_fp8(h))
    timed("silu_and_mul", "int8_op", lambda: A.silu_and_mul_int8(h))
    for block in (256, 512, 1024, 2048):
        for warps in (1, 2, 4, 8):
            cfg = {"BLOCK": block, "num_warps": warps}
            timed("silu_and_mul", f"int8_b{block}_w{warps}",
                  lambda cfg=cfg: launch_silu_and_mul(h, qi, si, OUT_INT8_GROUPS, cfg, sums=sumsi), config=cfg)
    if a.out:
        write_rows(rows, a.out)


if __name__ == "__main__":
    main()
