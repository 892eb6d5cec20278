"""The model and the generate loop on tiny random weights: KV cache / RoPE consistency, backends,
per-sequence lengths, capacity errors."""

import pytest
import torch

from fastdecode.engine.generate import Engine
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import random_model
from fastdecode.models.config import ModelConfig
from engine_helpers import assert_triton_decode_equals_torch
from helpers import interpreter_on

CFG = ModelConfig.from_preset("tiny")
# fp32 on both sides; only the order of fp32 sums differs (prefill and decode run different matmul
# shapes). 1e-5 failed on 3 of 60 seeds (1.08e-5 at worst): 5e-5, still ~200x below a bf16 ulp of the logits
ATOL = 5e-5


def _model(backend="torch", dtype=torch.float32, cfg=CFG, seed=None):
    m = random_model(cfg, device="cpu", dtype=dtype, backend=backend, max_seq_len=128,
                     std=0.2, seed=int(torch.randint(0, 2**31, ())) if seed is None else seed)
    return m


def test_decode_steps_equal_prefill():
    """Prefilling n tokens then decoding the rest one by one gives the logits of one long prefill."""
    m = _model()
    B, S, n = 2, 12, 5
    toks = torch.randint(0, CFG.vocab_size, (B, S))
    full = m.prefill(toks, KVCache(CFG, B, 32, dtype=torch.float32))
    cache = KVCache(CFG, B, 32, dtype=torch.float32)
    first = m.prefill(toks[:, :n], cache)
    torch.testing.assert_close(first, full[:, :n], atol=ATOL, rtol=0)
    for t in range(n, S):
        got = m.decode(toks[:, t], torch.full((B,), t), cache)
        torch.testing.assert_close(got, full[:, t], atol=ATOL, rtol=0)


