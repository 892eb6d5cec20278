"""The int4 W4A16 projection of the model (``Int4Linear``), on the ops of ``fastdecode.ops.int4``.

A block projection (or the lm head) becomes an ``Int4Linear`` through ``fastdecode.models.quantize``
(``quantize_model_int4``, ``quantize_head``) or an int4 checkpoint (GPTQ, AWQ, GGUF Q4_0 / Q4_1,
``fastdecode quantize``); ``fastdecode.models.llama`` holds the dense and FP8 projections (``Linear``,
``Fp8Linear``) and the model that calls them all.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fastdecode.ops.int4 import int4_linear, int4_linear_ref
from fastdecode.ops.int4_a8 import (
    ACT_GROUP as A8_GROUP, DECODE_MAX_M as A8_DECODE_M, MAX_M as A8_MAX_M, int4_linear_a8, int4_linear_a8_ref,
    supports as a8_supports,
)
from fastdecode.ops.int4_format import LAYOUT, Int4Weight, packed_cols

INT4_ACT_DTYPES = (torch.bfloat16, torch.float16)  # what the int4 kernels take; fp32 runs the reference


class Int4Linear(nn.Module):
    """W4A16: ``y = x @ dequantize_int4(W, x.dtype).T (+ b)`` on a prepacked int4 weight, fp32 accumulation.

    Holds the tensors of a ``fastdecode.quant.int4.Int4Weight`` as parameters, so that ``.to(device)``,
    ``state_dict`` and sharding see them: ``qweight`` int32 (N, Kp // 8) in the kernel layout, ``scales``
    (N, K // group_size) bf16/fp16, ``zeros`` uint8 (zero mode "zero") or ``mins`` (zero mode "min") of the
    same shape, ``perm`` int64 (K,) for GPTQ act-order; ``bias`` in the model dtype. The activation stays
    bf16/fp16 (never an FP8 pair: the norms before an int4 projection keep their float output); fp32
    activations (the CPU engine) run ``int4_linear_ref``. ``impl``: None (the int4 dispatcher: our kernels,
    or dequantise + cuBLAS at large M) or "dequant" (ablation ``int4_gemm`` off: dequantise + cuBLAS always).
    ``act_int8`` (the model's ``int4_a8`` switch): up to ``ops.int4_a8.DECODE_MAX_M`` token rows run W4A8, the
    activation quantised to int8 per group of 128 columns (``int4_linear_a8``), where the weight's groups allow it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group_size: int,
                 zero_mode: str = "sym", act_order: bool = False, device=None, dtype=torch.bfloat16,
                 scale_dtype=torch.bfloat16, layout: str = LAYOUT):
        super().__init__()
        if zero_mode not in ("sym", "zero", "min"):
            raise ValueError(f"zero_mode must be 'sym', 'zero' or 'min', got {zero_mode!r}")
        if in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.zero_mode, self.layout = group_size, zero_mode, layout
        G, kw = in_features // group_size, packed_cols(in_features)

        def param(shape, dt):
            return nn.Parameter(torch.empty(shape, device=device, dtype=dt), requires_grad=False)

        self.qweight = param((out_features, kw), torch.int32)
        self.scales = param((out_features, G), scale_dtype)
        self.zeros = param((out_features, G), torch.uint8) if zero_mode == "zero" else None
        self.mins = param((out_features, G), scale_dtype) if zero_mode == "min" else None
        self.perm = param((in_features,), torch.int64) if act_order else None
        self.bias = param((out_features,), dtype) if bias else None
        self.out_dtype = dtype  # the model's activation dtype: the output of an int8 activation (int4_a8)
        self.impl: Optional[str] = None
        self.act_int8 = False
        # rows that take W4A8 (ops.int4_a8.DECODE_MAX_M; eval-accuracy raises it: the reference beyond the kernel's 4)
        self.a8_max_rows = A8_DECODE_M

    @classmethod
    def from_weight(cls, w: Int4Weight, bias: Optional[torch.Tensor] = None, *, device=None,
                    dtype=torch.bfloat16) -> "Int4Linear":
        """A module holding ``w`` (tensors shared, not copied); ``device="meta"``: the structure only."""
        meta = device is not None and torch.device(device).type == "meta"
        m = cls(w.K, w.N, bias=bias is not None, group_size=w.group_size, zero_mode=w.zero_mode,
                act_order=w.perm is not None, device="meta", dtype=dtype if bias is None else bias.dtype,
                scale_dtype=w.scales.dtype, layout=w.layout)
        if not meta:
            for name in ("qweight", "scales", "zeros", "mins", "perm"):
                t = getattr(w, name)
                if t is not None:
                    setattr(m, name, nn.Parameter(t, requires_grad=False))
            if bias is not None:
                m.bias = nn.Parameter(bias, requires_grad=False)
        return m

    @property
    def packed(self) -> Int4Weight:
        """The weight as the int4 ops take it (a view of the parameters)."""
        return Int4Weight(self.qweight, self.scales, self.zeros, self.mins, self.group_size, self.zero_mode,
                          self.perm, self.in_features, self.layout)

    def forward(self, x, backend: str = "ref") -> torch.Tensor:
        w = self.packed
        if isinstance(x, tuple) and len(x) == 3 and self.act_int8:  # an int8 activation (int4_a8: an int8 producer)
            if backend == "ref":
                return int4_linear_a8_ref(x, w, self.bias, self.out_dtype)
            return int4_linear_a8(x, w, self.bias, out_dtype=self.out_dtype, backend=backend)
        if isinstance(x, tuple):
            raise ValueError("Int4Linear is W4A16: it takes a bf16/fp16 (or fp32) activation, got an (fp8, scale) "
                             "pair; the norm / activation before an int4 projection must not emit FP8")
        if self.act_int8 and x.is_floating_point() and x.numel() <= self.a8_max_rows * x.shape[-1] \
                and a8_supports(w):
            # the reference: the "ref" backend, fp32 activations (the CPU engine), more rows than the kernel's 4
            if backend == "ref" or x.dtype not in INT4_ACT_DTYPES or x.numel() > A8_MAX_M * x.shape[-1]:
                return int4_linear_a8_ref(x, w, self.bias)
            return int4_linear_a8(x, w, self.bias, backend=backend)
        if backend == "ref" or x.dtype not in INT4_ACT_DTYPES:
            return int4_linear_ref(x, w, self.bias)
        # impl applies to the Triton backend on CUDA (the torch backend has one path; no cuBLAS on the CPU)
        impl = self.impl if x.is_cuda and backend != "torch" else None
        return int4_linear(x, w, self.bias, backend=backend, impl=impl)

    def weight_bytes(self) -> int:
        """Bytes a forward reads: N * K / 2 of nibbles (not the layout's padding past K, which the kernels
        mask), scales, zeros / mins, the act-order permutation and the bias."""
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.zeros, self.mins, self.perm, self.bias)
                    if t is not None)
        return self.out_features * self.in_features // 2 + extra

    def extra_repr(self) -> str:
        act = "w4a8-int8 (decode)" if self.act_int8 and a8_supports(self.packed) else "w4a16"
        bias = self.bias is not None
        return f"in={self.in_features}, out={self.out_features}, bias={bias}, {self.packed.format} {act}"


