"""Sampling: greedy, temperature, top-k, top-p, seeds; checked against the exact distributions."""

import pytest
import torch

from fastdecode.engine.sampler import Sampler, SamplingParams, filter_logits, sample

N = 40000  # draws per distribution test: standard error of a frequency <= 0.0025


def _freqs(tokens, V):
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def test_greedy_is_argmax():
    logits = torch.randn(7, 1000)
    assert torch.equal(sample(logits), logits.argmax(-1))
    assert torch.equal(Sampler(SamplingParams(), "cpu")(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    logits = torch.randn(1, 8) * 2
    toks = sample(logits.expand(N, 8), temperature=temperature)
    expected = torch.softmax(logits[0] / temperature, -1)
    torch.testing.assert_close(_freqs(toks, 8), expected, atol=0.012, rtol=0)


def test_top_k_support_and_weights():
    logits = torch.randn(1, 10)
    k = 3
    toks = sample(logits.expand(N, 10), temperature=1.0, top_k=k)
    top = torch.topk(logits[0], k).indices
    expected = torch.zeros(10)
    expected[top] = torch.softmax(logits[0, top], -1)
    f = _freqs(toks, 10)
    assert f[expected == 0].sum() == 0
    torch.testing.assert_close(f, expected, atol=0.012, rtol=0)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()[None]
    # sorted: 0.5, 0.3 (mass before: 0.5 < 0.75, kept), 0.1 (mass before 0.8 >= 0.75, dropped)
    kept = torch.isfinite(filter_logits(logits, top_p=0.75))[0]
    assert kept.tolist() == [False, True, False, True, False]
    toks = sample(logits.expand(N, 5), temperature=1.0, top_p=0.75)
    torch.testing.assert_close(_freqs(toks, 5), torch.tensor([0, 0.625, 0, 0.375, 0]), atol=0.012, rtol=0)


def test_top_p_always_keeps_the_top_token():
    logits = torch.randn(4, 50)
    toks = sample(logits, temperature=1.0, top_p=1e-6)
    assert torch.equal(toks, logits.argmax(-1))


def test_top_k_1_is_greedy():
    logits = torch.randn(16, 300)
    assert torch.equal(sample(logits, temperature=1.3, top_k=1), logits.argmax(-1))


def test_seed_reproducible_and_different():
    logits = torch.zeros(64, 1000)  # uniform: every draw is up to the RNG
    p = SamplingParams(temperature=1.0, seed=1234)
    a, b = Sampler(p, "cpu")(logits), Sampler(p, "cpu")(logits)
    c = Sampler(SamplingParams(temperature=1.0, seed=4321), "cpu")(logits)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_params_validation():
    with pytest.raises(ValueError, match="temperature must be a float >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0.0)


def test_sample_rows_equals_each_row_sampled_alone():
    """``sample_rows`` (the continuous batcher's rows, one batched pass): every row's token is what ``sample`` gives
    that row alone with the same seed, for a mix of greedy, penalised, top-k, top-p, min-p and plain temperature rows;
    tied logits (rounded to a coarse grid) keep top-p's nucleus the same (a stable sort)."""
    from fastdecode.engine.sampler import apply_repetition_penalty, sample, sample_rows

    V = 300
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.1, top_k=5, seed=2), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=5),
              SamplingParams(temperature=1.3, top_k=V, top_p=0.5, seed=6), SamplingParams()]
    for trial in range(20):
        logits = (torch.randn(len(params), V) * 3).round() / 2  # ties
        seen = torch.rand(len(params), V) < 0.1
        want = []
        for b, p in enumerate(params):
            row = logits[b:b + 1]
            if p.repetition_penalty != 1:
                row = apply_repetition_penalty(row, seen[b:b + 1], p.repetition_penalty)
            g = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            want.append(int(sample(row, p.temperature, p.top_k, p.top_p, g, min_p=p.min_p)[0]))
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        got = sample_rows(logits, params, gens, seen).tolist()
        assert got == want, (trial, got, want)
    with pytest.raises(ValueError, match="seen"):
        sample_rows(logits, params, gens, None)
