"""Static KV cache: one allocation per engine, reused by prefill, decode and every captured graph."""

from __future__ import annotations

import os
from typing import Optional

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

    def rows(self, start: int, n: int = 1) -> "KVCacheRows":
        """A view of rows [start, start + n) (what prefill into one serving slot writes through)."""
        if not (0 <= start and n >= 1 and start + n <= self.max_batch):
            raise ValueError(f"rows [{start}, {start + n}) are outside the cache's {self.max_batch} rows")
        return KVCacheRows(self.k[:, start:start + n], self.v[:, start:start + n])

    def bytes_read(self, seq_lens) -> int:
        """Bytes one decode step reads from the cache for sequences of these lengths (all layers, K and V)."""
        L, _, Hkv, _, D = self.k.shape
        return 2 * L * Hkv * D * self.k.element_size() * int(sum(int(s) for s in seq_lens))


class KVCacheRows:
    """Some rows of a ``KVCache``: ``k``, ``v`` are views [L, n, Hkv, T, D], so writes land in the cache."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.max_batch, self.max_seq_len = k.shape[1], k.shape[3]


class KVCacheMemoryError(ValueError):
    """The KV cache asked for would not fit in the device's available memory."""


def kv_cache_bytes(cfg: ModelConfig, max_batch: int, max_seq_len: int, dtype=torch.bfloat16) -> int:
    """Bytes of a ``KVCache``: layers x 2 (K, V) x KV heads x head dim x positions x batch x dtype bytes."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * max_seq_len * max_batch * dtype.itemsize


def available_memory(device) -> Optional[int]:
    """Bytes free for new tensors on ``device``: CUDA ``mem_get_info``'s free; the CPU's MemAvailable (from
    /proc/meminfo, else free physical pages); None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)" if n >= 2**30 else f"{n / 2**20:.1f} MiB ({n:,} bytes)"


def check_kv_memory(cfg: ModelConfig, max_batch: int, max_seq_len: int, dtype, device, *,
                    fix: str = "lower --max-seq-len (max_seq_len)", group=None) -> int:
    """The KV cache's bytes; raises ``KVCacheMemoryError`` (naming the bytes needed and available, and ``fix``:
    what the caller's user can lower) before anything is allocated when they exceed ``available_memory(device)``.

    ``group``: a tensor-parallel process group whose ranks all check (a collective): a rank short of memory then
    stops every rank (``engine.tp.agree``: ``TPLoadError`` naming it) instead of leaving the others at the next
    collective."""
    need = kv_cache_bytes(cfg, max_batch, max_seq_len, dtype)
    have = available_memory(device)
    err = None
    if have is not None and need > have:
        err = (f"the KV cache needs {_size(need)}: {cfg.n_layers} layers x 2 (K, V) x {cfg.n_kv_heads} KV heads x "
               f"{cfg.head_dim} head dim x {max_seq_len} positions x batch {max_batch} x {dtype.itemsize} bytes, but "
               f"only {_size(have)} is available on {torch.device(device)}; {fix}")
    if group is not None:
        from fastdecode.engine.tp import agree

        agree(None if err is None else f"KVCacheMemoryError: {err}", group)
    if err is not None:
        raise KVCacheMemoryError(err)
    return need
