"""The residual stream's RMSNorm and residual add inside the decode GEMMs around them (the ``norm_gemm`` switch).

A Llama block at decode runs ``add + RMSNorm -> wqkv -> attention -> wo -> add + RMSNorm -> w13 -> w2``: two
norm kernels a layer between GEMMs that read every weight anyway. These two ops move them into the GEMMs:

    rms_norm_linear(h, g, W):   out = rms_norm(h, g) @ W.T (+ b)     the norm in the GEMM's activation loads
    add_linear_(h, x, W):       h += x @ W.T (+ b)  (in place)        the residual add in the GEMM's epilogue

so a block becomes ``rms_norm_linear(h, wqkv) -> attention -> add_linear_(h, wo) -> rms_norm_linear(h, w13) ->
add_linear_(h, w2, glu)``: 5 kernels instead of 7 (``fastdecode.models.llama``).

Numerics. ``rms_norm_linear`` multiplies ``h[k] * g[k]`` in h's dtype (one rounding, as the norm kernel rounds its
output; packed bf16x2 in the kernel), sums its products with ``W[n, k]`` in fp32 beside ``h[k]^2``, and scales the
sum by ``rsqrt(mean(h^2) + eps)`` at the end. The two-kernel path rounds ``h * rstd * g`` instead, so the two
differ by about one rounding of the activation (2^-9 relative in bf16). ``add_linear_`` adds
the fp32 product to h's old values and rounds once (the two-kernel path rounds the product, then the sum).
Where ``rms_norm_linear``'s kernel does not apply (the dispatcher picks cuBLAS or a tile other than the one-split
FMA GEMV, as for larger M or other shapes; ``fastdecode.ops.gemm``), it runs the norm kernel, then the GEMM.
``add_linear_`` takes the residual add into our kernel on any config; where the dispatcher picks cuBLAS it is one
``addmm_`` (beta = 1: one rounding), then the bias if any (a second). The ``*_ref`` functions follow the fused
recipe.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.constants import SCALE_NONE
from fastdecode.ops._common import as_rows, check_eps, check_same_device, check_tensor
from fastdecode.ops._registry import define_op
from fastdecode.ops.gemm import (
    LINEAR_DTYPES, _check_weight, _choose, _resolve_impl, check_bias, linear_with_config, run_linear,
)


def _fma_one_split(cfg: dict, K: int) -> bool:
    """Whether the kernel's X_NORM prologue applies: an FMA tile whose K is not split."""
    from fastdecode.kernels.gemm import split_k_blocks

    return cfg["kind"] == "fma" and split_k_blocks(K, cfg)[1] == 1


@define_op("rms_norm_linear", mutates_args=("out",))
def _rms_norm_linear_op(h: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                        bias: Optional[torch.Tensor], out: torch.Tensor, eps: float, impl: str) -> None:
    """h (M, K) unit stride in K; norm_weight (K,) contiguous or None; weight (N, K) contiguous; out (M, N)
    contiguous."""
    from fastdecode.ops.gemm import linear
    from fastdecode.ops.norm import rms_norm

    if impl == "torch":
        out.copy_(rms_norm_linear_ref(h, norm_weight, weight, bias, eps=eps))
        return
    which, cfg = _choose(impl, h, weight, cublas_ok=True)
    if which == "triton" and _fma_one_split(cfg, h.shape[1]):
        linear_with_config(h, weight, bias, None, SCALE_NONE, None, SCALE_NONE, out, cfg,
                           norm_weight=norm_weight, eps=eps, x_norm=True)
        return
    # the two kernels: the normed rows rounded to h's dtype, then the GEMM the dispatcher picks
    g = norm_weight if norm_weight is not None else _ones(h.shape[1], h.dtype, h.device)
    linear(rms_norm(h, g, eps, backend="triton"), weight, bias, out=out, backend="triton",
           impl=None if impl == "auto" else impl)


_ONES: dict = {}


