"""FP8 e4m3 weight (and activation) preparation for W8A8 linears.

A scale is a dequantisation scale, ``real = fp8 * scale`` (docs/architecture.md, "Numerical conventions"),
chosen so the largest magnitude maps to 448: ``scale = max(amax / 448, 1 / (448 * 512))`` and
``fp8 = e4m3(clamp(real / scale, -448, 448))``, rounded to nearest like PyTorch's cast, computed
in fp32. The same rule as the fused norm's dynamic quantisation (``quantize_rows_ref``).
"""

from __future__ import annotations

import torch

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE

FP8_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("channel", "tensor")


def _quantize(t: torch.Tensor, amax: torch.Tensor):
    scale = torch.clamp(amax.float() / FP8_MAX, min=FP8_MIN_SCALE)
    q = torch.clamp(t.float() / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight_fp8(weight: torch.Tensor, granularity: str = "channel", *, chunk_rows: int = 4096):
    """BF16/FP16/FP32 weight (N, K) -> ``(weight_fp8 (N, K) contiguous, scale float32)``.

    ``granularity="channel"``: one scale per output channel (row of the weight), shape ``(N,)``;
    ``"tensor"``: one scale, shape ``(1,)``. ``real ~= weight_fp8.float() * scale[:, None]``.
    Rows are processed ``chunk_rows`` at a time so a large weight needs no full fp32 copy.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D tensor (N, K), got {shape}")
    if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"weight must be bf16, fp16 or fp32, got {weight.dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    N = weight.shape[0]
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    if granularity == "tensor":
        amax = weight.abs().amax().float().reshape(1) if weight.numel() else torch.zeros(1, device=weight.device)
        scale = torch.clamp(amax / FP8_MAX, min=FP8_MIN_SCALE)
        for i in range(0, N, chunk_rows):
            q[i:i + chunk_rows] = torch.clamp(weight[i:i + chunk_rows].float() / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    scale = torch.empty(N, dtype=torch.float32, device=weight.device)
    for i in range(0, N, chunk_rows):
        rows = weight[i:i + chunk_rows]
        amax = rows.abs().amax(dim=1, keepdim=True) if rows.shape[1] else torch.zeros_like(rows[:, :1])
        q[i:i + chunk_rows], s = _quantize(rows, amax)
        scale[i:i + chunk_rows] = s.reshape(-1)
    return q, scale


def quantize_activation_fp8(x: torch.Tensor, scale=None):
    """Activation (..., K) -> ``(x_fp8, scale)``: static per-tensor when ``scale`` is given
    (float or 1-element fp32 tensor, returned as shape (1,)), else dynamic per-token, shape (..., 1).

    Plain PyTorch; in a model the fused norm / activation kernels produce these directly.
    """
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        return _quantize(x, amax)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    q = torch.clamp(x.float() / s, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
    """``q.float() * scale`` (fp32): scale has one element, or one per index of ``dim`` of q."""
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    shape = [1] * q.dim()
    shape[dim] = -1
    return q.float() * s.reshape(shape)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn values around |v| (3 mantissa bits; subnormal spacing 2^-9)."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)


def fp8_mismatches(q: torch.Tensor, q_ref: torch.Tensor, *, lost_carry_ok: bool) -> tuple[int, int]:
    """(values of ``q`` more than one e4m3 step from ``q_ref``, values accepted as a lost carry).

    The one FP8 comparison rule of the tests and ``fastdecode selfcheck``. With ``lost_carry_ok`` (the
    Triton interpreter, whose fp32 -> e4m3 cast may drop the carry into the next power of two) a
    value that is a power of two ``p`` with ``2p`` within one step of the reference is accepted: ``2p``
    may be the reference, or the reference one step below it when the fp32 values before the cast
    straddle the rounding boundary.
    """
    a, b = q.float(), q_ref.float()
    step = e4m3_step(b) * 1.0001
    ok = (a - b).abs() <= step
    lost = torch.zeros_like(ok)
    if lost_carry_ok:
        log2a = torch.log2(a.abs())
        lost = ~ok & (a != 0) & (log2a == log2a.round()) & ((2 * a - b).abs() <= step)
    return int((~(ok | lost)).sum()), int(lost.sum())
