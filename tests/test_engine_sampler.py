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
