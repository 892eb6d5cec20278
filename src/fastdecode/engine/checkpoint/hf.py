"""A Hugging Face model directory (config.json, *.safetensors, sharded or not) opened as a ``Checkpoint``:
tensor names, and how block projections are stored (plain, FP8 with ``weight_scale``, GPTQ, AWQ,
``fastdecode quantize``)."""

from __future__ import annotations

from typing import Optional

from fastdecode.engine.checkpoint.detect import checkpoint_format, quant_config
from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.checkpoint.int4 import hf_int4_source
from fastdecode.engine.checkpoint.safetensors_io import SafetensorsReader, safetensors_files
from fastdecode.engine.checkpoint.spec import Checkpoint, model_spec
from fastdecode.models.config import ModelConfig

HF_NAMES = {
    "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias", "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
HF_IGNORE = (r"rotary_emb\.inv_freq$",)

# static activation scales of FP8 checkpoints: unused (activations are quantised per token at run time)
HF_FP8_IGNORE = (r"\.input_scale$", r"\.input_scale_ub$", r"\.k_scale$", r"\.v_scale$")


def open_hf(path: str, *, quant: Optional[str] = None) -> Checkpoint:
    """A Hugging Face model directory: config.json, *.safetensors (sharded or not); its tokenizer.json is the
    loader's.

    Quantised checkpoints (FP8 with ``weight_scale``, GPTQ, AWQ, ``fastdecode quantize``) load as stored
    whatever ``quant`` says, unless it asks for the other format (then ``CheckpointError``)."""
    from fastdecode.models.quantize import method_of

    cfg = ModelConfig.from_hf(path)
    files = safetensors_files(path)
    fmt = checkpoint_format(path, files)
    kind = "int4" if fmt in ("gptq", "awq") else method_of(fmt)
    if kind is not None and quant not in (None, kind):
        raise CheckpointError(f"{path}: the checkpoint is quantised as {fmt}; it cannot be loaded with "
                              f"quant={quant!r} (load it with quant={kind!r} or None)")
    reader = SafetensorsReader()
    spec = model_spec(cfg, HF_NAMES)
    if cfg.tie_embeddings and "lm_head.weight" in files:
        files = {k: v for k, v in files.items() if k != "lm_head.weight"}  # some tied checkpoints store a copy
    # reader.get looked up at each read (tests wrap SafetensorsReader.get to record what is read)
    lazy = lambda n: reader.get(files, n)  # noqa: E731  (a safetensors slice: [a:b] reads only those bytes)
    int4 = None
    if kind == "int4":
        int4 = hf_int4_source(fmt, quant_config(path), lambda n: reader.get(files, n)[...], set(files), lazy=lazy)
    return Checkpoint("hf", path, cfg, spec, lazy, set(files),
                      ignore=HF_IGNORE + (HF_FP8_IGNORE if kind == "fp8" else ()), fp8_ckpt=kind == "fp8", int4=int4)
