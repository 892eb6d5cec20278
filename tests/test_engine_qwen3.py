"""Qwen3 in the engine (issue 17): the per-head q / k RMSNorm before RoPE and Qwen3's config.json, against
transformers' Qwen3ForCausalLM on tiny random checkpoints saved here, in fp32: prefill, decode with the KV cache,
chunked prefill (the server's), greedy tokens through ``Engine.generate``, the Triton decode path under the
interpreter, export round trip; unknown architectures refused by name."""

import json
import os
import re

import pytest
import torch

from fastdecode.engine.generate import Engine
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import load, random_model
from fastdecode.models.config import ModelConfig
from fastdecode.models.prefill import prefill_chunk
from engine_helpers import assert_triton_decode_equals_torch
from helpers import interpreter_on

transformers = pytest.importorskip("transformers")

# fp32 both sides, 2 layers, |logits| ~ 1: only the order of fp32 sums differs (2.4e-7 seen)
ATOL = 2e-5
# head_dim 32 with hidden 64 and 4 heads: q_size (128) != hidden, as in Qwen3 (head_dim given, not hidden / heads)
QWEN3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True)


def _save_qwen3(path, **kw):
    """A random Qwen3ForCausalLM saved as safetensors in ``path``; norm weights drawn around 1 (not all ones), so
    that q_norm / k_norm and which weight goes where matter. Returns (path, the transformers model)."""
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, **kw})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.5)
    hf.save_pretrained(str(path), safe_serialization=True)
    return str(path), hf


@pytest.fixture
def qwen3(tmp_path):
    return _save_qwen3(tmp_path / "qwen3")


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def test_qwen3_config_from_hf(qwen3):
    path, hf = qwen3
    cfg = ModelConfig.from_hf(path)
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3"
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.tie_embeddings) == (True, False, 32, True)
    assert (cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (1e-6, 1000000.0, 512)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())  # q_norm / k_norm counted


@pytest.mark.parametrize("backend", ["torch", "ref"])
def test_qwen3_prefill_and_decode_match_transformers(qwen3, backend):
    """Prefill logits, then three decode steps with the KV cache (per-sequence positions), against transformers'
    full forward; and without the q / k norm the logits are far off (the test sees the norm)."""
    path, hf = qwen3
    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64, backend=backend)
    m = loaded.model
    assert m.layers[1].attention.k_norm.weight.shape == (32,)
    ids = torch.randint(0, 300, (2, 9))
    cache = KVCache(loaded.config, 2, 64, dtype=torch.float32)
    got = m.prefill(ids, cache)
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=0)
    seq = ids
    for _ in range(3):
        nxt = torch.randint(0, 300, (2,))
        got = m.decode(nxt, torch.full((2,), seq.shape[1]), cache)
        seq = torch.cat([seq, nxt[:, None]], 1)
        torch.testing.assert_close(got, _hf_logits(hf, seq)[:, -1], atol=ATOL, rtol=0)
    for layer in m.layers:  # regression guard: the comparison above fails without the norm
        layer.attention.q_norm = layer.attention.k_norm = None
    off = m.prefill(ids, KVCache(loaded.config, 2, 64, dtype=torch.float32))
    assert (off - _hf_logits(hf, ids)).abs().max() > 1e-2


def test_qwen3_chunked_prefill_matches_transformers(qwen3):
    """``prefill_chunk`` (the server's chunked prefill) in three pieces: the logits of each piece's positions."""
    path, hf = qwen3
    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64)
    ids = torch.randint(0, 300, (2, 14))
    ref = _hf_logits(hf, ids)
    cache = KVCache(loaded.config, 2, 64, dtype=torch.float32)
    for a, b in ((0, 5), (5, 6), (6, 14)):
        got = prefill_chunk(loaded.model, ids[:, a:b], a, cache)
        torch.testing.assert_close(got, ref[:, a:b], atol=ATOL, rtol=0)


