"""The compiled pure-PyTorch peers of the decode benchmark: a gpt-fast-style Llama in each weight format.

``build_peer(model, quant, max_batch, max_seq_len)`` turns a fastdecode ``Transformer`` into a ``PeerLlama``
that computes the same function with nothing but PyTorch: fused ``wqkv`` / ``w13`` projections, RMSNorm in
plain ops, RoPE on the model's own ``[T, D/2, 2]`` table (HF half-split), a static KV cache of its own
(module buffers), ``F.scaled_dot_product_attention`` over the whole static cache with a position mask
(GQA through ``enable_gqa``), SwiGLU. Under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` this
is the strongest pure-PyTorch decode we know of (``anchors/compiled_decode*.py``: 190-201 tok/s BF16,
254 FP8, 283 int4 on Llama-3.1-8B shapes, H200).

Formats (``quant``), as gpt-fast / torchao run them:

* ``None``: ``F.linear`` (cuBLAS) on the model's own weight tensors. Nothing is copied: every weight,
  norm, the embedding, the lm head and the RoPE table are the model's tensors.
* ``"fp8"``: ``torch._scaled_mm`` W8A8 with one weight scale per tensor (``scale = amax / 448``,
  quantised once at build) and one dynamic activation scale per call (``max(amax(x) / 448, 1 / (448 * 512))``),
  output in the model dtype. Scales are dequantisation scales: ``real = fp8 * scale``.
* ``"int4"``: torch's tinygemm, ``aten._weight_int4pack_mm`` (group 128, ``inner_k_tiles=8``; on the CPU
  ``_weight_int4pack_mm_for_cpu``), W4A16, RTN per group with tinygemm's convention
  ``w = (q - 8) * scale + zero``, q in 0..15, ``scale = (max - min) / 15``, ``zero = min + 8 * scale``
  (the value of q = 8), scale and zero stored in bf16 as ``scales_and_zeros [K / group, N, 2]``.
  K is zero-padded to a multiple of 128 where needed (the kernel's k-tile; the activation is padded per call).

The block projections are quantised; the embedding, the norms and the lm head stay in the model dtype and
are shared (as in fastdecode's own FP8 / int4 models), unless ``quant_head`` quantises the head too (when the
benchmark quantises fastdecode's: like for like; gpt-fast's own int4 handler replaces every ``nn.Linear``, the head
included). A quantised peer's projection weights come from the
model's dense weights when it is not quantised yet (the benchmark builds the peer before ``quantize_model``,
so the bf16 block weights are freed when fastdecode swaps its projections), else from its dequantised
FP8 / int4 weights, one projection at a time (a transient fp32 copy of one projection).

The peer's step: ``decode_step(tokens [B], input_pos [B]) -> next tokens [B]`` (greedy argmax inside, as
gpt-fast's ``decode_one_token``); ``prefill(tokens [B, S]) -> fp32 logits [B, V]`` at the last position.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE
from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Fp8Linear, Linear, Transformer, step_read_bytes, unique_param_bytes
from fastdecode.quant.fp8 import FP8_DTYPE, dequantize_fp8, quantize_weight_fp8
from fastdecode.quant.int4 import dequantize_int4

PEER_QUANTS = (None, "fp8", "int4")
TINYGEMM_GROUP = 128
TINYGEMM_GROUPS = (32, 64, 128, 256)  # what _weight_int4pack_mm takes
TINYGEMM_INNER_K_TILES = 8
TINYGEMM_K_TILE = 16 * TINYGEMM_INNER_K_TILES  # K must be a multiple of this on CUDA (128)
TINYGEMM_MIN_SCALE = 1e-6  # a constant group (max == min) still gets a usable scale


def _param(t: torch.Tensor) -> nn.Parameter:
    """``t`` as a frozen parameter, sharing its storage (an existing parameter is returned as is)."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` in fp32, rounded once to x.dtype (fastdecode's rounding)."""
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE. x: [B, S, H, D]; cs: [B, S, D/2, 2] fp32 (cos, sin) -> [B, S, H, D] in x.dtype."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    cos, sin = cs[..., 0].unsqueeze(2), cs[..., 1].unsqueeze(2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- projections


