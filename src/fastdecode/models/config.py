"""Model configuration: one dataclass for the Llama family, read from HF config.json or GGUF metadata.

Covers Llama 2, Llama 3 / 3.1 (``rope_scaling`` of type ``llama3``), SmolLM2, Qwen2-style attention
(``qkv_bias``) and Qwen3 (``qk_norm``: an RMSNorm over each q and k head before RoPE, explicit ``head_dim``);
grouped-query attention via ``n_kv_heads``; tied or untied embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

ROPE_SCALING_TYPES = ("llama3", "linear")
#: HF ``model_type`` values read by ``ModelConfig.from_hf`` (mistral only without a sliding window in use)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3``: Llama 3.1's wavelength-banded scaling; ``linear``: positions / factor."""

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling type must be one of {ROPE_SCALING_TYPES}, got {self.type!r}")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    ``max_seq_len`` is the trained context length; the engine may allocate a smaller KV cache.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    intermediate_size: int = 14336
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScaling] = None
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm (weight [head_dim], norm_eps) on each q / k head, before RoPE
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "intermediate_size", "max_seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config {f} must be a positive integer, got {v!r}")
        _check_eps(self.norm_eps, "norm_eps")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"config n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"config dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"config head_dim must be even for RoPE, got {self.head_dim}")

    # ------------------------------------------------------------------ sizes

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.dim * (self.q_size + 2 * self.kv_size) + self.q_size * self.dim
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.dim * self.intermediate_size
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + self.dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ readers

    @classmethod
    def from_hf(cls, cfg: dict | str | os.PathLike) -> "ModelConfig":
        """From a Hugging Face ``config.json`` (path, directory or parsed dict)."""
        where = "config.json"
        if not isinstance(cfg, dict):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            with open(path) as f:
                try:
                    cfg = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}:{e.colno}") from None
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object ({{...}}), got a JSON {_json_kind(cfg)}")
        try:
            return cls._from_hf_dict(cfg)
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or [""])[0]
        model_type = cfg.get("model_type", "")
        if model_type not in HF_MODEL_TYPES + ("",) and "Llama" not in arch:
            raise ValueError(
                f"config.json model_type {model_type!r} ({arch or 'no architectures'}) is not a Llama-family "
                f"decoder this version runs (supported model_type: {', '.join(HF_MODEL_TYPES)})"
            )
        n_heads = cfg["num_attention_heads"]
        rs = cfg.get("rope_scaling") or None
        if rs is None and isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5 spelling
            rp = cfg["rope_parameters"]
            if rp.get("rope_type", "default") != "default":
                rs = rp
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", model_type == "mistral"):
            # sliding-window attention equals full attention while the context fits in the window
            max_pos = min(max_pos, int(window))
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            vocab_size=cfg["vocab_size"],
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or 0,
            norm_eps=_check_eps(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_from_hf(rs),
            max_seq_len=max_pos,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            name=cfg.get("_name_or_path", "") or model_type,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: Optional[set[str]] = None) -> "ModelConfig":
        """From GGUF metadata (key -> value, as read by ``fastdecode.engine.gguf_loader``).

        ``tensor_names`` tells tied embeddings (no ``output.weight``) and qkv bias apart.
        """
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"GGUF general.architecture {arch!r} is not supported (llama, qwen2)")

        def get(key, default=None):
            k = f"{arch}.{key}"
            if k not in meta:
                if default is None:
                    raise ValueError(f"GGUF metadata lacks {k!r}")
                return default
            return meta[k]

        n_heads = int(get("attention.head_count"))
        dim = int(get("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", ()))
        rs = None
        stype = meta.get(f"{arch}.rope.scaling.type")
        if stype == "linear":
            rs = RopeScaling(type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
        elif stype not in (None, "none"):
            raise ValueError(f"GGUF rope scaling type {stype!r} is not supported")
        # Llama 3.1 GGUFs bake the llama3 scaling into a 'rope_freqs.weight' tensor; the loader
        # reads its factors (see gguf_loader), so nothing to do here.
        names = tensor_names or set()
        return cls(
            dim=dim,
            n_layers=int(get("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            vocab_size=int(vocab),
            intermediate_size=int(get("feed_forward_length")),
            head_dim=int(meta.get(f"{arch}.attention.key_length", dim // n_heads)),
            norm_eps=_check_eps(get("attention.layer_norm_rms_epsilon", 1e-5),
                                f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rs,
            max_seq_len=int(get("context_length", 4096)),
            tie_embeddings=bool(names) and "output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            name=str(meta.get("general.name", arch)),
        )

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return PRESETS[key]


def _json_kind(v) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(v), "null")


def _check_eps(v, key: str) -> float:
    """The RMSNorm epsilon ``v`` as a float; ValueError naming ``key`` unless it is a finite number > 0
    (0 divides by zero on an all-zero row, NaN / inf poison every activation)."""
    try:
        eps = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"config {key} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"config {key} must be a finite number > 0, got {v!r}")
    return eps


def _rope_scaling_from_hf(rs: Optional[dict]) -> Optional[RopeScaling]:
    if not rs:
        return None
    rtype = rs.get("rope_type") or rs.get("type")
    if rtype in (None, "default"):
        return None
    if rtype == "llama3":
        return RopeScaling(
            type="llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    if rtype == "linear":
        return RopeScaling(type="linear", factor=float(rs["factor"]))
    raise ValueError(f"rope_scaling type {rtype!r} is not supported (supported: llama3, linear, default)")


_LLAMA31_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

#: Shapes of well-known models, for random-weight benchmarks (weights are never downloaded).
PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_seq_len=131072, name="llama-3.1-8b",
    ),
    "llama-3.1-70b": ModelConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, intermediate_size=28672,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_seq_len=131072, name="llama-3.1-70b",
    ),
    "llama-3.1-405b": ModelConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, intermediate_size=53248,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_seq_len=131072, name="llama-3.1-405b",
    ),
    "smollm2-135m": ModelConfig(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, intermediate_size=1536,
        norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True, name="smollm2-135m",
    ),
    # for tests and CPU smoke runs
    "tiny": ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, intermediate_size=128,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, name="tiny",
    ),
}
