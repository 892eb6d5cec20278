"""Chunked prefill: a prompt fed to the model in pieces, each piece attending to the KV cache the earlier pieces
wrote, so a long prompt is processed in several short forward passes (a server interleaves them with decode
steps of other sequences: ``fastdecode.engine.batching``).

``prefill_chunk(model, tokens, start, cache)`` runs tokens [B, C] at positions ``start .. start + C - 1``:
RoPE at those positions, K and V written to ``cache.k[i][:B, :, start:start + C]``, and attention of each new
token ``start + j`` over the cached positions ``0 .. start + j`` (everything before the chunk, causal inside it).
``start = 0`` with the whole prompt is ``Transformer.prefill``. This is the plain-PyTorch path (SDPA with an
explicit mask), run outside any CUDA graph like ``Transformer.prefill``; it uses the same modules (norms,
projections, feed-forward) and so the same quantised / tensor-parallel variants.

The cache is anything with ``k``, ``v`` of shape [L, B, Hkv, T, D]: an ``engine.kv_cache.KVCache`` or a view of
some of its rows (``KVCache.rows``), whose writes land in the real cache.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fastdecode.models.llama import Attention, Transformer, _lead


def attention_chunk(attn: Attention, x, cs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    start: int, backend: str):
    """x: [B, C, dim] (or an FP8 pair) at positions start..start+C-1, cs: their RoPE rows [B, C, D/2, 2].
    Writes k/v_cache[:B, :, start:start+C]; each query attends to cached positions <= its own. -> [B, C, dim]."""
    B, C = _lead(x)
    end = start + C
    q, k, v = attn._qkv(x, cs, backend)
    q = q.transpose(1, 2)  # [B, Hq, C, D]
    k_cache[:B, :, start:end] = k.transpose(1, 2)
    v_cache[:B, :, start:end] = v.transpose(1, 2)
    keys, values = k_cache[:B, :, :end], v_cache[:B, :, :end]  # [B, Hkv, end, D]
    # query j (position start + j) sees key t iff t <= start + j
    mask = torch.arange(end, device=q.device)[None, :] <= (start + torch.arange(C, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale,
                                       enable_gqa=attn.n_heads != attn.n_kv_heads)
    return attn.wo(o.transpose(1, 2).reshape(B, C, -1), backend)


@torch.no_grad()
def prefill_chunk(model: Transformer, tokens: torch.Tensor, start: int, cache,
                  last_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """tokens: [B, C] at positions start..start+C-1 of cache rows [:B], whose positions [0, start) hold the
    earlier chunks. Returns fp32 logits [B, C, V], or [B, V] at ``last_idx`` ([B], index inside the chunk)."""
    B, C = tokens.shape
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an integer >= 0, got {start!r}")
    if C < 1:
        raise ValueError(f"a chunk needs at least one token, got tokens of shape {tuple(tokens.shape)}")
    T = cache.k.shape[3]
    if start + C > min(T, model.rope_len):
        raise ValueError(f"chunk at positions [{start}, {start + C}) runs past the KV cache ({T} positions) or the "
                         f"RoPE table ({model.rope_len})")
    if B > cache.k.shape[1]:
        raise ValueError(f"batch of {B} rows exceeds the cache's {cache.k.shape[1]}")
    be = model.backend
    cs = model.rope[start:start + C].unsqueeze(0).expand(B, C, *model.rope.shape[1:])  # [B, C, D/2, 2]
    residual = model._embed(tokens)  # [B, C, dim]
    x = model.layers[0].attention_norm(residual, be)
    for i, layer in enumerate(model.layers):
        if i > 0:
            x, residual = layer.attention_norm.add_forward(x, residual, be)
        x = attention_chunk(layer.attention, x, cs, cache.k[i], cache.v[i], start, be)
        x, residual = layer.ffn_norm.add_forward(x, residual, be)
        x = layer.feed_forward(x, be)
    if model.norm.comm is not None:  # as Transformer.prefill: a TP partial sum, all-reduced with the add + norm
        h, _ = model.norm.add_forward(x, residual, be)
        head = model._head
    else:
        h = x + residual
        head = model._logits
    if last_idx is not None:
        rows = (torch.arange(B, device=last_idx.device), last_idx)
        h = tuple(t[rows] for t in h) if isinstance(h, tuple) else h[rows]
    return head(h)