def set_int4_switches(model, k: dict) -> None:
    """The int4 kernel switches of ``Transformer.set_kernels`` (``k``: its switch dict) on ``model``'s modules.

    ``int4_gemm`` off: every ``Int4Linear`` dequantises + cuBLAS. ``int4_a8`` (off by default; needs ``int4_gemm``):
    W4A8 decode, projections of up to 2 token rows (``ops.int4_a8.DECODE_MAX_M``) quantise their activation to int8
    per group of 128 columns and run the ``dp4a`` GEMV (``fastdecode.ops.int4_a8``), where the weight's groups allow
    it; decode's numbers then move by the activation's rounding. The producers of those activations emit int8
    themselves (one kernel each, with ``fused_norm`` / ``fused_act``): the norms before wqkv / w13 and the lm head,
    SiLU-and-mul before w2, and the fused attention kernel before wo (head_dim 128: one group a head).
    """
    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.impl = None if k["int4_gemm"] else "dequant"
            m.act_int8 = k["int4_a8"] and k["int4_gemm"]
    a8 = lambda m: isinstance(m, Int4Linear) and m.act_int8 and a8_supports(m.packed)  # noqa: E731
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        layer.attention_norm.int8_out = a8(a.wqkv) and k["fused_norm"]
        layer.ffn_norm.int8_out = a8(f.w13) and k["fused_norm"]
        f.int8_act = a8(f.w2) and k["fused_act"]
        a.int8_out = a8(a.wo) and a.head_dim == A8_GROUP and k["fused_rope"]
    model.norm.int8_out = a8(model.output) and k["fused_norm"]
