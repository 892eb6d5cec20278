"""Per-head q / k RMSNorm (Qwen3): each query and key head normalised over its ``head_dim`` values, with one
weight [D] for all q heads and one for all k heads, after the projection and before RoPE (as transformers'
``Qwen3Attention``: ``q_norm(q_proj(x).view(..., D))``).

Prefill normalises the [B, S, H, D] heads it has already split (``Attention._qkv``); decode normalises the q and k
parts of the fused ``wqkv`` rows here, before ``rope_kv_write`` (which rotates q and k and writes the cache) sees
them. Two ``rms_norm`` calls on the heads gathered into rows and a concatenation: correct first; folding the norm
into the ``rope_kv_write`` kernel would save those launches (and the copies) per layer.
"""

from __future__ import annotations

import torch


def norm_heads(norm, x: torch.Tensor, backend: str) -> torch.Tensor:
    """x [..., H, D] (heads, possibly a strided slice of the fused projection) -> ``norm`` over each head's D values,
    a new contiguous tensor of x's shape. The heads are gathered into rows [N, D] first (a copy when they are not
    already rows), a reshape that ``torch.compile`` traces (the ops' own strided-view fallback does not)."""
    return norm(x.reshape(-1, x.shape[-1]), backend).view(x.shape)


def norm_qk_rows(qkv: torch.Tensor, q_norm, k_norm, n_heads: int, n_kv_heads: int, backend: str) -> torch.Tensor:
    """qkv [B, (Hq + 2 Hkv) * D] (q | k | v) -> the same layout with every q head RMS-normed by ``q_norm`` and every
    k head by ``k_norm`` (``RMSNorm`` modules of dim D, called as ``norm(x, backend)``); v unchanged."""
    B, D = qkv.shape[0], q_norm.weight.shape[0]
    x = qkv.view(B, -1, D)  # [B, Hq + 2 Hkv, D]
    q = norm_heads(q_norm, x[:, :n_heads], backend)  # [B, Hq, D]
    k = norm_heads(k_norm, x[:, n_heads:n_heads + n_kv_heads], backend)  # [B, Hkv, D]
    return torch.cat([q, k, x[:, n_heads + n_kv_heads:]], dim=1).view(B, -1)
