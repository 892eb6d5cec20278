"""W4A8 int4 linear with int8 activations, for decode (a few tokens): two kernels on ``dp4a``.

    quantize_act_int8:  q = round(x / s), s = amax(|x| over a group of 128 columns) / 127 per row and group
    int4_linear_a8:     out = (q * s) @ dequantize_int4(w, float32).T + bias   (exact int32 sums, fp32 scaling,
                        one rounding to x.dtype)

Why: at one token the W4A16 kernels (``ops.int4``) are bound by instruction issue, not by memory; with int8
activations a ``dp4a`` multiplies and sums four weight values exactly, and a 32-bit word of 8 nibbles costs ~15
instructions instead of ~36 (``kernels.int4_a8``, benchmarks/NOTES.md session 22). The price is the activation's
rounding to int8 per group of 128 columns: each value moves by at most half a step, ``s / 2 = amax / 254``, so
the output moves by ~0.5-1 % of its scale on random data (the int4 weight's own rounding is ~10x larger; the
decode step's cost is what ``fastdecode eval-accuracy`` measures). The result is deterministic (integer sums).

The weight is any :class:`Int4Weight` whose groups are unions of the activation's groups: group size a multiple
of 128 or one group per row (``supports``); act-order weights gather x's columns first. Up to ``MAX_M`` tokens
(the kernel keeps one accumulator per token row; more tokens go to ``int4_linear``, where the tensor cores pay).
The quantised activation (``quantize_act_int8``) is a tuple ``(q, scales, sums)``: int8 ``(M, Kp)`` in the
kernel's byte order (``kernels.int4_a8``; Kp is K rounded up to 256), fp32 scales ``(M, Kp // 128)`` (a
dequantisation scale: ``x ~= q * s``) and the int32 sums of each group's q.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.constants import INT8_MIN_SCALE
from fastdecode.ops._common import (
    as_rows, cdiv, check_eps, check_out, check_same_device, check_tensor, l2_prefetch_bytes, next_pow2, pdl_enabled,
    resolve_backend, weight_prefetch_bytes,
)
from fastdecode.ops._registry import define_op
from fastdecode.ops._tuned import DEFAULT_NUM_SMS, device_info, load_table, lookup_cache, nearest_m, split_k_workspace
from fastdecode.ops.gemm import check_bias
from fastdecode.ops.int4 import _zm, check_x
from fastdecode.ops.int4_format import Int4Weight, dequantize_int4, packed_cols

ACT_GROUP = 128  # activation columns per int8 scale (half a 256-column layout tile)
MAX_M = 4  # token rows a program keeps accumulators for
# rows the model's int4_a8 switch sends here: on the H100 (session 22, benchmarks/results/h100/sweep_int4_a8.json) the
# GEMV beat the W4A16 table on every 8B shape at 1 and 2 tokens and lost at 4 on gate_up, down and the head
DECODE_MAX_M = 2
_P = (0, 2, 1, 3)  # byte b of a word holds the group's column 32 * _P[b] + j (kernels.int4_a8)


def supports(w: Int4Weight) -> bool:
    """Whether the a8 kernel computes ``w``: its groups are unions of 128-column activation groups."""
    return w.group_size % ACT_GROUP == 0 or w.group_size == w.K


def heuristic_config(M: int, N: int, K: int, num_sms: int = DEFAULT_NUM_SMS) -> dict:
    """BLOCK_N rows of 16-byte word loads (64 rows: 16 words a thread at 4 warps), split-K until about 4
    programs run per SM, never fewer than 4 layout tiles a split."""
    bm = next_pow2(min(max(M, 1), MAX_M))
    bn = 64 if bm == 1 else 32
    tiles = cdiv(M, bm) * cdiv(N, bn)
    steps = packed_cols(K) // 32
    split = int(max(1, min(cdiv(4 * num_sms, tiles), steps // 4, 16)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": split, "num_warps": 4}


TABLE_SECTION = "int4_linear_a8"  # the GEMV's tuned configs: a section of the int4_linear table (ops.int4)


@lookup_cache
def _a8_lookup(gpu_name: str, num_sms: int, M: int, N: int, K: int, group_size: int) -> dict:
    heuristic = heuristic_config(M, N, K, num_sms)
    if gpu_name == "cpu":
        return heuristic
    from fastdecode.ops.int4 import table_key

    table = load_table("int4_linear", gpu_name) or {}
    entry = nearest_m(table.get(TABLE_SECTION, {}).get(table_key(N, K, group_size)), M)
    return dict(entry["config"]) if entry else heuristic


def get_a8_config(M: int, N: int, K: int, device=None, group_size: int = ACT_GROUP) -> dict:
    """The launch config of ``int4_linear_a8`` for an (M, N, K) call: the tuned entry of the GPU's int4_linear
    table (section ``int4_linear_a8``, written by ``benchmarks/sweep_int4_a8.py --table``; the entry of the
    nearest tuned M, ``ops._tuned.nearest_m``), else the heuristic."""
    name, sms = device_info(torch.device(device) if device is not None else None)
    return dict(_a8_lookup(name, sms, int(M), int(N), int(K), int(group_size)))


# ----------------------------------------------------------------------------- registered ops


@define_op("int4_act_quant", mutates_args=("q", "scales", "sums"))
def _act_quant_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor, impl: str) -> None:
    """x (M, K) 16-bit (unit inner stride); q int8 (M, Kp); scales fp32 / sums int32 (M, Kp // 128)."""
    if impl == "torch":
        rq, rs, rsum = quantize_act_int8_ref(x)
        q.copy_(rq)
        scales.copy_(rs)
        sums.copy_(rsum)
        return
    from fastdecode.kernels.int4_a8 import launch_act_quant

    launch_act_quant(x, q, scales, sums, pdl=pdl_enabled(x))


@_act_quant_op.register_fake
def _(x, q, scales, sums, impl):
    return None


def a8_with_config(q, scales_x, sums_x, w: Int4Weight, bias, out, config: dict, warmup: bool = False,
                   accumulate: bool = False) -> None:
    """Run the GEMV with an explicit config (the benchmark's and the tuner's entry point; no checks, no dispatch)."""
    from fastdecode.kernels.int4 import lop3_asm_ok
    from fastdecode.kernels.int4_a8 import launch_int4_a8, split_k_of

    split = split_k_of(w.qweight.shape[1], config)
    config, part, locks = split_k_workspace(q.device, config, split, q.shape[0], w.N, "int4_linear_a8")
    launch_int4_a8(q, scales_x, sums_x, w.qweight, w.scales, _zm(w), w.group_size, w.zero_mode, bias, out, part,
                   locks, config, asm=lop3_asm_ok(q), pdl=pdl_enabled(q), accumulate=accumulate, warmup=warmup,
                   l2_slab=weight_prefetch_bytes(q))


@define_op("int4_linear_a8", mutates_args=("out",))
def _int4_a8_op(q: torch.Tensor, scales_x: torch.Tensor, sums_x: torch.Tensor, qweight: torch.Tensor,
                scales: torch.Tensor, zm: Optional[torch.Tensor], bias: Optional[torch.Tensor], out: torch.Tensor,
                group_size: int, zero_mode: str, K: int, impl: str) -> None:
    """The quantised activation (``quantize_act_int8``) times the weight's tensors (kernel layout); out (M, N)."""
    w = Int4Weight(qweight, scales, zm if zero_mode == "zero" else None, zm if zero_mode == "min" else None,
                   group_size, zero_mode, None, K)
    if impl == "torch":
        out.copy_(_a8_matmul_ref(q, scales_x, w, bias, out.dtype))
        return
    a8_with_config(q, scales_x, sums_x, w, bias, out, get_a8_config(q.shape[0], w.N, K, q.device, group_size))


@_int4_a8_op.register_fake
def _(q, scales_x, sums_x, qweight, scales, zm, bias, out, group_size, zero_mode, K, impl):
    return None


# ----------------------------------------------------------------------------- public API


def _act_buffers(lead, K: int, device):
    """Empty (q, scales, sums) of an int8 activation with leading dims ``lead`` and K columns."""
    Kp = packed_cols(K) * 8
    return (torch.empty(*lead, Kp, dtype=torch.int8, device=device),
            torch.empty(*lead, Kp // ACT_GROUP, dtype=torch.float32, device=device),
            torch.empty(*lead, Kp // ACT_GROUP, dtype=torch.int32, device=device))


def _rows(act):
    """(q, scales, sums) viewed as rows (M, ...)."""
    return tuple(t.reshape(-1, t.shape[-1]) for t in act)


def quantize_act_int8(x, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise a 16-bit activation (..., K) to int8 per row and group of 128 columns, for ``int4_linear_a8``.

    Returns ``(q, scales, sums)``: q int8 (..., Kp) in the kernel's byte order (the module docstring; padding
    columns are 0), scales fp32 (..., Kp // 128) with ``x ~= q * scale`` (``amax / 127``; a group holding a NaN
    gets a NaN scale), sums int32 (..., Kp // 128) of each group's q."""
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., K), got a scalar")
    x2 = as_rows("x", x)
    act = _act_buffers(x.shape[:-1], x.shape[-1], x.device)
    if x2.shape[0]:
        _act_quant_op(x2, *_rows(act), resolve_backend(backend, x.device, "quantize_act_int8"))
    return act


def _check_act(act, packed: Int4Weight):
    """An int8 activation ``(q, scales, sums)`` (``quantize_act_int8`` or an int8-output op) for ``packed``."""
    if not (isinstance(act, tuple) and len(act) == 3 and all(isinstance(t, torch.Tensor) for t in act)):
        raise ValueError(f"x must be a 16-bit tensor or an int8 activation (q, scales, sums), got {type(act).__name__}")
    q, sc, sums = act
    Kp = packed_cols(packed.K) * 8
    lead = tuple(q.shape[:-1])
    want = ((*lead, Kp), torch.int8), ((*lead, Kp // ACT_GROUP), torch.float32), ((*lead, Kp // ACT_GROUP),
                                                                                   torch.int32)
    for name, t, (shape, dtype) in zip(("q", "scales", "sums"), act, want):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"x's {name} must be contiguous {dtype} {shape} for K={packed.K}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if packed.perm is not None:
        raise ValueError("an act-order weight needs x's columns gathered before the quantisation: pass the tensor")
    return lead


def int4_linear_a8(x, packed: Int4Weight, bias=None, *, out_dtype=None, out=None,
                   backend: Optional[str] = None) -> torch.Tensor:
    """W4A8: ``out = dequantize_act_int8(quantize_act_int8(x)) @ dequantize_int4(packed, float32).T + bias``.

    x: (..., K) bf16/fp16 with at most ``MAX_M`` rows, or an int8 activation ``(q, scales, sums)`` as
    ``quantize_act_int8`` and the int8-output ops (``rms_norm_int8``, ``fused_add_rms_norm_int8``,
    ``silu_and_mul_int8``) return it; packed: an :class:`Int4Weight` (N, K) with ``supports``; bias (N,) of the
    output dtype or None. Returns (..., N) in ``out_dtype`` (bf16 or fp16; default x.dtype, bf16 for an int8
    activation), or ``out``. From a tensor, two
    kernels: the activation's quantisation, then the int4 x int8 GEMV (exact int32 sums per word and group, fp32
    scaling, one rounding).
    """
    if isinstance(x, torch.Tensor):
        K = check_x("x", x, packed)
        lead, device = tuple(x.shape[:-1]), x.device
        out_dtype = out_dtype or x.dtype
    else:
        from fastdecode.ops.int4 import _check_packed

        _check_packed(packed, packed.K)
        lead = _check_act(x, packed)
        K, device = packed.K, x[0].device
        out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bf16 or fp16, got {out_dtype}")
    if not supports(packed):
        raise ValueError(f"int4_linear_a8 needs int4 groups that are multiples of {ACT_GROUP} columns (or one group "
                         f"per row), got group_size={packed.group_size} for K={K}; use int4_linear")
    N = packed.N
    bias = check_bias(bias, N, (out_dtype,), "the weight")
    check_same_device(x=x if isinstance(x, torch.Tensor) else x[0], qweight=packed.qweight, scales=packed.scales,
                      bias=bias)
    out_shape = (*lead, N)
    check_out("out", out, out_shape, out_dtype, device)
    M = 1
    for d in lead:
        M *= d
    if M > MAX_M:
        raise ValueError(f"int4_linear_a8 takes at most {MAX_M} token rows (decode), got {M}; use int4_linear for more")
    be = resolve_backend(backend, device, "int4_linear_a8")
    out = torch.empty(out_shape, dtype=out_dtype, device=device) if out is None else out
    if M == 0 or N == 0:
        return out
    if isinstance(x, torch.Tensor):
        x2 = as_rows("x", x)
        if packed.perm is not None:  # act-order: the kernel's column order
            x2 = x2.index_select(1, packed.perm)
        x = quantize_act_int8(x2, backend=be)
    _int4_a8_op(*_rows(x), packed.qweight, packed.scales, _zm(packed), bias, out.view(-1, N), packed.group_size,
                packed.zero_mode, K, be)
    return out


# ----------------------------------------------------------------------------- int8 outputs of the producers


def _int8_fits(block: int, K: int) -> bool:
    """Whether a one-chunk row kernel of ``block`` columns writes every group of the 256-rounded row."""
    return block >= packed_cols(K) * 8


@define_op("rms_norm_int8", mutates_args=("residual", "q", "scales", "sums"))
def _rms_norm_int8_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, q: torch.Tensor,
                      scales: torch.Tensor, sums: torch.Tensor, eps: float, backend: str) -> None:
    """x, residual (M, H) rows; q (M, Hp), scales / sums (M, Hp // 128)."""
    from fastdecode.ops.norm import _norm_rows_ref, norm_config

    cfg = norm_config(*x.shape)
    if backend == "triton" and _int8_fits(cfg["BLOCK_H"], x.shape[1]):
        from fastdecode.constants import OUT_INT8_GROUPS
        from fastdecode.kernels.norm import launch_rms_norm

        launch_rms_norm(x, residual, weight, q, scales, eps, OUT_INT8_GROUPS, cfg, pdl=pdl_enabled(x), sums=sums)
        return
    if backend == "triton":  # rows the one-pass kernel cannot hold: the norm, then the quantisation
        from fastdecode.ops.norm import fused_add_rms_norm, rms_norm

        y = rms_norm(x, weight, eps) if residual is None else fused_add_rms_norm(x, residual, weight, eps)
        _act_quant_op(y, q, scales, sums, backend)
        return
    y, r, _ = _norm_rows_ref(x, residual, weight, eps, x.dtype, None)
    if residual is not None:
        residual.copy_(r)
    for t, v in zip((q, scales, sums), quantize_act_int8_ref(y)):
        t.copy_(v)


@_rms_norm_int8_op.register_fake
def _(x, residual, weight, q, scales, sums, eps, backend):
    return None


def _norm_int8(x, residual, weight, eps, backend, op):
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., H), got a scalar")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must have the shape and dtype of x {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have {x.shape[-1]} elements (the last dimension of x), got {weight.shape[0]}")
    eps = check_eps(eps)
    check_same_device(x=x, residual=residual, weight=weight)
    be = resolve_backend(backend, x.device, op)
    act = _act_buffers(x.shape[:-1], x.shape[-1], x.device)
    x2 = as_rows("x", x)
    r2 = as_rows("residual", residual, inplace=True) if residual is not None else None
    if x2.shape[0]:
        _rms_norm_int8_op(x2, r2, weight.contiguous(), *_rows(act), eps, be)
    return act


def rms_norm_int8(x, weight, eps: float = 1e-6, *, backend: Optional[str] = None):
    """``rms_norm(x, weight, eps)`` (rounded to x.dtype) as an int8 activation ``(q, scales, sums)`` for
    ``int4_linear_a8``: ``quantize_act_int8(rms_norm(x))`` in one kernel. x: (..., H) bf16/fp16."""
    return _norm_int8(x, None, weight, eps, backend, "rms_norm_int8")


def fused_add_rms_norm_int8(x, residual, weight, eps: float = 1e-6, *, backend: Optional[str] = None):
    """``residual <- x + residual`` (in place), returns ``quantize_act_int8(rms_norm(residual) * weight)`` as
    ``(q, scales, sums)``, one kernel."""
    check_tensor("residual", residual)
    return _norm_int8(x, residual, weight, eps, backend, "fused_add_rms_norm_int8")


@define_op("silu_and_mul_int8", mutates_args=("q", "scales", "sums"))
def _silu_int8_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor, backend: str) -> None:
    """x (M, 2I) rows; q (M, Ip), scales / sums (M, Ip // 128)."""
    from fastdecode.ops.activation import silu_and_mul, silu_and_mul_ref, silu_config

    I = x.shape[1] // 2
    cfg = silu_config(x.shape[0], I, False)  # column blocks: the groups are independent (kernels.activation)
    if x.shape[0] <= 64 and cfg["BLOCK"] >= 256:  # a few rows: blocks of two groups, one warp each (H100, session
        cfg = {"BLOCK": 256, "num_warps": 1}      # 25, 8B at M = 1: 2.11 us against 2.54 at 1024 x 4 warps)
    if backend == "triton" and cfg["BLOCK"] % 256 == 0:  # blocks that cover the 256-rounded row
        from fastdecode.constants import OUT_INT8_GROUPS
        from fastdecode.kernels.activation import launch_silu_and_mul

        launch_silu_and_mul(x, q, scales, OUT_INT8_GROUPS, cfg, pdl=pdl_enabled(x), sums=sums)
    elif backend == "triton":  # narrow rows (I < 256): SiLU-and-mul, then the quantisation
        _act_quant_op(silu_and_mul(x, backend=backend), q, scales, sums, backend)
    else:
        for t, v in zip((q, scales, sums), quantize_act_int8_ref(silu_and_mul_ref(x))):
            t.copy_(v)


@_silu_int8_op.register_fake
def _(x, q, scales, sums, backend):
    return None


def silu_and_mul_int8(x, *, backend: Optional[str] = None):
    """``silu_and_mul(x)`` (rounded to x.dtype) as an int8 activation ``(q, scales, sums)`` for
    ``int4_linear_a8``: one kernel. x: (..., 2I) bf16/fp16 ``[gate | up]``."""
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., 2*I) = [gate | up] with an even last dimension, got shape {tuple(x.shape)}")
    be = resolve_backend(backend, x.device, "silu_and_mul_int8")
    act = _act_buffers(x.shape[:-1], x.shape[-1] // 2, x.device)
    x2 = as_rows("x", x)
    if x2.shape[0] and x.shape[-1]:
        _silu_int8_op(x2, *_rows(act), be)
    return act


@define_op("rope_decode_attention_int8", mutates_args=("k_cache", "v_cache", "q", "scales", "sums"))
def _rope_attention_int8_op(qkv: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor,
                            n_q_heads: int, scale: float, num_splits: int, prefetch: Optional[torch.Tensor],
                            backend: str) -> None:
    """qkv (B, (Hq + 2 Hkv) * 128) rows; q (B, Kp), scales / sums (B, Kp // 128); caches written in place."""
    from fastdecode.ops.attention import _split_buffers, decode_attention_config, rope_decode_attention_ref

    B, Hq = qkv.shape[0], n_q_heads
    if Kp_pad := q.shape[1] - Hq * ACT_GROUP:  # an odd head count: the 256-rounded row's last group is padding
        q[:, -Kp_pad:].zero_()
        scales[:, Hq:].fill_(INT8_MIN_SCALE)  # as quantize_act_int8 leaves an all-zero group
        sums[:, Hq:].zero_()
    if backend == "triton":
        from fastdecode.kernels.attention import launch_rope_decode_attention

        Hkv, T = k_cache.shape[1], k_cache.shape[2]
        cfg = decode_attention_config(B, Hq, Hkv, T, ACT_GROUP, qkv.dtype, qkv.device, num_splits or None)
        o_part, lse = _split_buffers(B, Hq, cfg, qkv)
        launch_rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, None, o_part, lse, Hq, scale, cfg,
                                     pdl=pdl_enabled(qkv), int8_out=(q, scales, sums),
                                     prefetch=l2_prefetch_bytes(prefetch))
        return
    o = rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, Hq, scale).reshape(B, -1)
    for t, v in zip((q, scales, sums), quantize_act_int8_ref(o)):
        t.copy_(v)


