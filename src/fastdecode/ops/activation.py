"""SiLU-and-mul (the SwiGLU gate of Llama MLPs), with native or FP8 e4m3 output.

For ``x = [gate | up]`` of width 2I: ``out = silu(gate) * up`` of width I, fp32 math rounded once.
FP8 output: ``out = fp8(clamp(y / scale, -448, 448))``, ``real = fp8 * scale``; static per-tensor
scale given, or dynamic per-token scales computed in the kernel and returned with shape ``(..., 1)``.

NaN / Inf (both backends, docs/engine.md): a NaN propagates to its output column; with dynamic FP8 output the
row's scale and all its FP8 values are NaN. An infinite output gives that row scale inf (values 0, NaN at the
Inf): it dequantises to NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import (
    pdl_enabled,
    OUT_FP8_DYNAMIC, out_mode,
    next_pow2,
    FP8_DTYPE, FP8_MIN_SCALE, as_rows, check_out, check_tensor, require_sm, resolve_backend, static_scale,
)
from fastdecode.ops.norm import quantize_rows_ref

MAX_SINGLE_PASS_I = 32768  # dynamic FP8: wider rows are processed in two passes


def silu_config(M: int, I: int, dynamic_fp8: bool) -> dict:
    """Launch config (heuristic; measured on the H200, see benchmarks/NOTES.md)."""
    if dynamic_fp8:
        block = next_pow2(I)
        if block > MAX_SINGLE_PASS_I:
            block = 8192
        # one program per row, the row in registers: 32 warps at 32K columns (H200 sweep: 16 warps
        # 1525 us, 32 warps 1366 us at M=32768, I=28672; benchmarks/NOTES.md)
        return {"BLOCK": block, "num_warps": min(max(block // 1024, 1), 32)}
    # native / static: column blocks on a 1-D grid. H200 sweep: M=1 best at BLOCK 1024 (1.38-1.41 us
    # for 4-8 warps); M=32768 at BLOCK 2048 x 8 warps (4.39 TB/s, as fast as 1024 x 4 or 4096 x 16)
    block = 1024 if M <= 64 else 2048
    block = min(block, next_pow2(max(I, 1)))
    return {"BLOCK": block, "num_warps": max(1, min(block // 256, 8))}


@define_op("silu_and_mul", mutates_args=("out", "scale_out"))
def _silu_and_mul_op(
    x: torch.Tensor,
    out: torch.Tensor,
    scale_in: Optional[torch.Tensor],
    scale_out: Optional[torch.Tensor],
    backend: str,
) -> None:
    """x: (M, 2I) rows with unit inner stride; out: (M, I); scale_out (M, 1) for dynamic FP8."""
    if backend == "triton":
        from fastdecode.kernels.activation import launch_silu_and_mul

        mode, scale = out_mode(out, scale_in, scale_out)
        M, I = out.shape
        launch_silu_and_mul(x, out, scale, mode, silu_config(M, I, mode == OUT_FP8_DYNAMIC), pdl=pdl_enabled(x))
        return
    y, s = _silu_and_mul_rows_ref(x, out.dtype, scale_in)
    out.copy_(y)
    if scale_out is not None:
        scale_out.copy_(s)


@_silu_and_mul_op.register_fake
def _(x, out, scale_in, scale_out, backend):
    return None


def _silu(x, *, fp8: bool, scale, out, backend, op: str):
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., 2*I) = [gate | up] with an even last dimension, got shape {tuple(x.shape)}")
    if scale is not None and not fp8:
        raise ValueError("scale is only meaningful with FP8 output")
    I = x.shape[-1] // 2
    scale_t = static_scale(scale, x.device) if scale is not None else None
    out_shape = (*x.shape[:-1], I)
    out_dtype = FP8_DTYPE if fp8 else x.dtype
    check_out("out", out, out_shape, out_dtype, x.device)
    be = resolve_backend(backend, x.device, op)
    if fp8:
        require_sm(x.device, 8, 9, "FP8 output")
    x2 = as_rows("x", x)
    out = torch.empty(out_shape, dtype=out_dtype, device=x.device) if out is None else out
    dynamic = fp8 and scale_t is None
    scale_out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if dynamic else None
    if x2.shape[0] > 0 and I > 0:
        _silu_and_mul_op(x2, out.view(-1, I), scale_t, scale_out.view(-1, 1) if dynamic else None, be)
    elif dynamic:
        scale_out.fill_(FP8_MIN_SCALE)  # I = 0: amax of an empty row is 0 (as quantize_rows_ref)
    if fp8:
        return out, (scale_out if dynamic else scale_t)
    return out


def silu_and_mul(x, *, out=None, backend: Optional[str] = None) -> torch.Tensor:
    """``out = silu(x[..., :I]) * x[..., I:]`` for x of width 2I (bf16/fp16/fp32; rows may be strided)."""
    return _silu(x, fp8=False, scale=None, out=out, backend=backend, op="silu_and_mul")


def silu_and_mul_fp8(x, scale=None, *, out=None, backend: Optional[str] = None):
    """SiLU-and-mul with FP8 e4m3 output: returns ``(out_fp8, scale)``, ``real = out_fp8 * scale``.

    ``scale`` given: static per-tensor. ``scale=None``: dynamic per-token, returned as ``(..., 1)`` fp32.
    """
    return _silu(x, fp8=True, scale=scale, out=out, backend=backend, op="silu_and_mul_fp8")


def _silu_and_mul_rows_ref(x, out_dtype, scale):
    I = x.shape[-1] // 2
    g, u = x[..., :I].float(), x[..., I:].float()
    y = g / (1.0 + torch.exp(-g)) * u
    if out_dtype == FP8_DTYPE:
        return quantize_rows_ref(y, scale)
    return y.to(out_dtype), None


def silu_and_mul_ref(x) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`silu_and_mul`."""
    return _silu_and_mul_rows_ref(x, x.dtype, None)[0]


def silu_and_mul_fp8_ref(x, scale=None):
    """Reference of :func:`silu_and_mul_fp8`: returns ``(out_fp8, scale)``."""
    s = None if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    return _silu_and_mul_rows_ref(x, FP8_DTYPE, s)