def test_qwen3_greedy_generate_matches_transformers(tmp_path):
    """``Engine.generate`` (prefill + decode loop, two prompts of different lengths in one batch): the greedy
    tokens of transformers' full forward, step by step; untied embeddings here."""
    path, hf = _save_qwen3(tmp_path / "q", tie_word_embeddings=False, num_key_value_heads=1)
    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64)
    assert not loaded.config.tie_embeddings and loaded.config.n_kv_heads == 1
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (3, 8)]
    n_new = 6
    got = [r.tokens for r in Engine(loaded.model, None, max_batch=2, max_seq_len=64)
           .generate(prompts, max_new_tokens=n_new, ignore_eos=True)]
    for p, tokens in zip(prompts, got):
        seq = torch.tensor([p])
        for _ in range(n_new):
            seq = torch.cat([seq, _hf_logits(hf, seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert tokens == seq[0, len(p):].tolist()


def test_qwen3_triton_decode_under_interpreter_equals_torch():
    """The decode step with the q / k norm through the Triton kernels (rms_norm on the heads, then rope_kv_write,
    decode_attention; CPU interpreter) against the torch backend, fp32."""
    if not interpreter_on():  # the GPU suite runs the triton backend on CUDA (test_qwen3_cuda_graph_decode)
        pytest.skip("needs the Triton interpreter (CPU machine)")
    cfg = ModelConfig.from_preset("tiny").replace(n_layers=1, qk_norm=True, head_dim=32)
    m = random_model(cfg, device="cpu", dtype=torch.float32, backend="torch", max_seq_len=32, std=0.2,
                     seed=int(torch.randint(0, 2**31, ())))
    m.layers[0].attention.q_norm.weight.normal_(1.0, 0.5)
    m.layers[0].attention.k_norm.weight.normal_(1.0, 0.5)
    assert_triton_decode_equals_torch(m)


@pytest.mark.parametrize("backend", ["ref", "torch"])
def test_qwen3_decode_traces_as_one_graph(backend):
    """torch.compile(fullgraph=True) sees the decode step with the q / k norm without graph breaks (regression: the
    norm of a strided slice of heads went through the op's try-view-else-copy, which dynamo cannot trace)."""
    cfg = ModelConfig.from_preset("tiny").replace(n_layers=1, qk_norm=True, head_dim=32)
    m = random_model(cfg, device="cpu", dtype=torch.float32, backend=backend, max_seq_len=32, std=0.2,
                     seed=int(torch.randint(0, 2**31, ())))
    m.layers[0].attention.q_norm.weight.normal_(1.0, 0.5)
    cache, ref_cache = KVCache(cfg, 2, 32, dtype=torch.float32), KVCache(cfg, 2, 32, dtype=torch.float32)
    m.prefill(torch.randint(0, cfg.vocab_size, (2, 6)), cache)
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    nxt, pos = torch.randint(0, cfg.vocab_size, (2,)), torch.tensor([6, 4])
    ref = m.decode(nxt, pos, ref_cache)
    torch._dynamo.reset()
    got = torch.compile(m.decode, backend="eager", fullgraph=True)(nxt, pos, cache)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=0)


def test_qwen3_export_round_trip(qwen3, tmp_path):
    """``save_checkpoint`` writes Qwen3 (model_type qwen3, q_norm / k_norm tensors): transformers reads it back
    to the same logits, and so does our loader."""
    from fastdecode.engine.export import save_checkpoint

    path, hf = qwen3
    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64)
    dst = str(tmp_path / "exported")
    save_checkpoint(loaded.model, None, dst, None)
    assert json.load(open(os.path.join(dst, "config.json")))["model_type"] == "qwen3"
    ids = torch.randint(0, 300, (1, 7))
    again = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert type(again).__name__ == "Qwen3ForCausalLM"
    torch.testing.assert_close(_hf_logits(again, ids), _hf_logits(hf, ids), atol=0, rtol=0)
    ours = load(dst, dtype=torch.float32, progress=False, max_seq_len=64).model
    torch.testing.assert_close(ours.prefill(ids, KVCache(ours.config, 1, 64, dtype=torch.float32)),
                               _hf_logits(hf, ids), atol=ATOL, rtol=0)


def _tp_equals_tp1(rank, world, path, prompts):
    from engine_helpers import assert_greedy_equal_but_at_a_near_tie, greedy
    from fastdecode.engine.tp import load_tp

    full = load(path, dtype=torch.float32, progress=False, max_seq_len=64).model
    tp = load_tp(path, dtype=torch.float32, progress=False, max_seq_len=64).model
    assert tp.config.n_heads == 2 and tp.layers[0].attention.q_norm.weight.shape == (32,)  # the norms: replicated
    want, ref_logits = greedy(full, prompts, 6)
    got, logits = greedy(tp, prompts, 6)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)  # (the row-parallel sums' order only)
    assert_greedy_equal_but_at_a_near_tie(full, prompts, got, want, 2e-4)