def _ones(K: int, dtype, device) -> torch.Tensor:
    """A norm weight of ones for the two-kernel path without one, kept per (K, dtype, device): a decode step would
    otherwise add a fill kernel per norm. Not kept when made inside a CUDA-graph capture (its fill has not run
    then: only the graph's replays write it)."""
    key = (K, dtype, device)
    t = _ONES.get(key)
    if t is None:
        t = torch.ones(K, dtype=dtype, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ONES[key] = t
    return t


@_rms_norm_linear_op.register_fake
def _(h, norm_weight, weight, bias, out, eps, impl):
    return None


@define_op("add_linear_", mutates_args=("residual",))
def _add_linear_op(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   glu: bool, impl: str) -> None:
    """residual (M, N) contiguous; x (M, K) or, with glu, (M, 2K) ``[gate | up]``, unit stride in its last dim."""
    from fastdecode.ops.activation import silu_and_mul

    if impl == "torch":
        residual.copy_(add_linear_ref(residual, x, weight, bias, glu=glu))
        return
    which, cfg = _choose(impl, x, weight, cublas_ok=True)
    if which == "triton":
        linear_with_config(x, weight, bias, None, SCALE_NONE, None, SCALE_NONE, residual, cfg, glu=glu,
                           accumulate=True)
        return
    # cuBLAS (the dispatcher's pick for the shape, or impl="cublas"): residual += a @ W.T as one GEMM with beta = 1
    residual.addmm_(silu_and_mul(x, backend="triton") if glu else x, weight.t())
    if bias is not None:
        residual.add_(bias)


@_add_linear_op.register_fake
def _(residual, x, weight, bias, glu, impl):
    return None


def check_norm_weight(norm_weight, K: int, dtype) -> None:
    """A norm weight (K,) of h's dtype, or None (a norm without weight)."""
    if norm_weight is None:
        return
    check_tensor("norm_weight", norm_weight, dtypes=(dtype,), ndim=1)
    if norm_weight.shape[0] != K:
        raise ValueError(f"norm_weight must have shape ({K},) (the last dimension of h), got "
                         f"{tuple(norm_weight.shape)}")


def check_residual(residual, shape: tuple, dtype) -> None:
    """The residual an ``add_linear_`` updates in place: x's dtype, the output's shape, contiguous."""
    check_tensor("residual", residual, dtypes=(dtype,))
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"residual must have shape {tuple(shape)}, got {tuple(residual.shape)}")
    if not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous (it is updated in place), got strides {residual.stride()}")


def rms_norm_linear(h, norm_weight, weight, bias=None, *, eps: float = 1e-6, out=None,
                    backend: Optional[str] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``rms_norm(h, norm_weight, eps) @ weight.T + bias`` with the norm inside the GEMM (module docstring).

    h: (..., K) bf16/fp16/fp32 (rows may be strided); norm_weight: (K,) h's dtype, or None for a norm without
    weight (as when it is folded into ``weight``: ``fold_norm_weight``); weight: (N, K) contiguous, h's dtype;
    bias: (N,) or None. Returns (..., N) (or ``out``). impl: as ``linear``.
    """
    check_tensor("h", h, dtypes=LINEAR_DTYPES)
    if h.dim() == 0:
        raise ValueError("h must have at least 1 dimension (..., K), got a scalar")
    K = h.shape[-1]
    check_norm_weight(norm_weight, K, h.dtype)
    check_eps(eps)
    N = _check_weight(weight, K, LINEAR_DTYPES, x_name="h")
    if weight.dtype != h.dtype:
        raise ValueError(f"weight must have the dtype of h ({h.dtype}), got {weight.dtype}")
    bias = check_bias(bias, N, (h.dtype,))
    check_same_device(h=h, norm_weight=norm_weight, weight=weight, bias=bias)
    nw = norm_weight.contiguous() if norm_weight is not None else None
    # K = 0: the norm of an empty row is empty, the product 0
    return run_linear("rms_norm_linear", "h", h, K, N, bias, out, impl, backend,
                      lambda h2, out2, impl_s: _rms_norm_linear_op(h2, nw, weight, bias, out2, float(eps), impl_s))


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``weight * norm_weight`` along K (fp32 product, one rounding to weight's dtype): the weight for which
    ``rms_norm_linear(h, None, folded)`` is ``rms_norm_linear(h, norm_weight, weight)`` up to that rounding
    (``W[n, k] * g[k]`` rounded instead of ``h[k] * g[k]``). weight: (N, K); norm_weight: (K,)."""
    check_tensor("weight", weight, dtypes=LINEAR_DTYPES, ndim=2)
    check_tensor("norm_weight", norm_weight, ndim=1)
    if norm_weight.shape[0] != weight.shape[1]:
        raise ValueError(f"norm_weight must have shape ({weight.shape[1]},) (weight's K), got "
                         f"{tuple(norm_weight.shape)}")
    return (weight.float() * norm_weight.float()).to(weight.dtype)


def add_linear_(residual, x, weight, bias=None, *, glu: bool = False, backend: Optional[str] = None,
                impl: Optional[str] = None) -> torch.Tensor:
    """``residual += x @ weight.T + bias`` in place (fp32 sum, one rounding), as ``Tensor.addmm_``; returns
    residual. ``glu``: x is ``[gate | up]`` (..., 2K) and the input ``silu(gate) * up`` (``silu_and_mul_linear``).

    residual: (..., N) contiguous, x's dtype; x: (..., K) (or (..., 2K)) bf16/fp16/fp32, rows may be strided;
    weight: (N, K) contiguous; bias: (N,) or None. Nothing is written when the arguments are rejected.
    """
    check_tensor("x", x, dtypes=LINEAR_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., K), got a scalar")
    check_tensor("weight", weight, dtypes=LINEAR_DTYPES, ndim=2)
    K = check_glu_input(x, weight, glu)
    N = _check_weight(weight, K, LINEAR_DTYPES, x_name="x")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have the dtype of x ({x.dtype}), got {weight.dtype}")
    bias = check_bias(bias, N, (x.dtype,))
    check_residual(residual, (*x.shape[:-1], N), x.dtype)
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)
    impl_s = _resolve_impl(impl, backend, x.device, "add_linear_")
    return run_add_linear(residual, x, K, N, bias, lambda r2, x2: _add_linear_op(r2, x2, weight, bias, bool(glu),
                                                                                  impl_s))


