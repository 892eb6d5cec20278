"""Quantisation transforms applied after the model is built or loaded (gpt-fast style).

    model = load(path).model
    quantize_model(model, "fp8")       # every block's wqkv / wo / w13 / w2 -> Fp8Linear (W8A8)
    quantize_model(model, "int4")      # every block's wqkv / wo / w13 / w2 -> Int4Linear (W4A16, RTN g128)
    quantize_model(model, "int4", head="int4")  # ... and the lm head too (``quantize_head``; also head alone)

Formats are named by strings recorded in quantised checkpoints (``fastdecode quantize``), so that loading
a checkpoint with the wrong kernels is refused rather than silently wrong (the names, the methods and
``method_of`` live in ``fastdecode.quant.formats``; they are re-exported here):

* ``fp8-w8a8-channel``: FP8 e4m3 weights with one float32 scale per output channel; activations are
  quantised per token at run time (by the fused norm / SiLU-and-mul kernels). The embedding, the norms
  and the lm head stay in the model dtype.
* ``int4-w4a16-g128-zero``: int4 weights, round-to-nearest with a zero point (``w = (q - zero) * scale``,
  ``scale = (max - min) / 15`` over the group, the range widened to include 0), one scale and one uint8 zero
  per group of 128 input columns (64 or 32 where K is not a multiple of 128, e.g. SmolLM2's 576);
  activations stay bf16/fp16. The embedding, the norms and the lm head stay in the model dtype. The
  symmetric variant (``w = (q - 8) * scale``, ``int4-w4a16-g128-sym``, ``quantize_model_int4(m,
  symmetric=True)``) saves the zeros (1/64 of the bytes) but measured much worse on the shipped text
  (benchmarks/NOTES.md: perplexity +51% against +19% on SmolLM2-135M), so it is not the default.
* other ``int4-w4a16-*`` names record where imported int4 weights came from (``-gptq``, ``-awq``,
  ``-gguf``); each tensor carries its own group size and zero mode, and the checkpoint records the kernel
  layout (``fastdecode.quant.int4.LAYOUT``) its nibbles are packed in.

The lm head (``model.output``) is quantised only on request (``quantize_head(model, "fp8" | "int4")``): FP8 per
output channel with the final norm emitting FP8 + per-token scales (W8A8), or int4 RTN as the block projections
(W4A16, group 128 along K). It is recorded in ``model.head_quant`` and in ``model.format_label``
(``...+head-int4``), not in ``quant_format``: checkpoints do not store a quantised head (export refuses it).
With tied embeddings the embedding keeps the table in the model dtype and the head holds a quantised copy:
V * dim (FP8) or about V * dim / 2 (int4) bytes more in memory, while a decode step then reads the
quantised head plus only the looked-up embedding rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Fp8Linear, Linear, Transformer
from fastdecode.quant.formats import (  # noqa: F401  (re-exported: the names' old home)
    FORMATS, FP8_FORMAT, HEAD_METHODS, INT4_FAMILY, INT4_FORMAT, INT4_GROUP, INT4_SYMMETRIC, METHODS, QUANT_METHODS,
    check_head, int4_format, method_of,
)
from fastdecode.quant.fp8 import quantize_weight_fp8
from fastdecode.quant.int4 import SCALE_DTYPES, quantize_int4, rtn_group_size

# the projections of a block that are quantised (the lm head and the embedding are not)
BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


def int4_scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scales in the model dtype when the kernels take it (bf16 / fp16), else bf16 (fp32 CPU models)."""
    return dtype if dtype in SCALE_DTYPES else torch.bfloat16


def fp8_linear_from(lin: Linear, out_dtype: Optional[torch.dtype] = None) -> Fp8Linear:
    """An ``Fp8Linear`` holding ``lin``'s weight quantised per output channel (on ``meta``: empty, for loading)."""
    w = lin.weight
    out_dtype = out_dtype or w.dtype
    m = Fp8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device=w.device, out_dtype=out_dtype)
    m.gemm_impl = lin.gemm_impl
    if w.device.type == "meta":
        return m
    q, s = quantize_weight_fp8(w, "channel")  # s: (N,) float32, real = q * s
    m.weight.data = q
    m.weight_scale.data = s.reshape(-1)
    if lin.bias is not None:
        m.bias.data = lin.bias.detach().to(out_dtype)
    return m


def quantize_weight_int4(w: torch.Tensor, group_size: int = INT4_GROUP, symmetric: bool = INT4_SYMMETRIC):
    """RTN of a dense (N, K) weight as ``quantize_model_int4`` does it: group ``rtn_group_size(K, group_size)``,
    scales in ``int4_scale_dtype(w.dtype)``. Returns an ``Int4Weight``."""
    return quantize_int4(w.detach(), rtn_group_size(w.shape[1], group_size), symmetric=symmetric,
                         scale_dtype=int4_scale_dtype(w.dtype))