def test_qwen3_tensor_parallel_equals_tp1(qwen3):
    """TP=2 (2 gloo processes): each rank's query / KV heads use the one replicated q / k norm weight."""
    from helpers import run_ranks

    run_ranks(2, _tp_equals_tp1, qwen3[0], [torch.randint(0, 300, (n,)).tolist() for n in (4, 7)], timeout=180)


@pytest.mark.parametrize("model_type, arch", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("gemma3", "Gemma3ForCausalLM")])
def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path, model_type, arch):
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' \({arch}\) .*supported model_type: "
                                         r"llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf({"model_type": model_type, "architectures": [arch], "num_attention_heads": 4})
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(d))}/config.json: config.json model_type '{model_type}'"):
        load(str(d), progress=False)


@pytest.mark.gpu
def test_qwen3_cuda_graph_decode():
    """On the GPU, bf16, Triton backend: the decode step replayed from the CUDA graph equals the eager step, and
    both track the fp32 torch model (head_dim 128, as Qwen3's)."""
    from engine_helpers import rel_rms

    cfg = ModelConfig.from_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, head_dim=128, qk_norm=True,
                                                  n_layers=2, vocab_size=512, intermediate_size=384)
    seed = int(torch.randint(0, 2**31, ()))
    ref = random_model(cfg, device="cuda", dtype=torch.float32, backend="torch", max_seq_len=64, std=0.1, seed=seed)
    m = random_model(cfg, device="cuda", dtype=torch.bfloat16, backend="auto", max_seq_len=64, std=0.1, seed=seed)
    for a, b in zip(ref.layers, m.layers):
        for w in (a.attention.q_norm.weight, a.attention.k_norm.weight):
            w.normal_(1.0, 0.5)
        b.attention.q_norm.weight.copy_(a.attention.q_norm.weight)
        b.attention.k_norm.weight.copy_(a.attention.k_norm.weight)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 9)]
    eng = Engine(m, None, max_batch=2, max_seq_len=64)  # CUDA graph on
    eager = Engine(m, None, max_batch=2, max_seq_len=64, cuda_graph=False)
    a = [r.tokens for r in eng.generate(prompts, max_new_tokens=8, ignore_eos=True)]
    b = [r.tokens for r in eager.generate(prompts, max_new_tokens=8, ignore_eos=True)]
    assert a == b
    ids = torch.tensor([prompts[1]], device="cuda")
    c32 = KVCache(cfg, 1, 64, dtype=torch.float32, device="cuda")
    c16 = KVCache(cfg, 1, 64, dtype=torch.bfloat16, device="cuda")
    ref.prefill(ids, c32)
    m.prefill(ids, c16)
    nxt, pos = torch.tensor([7], device="cuda"), torch.tensor([ids.shape[1]], device="cuda")
    # bf16 against fp32: the bar sits above the rounding's own spread. The same step on the CPU's torch backend
    # in bf16 gave rel rms 0.0139 median, 0.0238 max over 1000 seeds (2.3 % of them above the old 2e-2, the
    # failure of session 20's GPU suite); q_norm's weight 10 % off gives 0.086 median, left out 0.55.
    err = rel_rms(m.decode(nxt, pos, c16), ref.decode(nxt, pos, c32))
    assert err < 4e-2, (float(err), seed)
