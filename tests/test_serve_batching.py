"""Chunked prefill and continuous batching (``models.prefill``, ``engine.batching``), fp32 on the CPU.

Chunked prefill is compared with the one-shot prefill and with decoding token by token; the batcher with
``Engine.generate`` running each request alone (greedy, and seeded sampling with every filter), while
requests join, leave, reuse slots and prefill in chunks beside decoding rows."""

import pytest
import torch

from fastdecode.engine.batching import ContinuousBatcher, Request
from fastdecode.engine.generate import Engine
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import random_model
from fastdecode.engine.sampler import SamplingParams
from fastdecode.engine.tokenizer import Tokenizer
from fastdecode.models.config import ModelConfig
from fastdecode.models.prefill import prefill_chunk, prefill_rows

# fp32 on the CPU: the chunked and one-shot paths differ only in summation order
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model():
    # std 0.1: logits spread out, so greedy choices are not near ties between differently ordered sums
    return random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, backend="torch",
                        std=0.1, seed=3, max_seq_len=128)


def _prompt(n, V=256):
    return torch.randint(0, V, (n,)).tolist()


@pytest.mark.parametrize("chunk", [1, 3, 7, 19])
def test_chunked_prefill_equals_one_shot_prefill(model, chunk):
    S = 19
    ids = torch.randint(0, 256, (2, S))
    ref_cache = KVCache(model.config, 2, 64, dtype=torch.float32)
    ref = model.prefill(ids, ref_cache)  # [2, S, V]
    cache = KVCache(model.config, 2, 64, dtype=torch.float32)
    cache.k.fill_(float("nan"))  # positions the chunks must write, poisoned
    cache.v.fill_(float("nan"))
    outs = [prefill_chunk(model, ids[:, s:s + chunk], s, cache) for s in range(0, S, chunk)]
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cache.k[:, :, :, :S], ref_cache.k[:, :, :, :S], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cache.v[:, :, :, :S], ref_cache.v[:, :, :, :S], atol=ATOL, rtol=RTOL)
    assert torch.isnan(cache.k[:, :, :, S:]).all()  # nothing written past the prompt


def test_chunked_prefill_equals_decoding_token_by_token(model):
    S = 11
    ids = torch.randint(0, 256, (1, S))
    cache = KVCache(model.config, 1, 32, dtype=torch.float32)
    steps = [model.decode(ids[:, t], torch.tensor([t]), cache) for t in range(S)]  # [1, V] each
    cache2 = KVCache(model.config, 1, 32, dtype=torch.float32)
    prefill_chunk(model, ids[:, :4], 0, cache2)
    out = prefill_chunk(model, ids[:, 4:], 4, cache2)  # [1, 7, V]
    torch.testing.assert_close(out[0], torch.cat(steps)[4:], atol=ATOL, rtol=RTOL)