def check_glu_input(x, weight, glu: bool) -> int:
    """x's last dimension against a weight (N, K): K, or 2K with ``glu`` (``[gate | up]``); returns K."""
    K = weight.shape[1]
    if x.shape[-1] != (2 * K if glu else K):
        want = f"(..., 2 * K) = (..., {2 * K}) ([gate | up] with glu=True)" if glu else f"(..., {K})"
        raise ValueError(f"x must have shape {want} for a weight of shape {tuple(weight.shape)}, "
                         f"got {tuple(x.shape)}")
    return K


def run_add_linear(residual, x, K: int, N: int, bias, call) -> torch.Tensor:
    """The tail the checked residual-add ops share: nothing to add for no rows or N = 0, the bias alone for K = 0,
    else ``call(residual_rows, x_rows)`` on 2-D views; returns residual."""
    x2 = as_rows("x", x)
    if x2.shape[0] == 0 or N == 0:
        return residual
    if K == 0:
        return residual.add_(bias) if bias is not None else residual
    call(residual.view(-1, N), x2)
    return residual


# ----------------------------------------------------------------------------- references


def rms_norm_linear_ref(h, norm_weight, weight, bias=None, *, eps: float = 1e-6) -> torch.Tensor:
    """Reference of :func:`rms_norm_linear`, the fused recipe: ``h * g`` rounded to h's dtype (h itself when
    norm_weight is None), its product with ``W.T`` in fp32 times each row's ``rsqrt(mean(h^2) + eps)``, plus the
    bias, one rounding to h's dtype."""
    v = h.float()
    rstd = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    a = (h.float() * norm_weight.float()).to(h.dtype) if norm_weight is not None else h
    y = (a.float() @ weight.float().t()) * rstd
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype)


def add_linear_ref(residual, x, weight, bias=None, *, glu: bool = False) -> torch.Tensor:
    """Reference of :func:`add_linear_` (out of place): ``residual + a @ W.T + b`` in fp32, one rounding; ``a``
    is x, or with glu ``silu_and_mul_ref(x)`` (rounded to x's dtype, as the kernel computes it)."""
    from fastdecode.ops.activation import silu_and_mul_ref

    a = silu_and_mul_ref(x) if glu else x
    y = a.float() @ weight.float().t() + residual.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(residual.dtype)


__all__ = ["add_linear_", "add_linear_ref", "fold_norm_weight", "rms_norm_linear", "rms_norm_linear_ref"]
