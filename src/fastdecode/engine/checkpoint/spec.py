"""What a model is made of, in a checkpoint's tensor names, and an opened checkpoint (``Checkpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fastdecode.models.config import ModelConfig

# (our name, [(checkpoint name, expected shape)], transform of the parts) -> one tensor
Spec = list[tuple[str, list[tuple[str, tuple]], Optional[Callable]]]

BLOCK_LINEARS = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight",
                 "feed_forward.w2.weight")


def scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale"


def model_spec(cfg: ModelConfig, names: dict) -> Spec:
    """What each model tensor is made of, in checkpoint names given by ``names`` (a format's name table)."""
    dim, I = cfg.dim, cfg.intermediate_size
    spec: Spec = [("tok_embeddings.weight", [(names["embed"], (cfg.vocab_size, dim))], None)]
    for i in range(cfg.n_layers):
        n = {k: v.format(i=i) for k, v in names.items()}
        p = f"layers.{i}."
        qkv = [(n["q"], (cfg.q_size, dim)), (n["k"], (cfg.kv_size, dim)), (n["v"], (cfg.kv_size, dim))]
        spec += [
            (p + "attention_norm.weight", [(n["attn_norm"], (dim,))], None),
            (p + "attention.wqkv.weight", qkv, "qkv"),
            (p + "attention.wo.weight", [(n["o"], (dim, cfg.q_size))], None),
            (p + "ffn_norm.weight", [(n["ffn_norm"], (dim,))], None),
            (p + "feed_forward.w13.weight", [(n["gate"], (I, dim)), (n["up"], (I, dim))], None),
            (p + "feed_forward.w2.weight", [(n["down"], (dim, I))], None),
        ]
        if cfg.qkv_bias:
            spec.append((p + "attention.wqkv.bias", [(n["q_bias"], (cfg.q_size,)), (n["k_bias"], (cfg.kv_size,)),
                                                     (n["v_bias"], (cfg.kv_size,))], "qkv"))
        if cfg.qk_norm:  # Qwen3's per-head norms: one [D] weight each, replicated under TP
            spec += [(p + f"attention.{w}_norm.weight", [(n[f"{w}_norm"], (cfg.head_dim,))], None) for w in "qk"]
    spec.append(("norm.weight", [(names["norm"], (dim,))], None))
    if not cfg.tie_embeddings:
        spec.append(("output.weight", [(names["output"], (cfg.vocab_size, dim))], None))
    return spec


@dataclass
class Checkpoint:
    """An opened checkpoint: its config, what the model is made of, and how to read each tensor.

    ``get(name)``: a tensor, or a lazy slice (``get_shape()``; ``[a:b]`` / ``[:, a:b]`` read only those bytes).
    ``qkv_transform(name, t)`` gets a tensor or an ``Int4Weight`` of q / k / v rows: the whole part, or rank's
    shard of it (whole heads); it must act within each head (a row permutation per head, say).
    ``fp8_ckpt``: block projections are stored as FP8 with ``<name>_scale`` tensors; ``int4``: block
    projections stored as int4 (an ``engine.checkpoint.int4.Int4Source``), loaded as they are.
    """

    kind: str  # "hf" or "gguf"
    source: str  # the path, named in errors
    config: ModelConfig
    spec: Spec
    get: Callable
    available: set
    ignore: tuple = ()  # regular expressions of tensor names the model does not use
    qkv_transform: Optional[Callable] = None
    rope_freq_factors: Optional[torch.Tensor] = None
    fp8_ckpt: bool = False
    int4: Optional[object] = None
    meta: Optional[dict] = None  # GGUF metadata (the vocabulary of the tokenizer)