@_rope_attention_int8_op.register_fake
def _(qkv, rope, input_pos, k_cache, v_cache, q, scales, sums, n_q_heads, scale, num_splits, prefetch, backend):
    return None


def rope_decode_attention_int8(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int, scale: Optional[float] = None,
                               *, num_splits: Optional[int] = None, prefetch: Optional[torch.Tensor] = None,
                               backend: Optional[str] = None):
    """``ops.attention.rope_decode_attention`` (rounded to qkv's dtype) as wo's int8 activation ``(q, scales, sums)``
    for ``int4_linear_a8``: ``quantize_act_int8(attention.reshape(B, Hq * 128))`` in the attention kernel itself (or
    its split merge), each head one group of 128 columns. Arguments as ``rope_decode_attention``; head_dim 128 and
    qkv bf16 / fp16. Returns q int8 (B, Kp), scales fp32 and sums int32 (B, Kp // 128), Kp = Hq * 128 rounded up
    to 256 (the padding group 0). ``prefetch``: as ``rope_decode_attention``'s (wo's packed weight)."""
    from fastdecode.ops.attention import _check_fused_args

    check_tensor("qkv", qkv, dtypes=(torch.bfloat16, torch.float16))
    B, D, scale = _check_fused_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale, num_splits, prefetch)
    if D != ACT_GROUP:
        raise ValueError(f"an int8 attention output needs head_dim {ACT_GROUP} (one group a head), got {D}")
    be = resolve_backend(backend, qkv.device, "rope_decode_attention_int8")
    act = _act_buffers((B,), n_q_heads * D, qkv.device)
    if B > 0:
        _rope_attention_int8_op(qkv, rope, input_pos, k_cache, v_cache, *act, n_q_heads, scale, num_splits or 0,
                                prefetch, be)
    return act


