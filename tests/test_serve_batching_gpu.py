"""Continuous batching on the GPU: the decode step replayed from the CUDA graph of each batch bucket, the Triton
kernels, chunked prefill into one cache row while other rows decode, slots freed and reused.

fp32, so that a request's tokens may not depend on which rows share its step: the kernels of a batch of 1 and of
a batch of 3 sum in different orders (~1e-7 relative in fp32), which flips a greedy choice only at a tie that
close. In bf16 the same reordering moves logits by ~1e-2 and flips near ties (``bench serve`` on the H200:
a served answer then differs from the same prompt generated alone without any fault); fp32 is where "identical
to each request alone" is a test of the batcher rather than of rounding."""

import pytest
import torch

from fastdecode.engine.batching import ContinuousBatcher, Request
from fastdecode.engine.generate import Engine
from fastdecode.engine.loader import random_model
from fastdecode.engine.tokenizer import Tokenizer
from fastdecode.models.config import ModelConfig
from test_serve_batching import _prompt, _run

pytestmark = pytest.mark.gpu


def _alone(engine, prompt, n, stop=()):
    [r] = engine.generate([prompt], max_new_tokens=n, stop=stop)
    return r


def _check(batcher, alone_engine, reqs, join_at):
    out = _run(batcher, reqs, join_at=join_at)
    for r in reqs:
        ref = _alone(alone_engine, r.prompt, r.max_new_tokens, stop=r.stop)
        toks, text, reason = out[r.id]
        assert text == ref.text, (r.prompt, toks, ref.tokens)
        assert toks[:len(ref.tokens)] == ref.tokens
        assert reason == [{"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reason]]
    assert batcher.free_slots == batcher.engine.max_batch and not batcher.has_work


def test_continuous_batching_on_cuda_graphs_equals_each_request_alone():
    """Tiny random model (std 0.1: logits spread out), fp32, CUDA graphs on: 7 requests through 3 slots, joining at
    different steps, prompts longer than the prefill chunk (prefill beside decoding rows), each answer equal to
    ``Engine.generate`` alone (a batch of one: another graph bucket)."""
    model = random_model(ModelConfig.from_preset("tiny"), device="cuda", dtype=torch.float32, std=0.1, seed=3,
                         max_seq_len=128)
    tok = Tokenizer.synthetic(256, eos_id=7)
    eng = Engine(model, tok, max_batch=3, max_seq_len=64)
    assert eng.graphs is not None  # CUDA graphs on
    alone = Engine(model, tok, max_batch=1, max_seq_len=64)
    lens = [3, 17, 1, 9, 25, 5, 12]
    news = [12, 5, 20, 9, 3, 15, 8]
    reqs = [Request(_prompt(n), max_new_tokens=m) for n, m in zip(lens, news)]
    _check(ContinuousBatcher(eng, prefill_chunk=4), alone, reqs, join_at=[0, 0, 2, 3, 3, 10, 11])


def test_embedded_model_served_rows_equal_alone_fp32():
    """The embedded SmolLM2 (int4 GGUF, loaded natively) in fp32 activations on CUDA: 6 chat-length prompts through
    4 slots with chunked prefill, 24 tokens each, each equal to the prompt generated alone."""
    from engine_helpers import smollm2_path
    from fastdecode.engine.loader import load

    loaded = load(smollm2_path(), device="cuda", dtype=torch.float32, progress=False)
    eng = Engine(loaded.model, loaded.tokenizer, max_batch=4, max_seq_len=256)
    alone = Engine(loaded.model, loaded.tokenizer, max_batch=1, max_seq_len=256)
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
             "Explain what a GPU does in one sentence.", "Once upon a time", "def fibonacci(n):"]
    reqs = [Request(loaded.tokenizer.encode(t), max_new_tokens=24) for t in texts]
    _check(ContinuousBatcher(eng, prefill_chunk=8), alone, reqs, join_at=[0, 0, 1, 5, 6, 20])
