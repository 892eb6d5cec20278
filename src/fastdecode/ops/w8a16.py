"""FP8 weights times 16-bit activations, for decode: ``linear_w8a16`` (and its SiLU-and-mul form).

    linear_w8a16:  out = x @ (weight_fp8 * weight_scale).T + bias        x bf16 / fp16, a few token rows
    glu=True:      out = silu_and_mul(h) @ (weight_fp8 * weight_scale).T + bias    h = [gate | up]

Why (benchmarks/NOTES.md, session 23): W8A8 needs its activation in FP8 with one scale per token, i.e. an amax over
the whole row before the GEMM. The norms emit that themselves, but the attention output before ``wo`` took a
quantisation kernel of its own and SiLU-and-mul before ``w2`` a row-wide one: two launches a layer (the FP8
profile's "activation" family, 64 calls and ~185 us of the 8B step on the H200). At a few tokens the GEMV streams
the FP8 weight either way; on the CUDA cores (the FMA kind of ``kernels.gemm``) its activation can as well be
bf16: each weight byte is widened to fp32 in registers (e4m3 is exact there), multiplied by the fp32 activation,
and the per-channel scale is applied once in the epilogue. So ``wo`` reads the attention output as it is, and
``w2``'s loads compute ``silu(gate) * up`` (``X_GLU``, as ``ops.glu_linear`` for bf16): both launches are gone,
and the activation is not rounded to FP8 at all (the results are closer to the unquantised model than W8A8's).

Up to ``MAX_M`` token rows (the FMA kind keeps one accumulator per row); prefill stays W8A8 on the tensor cores.
The kernel config is the linear table's ``w8a16`` entry (``benchmarks/sweep_w8a16.py --table``), else a heuristic
(not the W8A8 GEMV's FMA entry: with a 2-byte activation other tiles win, ``heuristic_config``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.constants import SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR
from fastdecode.ops._common import (
    FP8_DTYPE, check_eps, check_same_device, check_tensor, next_pow2, require_sm,
)
from fastdecode.ops._registry import define_op
from fastdecode.ops._tuned import device_info, load_table, lookup_cache, nearest_m
from fastdecode.ops.gemm import (
    _check_weight, _resolve_impl, _w_scale_vec, check_bias, linear_with_config, run_linear, with_split_k,
)

MAX_M = 4  # token rows: the FMA kind's accumulators
# rows the model's fp8_a16 switch sends here (decode); prefill keeps W8A8
DECODE_MAX_M = 4
X_DTYPES = (torch.bfloat16, torch.float16)


TABLE_SECTION = "w8a16"  # tuned configs: a section of the linear table (benchmarks/sweep_w8a16.py --table)


def table_key(N: int, K: int, glu: bool) -> str:
    """The section's key of a weight (N, K): ``"N,K"``, ``"N,K,glu"`` for SiLU-and-mul in the loads."""
    return f"{N},{K}" + (",glu" if glu else "")


def get_w8a16_config(M: int, N: int, K: int, device=None, glu: bool = False) -> dict:
    """The launch config of ``linear_w8a16`` for an (M, N, K) call: the GPU's linear table's ``w8a16`` entry (the
    nearest tuned M, ``ops._tuned.nearest_m``; written by ``benchmarks/sweep_w8a16.py --table``), else
    :func:`heuristic_config`."""
    return dict(_config(torch.device(device) if device is not None else None, int(M), int(N), int(K), bool(glu)))


