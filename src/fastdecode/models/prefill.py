"""Chunked prefill: a prompt fed to the model in pieces, each piece attending to the KV cache the earlier pieces
wrote, so a long prompt is processed in several short forward passes (a server interleaves them with decode
steps of other sequences: ``fastdecode.engine.batching``).

``prefill_chunk(model, tokens, start, cache)`` runs tokens [B, C] at positions ``start .. start + C - 1``:
RoPE at those positions, K and V written to ``cache.k[i][:B, :, start:start + C]``, and attention of each new
token ``start + j`` over the cached positions ``0 .. start + j`` (everything before the chunk, causal inside it).
``start = 0`` with the whole prompt is ``Transformer.prefill``; the pass is ``prefill_rows``' with every row alike.
This is the plain-PyTorch path (SDPA with an explicit mask), run outside any CUDA graph like
``Transformer.prefill``; it uses the same modules (norms, projections, feed-forward) and so the same quantised /
tensor-parallel variants.

The cache is anything with ``k``, ``v`` of shape [L, B, Hkv, T, D]: an ``engine.kv_cache.KVCache`` or a view of
some of its rows (``KVCache.rows``), whose writes land in the real cache.

``prefill_rows(model, tokens, starts, lens, slots, cache)`` runs chunks of several sequences in one forward pass:
row r holds ``lens[r]`` tokens (right-padded to the longest) at positions ``starts[r] ..`` of cache row
``slots[r]``. Only the real tokens' K and V are written; the padding computes values nobody reads. It returns the
logits at each row's last real token: a server prefills the prompts that arrived together in one pass of the
model's ~10 kernels a layer instead of one pass each (``engine.batching``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fastdecode.models.llama import Attention, Transformer, _lead


class _RowsPlan:
    """Index tensors of one ``prefill_rows`` pass, made once on the host and shared by every layer, so that the
    layers run without a host sync: boolean indexing of a device tensor (its ``nonzero``) and ``int(t.max())``
    each wait for the GPU, and five of them a layer left the pass's launches unpipelined (every layer waited for the
    one before it, then the host queued its ops one by one).

    ``tok_r, tok_j``: row and column of every real token in the chunk; ``cache_row, cache_pos``: where its K / V go;
    ``end``: one past the last position any row reads; ``live`` [R, 1, end, 1]: the cached keys of each row's own
    sequence (the rest zeroed); ``mask`` [R, 1, C, end]: query j of row r sees positions <= its own."""

    def __init__(self, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, C: int, rope_len: int, dev):
        j = torch.arange(C)
        valid = j[None, :] < lens[:, None]  # host tensors: their nonzero costs no sync
        tok_r, tok_j = valid.nonzero(as_tuple=True)
        pos = (starts[:, None] + j[None, :]).clamp(max=rope_len - 1)  # padding: any row of the RoPE table
        self.end = int((starts + lens).max())
        t = torch.arange(self.end)
        self.pos = pos.to(dev)
        self.tok_r, self.tok_j = tok_r.to(dev), tok_j.to(dev)
        self.cache_row, self.cache_pos = slots[tok_r].to(dev), pos[tok_r, tok_j].to(dev)
        self.slots = slots.to(dev)
        self.live = (t[None, :] < (starts + lens)[:, None])[:, None, :, None].to(dev)
        self.mask = (t[None, None, :] <= pos[:, :, None])[:, None].to(dev)


def attention_rows(attn: Attention, x, cs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: _RowsPlan, backend: str):
    """x: [R, C, dim] (or an FP8 pair); row r's token j at position ``plan.pos[r, j]`` of cache row
    ``plan.slots[r]``; cs: the RoPE rows of those positions. Writes the real tokens' k / v, then each query attends
    to the cached positions <= its own in its row. -> [R, C, dim]. No host sync (``_RowsPlan``)."""
    R, C = _lead(x)
    q, k, v = attn._qkv(x, cs, backend)
    k_cache[plan.cache_row, :, plan.cache_pos] = k[plan.tok_r, plan.tok_j]  # [N real tokens, Hkv, D]
    v_cache[plan.cache_row, :, plan.cache_pos] = v[plan.tok_r, plan.tok_j]
    # the rows' keys up to the longest row's end (copies); past a row's own end the cache holds another request's
    # leftovers (even NaN): zeroed, as masked keys are still multiplied (NaN * 0 is NaN)
    keys = torch.where(plan.live, k_cache[plan.slots, :, :plan.end], 0)
    values = torch.where(plan.live, v_cache[plan.slots, :, :plan.end], 0)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=plan.mask, scale=attn.scale,
                                       enable_gqa=attn.n_heads != attn.n_kv_heads)
    return attn.wo(o.transpose(1, 2).reshape(R, C, -1), backend)


def _blocks(model: Transformer, tokens: torch.Tensor, attend) -> tuple:
    """The layers over tokens [B, C]: ``attend(layer index, attention, x)`` is the attention with its cache writes;
    returns ``(h, head)``: the last hidden states and the head that takes them (the final norm inside, or done)."""
    be = model.backend
    residual = model._embed(tokens)  # [B, C, dim]
    x = model.layers[0].attention_norm(residual, be)
    for i, layer in enumerate(model.layers):
        if i > 0:
            x, residual = layer.attention_norm.add_forward(x, residual, be)
        x = attend(i, layer.attention, x)
        x, residual = layer.ffn_norm.add_forward(x, residual, be)
        x = layer.feed_forward(x, be)
    if model.norm.comm is not None:  # as Transformer.prefill: a TP partial sum, all-reduced with the add + norm
        h, _ = model.norm.add_forward(x, residual, be)
        return h, model._head
    return x + residual, model._logits


def _take_rows(h, rows):
    return tuple(t[rows] for t in h) if isinstance(h, tuple) else h[rows]


@torch.no_grad()
def prefill_rows(model: Transformer, tokens: torch.Tensor, starts, lens, slots, cache) -> torch.Tensor:
    """tokens: [R, C], row r's first ``lens[r]`` real (the rest padding), at positions ``starts[r] ..`` of cache row
    ``slots[r]`` (distinct), whose positions [0, starts[r]) hold that sequence's earlier chunks. Returns fp32
    logits [R, V] at each row's last real token."""
    R, C = tokens.shape
    dev = tokens.device
    starts, lens, slots = (torch.as_tensor(v, dtype=torch.long).reshape(-1).cpu() for v in (starts, lens, slots))
    if not len(starts) == len(lens) == len(slots) == R:
        raise ValueError(f"starts, lens and slots need one entry per row of tokens ({R}), got {len(starts)}, "
                         f"{len(lens)}, {len(slots)}")
    if R == 0 or C < 1 or (lens < 1).any() or (lens > C).any() or (starts < 0).any():
        raise ValueError(f"every row needs 1..{C} real tokens at a position >= 0; got lens {lens.tolist()}, "
                         f"starts {starts.tolist()}")
    T = cache.k.shape[3]
    if int((starts + lens).max()) > min(T, model.rope_len):
        raise ValueError(f"a chunk runs past the KV cache ({T} positions) or the RoPE table ({model.rope_len})")
    if len(set(slots.tolist())) < R or int(slots.min()) < 0 or int(slots.max()) >= cache.k.shape[1]:
        raise ValueError(f"slots must be distinct rows of the cache's {cache.k.shape[1]}, got {slots.tolist()}")
    h, head = _rows_pass(model, tokens, starts, lens, slots, cache)
    return head(_take_rows(h, (torch.arange(R, device=dev), (lens - 1).to(dev))))


def _rows_pass(model: Transformer, tokens: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
               slots: torch.Tensor, cache) -> tuple:
    """The layers over checked rows (``prefill_rows``' arguments as CPU int64 tensors) -> ``_blocks``' (h, head)."""
    plan = _RowsPlan(starts, lens, slots, tokens.shape[1], model.rope_len, tokens.device)
    cs = model.rope[plan.pos]  # [R, C, D/2, 2]
    return _blocks(model, tokens, lambda i, attn, x: attention_rows(
        attn, x, cs, cache.k[i], cache.v[i], plan, model.backend))


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
    # the rows [:B] of the cache, each chunk C long at the same start: prefill_rows' pass without padding
    h, head = _rows_pass(model, tokens, torch.full((B,), start), torch.full((B,), C), torch.arange(B), cache)
    if last_idx is not None:
        h = _take_rows(h, (torch.arange(B, device=last_idx.device), last_idx))
    return head(h)