class DenseLinear(nn.Module):
    """``y = F.linear(x, W, b)`` on a (shared) weight."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def quantize_fp8_tensor(x: torch.Tensor):
    """Per-tensor dynamic FP8 of an activation: ``(x_fp8, scale)``, scale a 0-d fp32 tensor,
    ``scale = max(amax(|x|) / 448, 1 / (448 * 512))``, ``x_fp8 = e4m3(clamp(x / scale, -448, 448))``."""
    scale = torch.clamp(x.abs().amax().float() / FP8_MAX, min=FP8_MIN_SCALE)
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8TensorLinear(nn.Module):
    """W8A8 with per-tensor scales: ``y = (x_fp8 @ W_fp8.T) * x_scale * w_scale (+ b)`` in ``out_dtype``
    through ``torch._scaled_mm``; ``weight_scale`` is a 0-d fp32 dequantisation scale (``W ~= weight * scale``)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor], out_dtype):
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {FP8_DTYPE} tensor, got {weight.dtype} {tuple(weight.shape)}")
        if weight_scale.numel() != 1:
            raise ValueError(f"weight_scale must have one element (per-tensor), got {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.weight = _param(weight.contiguous())
        self.weight_scale = _param(weight_scale.float().reshape(()))
        self.bias = None if bias is None else _param(bias.to(out_dtype))

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None, out_dtype=None) -> "Fp8TensorLinear":
        """Quantise a dense (N, K) weight once: ``scale = max(amax / 448, 1 / (448 * 512))``."""
        q, s = quantize_weight_fp8(w, "tensor")
        return cls(q, s, bias, out_dtype or w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = quantize_fp8_tensor(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, bias=self.bias,
                             out_dtype=self.out_dtype)
        return y.view(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 (N, K): ``weight * weight_scale``."""
        return dequantize_fp8(self.weight, self.weight_scale)


def quantize_tinygemm(w: torch.Tensor, group_size: int = TINYGEMM_GROUP):
    """RTN of a dense (N, K) weight in tinygemm's convention: returns ``(q int32 (N, K) in 0..15,
    scales_and_zeros bf16 (K / group_size, N, 2))`` with ``w ~= (q - 8) * scale + zero`` per group of
    ``group_size`` columns; ``scale = max((max - min) / 15, 1e-6)``, ``zero = min + 8 * scale``, both rounded to
    bf16 first, and q rounded to nearest against the rounded values (so the error is half a step plus
    their rounding)."""
    N, K = w.shape
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size must divide K = {K}, got {group_size}")
    wf = w.float().view(N, K // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    scale = torch.clamp((hi - lo) / 15, min=TINYGEMM_MIN_SCALE).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.clamp(torch.round((wf - zero.unsqueeze(-1)) / scale.unsqueeze(-1)) + 8, 0, 15).to(torch.int32)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, N, 2]
    return q.view(N, K), sz


def dequantize_tinygemm(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 (N, K): ``(q - 8) * scale + zero`` with scale, zero = ``scales_and_zeros[k // group_size, n]``."""
    N, K = q.shape
    s = scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)  # [N, K]
    z = scales_and_zeros[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return (q.float() - 8) * s + z


def pack_tinygemm_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int (N, K) in 0..15 -> uint8 (N, K / 2), what ``aten._convert_weight_to_int4pack`` (CUDA) takes:
    byte j holds column 2j in its high nibble and column 2j + 1 in its low nibble (torch's int4mm.cu
    documents the int32 value order v[0] v[1] ... as the uint8 nibbles v[0]H v[0]L ...)."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be 2-D with an even number of columns, got {tuple(q.shape)}")
    q = q.to(torch.int32)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)