def heuristic_config(M: int, N: int, K: int, num_sms: int) -> dict:
    """8 weight rows a program (fewer with more token rows: the same weight bytes a thread a step), 1024 columns a
    step, 4 warps (8 from K = 8192: long rows), split-K only where fewer than ~2 programs an SM would run. The H100
    sweep (session 24, ``results/h100/sweep_w8a16_ad28a84.json``, M = 1, 98 configs) found exactly these the best on
    the 8B wo (8.55 us) and w2 + SiLU (22.75 us), where the FMA default of the W8A8 GEMV (4 rows, 2048 columns, 4
    warps) took 9.59 and 25.83 us."""
    bm = next_pow2(min(max(M, 1), MAX_M))
    cfg = {"kind": "fma", "BLOCK_M": bm, "BLOCK_N": max(8 // bm, 1), "BLOCK_K": 1024,
           "num_warps": 8 if K >= 8192 else 4, "num_stages": 1}
    return with_split_k(cfg, M, N, K, num_sms, 2)


@lookup_cache
def _config(device, M: int, N: int, K: int, glu: bool) -> dict:
    if device is not None and device.type == "cuda":
        table = load_table("linear", device_info(device)[0]) or {}
        entry = nearest_m(table.get(TABLE_SECTION, {}).get(table_key(N, K, glu)), M)
        if entry and entry["config"].get("BLOCK_M", 1) >= min(M, MAX_M):
            return entry["config"]  # get_w8a16_config hands out copies
    return heuristic_config(M, N, K, device_info(device)[1])


def _check_rows(name: str, x, hint: str = "") -> None:
    """At most ``MAX_M`` token rows (the FMA kind's accumulators)."""
    M = x.numel() // max(x.shape[-1], 1)
    if M > MAX_M:
        raise ValueError(f"{name} takes at most {MAX_M} token rows (decode), got {M}{hint}")


def _config_for(x, weight, glu: bool = False) -> dict:
    """The checked device (e4m3 conversion: sm_89 and later) and the launch config of a W8A16 call on 2-D x."""
    require_sm(x.device, 8, 9, "FP8 linear")
    return get_w8a16_config(x.shape[0], weight.shape[0], weight.shape[1], x.device, glu)


def _launch(x, weight, weight_scale, bias, out, cfg, **kw) -> None:
    """The skinny kernel on FP8 weights with their per-tensor or per-channel scale, a 16-bit x without scale."""
    w_mode = SCALE_TENSOR if weight_scale.numel() == 1 else SCALE_VECTOR
    linear_with_config(x, weight, bias, None, SCALE_NONE, weight_scale, w_mode, out, cfg, **kw)


@define_op("linear_w8a16", mutates_args=("out",))
def _linear_w8a16_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], out: torch.Tensor, glu: bool, impl: str) -> None:
    """x (M, K) (or (M, 2K) with glu) unit stride in its last dimension; weight (N, K) fp8 contiguous; weight_scale
    (N,) or (1,) fp32; out (M, N)."""
    if impl == "torch":
        out.copy_(linear_w8a16_ref(x, weight, weight_scale, bias, glu=glu, out_dtype=out.dtype))
        return
    _launch(x, weight, weight_scale, bias, out, _config_for(x, weight, glu), glu=glu)


@_linear_w8a16_op.register_fake
def _(x, weight, weight_scale, bias, out, glu, impl):
    return None


