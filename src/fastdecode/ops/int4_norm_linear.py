"""The RMSNorm inside the int4 GEMM after it and the residual add inside the int4 GEMM before it (W4A16): the int4
projections of the ``norm_gemm`` decode step (``fastdecode.models.norm_gemm``), as ``ops.norm_linear`` is for
dense ones.

    int4_rms_norm_linear(h, g, W):  rms_norm(h, g, eps) @ dequantize_int4(W).T + bias
    int4_add_linear_(r, x, W):      r += x @ dequantize_int4(W).T + bias   (in place)
    int4_add_linear_(r, gu, W, glu=True):  r += silu_and_mul(gu) @ dequantize_int4(W).T + bias

Unlike a dense weight, an int4 weight cannot take the norm weight ``g`` (``W * g`` is no longer int4 on the
same scales), so ``g`` stays in the kernel: the loop multiplies ``h * g``, rounded to h's dtype as the norm kernel
rounds its output. Every program of the int4 kernels (fma, dot and mma kinds, any split: ``kernels.int4``) sums its
rows' squares over the whole of K (the fma kind with one split in its K loop, since session 31; the others in a
pass over the rows before it), and the row's ``rsqrt(mean(h^2) + eps)`` scales the fp32 sums at the end
(``kernels.int4``'s X_NORM). So the normed activation is never rounded as a whole, only ``h * g``: logits differ
from the two-kernel path by about one rounding of the normed rows. The residual add is the fp32 product added to
the residual in the epilogue, one rounding (ACCUMULATE). Where the dispatcher picks dequantise + cuBLAS (large M,
or ``impl="dequant"``), the two ops run the norm kernel then the GEMM, or the GEMM then an add. Where it picks a
tensor-core kind (dot, mma), ``int4_rms_norm_linear`` runs the norm kernel then that GEMM too: there the pass over
whole rows in every program cost more than the norm kernel (session 18, H200; ``models.norm_gemm``).

``glu=True`` (the ``int4_glu`` switch, session 30; on by default for a w2 of small K since session 31): the FMA
kernel computes ``silu(gate) * up`` as it loads its input, rounded to x's dtype as the SiLU-and-mul kernel stores
it, so the result equals SiLU-and-mul then the GEMM bit for bit, one kernel fewer. Session 11 removed this form for
the 8B (e4f24cd: its K = 14336 FMA loop is issue-bound, +201 us a step); it is back for the launch-bound small
models (SmolLM2's w2: K = 1536; on an H100 the embedded step took about 10 us less, session 31). Other kinds,
dequantise + cuBLAS and act-order weights run the SiLU-and-mul kernel first.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops._common import as_rows, check_eps, check_out, check_same_device, check_tensor
from fastdecode.ops._registry import define_op
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_ref
from fastdecode.ops.gemm import check_bias
from fastdecode.ops.int4 import (
    X_DTYPES, _zm, check_x, dispatch, int4_linear_dequant_cublas, int4_linear_with_config, op_weight, resolve_impl,
)
from fastdecode.ops.int4_format import Int4Weight, dequantize_int4
from fastdecode.ops.norm_linear import check_norm_weight, check_residual


# the int4 kernel kinds that take the norm inside (the others run the norm kernel first: module docstring); a
# diagnosis may widen it (benchmarks/diag_int4_norm_gemm_pdl.py)
_FUSED_KINDS = ("fma",)


@define_op("int4_rms_norm_linear", mutates_args=("out",))
def _int4_rms_norm_linear_op(h: torch.Tensor, norm_weight: Optional[torch.Tensor], qweight: torch.Tensor,
                             scales: torch.Tensor, zm: Optional[torch.Tensor], perm: Optional[torch.Tensor],
                             bias: Optional[torch.Tensor], out: torch.Tensor, group_size: int, zero_mode: str,
                             eps: float, impl: str) -> None:
    """h (M, K) original column order, unit stride in K; norm_weight (K,) or None; out (M, N) contiguous."""
    from fastdecode.ops.norm import rms_norm
    from fastdecode.ops.norm_linear import _ones

    w = op_weight(qweight, scales, zm, perm, group_size, zero_mode, h.shape[1])
    if impl == "torch":
        out.copy_(int4_rms_norm_linear_ref(h, norm_weight, w, bias, eps=eps))
        return
    if perm is not None:  # the kernels' column order (GPTQ act-order): h and g gathered alike
        h = h.index_select(1, perm)
        norm_weight = norm_weight.index_select(0, perm) if norm_weight is not None else None
    which, cfg = dispatch(impl, h, w, op="int4_rms_norm_linear")
    if which == "dequant" or cfg["kind"] not in _FUSED_KINDS:
        # the norm kernel first: before dequantise + cuBLAS, and before the tensor-core kinds, whose many programs
        # each summing the rows' squares cost more than the norm kernel (session 18, H200: 8B gate_up at M = 1 on
        # the mma kind 46.18 us fused against 31.51 as two kernels; models.norm_gemm)
        g = norm_weight if norm_weight is not None else _ones(h.shape[1], h.dtype, h.device)
        normed = rms_norm(h, g, eps, backend="triton")
        if which == "dequant":
            int4_linear_dequant_cublas(normed, w, bias, out)
        else:
            int4_linear_with_config(normed, w, bias, out, cfg)
    else:
        int4_linear_with_config(h, w, bias, out, cfg, norm_weight=norm_weight, eps=eps, x_norm=True)


@_int4_rms_norm_linear_op.register_fake
def _(h, norm_weight, qweight, scales, zm, perm, bias, out, group_size, zero_mode, eps, impl):
    return None


@define_op("int4_add_linear_", mutates_args=("residual",))
def _int4_add_linear_op(residual: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zm: Optional[torch.Tensor], perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        group_size: int, zero_mode: str, impl: str, glu: bool) -> None:
    """residual (M, N) contiguous; x (M, K) original column order, unit stride in K (``glu``: (M, 2K) ``[gate |
    up]``)."""
    K = x.shape[1] // (2 if glu else 1)
    w = op_weight(qweight, scales, zm, perm, group_size, zero_mode, K)
    if impl == "torch":
        residual.copy_(int4_add_linear_ref(residual, x, w, bias, glu=glu))
        return
    # the shape of the GEMM's input, glu or not; the table's entry of the op as it runs
    which, cfg = dispatch(impl, x.narrow(1, 0, K), w, op="int4_add_linear_glu" if glu else "int4_add_linear")
    if glu and (which == "dequant" or cfg["kind"] != "fma" or perm is not None):
        x, glu = silu_and_mul(x, backend="triton"), False  # the two kernels (module docstring)
        which, cfg = dispatch(impl, x, w, op="int4_add_linear")
    if perm is not None:
        x = x.index_select(1, perm)
    if which == "dequant":  # dequantise + cuBLAS, then the add
        y = torch.empty_like(residual)
        int4_linear_dequant_cublas(x, w, bias, y)
        residual.add_(y)
    else:
        int4_linear_with_config(x, w, bias, residual, cfg, accumulate=True, glu=glu)


@_int4_add_linear_op.register_fake
def _(residual, x, qweight, scales, zm, perm, bias, group_size, zero_mode, impl, glu):
    return None


# ----------------------------------------------------------------------------- public API


def int4_rms_norm_linear(h, norm_weight, packed: Int4Weight, bias=None, *, eps: float = 1e-6, out=None,
                         backend: Optional[str] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``rms_norm(h, norm_weight, eps) @ dequantize_int4(packed).T + bias`` with the norm inside the int4 GEMM
    (module docstring).

    h: (..., K) bf16/fp16, the residual stream (rows may be strided); norm_weight: (K,) of h's dtype, or None
    for a norm without weight; packed: an :class:`Int4Weight` (N, K); bias: (N,) of h's dtype or None. Returns
    (..., N) in h's dtype (or ``out``). impl: as ``int4_linear``.
    """
    K = check_x("h", h, packed)
    check_norm_weight(norm_weight, K, h.dtype)
    check_eps(eps)
    N = packed.N
    bias = check_bias(bias, N, (h.dtype,), "the weight")
    check_same_device(h=h, norm_weight=norm_weight, qweight=packed.qweight, scales=packed.scales, bias=bias)
    out_shape = (*h.shape[:-1], N)
    check_out("out", out, out_shape, h.dtype, h.device)
    impl_s = resolve_impl(impl, backend, h.device, "int4_rms_norm_linear")
    out = torch.empty(out_shape, dtype=h.dtype, device=h.device) if out is None else out
    h2 = as_rows("h", h)
    if h2.shape[0] == 0 or N == 0:
        return out
    nw = norm_weight.contiguous() if norm_weight is not None else None
    _int4_rms_norm_linear_op(h2, nw, packed.qweight, packed.scales, _zm(packed), packed.perm, bias, out.view(-1, N),
                             packed.group_size, packed.zero_mode, float(eps), impl_s)
    return out


