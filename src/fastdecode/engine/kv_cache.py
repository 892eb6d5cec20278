"""Static KV cache: one allocation per engine, reused by prefill, decode and every captured graph."""

from __future__ import annotations

import torch

from fastdecode.models.config import ModelConfig


class KVCache:
    """K and V of every layer: ``k``, ``v`` of shape [L, B_max, Hkv, T, D].

    ``k[i]`` is layer i's [B_max, Hkv, T, D] view (what the model indexes). Row b holds sequence b of
    the running batch; positions >= its length hold stale values that attention never reads.
    """

    def __init__(self, cfg: ModelConfig, max_batch: int, max_seq_len: int, *, dtype=torch.bfloat16, device=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        shape = (cfg.n_layers, max_batch, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_read(self, seq_lens) -> int:
        """Bytes one decode step reads from the cache for sequences of these lengths (all layers, K and V)."""
        L, _, Hkv, _, D = self.k.shape
        return 2 * L * Hkv * D * self.k.element_size() * int(sum(int(s) for s in seq_lens))
