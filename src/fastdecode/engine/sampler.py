"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, seeded; no host syncs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy (argmax). ``top_k == 0`` and ``top_p == 1`` switch those filters off.

    ``seed`` makes sampling reproducible (a generator on the logits' device); None draws from the global RNG.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a float >= 0 (0 is greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 is off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Holds the RNG of one generation; ``sampler(logits [B, V]) -> tokens [B]`` (int64, same device)."""

    def __init__(self, params: SamplingParams, device):
        self.params = params
        self.generator = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=torch.device(device)).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        return sample(logits, p.temperature, p.top_k, p.top_p, self.generator)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the smallest nucleus of mass >= top_p."""
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(srt, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p (the first is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        srt = srt.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, srt)
    return logits


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits: [B, V] -> [B] int64. Draws with the exponential race ``argmax(p / E)``, E ~ Exp(1),
    which samples from p without ``multinomial`` (no host sync, CUDA-graph friendly)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    e = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / e, dim=-1)