def test_chunked_prefill_into_one_row_leaves_the_others(model):
    cache = KVCache(model.config, 4, 32, dtype=torch.float32)
    cache.k.normal_()
    before = cache.k.clone()
    ids = torch.randint(0, 256, (1, 9))
    out = prefill_chunk(model, ids, 0, cache.rows(2), last_idx=torch.tensor([8]))
    alone = KVCache(model.config, 1, 32, dtype=torch.float32)
    torch.testing.assert_close(out, model.prefill(ids, alone)[:, -1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cache.k[:, 2, :, :9], alone.k[:, 0, :, :9], atol=ATOL, rtol=RTOL)
    for r in (0, 1, 3):
        assert torch.equal(cache.k[:, r], before[:, r])
    assert torch.equal(cache.k[:, 2, :, 9:], before[:, 2, :, 9:])


def test_chunked_prefill_arguments(model):
    cache = KVCache(model.config, 1, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="runs past the KV cache"):
        prefill_chunk(model, torch.zeros(1, 5, dtype=torch.long), 12, cache)
    with pytest.raises(ValueError, match="start must be an integer >= 0"):
        prefill_chunk(model, torch.zeros(1, 5, dtype=torch.long), -1, cache)
    with pytest.raises(ValueError, match="rows"):
        cache.rows(1)


def test_prefill_rows_equals_each_row_alone(model):
    """Three sequences in one pass: different slots (not the first rows, not in order), starts (two have earlier
    chunks in the cache) and lengths (right-padded): each row's logits and K / V as its own prefill_chunk; the
    positions past each row's real tokens (NaN) and the other rows are left alone."""
    cfg = model.config
    cache, ref = (KVCache(cfg, 5, 32, dtype=torch.float32) for _ in range(2))
    for c in (cache, ref):
        c.k.fill_(float("nan"))
        c.v.fill_(float("nan"))
    seqs = [(3, 0, _prompt(7)), (1, 5, _prompt(3)), (4, 2, _prompt(6))]  # (slot, start, tokens)
    earlier = {1: torch.randint(0, 256, (1, 5)), 4: torch.randint(0, 256, (1, 2))}
    for c in (cache, ref):
        for slot, ids in earlier.items():
            prefill_chunk(model, ids, 0, c.rows(slot))
    tokens = torch.tensor([t + [0] * (7 - len(t)) for _, _, t in seqs])
    out = prefill_rows(model, tokens, [st for _, st, _ in seqs], [len(t) for *_, t in seqs],
                       [slot for slot, *_ in seqs], cache)
    assert out.shape == (3, cfg.vocab_size) and torch.isfinite(out).all()
    for r, (slot, start, t) in enumerate(seqs):
        alone = prefill_chunk(model, torch.tensor([t]), start, ref.rows(slot), last_idx=torch.tensor([len(t) - 1]))
        torch.testing.assert_close(out[r:r + 1], alone, atol=ATOL, rtol=RTOL)
        end = start + len(t)
        torch.testing.assert_close(cache.k[:, slot, :, :end], ref.k[:, slot, :, :end], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(cache.v[:, slot, :, :end], ref.v[:, slot, :, :end], atol=ATOL, rtol=RTOL)
        assert torch.isnan(cache.k[:, slot, :, end:]).all() and torch.isnan(cache.v[:, slot, :, end:]).all()
    for slot in (0, 2):
        assert torch.isnan(cache.k[:, slot]).all()


def _host_syncs(fn):
    """The aten calls of ``fn()`` that wait for the device when its tensors live on a GPU: a scalar read
    (``.item()``, ``int(t)``), ``nonzero``, and indexing with a boolean mask (a ``nonzero`` inside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            idx = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
            if name in ("_local_scalar_dense", "item", "nonzero", "is_nonzero") or any(
                    torch.is_tensor(t) and t.dtype == torch.bool for t in (idx or ()) if t is not None):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return seen


def test_prefill_rows_layers_run_without_a_host_sync():
    """The pass's index tensors are made once on the host (``models.prefill._RowsPlan``): the layers add no call
    that would wait for a GPU (boolean indexing and ``int(t.max())`` did, five a layer), so a deeper model
    makes no more of them than a shallow one, and the setup's own are on host tensors."""
    counts = {}
    for n_layers in (1, 3):
        cfg = ModelConfig.from_preset("tiny").replace(n_layers=n_layers)
        m = random_model(cfg, device="cpu", dtype=torch.float32, backend="torch", std=0.1, seed=3, max_seq_len=32)
        cache = KVCache(cfg, 4, 32, dtype=torch.float32)
        tokens = torch.randint(0, 256, (3, 5))
        counts[n_layers] = _host_syncs(lambda: prefill_rows(m, tokens, [0, 4, 2], [5, 2, 3], [2, 0, 3], cache))
    assert counts[1] == counts[3], counts
    assert "index" not in counts[3] and "index_put" not in counts[3] and "index_put_" not in counts[3], counts


def test_prefill_rows_arguments(model):
    cache = KVCache(model.config, 3, 16, dtype=torch.float32)
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="one entry per row"):
        prefill_rows(model, ids, [0], [4, 4], [0, 1], cache)
    with pytest.raises(ValueError, match=r"1\.\.4 real tokens"):
        prefill_rows(model, ids, [0, 0], [4, 5], [0, 1], cache)
    with pytest.raises(ValueError, match="runs past the KV cache"):
        prefill_rows(model, ids, [0, 13], [4, 4], [0, 1], cache)
    with pytest.raises(ValueError, match="slots must be distinct rows"):
        prefill_rows(model, ids, [0, 0], [4, 4], [1, 1], cache)
    with pytest.raises(ValueError, match="slots must be distinct rows"):
        prefill_rows(model, ids, [0, 0], [4, 4], [0, 3], cache)


def _run(batcher, requests, join_at=None):
    """Add ``requests`` (request i before step ``join_at[i]``), step until done; {id: (tokens, text, reason)}."""
    join_at = join_at or [0] * len(requests)
    out = {r.id: ([], [], []) for r in requests}

    def collect(ev):
        toks, text, reason = out[ev.request_id]
        toks += ev.token_ids
        text.append(ev.text)
        if ev.finish_reason:
            reason.append(ev.finish_reason)

    for r in requests:
        r.on_event = collect
    step = 0
    while step <= max(join_at) or batcher.has_work:
        for r, at in zip(requests, join_at):
            if at == step:
                batcher.add(r)
        batcher.step()
        step += 1
        assert step < 10_000
    return {k: (t, "".join(x), rs) for k, (t, x, rs) in out.items()}


def _alone(model, tok, prompt, n, sampling=SamplingParams(), stop=(), max_seq_len=64):
    eng = Engine(model, tok, max_batch=1, max_seq_len=max_seq_len)
    [r] = eng.generate([prompt], max_new_tokens=n, sampling=sampling, stop=stop)
    return r


def test_continuous_batching_equals_each_request_alone(model):
    """Greedy: 7 requests through 3 slots (so slots are reused), joining at different steps, prompts longer than
    the prefill chunk, stop strings and EOS: each gets exactly the tokens and text of Engine.generate alone."""
    tok = Tokenizer.synthetic(256, eos_id=7)
    eng = Engine(model, tok, max_batch=3, max_seq_len=64)
    batcher = ContinuousBatcher(eng, prefill_chunk=4)
    lens = [3, 17, 1, 9, 25, 5, 12]
    news = [12, 5, 20, 9, 3, 15, 8]
    reqs = [Request(_prompt(n), max_new_tokens=m) for n, m in zip(lens, news)]
    ref0 = _alone(model, tok, reqs[0].prompt, 20)
    reqs[0].stop = [ref0.text.split(" ")[3]] if len(ref0.tokens) > 5 else []  # a stop string it meets
    out = _run(batcher, reqs, join_at=[0, 0, 2, 3, 3, 10, 11])
    for r in reqs:
        ref = _alone(model, tok, r.prompt, r.max_new_tokens, stop=r.stop)
        toks, text, reason = out[r.id]
        assert text == ref.text, (r.prompt, r.stop)
        assert toks[:len(ref.tokens)] == ref.tokens
        want = {"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reason]
        assert reason == [want]
    assert batcher.free_slots == 3 and not batcher.has_work


def test_prompts_arriving_together_are_prefilled_together(model, monkeypatch):
    """Five short prompts and a long one admitted in one step: the first prefill pass takes as many as fit the
    chunk budget (rows x the longest chunk <= prefill_chunk: 4 rows of up to 4 tokens in 16), the next the fifth
    beside the long prompt's first chunk cut to its share (8), then the long one alone; every request still gets
    Engine.generate's tokens alone."""
    import fastdecode.engine.batching as B

    passes = []
    real = B.prefill_rows
    monkeypatch.setattr(B, "prefill_rows", lambda m, tokens, *a: passes.append(tuple(tokens.shape)) or real(
        m, tokens, *a))
    tok = Tokenizer.synthetic(256)
    eng = Engine(model, tok, max_batch=6, max_seq_len=64)
    batcher = ContinuousBatcher(eng, prefill_chunk=16)
    reqs = [Request(_prompt(n), max_new_tokens=6) for n in (4, 3, 4, 2, 1, 30)]
    assert batcher.prefill_plan() == []
    out = _run(batcher, reqs)
    assert passes[:4] == [(4, 4), (2, 8), (1, 16), (1, 6)]
    assert all(r * c <= 16 for r, c in passes)
    for r in reqs:
        assert out[r.id][0] == _alone(model, tok, r.prompt, r.max_new_tokens).tokens


def test_prefill_beside_decoding_rows_keeps_both_right(model):
    """A long prompt prefilled chunk by chunk into slot 0 while slots 1 and 2 decode (its row runs a dummy token
    in their decode steps): all three agree with generating alone."""
    tok = Tokenizer.synthetic(256)
    eng = Engine(model, tok, max_batch=3, max_seq_len=64)
    batcher = ContinuousBatcher(eng, prefill_chunk=3)
    short = [Request(_prompt(4), max_new_tokens=30) for _ in range(3)]
    long_ = Request(_prompt(40), max_new_tokens=10)
    out = {}
    for r in short:
        r.on_event = lambda ev: out.setdefault(ev.request_id, []).extend(ev.token_ids)
        batcher.add(r)
    for _ in range(5):
        batcher.step()
    batcher.cancel(short[0].id)  # frees slot 0 while 1 and 2 decode
    assert batcher.slots[0] is None
    long_.on_event = lambda ev: out.setdefault(ev.request_id, []).extend(ev.token_ids)
    batcher.add(long_)
    while batcher.has_work:
        batcher.step()
    for r in short[1:] + [long_]:
        assert out[r.id] == _alone(model, tok, r.prompt, r.max_new_tokens).tokens


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=11),
    dict(temperature=1.2, top_k=20, top_p=0.9, seed=5),
    dict(temperature=1.0, min_p=0.05, seed=2),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.7, repetition_penalty=0.8, top_k=50, seed=9),
])
def test_per_request_sampling_equals_generate_alone(model, params):
    """Each request draws from its own generator: beside other requests (greedy and sampled) it gets the tokens
    Engine.generate gives it alone with the same seed."""
    tok = Tokenizer.synthetic(256)
    eng = Engine(model, tok, max_batch=4, max_seq_len=64)
    batcher = ContinuousBatcher(eng, prefill_chunk=8)
    sp = SamplingParams(**params)
    reqs = [Request(_prompt(6), sampling=sp, max_new_tokens=12),
            Request(_prompt(9), max_new_tokens=15),
            Request(_prompt(3), sampling=SamplingParams(temperature=1.0, seed=1), max_new_tokens=10)]
    out = _run(batcher, reqs, join_at=[1, 0, 0])
    for r in reqs:
        assert out[r.id][0] == _alone(model, tok, r.prompt, r.max_new_tokens, sampling=r.sampling).tokens


