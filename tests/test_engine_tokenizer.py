"""Tokenizer from a Hugging Face directory (tokenizer.json + tokenizer_config.json + generation_config.json)."""

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

from fastdecode.engine.tokenizer import Tokenizer  # noqa: E402
from engine_helpers import smollm2_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def gguf_tok():
    return smollm2_tokenizer()


def _save_dir(tmp_path, gguf_tok, post_bos: bool, config: dict, gen: dict = None):
    from tokenizers import processors

    tk = gguf_tok.tk
    if post_bos:  # Llama 3 style: tokenizer.json's post-processor adds BOS itself
        bos = gguf_tok.bos_token
        tk = type(tk).from_str(tk.to_str())
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, gguf_tok.bos_id)])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return Tokenizer.from_hf_dir(str(tmp_path))


TEXTS = ["Hello world", "  spaces and 12345 digits", "ünïcödé → 🙂"]


def test_same_ids_as_gguf_vocab(tmp_path, gguf_tok):
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": gguf_tok.chat_template}
    tok = _save_dir(tmp_path, gguf_tok, False, cfg)
    for t in TEXTS:
        assert tok.encode(t) == gguf_tok.encode(t)
        assert tok.decode(tok.encode(t)) == t
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == gguf_tok.apply_chat_template(msgs)
    assert tok.eos_ids == (2,)


def test_post_processor_bos_is_not_doubled(tmp_path, gguf_tok):
    cfg = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True}
    tok = _save_dir(tmp_path, gguf_tok, True, cfg, gen={"eos_token_id": [2, 0]})
    ids = tok.encode("Hello")
    assert ids[0] == 1 and ids[1] != 1  # one BOS, from the post-processor
    assert not tok.add_bos
    assert tok.encode("Hello", add_special_tokens=False) == ids[1:]
    assert tok.eos_ids == (2, 0)  # generation_config.json's list (Llama 3 has several)


def test_config_bos_added_when_no_post_processor(tmp_path, gguf_tok):
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    tok = _save_dir(tmp_path, gguf_tok, False, cfg)
    assert tok.encode("Hello")[:2] == [1, gguf_tok.encode("Hello")[0]]


def test_no_chat_template_is_a_clear_error(tmp_path, gguf_tok):
    tok = _save_dir(tmp_path, gguf_tok, False, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match="this model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
