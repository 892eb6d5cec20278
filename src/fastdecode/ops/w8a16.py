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
from fastdecode.ops._common import FP8_DTYPE, check_same_device, check_tensor, next_pow2, require_sm
from fastdecode.ops._registry import define_op
from fastdecode.ops._tuned import device_info, load_table, lookup_cache, nearest_m
from fastdecode.ops.gemm import (
    _check_weight, _w_scale_vec, check_bias, linear_with_config, run_linear, with_split_k,
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


@define_op("linear_w8a16", mutates_args=("out",))
def _linear_w8a16_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], out: torch.Tensor, glu: bool, impl: str) -> None:
    """x (M, K) (or (M, 2K) with glu) unit stride in its last dimension; weight (N, K) fp8 contiguous; weight_scale
    (N,) or (1,) fp32; out (M, N)."""
    if impl == "torch":
        out.copy_(linear_w8a16_ref(x, weight, weight_scale, bias, glu=glu, out_dtype=out.dtype))
        return
    require_sm(x.device, 8, 9, "FP8 linear")  # the conversion of e4m3 (sm_89 and later)
    M, (N, K) = x.shape[0], weight.shape
    cfg = get_w8a16_config(M, N, K, x.device, glu)
    w_mode = SCALE_TENSOR if weight_scale.numel() == 1 else SCALE_VECTOR
    linear_with_config(x, weight, bias, None, SCALE_NONE, weight_scale, w_mode, out, cfg, glu=glu)


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
    M = x.numel() // max(x.shape[-1], 1)
    if M > MAX_M:
        raise ValueError(f"linear_w8a16 takes at most {MAX_M} token rows (decode), got {M}; use linear_fp8")
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
    ws = weight_scale.float()
    ws = ws.reshape(()) if ws.numel() == 1 and ws.dim() <= 1 else ws.reshape(-1)
    y = (xin.float() @ weight_fp8.float().t()) * ws
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


__all__ = ["DECODE_MAX_M", "MAX_M", "TABLE_SECTION", "get_w8a16_config", "heuristic_config", "linear_w8a16",
           "linear_w8a16_ref", "table_key"]
