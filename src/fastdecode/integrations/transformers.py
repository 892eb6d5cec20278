"""fastdecode's fused ops in a loaded Hugging Face transformers model: ``apply(model, ...)``.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    apply(model)                        # fused add + RMSNorm, RMSNorm, SiLU-and-mul
    apply(model, linear="fp8")          # ... and every block projection FP8 (weights per output channel)
    model.generate(ids, max_new_tokens=128, cache_implementation="static")   # compiled by transformers on CUDA

Supported: ``LlamaForCausalLM`` / ``LlamaModel`` and the same two classes of Mistral, Qwen2 and Qwen3
(``SUPPORTED``); any other class is refused by name (``TypeError``). What is patched, per decoder layer
(``docs/integrations.md`` says why this shape):

* ``norm=True``: every RMSNorm module of the model (the layers' two, the final norm, Qwen3's per-head q / k norms)
  runs ``fastdecode.ops.rms_norm``; and the layer's ``forward`` is replaced so that the residual add after the
  attention and the ``post_attention_layernorm`` are one ``fused_add_rms_norm``. The add after the MLP stays a
  PyTorch add (it ends the layer: fusing it with the next layer's norm would change what a layer returns).
  The layer's ``forward`` is written for transformers 5 (``FUSED_LAYER_MAJORS``); with another major version only
  the RMSNorm modules are patched (one warning).
* ``act=True``: the MLP's ``gate_proj`` and ``up_proj`` become one ``gate_up_proj`` (their weights concatenated,
  [gate | up]: one GEMM instead of two) followed by ``fastdecode.ops.silu_and_mul`` (``silu_and_mul_fp8`` when
  ``down_proj`` is FP8, so that the activation reaches it quantised). The two old modules are removed.
* ``linear="fp8"`` / ``"int4"``: every ``nn.Linear`` inside the decoder layers (q, k, v, o, gate | up, down;
  not the lm head, not the embedding) becomes ``HFFp8Linear`` (per-channel FP8 weights; activations quantised per
  token at run time (W8A8), except at up to 4 token rows (decode), where the 16-bit activation goes in as it is
  (W8A16, SiLU-and-mul inside ``down_proj``'s loads), as the engine's default decode does) or ``HFInt4Linear``
  (W4A16, RTN group 128 with zero points), quantised here, by ``fastdecode.quant`` as ``fastdecode quantize`` does.

Module *instances* are patched (bound ``forward`` methods and replaced children of this model); transformers'
classes are untouched, so another model of the same class in the process runs as before. ``apply`` records what
it did in ``model.fastdecode_patch`` and refuses a model patched already.

Semantics: in fp32 the patched model computes what transformers computes (the same greedy tokens; the norms are
bitwise the same formula, SiLU and the fused gate | up GEMM differ by rounding only). In bf16 / fp16 fastdecode
rounds once (``docs/architecture.md``, "Numerical conventions") where transformers' RMSNorm rounds the normalised
value to the input dtype before multiplying by the weight: one rounding step apart. For inference only: no
gradient flows through the fastdecode ops. Call ``apply`` after moving the model to its device and dtype.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Fp8Linear
from fastdecode.models.quantize import quantize_weight_int4
from fastdecode.ops._common import BACKENDS, resolve_backend
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_fp8
from fastdecode.ops.norm import fused_add_rms_norm, rms_norm
from fastdecode.ops.w8a16 import DECODE_MAX_M as W8A16_DECODE_MAX_M
from fastdecode.quant.fp8 import quantize_weight_fp8

log = logging.getLogger("fastdecode")

#: model_type -> the class-name prefix of its transformers modules (``LlamaForCausalLM``, ``LlamaDecoderLayer``...)
SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
MODEL_SUFFIXES = ("ForCausalLM", "Model")
LINEAR_METHODS = (None, "fp8", "int4")
SILU_ACTS = ("silu", "swish")  # transformers' names of SiLU (ACT2FN)
#: transformers major versions whose decoder layer ``_layer_forward`` reproduces (it returns a tensor and passes its
#: arguments on to ``self_attn`` by name; read in 5.24); with another (4.x, a future 6) ``norm=True`` patches the
#: RMSNorm modules only, without the fused residual add, and says so in one warning
FUSED_LAYER_MAJORS = (5,)


@dataclass(frozen=True)
class Patch:
    """What ``apply`` did to a model (``model.fastdecode_patch``)."""

    family: str  # "llama", "mistral", "qwen2", "qwen3"
    norm: bool
    fused_add: bool  # the layers' forward replaced (residual add + post-attention norm fused)
    act: bool
    linear: Optional[str]
    backend: str  # what the ops are called with: "triton" or "torch", resolved at patch time
    transformers_version: str


def supported_classes() -> list[str]:
    return [p + s for p in SUPPORTED.values() for s in MODEL_SUFFIXES]


# ----------------------------------------------------------------------------- projections (nn.Linear-shaped)


class HFFp8Linear(Fp8Linear):
    """``Fp8Linear`` called as an ``nn.Linear`` (``module(x)``): ``y = (x_fp8 @ W_fp8.T) * x_scale * w_scale (+ b)``;
    x is a float tensor (quantised per token here) or the ``(fp8, scale)`` pair of ``silu_and_mul_fp8``. Up to
    ``a16_max_rows`` token rows (decode; 4 unless set) a 16-bit x is not quantised: W8A16 (``ops.w8a16``), as the
    engine's default ``fp8_a16`` decode, one kernel instead of two and closer to the unquantised model; set
    ``a16_max_rows = 0`` for W8A8 at every size."""

    backend: Optional[str] = None  # the ops' backend argument (None: FASTDECODE_BACKEND, else "auto")

    @classmethod
    def from_linear(cls, lin: nn.Linear, backend: Optional[str] = None) -> "HFFp8Linear":
        w = lin.weight.detach()
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", out_dtype=w.dtype)
        q, s = quantize_weight_fp8(w, "channel")  # real = q * s[:, None]
        m.weight = nn.Parameter(q, requires_grad=False)
        m.weight_scale = nn.Parameter(s.reshape(-1), requires_grad=False)
        if lin.bias is not None:
            m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        m.backend = backend
        m.a16_max_rows = W8A16_DECODE_MAX_M
        return m

    def forward(self, x):
        return super().forward(x, self.backend)


class HFInt4Linear(Int4Linear):
    """``Int4Linear`` called as an ``nn.Linear``: ``y = x @ dequantize_int4(W).T (+ b)`` (W4A16; fp32 activations
    run the reference)."""

    backend: Optional[str] = None

    @classmethod
    def from_linear(cls, lin: nn.Linear, backend: Optional[str] = None) -> "HFInt4Linear":
        w = lin.weight.detach()
        bias = None if lin.bias is None else lin.bias.detach().clone()
        m = cls.from_weight(quantize_weight_int4(w), bias, dtype=w.dtype)
        m.backend = backend
        return m

    def forward(self, x):
        return super().forward(x, self.backend)


# ----------------------------------------------------------------------------- the patched forwards


def _norm_forward(backend):
    def forward(self, hidden_states):
        if self.weight.dtype != hidden_states.dtype:  # transformers would promote to the weight's dtype: its code
            return type(self).forward(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=backend)
    return forward


def _layer_forward(arg_names: tuple, backend):
    """The decoder layer of transformers 5 (Llama, Mistral, Qwen2, Qwen3 alike), with the residual add after the
    attention fused into the post-attention norm. Every argument reaches ``self_attn`` as the original passes it."""

    def forward(self, hidden_states, *args, **kwargs):
        if args:  # the model passes them by name; a positional call is mapped onto the original's names
            kwargs.update(zip(arg_names, args))
        residual = hidden_states  # [B, S, dim]; never written (a caller may hold it: inputs_embeds, hidden states)
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(hidden_states=h, **kwargs)
        ln = self.post_attention_layernorm
        if h.dtype == residual.dtype == ln.weight.dtype and h.is_contiguous():
            # h <- residual + h in place (h: o_proj's fresh output, which nothing else holds), then the norm
            normed = fused_add_rms_norm(residual, h, ln.weight, ln.variance_epsilon, backend=backend)
            residual = h
        else:
            residual = residual + h
            normed = ln(residual)
        return residual + self.mlp(normed)
    return forward


def _mlp_forward(backend, fp8: bool):
    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # [..., 2I] = gate | up
        if fp8:  # decode rows: W8A16 with SiLU-and-mul in down_proj's loads (None: W8A8 after silu_and_mul_fp8)
            y = self.down_proj.forward_glu(gate_up, self.down_proj.backend)
            if y is not None:
                return y
        h = silu_and_mul_fp8(gate_up, backend=backend) if fp8 else silu_and_mul(gate_up, backend=backend)
        return self.down_proj(h)
    return forward


def _bind(module: nn.Module, fn) -> None:
    module.forward = types.MethodType(fn, module)  # this instance only; the class keeps its forward


# ----------------------------------------------------------------------------- checks


def _family(model) -> str:
    """The model's family (a key of ``SUPPORTED``), or TypeError naming its class."""
    cls = type(model)
    for family, prefix in SUPPORTED.items():
        if cls.__module__ == f"transformers.models.{family}.modeling_{family}" and \
                cls.__name__ in (prefix + s for s in MODEL_SUFFIXES):
            return family
    raise TypeError(f"fastdecode.integrations.transformers.apply does not know {cls.__module__}.{cls.__name__}; "
                    f"supported: {', '.join(supported_classes())} (the exact transformers classes)")