def unpack_tinygemm_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_tinygemm_nibbles`: uint8 (N, K / 2) -> int32 (N, K)."""
    b = b.to(torch.int32)
    return torch.stack([b >> 4, b & 0xF], dim=-1).view(b.shape[0], -1)


class TinygemmLinear(nn.Module):
    """W4A16 on torch's tinygemm: ``y = x @ ((q - 8) * scale + zero).T (+ b)``, group ``group_size`` along K.

    ``packed``: the kernel's int4 layout (``_convert_weight_to_int4pack`` on CUDA: int32
    [N / 8, Kp / 128, 32, 4]; ``_convert_weight_to_int4pack_for_cpu`` on the CPU: uint8 [N, Kp / 2]);
    ``scales_and_zeros`` [Kp / group_size, N, 2] (bf16 on CUDA, the activation dtype on the CPU, bf16 values
    either way). ``Kp`` >= K: zero columns padded to the kernel's k-tile; x is zero-padded to match.
    On CUDA the kernel takes bf16 activations only: other dtypes are cast there and back.
    """

    def __init__(self, packed, scales_and_zeros, in_features: int, padded_in_features: int, out_features: int,
                 group_size: int, bias: Optional[torch.Tensor], dtype):
        super().__init__()
        self.in_features, self.padded_in_features, self.out_features = in_features, padded_in_features, out_features
        self.group_size, self.dtype = group_size, dtype
        self.on_cpu = packed.device.type == "cpu"
        self.packed = _param(packed)
        self.scales_and_zeros = _param(scales_and_zeros)
        self.bias = None if bias is None else _param(bias)

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None, group_size: int = TINYGEMM_GROUP,
                   dtype=None) -> "TinygemmLinear":
        """RTN-quantise (:func:`quantize_tinygemm`) and pack a dense (N, K) weight for ``w.device``."""
        if group_size not in TINYGEMM_GROUPS:
            raise ValueError(f"group_size must be one of {TINYGEMM_GROUPS} (tinygemm), got {group_size}")
        N, K = w.shape
        dtype = dtype or w.dtype
        cpu = w.device.type == "cpu"
        n_tile = 16 if cpu else 8  # the CPU kernel packs 16 rows at a time, the CUDA one 8
        if N % n_tile:
            raise ValueError(f"tinygemm on {w.device.type} needs out_features divisible by {n_tile}, got {N}")
        step = math.lcm(group_size, TINYGEMM_K_TILE)
        Kp = -(-K // step) * step
        wp = F.pad(w.float(), (0, Kp - K)) if Kp != K else w
        q, sz = quantize_tinygemm(wp, group_size)
        del wp
        if cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, TINYGEMM_INNER_K_TILES)
            sz = sz.to(dtype)  # the CPU kernel takes scales in the activation dtype (bf16 values)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_tinygemm_nibbles(q).contiguous(),
                                                                TINYGEMM_INNER_K_TILES)
        return cls(packed, sz, K, Kp, N, group_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        if self.on_cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group_size,
                                                            self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                   self.group_size, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


# ----------------------------------------------------------------------------- the model


class PeerBlock(nn.Module):
    """One decoder layer with its own static KV cache (buffers [B_max, Hkv, T, D])."""

    def __init__(self, cfg, attention_norm, wqkv, wo, ffn_norm, w13, w2, *, max_batch: int, max_seq_len: int,
                 dtype, device):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        self.attention_norm, self.ffn_norm = _param(attention_norm), _param(ffn_norm)
        self.wqkv, self.wo, self.w13, self.w2 = wqkv, wo, w13, w2
        shape = (max_batch, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, x, cs, rows, pos, mask):
        """x [B, S, dim]; cs [B, S, D/2, 2]; rows [B, 1]; pos [B, S]; mask [B, 1, S, T] -> [B, S, dim]."""
        B, S, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(rms_norm(x, self.attention_norm, self.eps)).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, S, Hq, D), cs).transpose(1, 2)  # [B, Hq, S, D]
        k = apply_rope(k.view(B, S, Hkv, D), cs)
        # written into the whole buffers (not a slice of them), so that Inductor turns the functional
        # index_put back into an in-place write on the buffer; rows [B, 1] x pos [B, S] -> k [B, S, Hkv, D]
        self.k_cache[rows, :, pos] = k
        self.v_cache[rows, :, pos] = v.view(B, S, Hkv, D)
        kc, vc = (self.k_cache, self.v_cache) if B == self.k_cache.shape[0] else (self.k_cache[:B], self.v_cache[:B])
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=1.0 / math.sqrt(D),
                                           enable_gqa=Hq != Hkv)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, Hq * D))
        g, u = self.w13(rms_norm(x, self.ffn_norm, self.eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


class PeerLlama(nn.Module):
    """gpt-fast-style Llama over (shared or re-quantised) fastdecode weights; see the module docstring."""

    def __init__(self, cfg, tok_embeddings: torch.Tensor, layers: list[PeerBlock], norm: torch.Tensor,
                 output: nn.Module, rope: torch.Tensor, *, quant: Optional[str], description: str):
        super().__init__()
        self.config, self.quant, self.description = cfg, quant, description
        self.tok_embeddings = _param(tok_embeddings)
        self.layers = nn.ModuleList(layers)
        self.norm = _param(norm)
        self.output = output
        self.register_buffer("rope", rope, persistent=False)  # the model's table, not a copy
        T = layers[0].k_cache.shape[2]
        self.register_buffer("positions", torch.arange(T, device=rope.device), persistent=False)
        self.copied_bytes = 0  # set by build_peer: bytes of parameters not shared with the source model

    @property
    def max_batch(self) -> int:
        return self.layers[0].k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.layers[0].k_cache.shape[2]

    def kv_buffers(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.k_cache, layer.v_cache)]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens, input_pos: [B, S] (each sequence's own positions). Writes the cache there; fp32 logits [B, S, V]."""
        B = tokens.shape[0]
        x = F.embedding(tokens, self.tok_embeddings)
        cs = self.rope[input_pos]  # [B, S, D/2, 2]
        rows = torch.arange(B, device=tokens.device).unsqueeze(1)
        mask = (self.positions.view(1, 1, -1) <= input_pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, S, T]
        for layer in self.layers:
            x = layer(x, cs, rows, input_pos, mask)
        return self.output(rms_norm(x, self.norm, self.config.norm_eps)).float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] at positions 0..S-1 -> fp32 logits [B, V] of the last position."""
        B, S = tokens.shape
        pos = torch.arange(S, device=tokens.device).expand(B, S)
        return self.forward(tokens, pos)[:, -1]

    @torch.no_grad()
    def decode_logits(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens, input_pos [B] -> fp32 logits [B, V]."""
        return self.forward(tokens.view(-1, 1), input_pos.view(-1, 1))[:, 0]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """The step the benchmark compiles: tokens, input_pos [B] -> greedy next tokens [B] (no host sync)."""
        return torch.argmax(self.decode_logits(tokens, input_pos), dim=-1)

    def weight_bytes(self) -> int:
        """Bytes of all parameters (each tensor once): what one step reads."""
        return unique_param_bytes(self.parameters())

    def decode_step_bytes(self, batch: int) -> int:
        """Weight bytes one step of ``batch`` sequences reads: as ``Transformer.decode_step_bytes`` (only
        ``batch`` rows of an untied embedding table)."""
        return step_read_bytes(self.weight_bytes(), self.tok_embeddings, self.output, batch)


# ----------------------------------------------------------------------------- building


def _format(quant: Optional[str], group_size: int) -> str:
    if quant == "fp8":
        return "_scaled_mm per-tensor"
    if quant == "int4":
        return f"tinygemm int4 g{group_size}"
    return "F.linear"


def peer_description(quant: Optional[str], group_size: int = TINYGEMM_GROUP, quant_head: Optional[str] = None) -> str:
    """What the peer is, for the benchmark's rows (``quant_head``: the lm head's format when quantised)."""
    head = f", head {_format(quant_head, group_size)}" if quant_head is not None else ""
    return f"gpt-fast-style, {_format(quant, group_size)}{head}"


def _dense(lin: nn.Module) -> torch.Tensor:
    """The (N, K) weight of a fastdecode projection: the module's own tensor when dense, else its
    dequantised fp32 values (a transient copy of this projection only)."""
    if isinstance(lin, Linear):
        return lin.weight
    if isinstance(lin, Fp8Linear):
        return dequantize_fp8(lin.weight, lin.weight_scale, dim=0)
    if isinstance(lin, Int4Linear):
        return dequantize_int4(lin.packed, torch.float32)
    raise ValueError(f"cannot build a peer projection from {type(lin).__name__}")


def _peer_linear(lin: nn.Module, quant: Optional[str], dtype, group_size: int) -> nn.Module:
    w, bias = _dense(lin), lin.bias
    if quant == "fp8":
        return Fp8TensorLinear.from_dense(w, bias, out_dtype=dtype)
    if quant == "int4":
        return TinygemmLinear.from_dense(w, bias, group_size, dtype=dtype)
    return DenseLinear(w if w.dtype == dtype else w.to(dtype), bias)


def build_peer(model: Transformer, quant: Optional[str], max_batch: int, max_seq_len: int, *,
               group_size: int = TINYGEMM_GROUP, quant_head: Optional[str] = None) -> PeerLlama:
    """A ``PeerLlama`` computing ``model``'s function in format ``quant`` (None, "fp8", "int4"), with a static
    KV cache for ``max_batch`` sequences of ``max_seq_len`` positions (at most the model's RoPE table).
    ``quant_head`` ("fp8", "int4"): the lm head in that format too (from the model's head, dense or
    dequantised); None: the model's dense head, shared.

    Shared, never copied: the embedding, the norms, the lm head (``quant_head=None``), the RoPE table and, for
    ``quant=None`` on a dense model, every projection. Copied: the quantised projections (FP8: 1 byte per weight;
    int4: half a byte plus 4 bytes per group), a quantised head, and, for ``quant=None`` on a quantised model, its
    dequantised projections.
    """
    if quant not in PEER_QUANTS:
        raise ValueError(f"quant must be one of {PEER_QUANTS}, got {quant!r}")
    if quant_head not in PEER_QUANTS:
        raise ValueError(f"quant_head must be one of {PEER_QUANTS}, got {quant_head!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= model.rope_len:
        raise ValueError(f"max_seq_len must be an integer in [1, {model.rope_len}] (the model's RoPE table), "
                         f"got {max_seq_len!r}")
    if model.tp is not None:
        raise ValueError("the peer is single-device: build it from a model without tensor parallelism")
    cfg = model.config
    if cfg.qk_norm:  # it would compute another function, silently
        raise ValueError("the peer has no per-head q/k RMSNorm (Qwen3): build it from a Llama / Qwen2-style model")
    emb = model.tok_embeddings.weight
    dtype, device = emb.dtype, emb.device
    layers = []
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        proj = [_peer_linear(m, quant, dtype, group_size) for m in (a.wqkv, a.wo, f.w13, f.w2)]
        layers.append(PeerBlock(cfg, layer.attention_norm.weight, proj[0], proj[1], layer.ffn_norm.weight, proj[2],
                                proj[3], max_batch=max_batch, max_seq_len=max_seq_len, dtype=dtype, device=device))
    if quant_head is not None:
        output = _peer_linear(model.output, quant_head, dtype, group_size)
    elif isinstance(model.output, Linear):
        output = DenseLinear(model.output.weight, model.output.bias)
    else:
        raise ValueError(f"the lm head must be a dense Linear to be shared (quant_head=None), got "
                         f"{type(model.output).__name__}: pass quant_head")
    peer = PeerLlama(cfg, emb, layers, model.norm.weight, output, model.rope, quant=quant,
                     description=peer_description(quant, group_size, quant_head))
    source = {p.untyped_storage().data_ptr() for p in model.parameters()}
    peer.copied_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in peer.parameters()}.values()
                            if p.untyped_storage().data_ptr() not in source)
    return peer