def int4_linear_from(lin: Linear, group_size: int = INT4_GROUP, symmetric: bool = INT4_SYMMETRIC) -> Int4Linear:
    """An ``Int4Linear`` holding ``lin``'s weight RTN-quantised (``quantize_weight_int4``); on ``meta``: the
    structure only, for loading."""
    w = lin.weight
    if w.device.type == "meta":
        return Int4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          group_size=rtn_group_size(lin.in_features, group_size),
                          zero_mode="sym" if symmetric else "zero", device="meta", dtype=w.dtype,
                          scale_dtype=int4_scale_dtype(w.dtype))
    packed = quantize_weight_int4(w, group_size, symmetric)
    return Int4Linear.from_weight(packed, None if lin.bias is None else lin.bias.detach(), dtype=w.dtype)


def _swap_block_linears(model: Transformer, make) -> None:
    for layer in model.layers:
        for path in BLOCK_LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, make(getattr(parent, name)))


def quantize_model_fp8(model: Transformer) -> Transformer:
    """In place: every block's projections -> ``Fp8Linear`` (per-channel FP8 weights), and the norms before
    wqkv / w13 and the SiLU-and-mul before w2 switched to FP8 output. Returns the model.

    On a ``meta`` model only the structure changes (the loader then assigns FP8 tensors and scales).
    """
    if model.quant is not None:
        raise ValueError(f"the model is already quantised ({model.quant!r})")
    dtype = model.tok_embeddings.weight.dtype
    _swap_block_linears(model, lambda lin: fp8_linear_from(lin, out_dtype=dtype))
    model.quant_format = FP8_FORMAT
    model.set_kernels()  # FP8 outputs of the fused norms / activation where their switches are on
    return model


def quantize_model_int4(model: Transformer, group_size: int = INT4_GROUP,
                        symmetric: bool = INT4_SYMMETRIC) -> Transformer:
    """In place: every block's projections -> ``Int4Linear``, RTN with ``group_size`` along K (the largest of
    128 / 64 / 32 not above it that divides K, else per channel), with zero points unless ``symmetric``.
    Returns the model.

    On a ``meta`` model only the structure changes (the shapes of this RTN format). Under tensor
    parallelism, call it after sharding: each rank quantises its own shard (groups never straddle a shard).
    """
    if model.quant is not None:
        raise ValueError(f"the model is already quantised ({model.quant!r})")
    _swap_block_linears(model, lambda lin: int4_linear_from(lin, group_size, symmetric))
    model.quant_format = int4_format(group_size, symmetric)
    model.set_kernels()  # int4_gemm switch; no FP8 activations
    return model


def quantize_head(model: Transformer, method: str, group_size: int = INT4_GROUP,
                  symmetric: bool = INT4_SYMMETRIC) -> Transformer:
    """In place: the lm head ``model.output`` -> ``Fp8Linear`` (``method="fp8"``: per-channel weights, the
    final norm emits the per-token FP8 activation) or ``Int4Linear`` (``"int4"``: W4A16, RTN as
    ``quantize_model_int4``). Tied embeddings are untied: the embedding keeps the dense table. Under tensor
    parallelism, call it after sharding (each rank quantises its vocabulary rows). Returns the model."""
    check_head(method, "method")
    if method is None:
        raise ValueError(f"method must be one of {HEAD_METHODS}, got None")
    if model.head_quant is not None:
        raise ValueError(f"the lm head is already quantised ({model.head_quant!r})")
    lin = model.output
    if not isinstance(lin, Linear):
        raise ValueError(f"the lm head must be a dense Linear to quantise, got {type(lin).__name__}")
    if lin.weight.device.type == "meta":
        raise ValueError("quantize_head needs the head's weights (the model is on meta); call it after loading")
    if method == "fp8":
        model.output = fp8_linear_from(lin, out_dtype=lin.weight.dtype)
    else:
        model.output = int4_linear_from(lin, group_size, symmetric)
    model.head_quant = method
    model.set_kernels()  # the final norm's FP8 output for an FP8 head
    return model


def quantize_model(model: Transformer, method: Optional[str], *, head: Optional[str] = None) -> Transformer:
    """Apply ``method`` (None, "fp8" or "int4") to the block projections and ``head`` (None, "fp8" or "int4")
    to the lm head, in place; returns the model."""
    if method is not None and method not in QUANT_METHODS:
        raise ValueError(f"quant method must be one of {QUANT_METHODS} or None, got {method!r}")
    check_head(head)
    if method == "fp8":
        quantize_model_fp8(model)
    elif method == "int4":
        quantize_model_int4(model)
    if head is not None:
        quantize_head(model, head)
    return model
