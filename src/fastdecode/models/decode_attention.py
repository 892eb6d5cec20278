"""The decode step's attention after the ``wqkv`` projection: RoPE of q and k at each sequence's new position, the
KV-cache write there, and attention over positions ``0..input_pos`` (``Attention.decode`` in ``llama.py``).

``fused_rope`` (the default): one kernel does all three (``ops.attention.rope_decode_attention``; plus the merge
kernel under split-KV). With ``int8`` (the ``int4_a8`` switch on a W4A8 ``wo``) that kernel emits wo's int8
activation itself (``ops.int4_a8.rope_decode_attention_int8``). Off (ablation): ``rope_kv_write``, then
``decode_attention`` over ``seq_lens``. The ``"ref"`` backend calls the plain-PyTorch references of the same ops, for
``torch.compile``.

``l2_prefetch`` (opt-in, ``Attention.attend``): the fused kernel also prefetches wo's weight (``wo_prefetch``) into L2
while the qkv GEMV drains and the attention itself leaves the memory bus idle (``fastdecode.kernels.prefetch``).

``attn_wo`` (opt-in; ``models.norm_gemm``'s path): ``attend_add_wo`` takes wo and its residual add into the same
kernel (``ops.attention_wo``), where wo is dense or W4A16 int4 (``wo_fusable``) and one split serves the cache.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.models.int4 import Int4Linear
from fastdecode.models.qk_norm import norm_qk_rows
from fastdecode.ops.attention import (
    decode_attention, decode_attention_ref, rope_decode_attention, rope_decode_attention_ref, rope_kv_write,
    rope_kv_write_ref,
)
from fastdecode.ops.attention_wo import rope_attention_add_linear_
from fastdecode.ops.int4_a8 import rope_decode_attention_int8, rope_decode_attention_int8_ref


def wo_prefetch(wo, limit: Optional[int] = None) -> torch.Tensor:
    """The bytes of ``wo``'s weight that the attention kernel prefetches into L2 (the ``l2_prefetch`` switch,
    ``fastdecode.kernels.prefetch``): a uint8 view of the dense or FP8 weight, or of an ``Int4Linear``'s packed words
    (its scales are small), whole or its first ``limit`` bytes (rounded down to 16)."""
    w = wo.qweight if hasattr(wo, "qweight") else wo.weight
    w = w.reshape(-1).view(torch.uint8)
    return w if limit is None or limit >= w.numel() else w[:max(16, limit // 16 * 16)]


def decode_attend(qkv: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, seq_lens: Optional[torch.Tensor], n_heads: int, scale: float, fused: bool,
                  backend: str, int8: bool = False, prefetch: Optional[torch.Tensor] = None):
    """qkv [B, (Hq + 2 Hkv) * D] -> attention output [B, Hq, D]; writes k / v at input_pos. seq_lens [B] int32
    (= input_pos + 1) is read only when not ``fused``, and computed here when None. ``int8`` (with ``fused``): the
    output as an int8 activation ``(q, scales, sums)`` of B rows instead. ``prefetch`` (with ``fused``; a hint): the
    next projection's weight bytes, which the attention kernel prefetches into L2 (``kernels.prefetch``)."""
    if fused and int8:
        if backend == "ref":
            return rope_decode_attention_int8_ref(qkv, rope, input_pos, k_cache, v_cache, n_heads, scale)
        return rope_decode_attention_int8(qkv, rope, input_pos, k_cache, v_cache, n_heads, scale, prefetch=prefetch,
                                          backend=backend)
    if fused:
        if backend == "ref":
            return rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, n_heads, scale)
        return rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, n_heads, scale, prefetch=prefetch,
                                     backend=backend)
    if seq_lens is None:
        seq_lens = (input_pos + 1).to(torch.int32)
    if backend == "ref":
        q = rope_kv_write_ref(qkv, rope, input_pos, k_cache, v_cache, n_heads)
        return decode_attention_ref(q, k_cache, v_cache, seq_lens, scale)
    q = rope_kv_write(qkv, rope, input_pos, k_cache, v_cache, n_heads, backend=backend)
    return decode_attention(q, k_cache, v_cache, seq_lens, scale, backend=backend)


def wo_weight(attn):
    """What ``attend_add_wo`` passes as wo's weight: a dense ``Linear``'s tensor, an ``Int4Linear``'s packed weight."""
    return attn.wo.packed if isinstance(attn.wo, Int4Linear) else attn.wo.weight


def wo_fusable(attn) -> bool:
    """Whether ``attend_add_wo`` serves the block's ``attn`` (where ``ops.attention_wo.applies`` to the step's batch
    and cache): RoPE fused into the attention (``fused_rope``), and wo dense (``Linear``) or W4A16 int4 on the int4
    kernels (``Int4Linear`` without act-order, not W4A8, ``int4_gemm`` on); an FP8 wo keeps its own kernel."""
    from fastdecode.models.llama import Linear

    wo = attn.wo
    int4 = isinstance(wo, Int4Linear) and wo.perm is None and not wo.act_int8 and wo.impl is None
    return attn.fused_rope and (type(wo) is Linear or int4)


def attend_add_wo(attn, h: torch.Tensor, qkv: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, input_pos: torch.Tensor, backend: str) -> None:
    """``h += wo(attn.attend(qkv, ...))`` in one kernel (``ops.attention_wo``): h [B, 1, dim] (the residual stream,
    contiguous), qkv [B, 1, (Hq + 2 Hkv) * D]; writes k / v at input_pos. Where ``wo_fusable``."""
    B = qkv.shape[0]
    qkv = qkv.view(B, -1)
    if attn.q_norm is not None:
        qkv = norm_qk_rows(qkv, attn.q_norm, attn.k_norm, attn.n_heads, attn.n_kv_heads, backend)
    rope_attention_add_linear_(h.view(B, -1), qkv, rope, input_pos, k_cache[:B], v_cache[:B], wo_weight(attn),
                               attn.wo.bias, n_q_heads=attn.n_heads, scale=attn.scale, backend=backend)
