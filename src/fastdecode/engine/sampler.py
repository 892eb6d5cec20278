"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded;
no host syncs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fastdecode.ops.argmax import argmax


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy (argmax). ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` switch those
    filters off; ``min_p`` drops tokens less likely than ``min_p`` times the most likely one (after temperature).
    ``repetition_penalty`` (1 is off; the CTRL / Hugging Face rule) divides the positive logits of every token
    already seen (prompt or output) by it and multiplies the negative ones, before everything else.

    ``seed`` makes sampling reproducible (a generator on the logits' device); None draws from the global RNG.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a float >= 0 (0 is greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 is off), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 is off), got {self.min_p!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite float > 0 (1 is off), got "
                             f"{self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Holds the RNG of one generation; ``sampler(logits [B, V], seen) -> tokens [B]`` (int64, same device).

    ``seen``: [B, V] bool, the tokens each row has seen (prompt and output), for the repetition penalty (needed
    when ``params.repetition_penalty != 1``; ``seen_mask`` builds it)."""

    def __init__(self, params: SamplingParams, device):
        self.params = params
        self.generator = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=torch.device(device)).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, seen: Optional[torch.Tensor] = None) -> torch.Tensor:
        p = self.params
        if p.repetition_penalty != 1:
            if seen is None:
                raise ValueError("repetition_penalty != 1 needs the tokens seen so far (seen=)")
            logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
        return sample(logits, p.temperature, p.top_k, p.top_p, self.generator, min_p=p.min_p)


def seen_mask(ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, V] bool: True at every token id of each row of ``ids`` (for ``apply_repetition_penalty``)."""
    seen = torch.zeros(len(ids), vocab_size, dtype=torch.bool)
    for b, row in enumerate(ids):
        seen[b, torch.tensor(row, dtype=torch.long)] = True
    return seen.to(device)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``l / penalty`` where ``l > 0`` and ``l * penalty`` elsewhere, on the tokens ``seen`` ([B, V] bool);
    a new tensor."""
    pen = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, pen, logits)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the smallest nucleus of mass >= top_p, then those
    whose probability is below ``min_p`` times the largest."""
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = _nucleus(logits, top_p)
    if min_p > 0:
        logits = _min_p(logits, math.log(min_p))
    return logits


def _nucleus(logits: torch.Tensor, top_p) -> torch.Tensor:
    """top-p of ``filter_logits`` (``top_p``: a float, or a [B, 1] tensor of each row's)."""
    # stable: tied logits keep their order, so the nucleus is the same whatever the other rows of a batch
    srt, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(srt, dim=-1)
    # drop a token when the tokens ranked above it already hold top_p (the first is always kept)
    srt = srt.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


def _min_p(logits: torch.Tensor, log_min_p) -> torch.Tensor:
    """min-p of ``filter_logits`` (``log_min_p``: a float, or a [B, 1] tensor of each row's)."""
    # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p) (the softmax's normaliser cancels)
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < top + log_min_p, float("-inf"))


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None, min_p: float = 0.0) -> torch.Tensor:
    """logits: [B, V] -> [B] int64. Draws with the exponential race ``argmax(p / E)``, E ~ Exp(1),
    which samples from p without ``multinomial`` (no host sync, CUDA-graph friendly). Both argmaxes are
    ``fastdecode.argmax`` on a GPU (torch's rule and result; torch's own reduction of one 128K row runs in
    one block, 27.7 us on the H200) and ``torch.argmax`` elsewhere."""
    if temperature == 0:
        return greedy_argmax(logits)
    logits = filter_logits(logits.float() / temperature, top_k, top_p, min_p)
    probs = torch.softmax(logits, dim=-1)
    e = torch.empty_like(probs).exponential_(generator=generator)
    return greedy_argmax(probs / e)


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
                seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [B, V] -> [B] int64, row b with its own ``params[b]`` and ``generators[b]``: the token ``sample`` gives
    that row alone (after ``apply_repetition_penalty`` where it has one), with the same draws from its generator,
    in one batched pass (the continuous batcher's rows; ~10 small ops a row before). ``seen`` [B, V] bool: the tokens
    each row has seen, read for the rows with a repetition penalty.

    Per-row parameters become columns of the batched ops: the penalty and temperature divide by a [B, 1] tensor (the
    same fp32 division as by the scalar), top-k keeps the values >= each row's k-th largest (``sort``, as ``topk``'s
    k-th value), top-p and min-p run on the rows that set them only (a row without them is not touched, as in
    ``filter_logits``). Each row's exponentials come from its own generator, [1, V] as a row sampled alone."""
    B, V = logits.shape
    dev = logits.device
    out = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return out
    pen = [float(p.repetition_penalty) for p in params]
    plain = [b for b, p in enumerate(params) if p.greedy and pen[b] == 1]
    if plain:
        idx = torch.tensor(plain, device=dev)
        out[idx] = greedy_argmax(logits[idx])
    rest = sorted(set(range(B)) - set(plain))
    if not rest:
        return out
    ridx = torch.tensor(rest, device=dev)
    x = logits[ridx]
    if any(pen[b] != 1 for b in rest):
        if seen is None:
            raise ValueError("a row with repetition_penalty != 1 needs the tokens seen so far (seen=)")
        pv = torch.tensor([pen[b] for b in rest], dtype=x.dtype, device=dev)[:, None]
        hit = seen[ridx] & (pv != 1)
        x = torch.where(hit, torch.where(x > 0, x / pv, x * pv), x)
    greedy = [i for i, b in enumerate(rest) if params[b].greedy]
    if greedy:
        gi = torch.tensor(greedy, device=dev)
        out[ridx[gi]] = greedy_argmax(x[gi])
    hot = [i for i, b in enumerate(rest) if not params[b].greedy]
    if not hot:
        return out
    ps = [params[rest[i]] for i in hot]
    hidx = torch.tensor(hot, device=dev)
    x = x[hidx].float() / torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in ps]
    if any(ks):
        srt = torch.sort(x, dim=-1, descending=True).values
        kth = srt.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    # top-p, then min-p, each on the rows that set it, with each row's value as a [R, 1] column
    for rows, step, value in (([i for i, p in enumerate(ps) if p.top_p < 1], _nucleus, lambda p: p.top_p),
                              ([i for i, p in enumerate(ps) if p.min_p > 0], _min_p, lambda p: math.log(p.min_p))):
        if rows:
            ri = torch.tensor(rows, device=dev)
            col = torch.tensor([value(ps[i]) for i in rows], dtype=torch.float32, device=dev)[:, None]
            x = x.index_copy(0, ri, step(x[ri], col))
    probs = torch.softmax(x, dim=-1)
    e = torch.cat([torch.empty(1, V, dtype=probs.dtype, device=dev).exponential_(generator=generators[rest[i]])
                   for i in hot])
    out[ridx[hidx]] = greedy_argmax(probs / e)
    return out


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: ``fastdecode.argmax`` on CUDA, ``torch.argmax`` elsewhere (the same result)."""
    if x.is_cuda:  # the backend from FASTDECODE_BACKEND (auto: the Triton kernels)
        return argmax(x)
    return torch.argmax(x, dim=-1)
