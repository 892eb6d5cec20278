"""Rotary position embeddings of the Llama family: the inverse frequencies (Llama 3.1 / linear scaling, GGUF
``rope_freqs`` divisors), the (cos, sin) table the model keeps as a buffer, and the half-split rotation that
prefill applies. Plain PyTorch; decode rotates inside ``fastdecode.ops.attention``'s ``rope_kv_write`` from the
same table.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fastdecode.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, freq_factors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse frequencies [D/2] in float64, with Llama 3.1 / linear scaling or GGUF ``rope_freqs`` divisors."""
    D = cfg.head_dim
    # on the CPU in float64 whatever the default device (models are built under torch.device("meta"))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64, device="cpu") / D))
    if freq_factors is not None:
        return inv / freq_factors.to("cpu", torch.float64)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.type == "linear":
        return inv / rs.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a linear blend in between
    wavelen = 2 * math.pi / inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * inv / rs.factor + smooth * inv
    out = torch.where(wavelen > low_wl, inv / rs.factor, inv)
    return torch.where((wavelen >= high_wl) & (wavelen <= low_wl), blended, out)


def rope_cache(cfg: ModelConfig, max_seq_len: int, freq_factors=None, device=None) -> torch.Tensor:
    """[T, D/2, 2] float32 table of (cos, sin) per position and frequency."""
    inv = rope_inv_freq(cfg, freq_factors)
    t = torch.arange(max_seq_len, dtype=torch.float64, device="cpu")
    ang = torch.outer(t, inv)  # [T, D/2]
    return torch.stack([ang.cos(), ang.sin()], dim=-1).to(device=device, dtype=torch.float32)


def apply_rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Half-split (HF / NeoX) rotation. x: [B, S, H, D]; cs: [B, S, D/2, 2] fp32 -> [B, S, H, D] in x.dtype."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    cos, sin = cs[..., 0].unsqueeze(2), cs[..., 1].unsqueeze(2)  # [B, S, 1, D/2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