def test_cancel_frees_the_slot_and_reports_abort(model):
    eng = Engine(model, Tokenizer.synthetic(256), max_batch=1, max_seq_len=64)
    batcher = ContinuousBatcher(eng, prefill_chunk=4)
    events = []
    a = Request(_prompt(5), max_new_tokens=50, on_event=events.append)
    b = Request(_prompt(5), max_new_tokens=2, on_event=events.append)
    batcher.add(a)
    batcher.add(b)
    for _ in range(4):
        batcher.step()
    assert batcher.slots[0].req is a and len(batcher.waiting) == 1
    assert batcher.cancel(a.id) and not batcher.cancel(a.id)
    assert events[-1].request_id == a.id and events[-1].finish_reason == "abort"
    while batcher.has_work:
        batcher.step()
    assert [e.finish_reason for e in events if e.request_id == b.id][-1] == "length"
    assert batcher.free_slots == 1


def test_a_receiver_that_fails_frees_the_slot(model):
    eng = Engine(model, None, max_batch=2, max_seq_len=64)
    batcher = ContinuousBatcher(eng)

    def gone(ev):
        raise RuntimeError("event loop is closed")

    batcher.add(Request(_prompt(5), max_new_tokens=30, on_event=gone))
    batcher.step()
    assert not batcher.has_work and batcher.free_slots == 2


def test_requests_refused_with_the_reason(model):
    eng = Engine(model, None, max_batch=1, max_seq_len=16)
    batcher = ContinuousBatcher(eng)
    with pytest.raises(ValueError, match="the prompt has 16 tokens; the context holds 16"):
        batcher.add(Request([1] * 16))
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        batcher.add(Request([1, 256]))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        batcher.add(Request([1], max_new_tokens=0))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        batcher.add(Request([1], stop=["x"]))
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        ContinuousBatcher(eng, prefill_chunk=0)
    assert not batcher.has_work


def test_min_p_and_repetition_penalty_filters():
    from fastdecode.engine.sampler import apply_repetition_penalty, filter_logits

    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    kept = torch.isfinite(filter_logits(probs.log(), min_p=0.2))  # keep p >= 0.1
    assert kept.tolist() == [[True, True, True, False]]
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite float > 0"):
        SamplingParams(repetition_penalty=0)