# ----------------------------------------------------------------------------- references


def quantize_act_int8_ref(x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_act_int8` on 2-D x (M, K): fp32 maths, ``torch.round`` (half to even)."""
    M, K = x.shape
    Kp = packed_cols(K) * 8
    xp = torch.zeros(M, Kp, dtype=torch.float32, device=x.device)
    xp[:, :K] = x.float()
    g = xp.view(M, Kp // ACT_GROUP, ACT_GROUP)
    nan = torch.isnan(g).any(-1)
    s = (g.abs().nan_to_num(nan=0.0).amax(-1) / 127.0).clamp(min=1e-30)
    v = g / s.unsqueeze(-1)
    q = torch.round(v).clamp(-127, 127).nan_to_num(nan=0.0)
    sums = q.sum(-1).to(torch.int32)
    s = torch.where(nan, torch.full_like(s, float("nan")), s)
    # natural (group, p, j) -> kernel byte order (group, j, b) with byte b holding p = _P[b]
    qk = q.view(M, Kp // ACT_GROUP, 4, 32)[:, :, list(_P), :].transpose(2, 3).reshape(M, Kp)
    return qk.to(torch.int8), s, sums


def dequantize_act_int8(q, scales, K: int) -> torch.Tensor:
    """fp32 (M, K) in the natural column order from ``quantize_act_int8``'s q and scales."""
    M, Kp = q.shape
    nat = q.view(M, Kp // ACT_GROUP, 32, 4)[..., list(_P)].transpose(2, 3).reshape(M, Kp // ACT_GROUP, ACT_GROUP)
    return (nat.float() * scales.unsqueeze(-1)).reshape(M, Kp)[:, :K]


def _a8_matmul_ref(q, scales_x, w: Int4Weight, bias, out_dtype) -> torch.Tensor:
    y = dequantize_act_int8(q, scales_x, w.K) @ dequantize_int4(w, torch.float32, kernel_order=True).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int4_linear_a8_ref(x, packed: Int4Weight, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Reference of :func:`int4_linear_a8`: the reference quantisation of x (a tensor; or an int8 activation
    ``(q, scales, sums)``, then ``out_dtype``), dequantised, times the fp32 dequantised weight; one rounding."""
    if isinstance(x, torch.Tensor):
        x2 = x.reshape(-1, x.shape[-1])
        if packed.perm is not None:
            x2 = x2.index_select(1, packed.perm)
        q, s, _ = quantize_act_int8_ref(x2)
        return _a8_matmul_ref(q, s, packed, bias, x.dtype).reshape(*x.shape[:-1], packed.N)
    q, s, _ = x
    y = _a8_matmul_ref(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]), packed, bias, out_dtype)
    return y.reshape(*q.shape[:-1], packed.N)


def rms_norm_int8_ref(x, weight, eps: float = 1e-6):
    """Reference of :func:`rms_norm_int8`: ``quantize_act_int8_ref(rms_norm_ref(x))`` (leading dims kept)."""
    from fastdecode.ops.norm import rms_norm_ref

    return _act_ref(rms_norm_ref(x, weight, eps))


def fused_add_rms_norm_int8_ref(x, residual, weight, eps: float = 1e-6):
    """Reference of :func:`fused_add_rms_norm_int8`: returns ``((q, scales, sums), new_residual)``."""
    from fastdecode.ops.norm import fused_add_rms_norm_ref

    y, r = fused_add_rms_norm_ref(x, residual, weight, eps)
    return _act_ref(y), r


def silu_and_mul_int8_ref(x):
    """Reference of :func:`silu_and_mul_int8`."""
    from fastdecode.ops.activation import silu_and_mul_ref

    return _act_ref(silu_and_mul_ref(x))


def rope_decode_attention_int8_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int,
                                   scale: Optional[float] = None):
    """Reference of :func:`rope_decode_attention_int8` (writes the caches in place)."""
    from fastdecode.ops.attention import rope_decode_attention_ref

    o = rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale)
    return _act_ref(o.reshape(qkv.shape[0], -1))


def _act_ref(y):
    q, s, sums = quantize_act_int8_ref(y.reshape(-1, y.shape[-1]))
    lead = y.shape[:-1]
    return q.reshape(*lead, -1), s.reshape(*lead, -1), sums.reshape(*lead, -1)


__all__ = ["ACT_GROUP", "DECODE_MAX_M", "MAX_M", "dequantize_act_int8", "fused_add_rms_norm_int8",
           "fused_add_rms_norm_int8_ref", "get_a8_config", "int4_linear_a8", "int4_linear_a8_ref", "quantize_act_int8",
           "quantize_act_int8_ref", "rms_norm_int8", "rms_norm_int8_ref", "rope_decode_attention_int8",
           "rope_decode_attention_int8_ref", "silu_and_mul_int8", "silu_and_mul_int8_ref", "supports"]