def int4_add_linear_(residual, x, packed: Int4Weight, bias=None, *, glu: bool = False,
                     backend: Optional[str] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``residual += x @ dequantize_int4(packed).T + bias`` in place (fp32 sum, one rounding); returns residual.

    residual: (..., N) contiguous, x's dtype; x: (..., K) bf16/fp16 (rows may be strided); packed: an
    :class:`Int4Weight` (N, K); bias: (N,) or None. ``glu``: x is (..., 2K) ``[gate | up]`` and the input
    ``silu_and_mul(x)``, computed inside the FMA kernel (module docstring). Nothing is written when the arguments
    are rejected.
    """
    if glu:
        check_tensor("x", x, dtypes=X_DTYPES)
        if x.dim() == 0 or x.shape[-1] != 2 * packed.K:
            raise ValueError(f"x must have shape (..., 2 * K) = (..., {2 * packed.K}) with glu=True ([gate | up], "
                             f"each K wide, for a weight of K = {packed.K}), got {tuple(x.shape)}")
        check_x("x's gate half", x[..., :packed.K], packed)
    else:
        check_x("x", x, packed)
    N = packed.N
    bias = check_bias(bias, N, (x.dtype,), "the weight")
    check_residual(residual, (*x.shape[:-1], N), x.dtype)
    check_same_device(x=x, qweight=packed.qweight, scales=packed.scales, bias=bias, residual=residual)
    impl_s = resolve_impl(impl, backend, x.device, "int4_add_linear_")
    x2 = as_rows("x", x)
    if x2.shape[0] == 0 or N == 0:
        return residual
    _int4_add_linear_op(residual.view(-1, N), x2, packed.qweight, packed.scales, _zm(packed), packed.perm, bias,
                        packed.group_size, packed.zero_mode, impl_s, bool(glu))
    return residual


# ----------------------------------------------------------------------------- references


def int4_rms_norm_linear_ref(h, norm_weight, packed: Int4Weight, bias=None, *, eps: float = 1e-6) -> torch.Tensor:
    """Reference of :func:`int4_rms_norm_linear`, the fused recipe: ``h * g`` rounded to h's dtype (h itself when
    norm_weight is None), its fp32 product with the weight dequantised as ``int4_linear_ref`` does, times each
    row's ``rsqrt(mean(h^2) + eps)``, plus the bias, one rounding to h's dtype."""
    v = h.float()
    rstd = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    a = (v * norm_weight.float()).to(h.dtype) if norm_weight is not None else h
    y = (a.float() @ dequantize_int4(packed, h.dtype).float().t()) * rstd
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype)


def int4_add_linear_ref(residual, x, packed: Int4Weight, bias=None, *, glu: bool = False) -> torch.Tensor:
    """Reference of :func:`int4_add_linear_` (out of place): ``residual + x @ W.T + bias`` in fp32, one rounding
    (``glu``: x is ``[gate | up]`` and ``silu_and_mul_ref(x)`` the input)."""
    if glu:
        x = silu_and_mul_ref(x)
    y = residual.float() + x.float() @ dequantize_int4(packed, x.dtype).float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(residual.dtype)


__all__ = ["int4_add_linear_", "int4_add_linear_ref", "int4_rms_norm_linear", "int4_rms_norm_linear_ref"]
