"""Safetensors loading (sharded index, tied/untied, Qwen2 qkv bias, Llama 3.1 RoPE scaling) against
transformers on tiny random models saved here; clear errors for broken checkpoints."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import CheckpointError, load
from fastdecode.models.config import ModelConfig
from engine_helpers import smollm2_path
from helpers import edit_json

transformers = pytest.importorskip("transformers")

# fp32 both sides, 2 layers, |logits| ~ 1: summation order only
ATOL = 2e-5


def _llama_cfg(**kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _save(tmp_path, model, shard=None):
    d = str(tmp_path / "ckpt")
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, safe_serialization=True, **kw)
    return d


def _compare(d, hf_model, seq=11):
    loaded = load(d, dtype=torch.float32, progress=False, max_seq_len=64)
    ids = torch.randint(0, hf_model.config.vocab_size, (2, seq))
    with torch.no_grad():
        ref = hf_model(ids).logits
    cache = KVCache(loaded.config, 2, 64, dtype=torch.float32)
    got = loaded.model.prefill(ids, cache)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # one decode step at per-sequence positions against the full forward
    nxt = torch.randint(0, hf_model.config.vocab_size, (2,))
    got = loaded.model.decode(nxt, torch.tensor([seq, seq]), cache)
    with torch.no_grad():
        ref = hf_model(torch.cat([ids, nxt[:, None]], 1)).logits[:, -1]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    return loaded


def test_sharded_llama_matches_hf(tmp_path):
    hf = transformers.LlamaForCausalLM(_llama_cfg()).eval()
    d = _save(tmp_path, hf, shard="60KB")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    loaded = _compare(d, hf)
    assert not loaded.config.tie_embeddings


def test_tied_llama31_rope_scaling_matches_hf(tmp_path):
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # short so the blended band covers real frequencies
    hf = transformers.LlamaForCausalLM(_llama_cfg(tie_word_embeddings=True, rope_scaling=rs,
                                                  rope_theta=500000.0, head_dim=32, num_attention_heads=2,
                                                  num_key_value_heads=1)).eval()
    loaded = _compare(_save(tmp_path, hf), hf, seq=40)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.type == "llama3"
    assert loaded.model.output.weight is loaded.model.tok_embeddings.weight


def test_qwen2_qkv_bias_matches_hf(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, use_sliding_window=False)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases: HF initialises them to zero, which would not test anything
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    loaded = _compare(_save(tmp_path, hf), hf)
    assert loaded.config.qkv_bias


def test_config_from_hf_llama31_dict():
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "intermediate_size": 14336,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False,
    })
    assert cfg == ModelConfig.from_preset("llama-3.1-8b").replace(name=cfg.name)


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "num_attention_heads": 4})
    with pytest.raises(ValueError, match="n_heads \\(6\\) must be a multiple of n_kv_heads \\(4\\)"):
        ModelConfig(dim=64, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8,
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unknown preset 'llama-9'"):
        ModelConfig.from_preset("llama-9")


# ----------------------------------------------------------------------------- broken checkpoints


@pytest.fixture
def ckpt(tmp_path):
    hf = transformers.LlamaForCausalLM(_llama_cfg())
    return _save(tmp_path, hf, shard="60KB")


def _shards(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def test_missing_tensor_is_named(ckpt):
    wm = _shards(ckpt)
    name = "model.layers.1.mlp.up_proj.weight"
    f = os.path.join(ckpt, wm[name])
    sd = load_file(f)
    del sd[name]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*lacks it"):
        load(ckpt, dtype=torch.float32, progress=False)


def test_missing_tensor_in_index_is_named(ckpt):
    edit_json(os.path.join(ckpt, "model.safetensors.index.json"),
              lambda idx: idx["weight_map"].pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' is missing"):
        load(ckpt, dtype=torch.float32, progress=False)


def test_mismatched_shape_is_named(ckpt):
    wm = _shards(ckpt)
    name = "model.layers.0.self_attn.o_proj.weight"
    f = os.path.join(ckpt, wm[name])
    sd = load_file(f)
    sd[name] = sd[name][:, :32].contiguous()
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight' has shape \(64, 32\), expected \(64, 64\)"):
        load(ckpt, dtype=torch.float32, progress=False)


def test_truncated_shard_is_named(ckpt):
    wm = _shards(ckpt)
    f = os.path.join(ckpt, wm["model.layers.1.mlp.down_proj.weight"])
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(f)}.*truncated"):
        load(ckpt, dtype=torch.float32, progress=False)


def test_missing_shard_file_is_named(ckpt):
    wm = _shards(ckpt)
    f = wm["model.norm.weight"]
    os.remove(os.path.join(ckpt, f))
    with pytest.raises(CheckpointError, match=rf"shard '{f}'.*does not exist"):
        load(ckpt, dtype=torch.float32, progress=False)


def test_extra_layer_is_rejected(ckpt):
    """A config with fewer layers than the checkpoint must not load silently."""
    edit_json(os.path.join(ckpt, "config.json"), lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\."):
        load(ckpt, dtype=torch.float32, progress=False)


def test_truncated_gguf_is_named(tmp_path):
    src = smollm2_path(importorskip_gguf=False)
    dst = tmp_path / "cut.gguf"
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(fi.read(os.path.getsize(src) - 5000))
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated.*tensor '"):
        load(str(dst), dtype=torch.float32, progress=False)


def test_unknown_path_message():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("/nonexistent/model.gguf")


def test_truncated_single_file_checkpoint_names_the_tensor(tmp_path):
    """Regression: without an index the header was opened with safe_open before the size check, whose
    error named neither the tensor nor the cut; a file cut inside its header names the file."""
    d = _save(tmp_path, transformers.LlamaForCausalLM(_llama_cfg()))
    f = os.path.join(d, "model.safetensors")
    assert not os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: file is truncated: tensor '{re.escape(last)}'"):
        load(d, dtype=torch.float32, progress=False)
    with open(f, "r+b") as fh:
        fh.truncate(8 + n // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: file is truncated inside its header"):
        load(d, dtype=torch.float32, progress=False)