def test_ref_backend_equals_ops():
    m = _model()
    toks = torch.randint(0, CFG.vocab_size, (3, 9))
    c1, c2 = KVCache(CFG, 3, 16, dtype=torch.float32), KVCache(CFG, 3, 16, dtype=torch.float32)
    a = m.prefill(toks, c1)
    m.backend = "ref"
    b = m.prefill(toks, c2)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    pos = torch.tensor([9, 4, 7])
    nxt = torch.randint(0, CFG.vocab_size, (3,))
    b = m.decode(nxt, pos, c2)
    m.backend = "torch"
    a = m.decode(nxt, pos, c1)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_triton_backend_under_interpreter_equals_torch():
    """Every op through its Triton kernel (CPU interpreter) against the torch backend, fp32."""
    if not interpreter_on():
        # The interpreter is process-wide and fixed when a kernel module is first imported: turning
        # it on for one test would leave every later GPU test on interpreted kernels. On a GPU
        # machine test_engine_gpu.py runs the triton backend on CUDA against fp32 instead.
        pytest.skip("needs the Triton interpreter (CPU machine); the GPU suite covers this on CUDA")
    assert_triton_decode_equals_torch(_model(cfg=CFG.replace(n_layers=1)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_rope_switch_changes_nothing(backend):
    """Decode steps with RoPE + KV write inside the attention kernel (``fused_rope``, the default) and with the two
    ops apart: the same logits and caches, on the torch and the triton backend (the interpreter on a CPU)."""
    if backend == "triton" and not interpreter_on():
        pytest.skip("needs the Triton interpreter (CPU machine); on a GPU test_engine_gpu.py runs the fused path")
    m = _model(cfg=CFG.replace(n_layers=2))
    m.backend = backend
    assert all(layer.attention.fused_rope for layer in m.layers)
    toks = torch.randint(0, CFG.vocab_size, (2, 7))
    caches = [KVCache(CFG, 2, 16, dtype=torch.float32) for _ in range(2)]
    for c in caches:
        m.prefill(toks[:, :4], c)
    for t in range(4, 7):
        pos = torch.tensor([t, t - 2])
        m.set_kernels(fused_rope=True)
        fused = m.decode(toks[:, t], pos, caches[0])
        m.set_kernels(fused_rope=False)
        assert not any(layer.attention.fused_rope for layer in m.layers)
        apart = m.decode(toks[:, t], pos, caches[1])
        torch.testing.assert_close(fused, apart, atol=ATOL, rtol=0)
        # layer 0 writes the same K / V bits; later layers' inputs differ in the order of fp32 sums
        torch.testing.assert_close(caches[0].v[0], caches[1].v[0], atol=0, rtol=0)
        torch.testing.assert_close(caches[0].k, caches[1].k, atol=1e-5, rtol=0)
        torch.testing.assert_close(caches[0].v, caches[1].v, atol=1e-5, rtol=0)


def test_batch_with_different_lengths_equals_single_runs():
    m = _model()
    eng = Engine(m, None, max_batch=3, max_seq_len=64)
    prompts = [torch.randint(0, CFG.vocab_size, (n,)).tolist() for n in (3, 11, 6)]
    batched = eng.generate(prompts, max_new_tokens=8)
    for p, r in zip(prompts, batched):
        [single] = eng.generate([p], max_new_tokens=8)
        assert r.tokens == single.tokens
        assert len(r.tokens) == 8 and r.finish_reason == "length"


def test_generation_stops_at_context_end():
    m = _model()
    eng = Engine(m, None, max_batch=1, max_seq_len=20)
    [r] = eng.generate([list(range(1, 18))], max_new_tokens=10)
    assert len(r.tokens) == 3 and r.finish_reason == "length"  # 17 prompt + 3 new = 20


def test_prompt_longer_than_context_is_rejected():
    eng = Engine(_model(), None, max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt 1 has 16 tokens; the context holds 16"):
        eng.generate([[1, 2], list(range(16))], max_new_tokens=4)


def test_batch_over_capacity_is_rejected():
    eng = Engine(_model(), None, max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"batch of 3 prompts exceeds the engine's capacity \(max_batch=2\)"):
        eng.generate([[1], [2], [3]], max_new_tokens=4)


def test_bad_prompts_are_rejected():
    eng = Engine(_model(), None, max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"token id 999 is outside the vocabulary \[0, 256\)"):
        eng.generate([[1, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        eng.generate([[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        eng.generate("hello", max_new_tokens=2)


def test_model_backend_validation():
    with pytest.raises(ValueError, match="backend must be one of"):
        _model(backend="cuda")


def test_llama3_rope_scaling_matches_transformers():
    tr = pytest.importorskip("transformers")
    from fastdecode.models.llama import rope_inv_freq

    cfg = ModelConfig.from_preset("llama-3.1-8b")
    hf_cfg = tr.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_hf, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg).float(), inv_hf.float(), atol=0, rtol=1e-6)


@pytest.mark.parametrize("backend", ["ref", "torch"])
def test_decode_traces_as_one_graph(backend):
    """torch.compile(fullgraph=True) sees the decode step without graph breaks: plain PyTorch ("ref",
    the compiled baseline) and the registered fastdecode ops ("torch", through their fake kernels)."""
    m = _model(backend=backend)
    cache = KVCache(CFG, 2, 32, dtype=torch.float32)
    toks = torch.randint(0, CFG.vocab_size, (2, 6))
    m.prefill(toks, cache)
    nxt, pos = torch.randint(0, CFG.vocab_size, (2,)), torch.tensor([6, 6])
    ref_cache = KVCache(CFG, 2, 32, dtype=torch.float32)
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    ref = m.decode(nxt, pos, ref_cache)
    torch._dynamo.reset()
    compiled = torch.compile(m.decode, backend="eager", fullgraph=True)
    got = compiled(nxt, pos, cache)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama31", "qwen2"])
def test_random_model_matches_transformers(variant):
    """The model code against transformers with the same weights (the GPU suite does this at 8B shapes)."""
    pytest.importorskip("transformers")
    from engine_helpers import to_hf

    cfg = ModelConfig.from_preset("tiny")
    if variant == "llama31":
        from fastdecode.models.config import RopeScaling

        cfg = cfg.replace(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32), rope_theta=500000.0)
    else:
        cfg = cfg.replace(qkv_bias=True, tie_embeddings=True)
    m = _model(cfg=cfg)
    hf = to_hf(m)
    toks = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf(toks).logits
    got = m.prefill(toks, KVCache(cfg, 2, 64, dtype=torch.float32))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant, expected", [(None, 15_009_857_536), ("fp8", 8_036_040_704), ("int4", 4_704_452_608)])
def test_decode_step_bytes_count_embedding_rows_not_the_table(quant, expected):
    """Regression: the decode benchmark's bytes counted the whole (untied) embedding table, which a step
    reads B rows of; Llama-3.1-8B in bf16 at batch 1 reads ~15.0 GB (282 tokens/s at 4.24 TB/s)."""
    from fastdecode.models.llama import Transformer
    from fastdecode.models.quantize import quantize_model

    cfg = ModelConfig.from_preset("llama-3.1-8b")
    with torch.device("meta"):  # shapes only, nothing allocated
        m = Transformer(cfg, dtype=torch.bfloat16, rope_len=16)
    if quant:
        quantize_model(m, quant)
    row = cfg.dim * 2
    assert m.decode_step_bytes(1) == expected
    assert m.decode_step_bytes(32) - m.decode_step_bytes(1) == 31 * row
    assert m.weight_bytes() - m.decode_step_bytes(1) == (cfg.vocab_size - 1) * row
    tied = random_model(ModelConfig.from_preset("tiny").replace(tie_embeddings=True), device="cpu",
                        dtype=torch.float32, max_seq_len=16)
    assert tied.decode_step_bytes(8) == tied.weight_bytes()  # the head reads the shared table whole, once
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        tied.decode_step_bytes(0)
