"""Quantisation transforms applied after the model is built or loaded (gpt-fast style).

    model = load(path).model
    quantize_model(model, "fp8")       # every block's wqkv / wo / w13 / w2 -> Fp8Linear (W8A8)

Formats are named by strings recorded in quantised checkpoints (``fastdecode quantize``), so that loading
a checkpoint with the wrong kernels is refused rather than silently wrong:

* ``fp8-w8a8-channel``: FP8 e4m3 weights with one float32 scale per output channel; activations are
  quantised per token at run time (by the fused norm / SiLU-and-mul kernels). The embedding, the norms
  and the lm head stay in the model dtype.

``int4`` (W4A16, group 128) is the hook for the int4 kernels: ``QUANT_METHODS`` lists it, and
``quantize_model(model, "int4")`` raises until the int4 module provides its transform.
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.models.llama import Fp8Linear, Linear, Transformer
from fastdecode.quant.fp8 import quantize_weight_fp8

QUANT_METHODS = ("fp8", "int4")
FP8_FORMAT = "fp8-w8a8-channel"
#: method -> the format string a checkpoint records
FORMATS = {"fp8": FP8_FORMAT}
# the projections of a block that are quantised (the lm head and the embedding are not)
BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


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


def quantize_model_fp8(model: Transformer) -> Transformer:
    """In place: every block's projections -> ``Fp8Linear`` (per-channel FP8 weights), and the norms before
    wqkv / w13 and the SiLU-and-mul before w2 switched to FP8 output. Returns the model.

    On a ``meta`` model only the structure changes (the loader then assigns FP8 tensors and scales).
    """
    if model.quant is not None:
        raise ValueError(f"the model is already quantised ({model.quant!r})")
    dtype = model.tok_embeddings.weight.dtype
    for layer in model.layers:
        for path in BLOCK_LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, fp8_linear_from(getattr(parent, name), out_dtype=dtype))
    model.quant = "fp8"
    model.set_kernels()  # FP8 outputs of the fused norms / activation where their switches are on
    return model


def quantize_model(model: Transformer, method: Optional[str]) -> Transformer:
    """Apply ``method`` (None, "fp8" or "int4") in place; returns the model."""
    if method is None:
        return model
    if method not in QUANT_METHODS:
        raise ValueError(f"quant method must be one of {QUANT_METHODS} or None, got {method!r}")
    if method == "fp8":
        return quantize_model_fp8(model)
    raise NotImplementedError("quant 'int4' is not available yet: the int4 kernels and their transform "
                              "(fastdecode.quant.int4) plug in here")
