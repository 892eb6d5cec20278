"""What one decode step reads from a model's weights: the bytes of ``Transformer.weight_bytes`` /
``decode_step_bytes`` and of the benchmarks' peers (``fastdecode.bench``), counted once per tensor."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def unique_param_bytes(params, seen: Optional[set] = None) -> int:
    """Bytes of ``params``, each tensor counted once; ``seen``: ids of tensors already counted (updated)."""
    seen = set() if seen is None else seen
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def step_read_bytes(weight_bytes: int, embedding: torch.Tensor, head: nn.Module, batch: int) -> int:
    """Bytes one decode step of ``batch`` sequences reads out of a model's ``weight_bytes``: all of them,
    except that an embedding table the head does not share adds only ``batch`` of its rows (a head tied to
    the table reads it whole; the lookups then add nothing)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if getattr(head, "weight", None) is embedding:
        return weight_bytes
    rows = min(batch, embedding.shape[0])  # under TP a token outside this rank's range reads row 0
    return weight_bytes + (rows - embedding.shape[0]) * embedding.shape[1] * embedding.element_size()


__all__ = ["step_read_bytes", "unique_param_bytes"]
