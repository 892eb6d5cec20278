"""RMSNorm, residual-add + RMSNorm, with native or FP8 e4m3 output.

Semantics (same as vLLM's fused_add_rms_norm)::

    residual <- (x + residual).to(residual.dtype)            # in place
    out = residual / sqrt(mean(residual**2) + eps) * weight   # fp32 math, rounded once

FP8 output: ``out = fp8(clamp(y / scale, -448, 448))`` with ``real = fp8 * scale``; the scale is either
given (static, per tensor) or computed per row (dynamic, per token) as
``max(amax(|y|) / 448, 1 / (448 * 512))`` and returned with shape ``(..., 1)`` in float32.

NaN / Inf (both backends, docs/engine.md): a NaN in a row makes the whole normalised row NaN (so, with FP8
output, a NaN scale and NaN FP8 values); an Inf makes it NaN where the Inf was and 0 elsewhere
(``rsqrt(inf) = 0``), so with dynamic FP8 output the scale is NaN too. Other rows are unaffected.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import (
    pdl_enabled,
    OUT_NATIVE, out_mode,
    next_pow2,
    FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, as_rows, check_eps, check_out, check_same_device,
    check_tensor, require_sm, resolve_backend, static_scale,
)

MAX_SINGLE_PASS_H = 32768  # wider rows are processed in chunks (re-read from L2)


def norm_config(M: int, H: int, fp8: bool = False) -> dict:
    """Launch config for the RMSNorm kernel: a heuristic fitted to the H200 sweep
    (benchmarks/sweep_norm_configs.py; numbers in benchmarks/NOTES.md)."""
    block_h = next_pow2(H)
    if block_h > MAX_SINGLE_PASS_H:
        block_h = 8192
    block_m = 1
    if block_h <= 1024:  # narrow rows: several rows per program so each moves a few KB
        block_m = min(max(2048 // block_h, 1), next_pow2(max(M, 1)))
    elif block_h <= 4096 and M >= 4096:
        block_m = 2  # H=4096, M=32768: 2 rows x 4 warps 4.13 TB/s, 1 row 4.10
    if block_h <= 2048:
        num_warps = max(1, block_h * block_m // 512)
    elif block_h <= 4096:
        num_warps = 4 if block_m > 1 else 8  # M=1: 8 warps 1.77 us, 4 warps 2.05
    elif block_h == 8192:
        num_warps = 8 if fp8 else 4  # M=1: native 4 warps 2.26 us (8: 2.50); FP8 8 warps 2.75 (4: 2.93)
    else:
        num_warps = 16
    return {"BLOCK_M": block_m, "BLOCK_H": block_h, "num_warps": num_warps}


# ----------------------------------------------------------------------------- registered op


@define_op("rms_norm", mutates_args=("residual", "out", "scale_out"))
def _rms_norm_op(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    out: torch.Tensor,
    scale_in: Optional[torch.Tensor],
    scale_out: Optional[torch.Tensor],
    eps: float,
    backend: str,
) -> None:
    """x, residual, out: (M, H) rows (unit stride in H); scale_out: (M, 1) for dynamic FP8."""
    if backend == "triton":
        from fastdecode.kernels.norm import launch_rms_norm

        mode, scale = out_mode(out, scale_in, scale_out)
        launch_rms_norm(x, residual, weight, out, scale, eps, mode, norm_config(*x.shape, fp8=mode != OUT_NATIVE),
                        pdl=pdl_enabled(x))
        return
    y, new_res, s = _norm_rows_ref(x, residual, weight, eps, out.dtype, scale_in)
    if residual is not None:
        residual.copy_(new_res)
    out.copy_(y)
    if scale_out is not None:
        scale_out.copy_(s)


@_rms_norm_op.register_fake
def _(x, residual, weight, out, scale_in, scale_out, eps, backend):
    return None


# ----------------------------------------------------------------------------- public API


def _norm(x, residual, weight, eps, *, fp8: bool, scale, out, backend, op: str):
    check_tensor("x", x)
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    check_tensor("weight", weight, ndim=1)
    H = x.shape[-1] if x.dim() else 0
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., H), got a scalar")
    if weight.shape[0] != H:
        raise ValueError(f"weight must have {H} elements (the last dimension of x), got {weight.shape[0]}")
    eps = check_eps(eps)
    check_same_device(x=x, residual=residual, weight=weight)
    if scale is not None and not fp8:
        raise ValueError("scale is only meaningful with FP8 output")
    scale_t = static_scale(scale, x.device) if scale is not None else None
    out_dtype = FP8_DTYPE if fp8 else x.dtype
    check_out("out", out, x.shape, out_dtype, x.device)
    be = resolve_backend(backend, x.device, op)
    if fp8:
        require_sm(x.device, 8, 9, "FP8 output")

    x2 = as_rows("x", x)
    r2 = as_rows("residual", residual, inplace=True) if residual is not None else None
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    dynamic = fp8 and scale_t is None
    scale_out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if dynamic else None
    if x2.shape[0] > 0 and H > 0:
        _rms_norm_op(
            x2, r2, weight, out.view(-1, H), scale_t,
            scale_out.view(-1, 1) if dynamic else None, eps, be,
        )
    elif dynamic:
        scale_out.fill_(FP8_MIN_SCALE)  # H = 0: amax of an empty row is 0 (as quantize_rows_ref)
    if fp8:
        return out, (scale_out if dynamic else scale_t)
    return out


def rms_norm(x, weight, eps: float = 1e-6, *, out=None, backend: Optional[str] = None) -> torch.Tensor:
    """``out = x / sqrt(mean(x**2, -1) + eps) * weight`` (fp32 math, one rounding to x.dtype).

    x: (..., H) bf16/fp16/fp32, rows may be strided; weight: (H,). Returns a new tensor (or ``out``).
    """
    return _norm(x, None, weight, eps, fp8=False, scale=None, out=out, backend=backend, op="rms_norm")


def fused_add_rms_norm(
    x, residual, weight, eps: float = 1e-6, *, out=None, backend: Optional[str] = None
) -> torch.Tensor:
    """``residual <- x + residual`` (in place, rounded to residual.dtype), returns ``rms_norm(residual) * weight``.

    Nothing is written when the arguments are rejected.
    """
    check_tensor("residual", residual)
    return _norm(x, residual, weight, eps, fp8=False, scale=None, out=out, backend=backend,
                 op="fused_add_rms_norm")


def rms_norm_fp8(x, weight, eps: float = 1e-6, scale=None, *, out=None, backend: Optional[str] = None):
    """RMSNorm with FP8 e4m3 output: returns ``(out_fp8, scale)`` with ``real = out_fp8 * scale``.

    ``scale`` given (float or 1-element fp32 tensor): static per-tensor quantisation.
    ``scale=None``: dynamic per-token; the returned scale has shape ``(..., 1)``, float32.
    """
    return _norm(x, None, weight, eps, fp8=True, scale=scale, out=out, backend=backend, op="rms_norm_fp8")


def fused_add_rms_norm_fp8(
    x, residual, weight, eps: float = 1e-6, scale=None, *, out=None, backend: Optional[str] = None
):
    """``residual <- x + residual`` (in place), returns ``(fp8(rms_norm(residual) * weight / scale), scale)``.

    Static scale when given, else dynamic per-token scales (shape ``(..., 1)``); ``real = fp8 * scale``.
    """
    check_tensor("residual", residual)
    return _norm(x, residual, weight, eps, fp8=True, scale=scale, out=out, backend=backend,
                 op="fused_add_rms_norm_fp8")


# ----------------------------------------------------------------------------- references


def quantize_rows_ref(y: torch.Tensor, scale: Optional[torch.Tensor]):
    """fp32 rows -> (fp8, scale) exactly as the kernels round: static scale, or per-row dynamic."""
    if scale is None:
        if y.shape[-1] == 0:  # amax of an empty row is 0: the scale is the floor
            amax = y.new_zeros((*y.shape[:-1], 1))
        else:
            amax = y.abs().amax(dim=-1, keepdim=True)
        scale = torch.clamp(amax / FP8_MAX, min=FP8_MIN_SCALE)
    q = torch.clamp(y / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


def _norm_rows_ref(x, residual, weight, eps, out_dtype, scale):
    if residual is not None:
        residual = (x.float() + residual.float()).to(residual.dtype)
        v = residual.float()
    else:
        v = x.float()
    rstd = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = v * rstd * weight.float()
    if out_dtype == FP8_DTYPE:
        q, s = quantize_rows_ref(y, scale)
        return q, residual, s
    return y.to(out_dtype), residual, None


def rms_norm_ref(x, weight, eps: float = 1e-6) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`rms_norm`."""
    return _norm_rows_ref(x, None, weight, eps, x.dtype, None)[0]


def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6):
    """Reference of :func:`fused_add_rms_norm`: returns ``(out, new_residual)``; inputs untouched."""
    y, r, _ = _norm_rows_ref(x, residual, weight, eps, x.dtype, None)
    return y, r


def rms_norm_fp8_ref(x, weight, eps: float = 1e-6, scale=None):
    """Reference of :func:`rms_norm_fp8`: returns ``(out_fp8, scale)``."""
    s = None if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    y, _, s = _norm_rows_ref(x, None, weight, eps, FP8_DTYPE, s)
    return y, s


def fused_add_rms_norm_fp8_ref(x, residual, weight, eps: float = 1e-6, scale=None):
    """Reference of :func:`fused_add_rms_norm_fp8`: returns ``(out_fp8, scale, new_residual)``."""
    s = None if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    y, r, s = _norm_rows_ref(x, residual, weight, eps, FP8_DTYPE, s)
    return y, s, r
