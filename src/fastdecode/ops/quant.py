"""FP8 e4m3 quantisation of activations: ``q = fp8(clamp(x / scale, -448, 448))``, ``real = q * scale``.

Three modes: static per-tensor (scale given), dynamic per-tensor (scale = amax(|x|) / 448 over the
whole tensor) and dynamic per-token (one scale per row, shape ``(..., 1)``). Dynamic scales are
bounded below by ``1 / (448 * 512)`` so that zeros never divide by zero.

NaN / Inf (both backends, docs/engine.md): a NaN propagates as in PyTorch: a row (per token) or tensor (per
tensor) holding a NaN gets a NaN scale and NaN FP8 values; under a static scale a NaN value stays NaN. An Inf
gives ``scale = inf`` and ``x / inf`` = 0 or NaN (inf / inf): the row dequantises to NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import (
    pdl_enabled,
    FP8_DTYPE, FP8_MIN_SCALE, as_rows, check_out, check_tensor, require_sm, resolve_backend, static_scale,
)
from fastdecode.ops.norm import norm_config, quantize_rows_ref


@define_op("quantize_fp8", mutates_args=("out", "scale_out"))
def _quantize_fp8_op(
    x: torch.Tensor,
    out: torch.Tensor,
    scale_in: Optional[torch.Tensor],
    scale_out: Optional[torch.Tensor],
    per_token: bool,
    backend: str,
) -> None:
    """x, out: (M, H); static: scale_in (1,); dynamic: scale_out (1,) per tensor or (M, 1) per token."""
    if backend == "triton":
        from fastdecode.kernels.quant import QUANT_FROM_AMAX, QUANT_PER_TOKEN, QUANT_STATIC, launch_quantize_fp8

        cfg = norm_config(*x.shape, fp8=True)  # same row-wise memory pattern as RMSNorm
        if scale_in is not None:
            launch_quantize_fp8(x, out, scale_in, None, QUANT_STATIC, cfg, pdl=pdl_enabled(x))
        elif per_token:
            launch_quantize_fp8(x, out, scale_out, None, QUANT_PER_TOKEN, cfg, pdl=pdl_enabled(x))
        else:
            amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
            launch_quantize_fp8(x, out, scale_out, amax_bits, QUANT_FROM_AMAX, cfg, pdl=pdl_enabled(x))
        return
    q, s = _quantize_ref(x, scale_in, per_token)
    out.copy_(q)
    if scale_out is not None:
        scale_out.copy_(s.reshape(scale_out.shape))


@_quantize_fp8_op.register_fake
def _(x, out, scale_in, scale_out, per_token, backend):
    return None


def quantize_fp8(x, scale=None, per_token: bool = False, *, out=None, backend: Optional[str] = None):
    """Quantise x (..., H) to FP8 e4m3: returns ``(q, scale)`` with ``real = q * scale``.

    scale given (float or 1-element fp32 tensor): static per-tensor. ``scale=None, per_token=False``:
    dynamic per-tensor, scale shape ``(1,)``. ``per_token=True``: dynamic per-row, scale ``(..., 1)``.
    A NaN in a row gives that row (per tensor: the tensor) a NaN scale and NaN values; an Inf gives scale
    inf, values 0 (NaN where x is +-inf), so the row dequantises to NaN (module docstring).
    """
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., H), got a scalar")
    if scale is not None and per_token:
        raise ValueError("per_token=True computes dynamic scales; do not pass scale as well")
    scale_t = static_scale(scale, x.device) if scale is not None else None
    check_out("out", out, x.shape, FP8_DTYPE, x.device)
    be = resolve_backend(backend, x.device, "quantize_fp8")
    require_sm(x.device, 8, 9, "FP8 output")
    x2 = as_rows("x", x)
    H = x.shape[-1]
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
    scale_out = None
    if scale_t is None:
        shape = (*x.shape[:-1], 1) if per_token else (1,)
        scale_out = torch.empty(shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0 and H > 0:
        _quantize_fp8_op(x2, out.view(-1, H), scale_t,
                         scale_out.view(-1, 1) if per_token else scale_out, per_token, be)
    elif scale_out is not None:
        scale_out.fill_(FP8_MIN_SCALE)  # amax of an empty tensor (or empty rows) is 0
    return out, (scale_t if scale_t is not None else scale_out)


def _quantize_ref(x, scale, per_token):
    x = x.float()
    if scale is None and not per_token:
        q, s = quantize_rows_ref(x.reshape(1, -1), None)
        return q.reshape(x.shape), s.reshape(1)
    return quantize_rows_ref(x, scale)


def quantize_fp8_ref(x, scale=None, per_token: bool = False):
    """Plain-PyTorch reference of :func:`quantize_fp8`: returns ``(q, scale)``."""
    s = None if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    return _quantize_ref(x, s, per_token)
