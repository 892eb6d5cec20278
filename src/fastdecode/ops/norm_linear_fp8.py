"""The RMSNorm and the activation's FP8 quantisation inside a W8A8 GEMM: ``rms_norm_linear_fp8``.

    rms_norm_linear_fp8(h, g, Wq, s):  y = rms_norm(h, g, eps) @ (Wq * s).T + bias     the normed input in e4m3

Why (benchmarks/NOTES.md, session 28): in the FP8 ``norm_gemm`` decode step every block but one kernel is fused; the
norm before w13 (gate_up) stays a kernel of its own because w13 runs W8A8 on the tensor cores (its W8A16 forms
were slower: 35-38 us against 31 for the 8B gate_up on the H200, session 26), and W8A8 needs the row's FP8 scale
before its first MMA, i.e. a pass over the whole row. Here each K block of ``QUANT_GROUP`` columns quantises
itself, inside the GEMM's loop: its own scale a row (``max(amax(|z|) / 448, min)`` of ``z = h * g``, rounded to
h's dtype as the norm kernel rounds its output), its MMA sums times that scale, and each row's
``rsqrt(mean(h^2) + eps)`` applied once after the loop (it scales z, so it cancels inside the quantisation). No
pass before the weights and no second kernel (``kernels.gemm``, X_NORM on the FP8 dot path).

Numerics: a finer activation quantisation than the two-kernel path's one scale a row (a block of 128 columns whose
values are small keeps more of their bits); the rest as W8A8: e4m3 products, fp32 sums, one rounding to h's dtype.
A row holding a NaN gives NaN (``kernels.quant``'s rule). The kernel config is the FP8 linear table's tensor-core
(DOT_FP8) entry for the shape, with ``QUANT_GROUP`` columns a step and one split (the row's squares must all reach
one program), else a fixed tile.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE, SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR
from fastdecode.ops._common import FP8_DTYPE, next_pow2, require_sm
from fastdecode.ops._registry import define_op
from fastdecode.ops._tuned import lookup_cache
from fastdecode.ops.gemm import get_linear_config, linear_with_config, run_linear
from fastdecode.ops.w8a16 import check_norm_fp8_args

QUANT_GROUP = 128  # columns of h a scale covers: the kernel's BLOCK_K
# the tile where the table has no DOT_FP8 entry (the 8B qkv's W8A8 tile: 64 weight rows, 5 stages)
DEFAULT_CONFIG = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": QUANT_GROUP, "SPLIT_K": 1, "num_warps": 4,
                  "num_stages": 5, "DOT_FP8": True, "EVICT": True}


def get_norm_fp8_config(M: int, N: int, K: int, device=None) -> dict:
    """The launch config of an (M, N, K) call: the FP8 linear table's DOT_FP8 tile for the shape (its BLOCK_N,
    warps, stages and eviction hint) with BLOCK_K = ``QUANT_GROUP`` and one split, else ``DEFAULT_CONFIG``; BLOCK_M
    16-64 (the MMA's narrow side)."""
    return dict(_config(torch.device(device) if device is not None else None, int(M), int(N), int(K)))


@lookup_cache
def _config(device, M: int, N: int, K: int) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    impl, tuned = get_linear_config(M, N, K, FP8_DTYPE, device)
    if impl == "triton" and tuned["kind"] == "dot" and tuned.get("DOT_FP8"):
        cfg.update({k: tuned[k] for k in ("BLOCK_N", "num_warps", "num_stages", "EVICT") if k in tuned})
    cfg["BLOCK_M"] = min(64, max(16, next_pow2(M)))
    return cfg


@define_op("rms_norm_linear_fp8", mutates_args=("out",))
def _rms_norm_linear_fp8_op(h: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                            weight_scale: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, eps: float,
                            impl: str) -> None:
    """h (M, K) unit stride in K; norm_weight (K,) contiguous or None; weight (N, K) fp8; weight_scale (N,) or (1,)
    fp32; out (M, N)."""
    if impl == "torch":
        out.copy_(rms_norm_linear_fp8_ref(h, norm_weight, weight, weight_scale, bias, eps=eps))
        return
    require_sm(h.device, 8, 9, "FP8 linear")
    cfg = get_norm_fp8_config(h.shape[0], weight.shape[0], weight.shape[1], h.device)
    w_mode = SCALE_TENSOR if weight_scale.numel() == 1 else SCALE_VECTOR
    linear_with_config(h, weight, bias, None, SCALE_NONE, weight_scale, w_mode, out, cfg, norm_weight=norm_weight,
                       eps=eps, x_norm=True)


@_rms_norm_linear_fp8_op.register_fake
def _(h, norm_weight, weight, weight_scale, bias, out, eps, impl):
    return None


def rms_norm_linear_fp8(h, norm_weight, weight_fp8, weight_scale, bias=None, *, eps: float = 1e-6, out=None,
                        backend: Optional[str] = None) -> torch.Tensor:
    """W8A8 of ``rms_norm(h, norm_weight, eps)`` with the norm and the activation's quantisation in the GEMM.

    h: (..., K) bf16 / fp16 (rows may be strided), any number of rows; norm_weight: (K,) of h's dtype, or None (a
    norm without weight); weight_fp8: (N, K) float8_e4m3fn, contiguous; weight_scale: one element (per tensor) or
    (N,) / (N, 1) fp32; bias: (N,) of h's dtype or None. Each row's ``h * norm_weight`` (rounded to h's dtype) is
    quantised to e4m3 with one scale per block of ``QUANT_GROUP`` columns (module docstring). Returns (..., N) in
    h's dtype (or ``out``).
    """
    K, N, bias, ws, nw = check_norm_fp8_args(h, norm_weight, weight_fp8, weight_scale, bias, eps)
    return run_linear("rms_norm_linear_fp8", "h", h, K, N, bias, out, None, backend,
                      lambda h2, out2, impl_s: _rms_norm_linear_fp8_op(h2, nw, weight_fp8, ws, bias, out2,
                                                                       float(eps), impl_s))


def quantize_blocks_ref(z: torch.Tensor, group: int = QUANT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows (M, K) -> (e4m3 values (M, K), fp32 scales (M, ceil(K / group))): one dynamic scale a row and block
    of ``group`` columns, ``max(amax / 448, min)`` (NaN for a block holding a NaN), values ``z / scale`` clamped."""
    M, K = z.shape
    nb = -(-K // group)
    zb = torch.nn.functional.pad(z, (0, nb * group - K)).view(M, nb, group)
    s = (zb.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    s = torch.where(zb.isnan().any(dim=-1), torch.full_like(s, float("nan")), s)
    q = (zb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, nb * group)[:, :K], s


def rms_norm_linear_fp8_ref(h, norm_weight, weight_fp8, weight_scale, bias=None, *, eps: float = 1e-6):
    """Reference of :func:`rms_norm_linear_fp8`: ``z = h * g`` rounded to h's dtype, quantised per row and block
    (``quantize_blocks_ref``), each block's fp32 product with the fp32 FP8 weight times its scale, summed in block
    order, times each row's ``rsqrt(mean(h^2) + eps)`` and the weight's scale, plus the bias; one rounding."""
    lead, K = h.shape[:-1], h.shape[-1]
    h2 = h.reshape(-1, K)
    rstd = torch.rsqrt(h2.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    z = (h2.float() * norm_weight.float()).to(h.dtype).float() if norm_weight is not None else h2.float()
    q, s = quantize_blocks_ref(z)
    wf = weight_fp8.float()
    y = torch.zeros(h2.shape[0], wf.shape[0], device=h.device)
    for b in range(s.shape[1]):
        cols = slice(b * QUANT_GROUP, min(K, (b + 1) * QUANT_GROUP))
        y = y + (q[:, cols].float() @ wf[:, cols].t()) * s[:, b:b + 1]
    ws = weight_scale.float().reshape(1, -1) if weight_scale.numel() > 1 else weight_scale.float().reshape(1, 1)
    y = y * rstd * ws
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype).reshape(*lead, -1)


__all__ = ["QUANT_GROUP", "get_norm_fp8_config", "quantize_blocks_ref", "rms_norm_linear_fp8",
           "rms_norm_linear_fp8_ref"]