def _layers(model, family: str) -> list[nn.Module]:
    base = model.model if type(model).__name__.endswith("ForCausalLM") else model
    layers = list(base.layers)
    want = SUPPORTED[family] + "DecoderLayer"
    for i, layer in enumerate(layers):
        if type(layer).__name__ != want:
            raise TypeError(f"layer {i} of the model is a {type(layer).__name__}, not a {want}: not patched")
    return layers


def _transformers_major() -> tuple[int, str]:
    import transformers

    v = transformers.__version__
    try:
        return int(v.split(".")[0]), v
    except ValueError:  # pragma: no cover
        return 0, v


def _check(model, linear, backend, act: bool) -> None:
    if getattr(model, "fastdecode_patch", None) is not None:
        raise ValueError(f"the model is patched already ({model.fastdecode_patch}); load a fresh one to patch again")
    if linear not in LINEAR_METHODS:
        raise ValueError(f"linear must be one of {LINEAR_METHODS}, got {linear!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"the model has weights on the meta device ({meta[0]}, ...); load them before apply")
    act_name = getattr(model.config, "hidden_act", None)
    if act and act_name not in SILU_ACTS:
        raise ValueError(f"act=True fuses SiLU-and-mul, but the model's hidden_act is {act_name!r}; pass act=False")


# ----------------------------------------------------------------------------- apply


def apply(model: nn.Module, *, norm: bool = True, act: bool = True, linear: Optional[str] = None,
          backend: Optional[str] = None) -> nn.Module:
    """Patch a loaded transformers Llama / Mistral / Qwen2 / Qwen3 model in place with fastdecode's ops; returns it.

    ``norm``: RMSNorm -> ``rms_norm``, the post-attention residual add + norm -> ``fused_add_rms_norm``;
    ``act``: gate | up as one GEMM, then ``silu_and_mul``; ``linear``: None, ``"fp8"`` (W8A8) or ``"int4"``
    (W4A16 RTN) for the decoder layers' projections, quantised now; ``backend``: ``"auto"``, ``"triton"`` or
    ``"torch"`` (None: ``FASTDECODE_BACKEND``, else ``"auto"``: Triton on CUDA, the PyTorch reference on the CPU),
    resolved now for the device of the model's weights and passed to every op.
    Raises TypeError for a model class it does not know, ValueError for bad arguments or a patched model.
    """
    family = _family(model)
    layers = _layers(model, family)
    _check(model, linear, backend, act)
    _check_targets(model, layers, norm, act)
    # resolved once, here: under torch.compile the ops then see a fixed backend (no environment lookup, and no
    # fallback log line, whose lock would break a fullgraph trace on the CPU)
    backend = resolve_backend(backend, next(model.parameters()).device, "fastdecode.integrations.transformers")
    major, version = _transformers_major()
    fused_add = norm and major in FUSED_LAYER_MAJORS
    if norm and not fused_add:
        log.warning("fastdecode: transformers %s: only the RMSNorm modules are patched (the fused residual add "
                    "is written for transformers %s)", version, " / ".join(f"{m}.x" for m in FUSED_LAYER_MAJORS))
    with torch.no_grad():
        if norm:
            norm_cls = type(layers[0].input_layernorm)
            for m in model.modules():
                if type(m) is norm_cls:
                    _bind(m, _norm_forward(backend))
        for layer in layers:
            if act:
                _fuse_gate_up(layer.mlp)
            if linear is not None:
                _quantize_linears(layer, linear, backend)
            if act:
                _bind(layer.mlp, _mlp_forward(backend, fp8=isinstance(layer.mlp.down_proj, HFFp8Linear)))
            if fused_add:
                _bind(layer, _layer_forward(_arg_names(layer), backend))
    model.fastdecode_patch = Patch(family, norm, fused_add, act, linear, backend, version)
    return model


def _arg_names(layer: nn.Module) -> tuple:
    """Names of the original forward's parameters after ``hidden_states`` (those a positional call fills)."""
    import inspect

    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]  # self, hidden_states
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _check_targets(model, layers, norm: bool, act: bool) -> None:
    """Before anything changes: the modules whose forward would be bound have none of their own (bound by someone
    else: accelerate's device-map hooks, another patch, which ours would silently drop), and with ``act`` the
    projections to concatenate are plain ``nn.Linear`` (not quantised by another library)."""
    targets = [(n, m) for n, m in model.named_modules() if norm and type(m) is type(layers[0].input_layernorm)]
    if act:
        targets += [(n, m) for n, m in model.named_modules() if any(m is layer.mlp for layer in layers)]
        for i, layer in enumerate(layers):
            g, u = layer.mlp.gate_proj, layer.mlp.up_proj
            if type(g) is not nn.Linear or type(u) is not nn.Linear:
                raise TypeError(f"act=True concatenates the MLP's gate_proj and up_proj, which must be nn.Linear; "
                                f"layer {i} has {type(g).__name__} / {type(u).__name__} (pass act=False)")
    if norm:
        targets += [(n, m) for n, m in model.named_modules() if any(m is layer for layer in layers)]
    for name, m in targets:
        if "forward" in vars(m):
            raise ValueError(f"module {name or type(m).__name__} already has a forward of its own (accelerate hooks "
                             f"from a device_map, or another patch): not patched")


def _fuse_gate_up(mlp: nn.Module) -> None:
    """``gate_proj`` + ``up_proj`` -> one ``gate_up_proj`` ([gate | up] rows, silu_and_mul's layout)."""
    g, u = mlp.gate_proj, mlp.up_proj
    fused = nn.Linear(g.in_features, 2 * g.out_features, bias=g.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([g.weight, u.weight]), requires_grad=False)
    if g.bias is not None:
        fused.bias = nn.Parameter(torch.cat([g.bias, u.bias]), requires_grad=False)
    del mlp.gate_proj, mlp.up_proj  # the concatenated copy replaces them: the same memory
    mlp.gate_up_proj = fused


def _quantize_linears(layer: nn.Module, method: str, backend) -> None:
    make = HFFp8Linear.from_linear if method == "fp8" else HFInt4Linear.from_linear
    for name, m in list(layer.named_modules()):
        if type(m) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, make(m, backend))


__all__ = ["HFFp8Linear", "HFInt4Linear", "LINEAR_METHODS", "Patch", "SUPPORTED", "apply", "supported_classes"]