def linear_w8a16(x, weight_fp8, weight_scale, bias=None, *, glu: bool = False, out=None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """W8A16: ``out = x @ (weight_fp8 * weight_scale).T + bias`` with fp32 accumulation, one rounding to x.dtype.

    x: (..., K) bf16 / fp16 with at most ``MAX_M`` rows (rows may be strided), or with ``glu`` (..., 2K)
    ``[gate | up]``, whose ``silu(gate) * up`` (rounded to x.dtype, as ``silu_and_mul`` stores it) is the input;
    weight_fp8: (N, K) float8_e4m3fn, contiguous; weight_scale: one element (per tensor) or (N,) / (N, 1) fp32, a
    dequantisation scale; bias: (N,) of x's dtype or None. Returns (..., N) in x.dtype (or ``out``).
    """
    check_tensor("x", x, dtypes=X_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., K), got a scalar")
    check_tensor("weight_fp8", weight_fp8, dtypes=(FP8_DTYPE,), ndim=2)
    K = weight_fp8.shape[1]
    if glu and x.shape[-1] != 2 * K:
        raise ValueError(f"x must have shape (..., 2 * K) = (..., {2 * K}) with glu ([gate | up], each K wide) for "
                         f"a weight of shape {tuple(weight_fp8.shape)}, got {tuple(x.shape)}")
    N = _check_weight(weight_fp8, x.shape[-1] // 2 if glu else x.shape[-1], (FP8_DTYPE,), "weight_fp8",
                      "x's gate half" if glu else "x")
    _check_rows("linear_w8a16", x, "; use linear_fp8")
    bias = check_bias(bias, N, (x.dtype,), "weight_fp8")
    check_same_device(x=x, weight_fp8=weight_fp8, bias=bias)
    ws = _w_scale_vec(weight_scale, N, x.device)
    return run_linear("linear_w8a16", "x", x, K, N, bias, out, None, backend,
                      lambda x2, out2, impl_s: _linear_w8a16_op(x2, weight_fp8, ws, bias, out2, glu, impl_s))


def linear_w8a16_ref(x, weight_fp8, weight_scale, bias=None, *, glu: bool = False,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Reference of :func:`linear_w8a16`: the input (``silu_and_mul_ref`` of it with glu) times the fp32 FP8
    weight, times the weight's scale, plus the bias, in fp32; one rounding to ``out_dtype`` (default x.dtype)."""
    from fastdecode.ops.activation import silu_and_mul_ref

    xin = silu_and_mul_ref(x) if glu else x
    y = (xin.float() @ weight_fp8.float().t()) * _ref_scale(weight_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- the norm and the residual add inside
#
# The FP8 projections of the ``norm_gemm`` decode step (``fastdecode.models.norm_gemm``), as ``ops.norm_linear`` is
# for dense ones and ``ops.int4_norm_linear`` for int4 ones:
#
#     rms_norm_linear_w8a16(h, g, Wq, s):  rms_norm(h, g, eps) @ (Wq * s).T + bias
#     add_linear_w8a16_(r, x, Wq, s):      r += x @ (Wq * s).T + bias      (in place; glu: x = [gate | up])
#
# The norm weight g stays in the kernel (``h * g`` rounded to h's dtype, as the norm kernel rounds its output): it
# cannot be folded into an FP8 weight without rounding that weight to FP8 a second time. Each program of the FMA
# kind streams its whole x row anyway (one split), so it sums the row's squares beside its products and scales the
# fp32 sums by ``rsqrt(mean(h^2) + eps)`` at the end (``kernels.gemm``'s X_NORM). Where the config is not a
# one-split FMA tile, the norm kernel runs first (two kernels). The residual add is the fp32 product added to the
# residual in the epilogue, one rounding (ACCUMULATE), on any config.


@define_op("rms_norm_linear_w8a16", mutates_args=("out",))
def _rms_norm_linear_w8a16_op(h: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                              weight_scale: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, eps: float,
                              impl: str) -> None:
    """h (M, K) unit stride in K; norm_weight (K,) contiguous or None; weight (N, K) fp8; weight_scale (N,) or (1,)
    fp32; out (M, N)."""
    from fastdecode.ops.norm import rms_norm
    from fastdecode.ops.norm_linear import _fma_one_split, _ones

    if impl == "torch":
        out.copy_(rms_norm_linear_w8a16_ref(h, norm_weight, weight, weight_scale, bias, eps=eps))
        return
    cfg = _config_for(h, weight)
    K = h.shape[1]
    if _fma_one_split(cfg, K):
        _launch(h, weight, weight_scale, bias, out, cfg, norm_weight=norm_weight, eps=eps, x_norm=True)
        return
    g = norm_weight if norm_weight is not None else _ones(K, h.dtype, h.device)
    _launch(rms_norm(h, g, eps, backend="triton"), weight, weight_scale, bias, out, cfg)


@_rms_norm_linear_w8a16_op.register_fake
def _(h, norm_weight, weight, weight_scale, bias, out, eps, impl):
    return None


@define_op("add_linear_w8a16_", mutates_args=("residual",))
def _add_linear_w8a16_op(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], glu: bool, impl: str) -> None:
    """residual (M, N) contiguous; x (M, K) or, with glu, (M, 2K), unit stride in its last dimension."""
    if impl == "torch":
        residual.copy_(add_linear_w8a16_ref(residual, x, weight, weight_scale, bias, glu=glu))
        return
    _launch(x, weight, weight_scale, bias, residual, _config_for(x, weight, glu), glu=glu, accumulate=True)


@_add_linear_w8a16_op.register_fake
def _(residual, x, weight, weight_scale, bias, glu, impl):
    return None


def check_norm_fp8_args(h, norm_weight, weight_fp8, weight_scale, bias, eps) -> tuple:
    """The checks of an op computing ``rms_norm(h, norm_weight, eps) @ (weight_fp8 * weight_scale).T + bias``
    (``rms_norm_linear_w8a16``): h (..., K) bf16 / fp16, norm_weight (K,) of h's dtype or None, an e4m3 weight
    (N, K), a bias of h's dtype -> (K, N, bias, the scale as an (N,) or (1,) vector, the contiguous norm weight)."""
    from fastdecode.ops.norm_linear import check_norm_weight

    check_tensor("h", h, dtypes=X_DTYPES)
    if h.dim() == 0:
        raise ValueError("h must have at least 1 dimension (..., K), got a scalar")
    check_tensor("weight_fp8", weight_fp8, dtypes=(FP8_DTYPE,), ndim=2)
    K = h.shape[-1]
    check_norm_weight(norm_weight, K, h.dtype)
    check_eps(eps)
    N = _check_weight(weight_fp8, K, (FP8_DTYPE,), "weight_fp8", "h")
    bias = check_bias(bias, N, (h.dtype,), "weight_fp8")
    check_same_device(h=h, norm_weight=norm_weight, weight_fp8=weight_fp8, bias=bias)
    return K, N, bias, _w_scale_vec(weight_scale, N, h.device), (
        norm_weight.contiguous() if norm_weight is not None else None)


def rms_norm_linear_w8a16(h, norm_weight, weight_fp8, weight_scale, bias=None, *, eps: float = 1e-6, out=None,
                          backend: Optional[str] = None) -> torch.Tensor:
    """``rms_norm(h, norm_weight, eps) @ (weight_fp8 * weight_scale).T + bias``, the norm inside the W8A16 GEMV.

    h: (..., K) bf16 / fp16, at most ``MAX_M`` rows (may be strided); norm_weight: (K,) h's dtype, or None (a norm
    without weight); weight_fp8 / weight_scale / bias: as :func:`linear_w8a16`. The product ``h * norm_weight`` is
    rounded to h's dtype, the sums are fp32, scaled by each row's ``rsqrt(mean(h^2) + eps)``; one rounding to h's
    dtype. Returns (..., N) (or ``out``).
    """
    K, N, bias, ws, nw = check_norm_fp8_args(h, norm_weight, weight_fp8, weight_scale, bias, eps)
    _check_rows("rms_norm_linear_w8a16", h)
    return run_linear("rms_norm_linear_w8a16", "h", h, K, N, bias, out, None, backend,
                      lambda h2, out2, impl_s: _rms_norm_linear_w8a16_op(h2, nw, weight_fp8, ws, bias, out2,
                                                                         float(eps), impl_s))


def add_linear_w8a16_(residual, x, weight_fp8, weight_scale, bias=None, *, glu: bool = False,
                      backend: Optional[str] = None) -> torch.Tensor:
    """``residual += x @ (weight_fp8 * weight_scale).T + bias`` in place (fp32 sum, one rounding); returns
    residual. ``glu``: x is ``[gate | up]`` (..., 2K) and the input ``silu(gate) * up``.

    residual: (..., N) contiguous, x's dtype; x: (..., K) (or (..., 2K)) bf16 / fp16, at most ``MAX_M`` rows;
    weight_fp8 / weight_scale / bias: as :func:`linear_w8a16`. Nothing is written when the arguments are rejected.
    """
    from fastdecode.ops.norm_linear import check_glu_input, check_residual, run_add_linear

    check_tensor("x", x, dtypes=X_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., K), got a scalar")
    check_tensor("weight_fp8", weight_fp8, dtypes=(FP8_DTYPE,), ndim=2)
    K = check_glu_input(x, weight_fp8, glu)
    N = _check_weight(weight_fp8, K, (FP8_DTYPE,), "weight_fp8", "x")
    _check_rows("add_linear_w8a16_", x)
    bias = check_bias(bias, N, (x.dtype,), "weight_fp8")
    check_residual(residual, (*x.shape[:-1], N), x.dtype)
    check_same_device(x=x, weight_fp8=weight_fp8, bias=bias, residual=residual)
    ws = _w_scale_vec(weight_scale, N, x.device)
    impl_s = _resolve_impl(None, backend, x.device, "add_linear_w8a16_")
    return run_add_linear(residual, x, K, N, bias,
                          lambda r2, x2: _add_linear_w8a16_op(r2, x2, weight_fp8, ws, bias, bool(glu), impl_s))


def rms_norm_linear_w8a16_ref(h, norm_weight, weight_fp8, weight_scale, bias=None, *, eps: float = 1e-6):
    """Reference of :func:`rms_norm_linear_w8a16`, the fused recipe: ``h * g`` rounded to h's dtype (h itself
    without g), its fp32 product with the fp32 FP8 weight times each row's ``rsqrt(mean(h^2) + eps)`` and the
    weight's scale, plus the bias; one rounding to h's dtype."""
    rstd = torch.rsqrt(h.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    a = (h.float() * norm_weight.float()).to(h.dtype) if norm_weight is not None else h
    y = (a.float() @ weight_fp8.float().t()) * rstd * _ref_scale(weight_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype)


def add_linear_w8a16_ref(residual, x, weight_fp8, weight_scale, bias=None, *, glu: bool = False) -> torch.Tensor:
    """Reference of :func:`add_linear_w8a16_` (out of place): ``residual + a @ (Wq * s).T + b`` in fp32, one
    rounding; ``a`` is x, or with glu ``silu_and_mul_ref(x)``."""
    y = linear_w8a16_ref(x, weight_fp8, weight_scale, bias, glu=glu, out_dtype=torch.float32) + residual.float()
    return y.to(residual.dtype)


def _ref_scale(weight_scale) -> torch.Tensor:
    ws = weight_scale.float()
    return ws.reshape(()) if ws.numel() == 1 and ws.dim() <= 1 else ws.reshape(-1)


__all__ = ["DECODE_MAX_M", "MAX_M", "TABLE_SECTION", "add_linear_w8a16_", "add_linear_w8a16_ref",
           "get_w8a16_config", "heuristic_config", "linear_w8a16", "linear_w8a16_ref", "rms_norm_linear_w8a16",
           "rms_norm_linear_w8a16_ref", "table_key"]
