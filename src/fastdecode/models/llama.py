"""Llama-family decoder written against ``fastdecode.ops`` (gpt-fast spirit: flat modules, shape comments).

Weight layout (names used by every loader)::

    tok_embeddings.weight                       [V, dim]
    layers.{i}.attention_norm.weight            [dim]
    layers.{i}.attention.wqkv.weight (.bias)    [(Hq + 2 Hkv) * D, dim]   q | k | v rows, HF (half-split) RoPE order
    layers.{i}.attention.q_norm.weight (k_norm) [D]                       Qwen3 (qk_norm) only: per-head RMSNorm
    layers.{i}.attention.wo.weight              [dim, Hq * D]
    layers.{i}.ffn_norm.weight                  [dim]
    layers.{i}.feed_forward.w13.weight          [2 I, dim]                gate | up, for silu_and_mul
    layers.{i}.feed_forward.w2.weight           [dim, I]
    norm.weight                                 [dim]
    output.weight                               [V, dim]                  the embedding when tied
    <projection>.weight_scale                   [N] float32               FP8 models only (Fp8Linear)
    <projection>.qweight / .scales (.zeros | .mins, .perm)                  int4 models: Int4Linear, no .weight

The KV cache is an explicit object passed to ``prefill``/``decode`` (``cache.k[i]``, ``cache.v[i]`` of shape
[B_max, Hkv, T, D]); see ``fastdecode.engine.kv_cache``.

FP8 W8A8 (``fastdecode.models.quantize.quantize_model_fp8``): the four projections of every block become
``Fp8Linear`` (FP8 weight, per-channel scale); the norms before wqkv and w13 then emit FP8 + per-token
scales directly and SiLU-and-mul feeds w2 in FP8; the attention output is quantised per token before wo.
An activation is then either a tensor or an ``(fp8, scale)`` pair (``real = fp8 * scale``). The lm head
stays in the model dtype unless asked for (it is the most accuracy-sensitive matmul).

Quantised lm head (``fastdecode.models.quantize.quantize_head``, ``quantize_model(..., head=)``): ``output``
becomes an ``Fp8Linear`` (the final norm then emits FP8 + per-token scales) or an ``Int4Linear``; recorded in
``model.head_quant``, not in ``quant_format``. Tied embeddings: the embedding keeps its own table in the model
dtype (the head gets a quantised copy).

Int4 W4A16 (``fastdecode.models.quantize.quantize_model_int4``, or int4 checkpoints: GPTQ, AWQ, GGUF Q4_0 /
Q4_1, ``fastdecode quantize``): a block projection becomes ``Int4Linear`` (``fastdecode.models.int4``: a
prepacked ``Int4Weight``, group-wise scales); activations stay in the model dtype, so no norm emits FP8
before it. Projections of one model may differ in format (group size, zero mode) or stay dense; each module
dispatches its own kernel.

Tensor parallelism (``fastdecode.engine.tp.apply_tp``): the norm after each row-parallel layer owns the
all-reduce (``RMSNorm.comm``), fused with the residual add and the norm; ``model.tp`` makes the embedding
and the lm head vocab-parallel.

Kernel switches for the ablation: ``model.set_kernels(fused_norm=..., fused_act=..., fused_down=...,
skinny_gemm=..., fused_allreduce=..., int4_gemm=..., fused_rope=..., norm_gemm=..., int4_a8=..., fp8_a16=...)``;
a switched-off fusion runs as separate plain-PyTorch ops (an int4 GEMM as dequantise + cuBLAS). ``fused_down``: on
CUDA, SiLU-and-mul inside a bf16 / fp16 ``w2``'s GEMM (``Linear.forward_glu``); off, apart, as always for int4
(``fastdecode.ops.glu_linear`` says why). ``fused_rope``: ``fastdecode.models.decode_attention``. ``norm_gemm``:
``fastdecode.models.norm_gemm`` (the decode step's norms and residual adds inside the bf16 / fp16, W4A16 int4 and
W8A16 FP8 GEMMs; it folds the norm weights into dense wqkv / w13 in place at the first decode). ``int4_a8`` (off
by default): W4A8 decode with int8 activations (``fastdecode.models.int4.set_int4_switches``). ``fp8_a16`` (on): the FP8
``wqkv``, ``wo`` and ``w2`` of up to 4 token rows run W8A16 (``fastdecode.ops.w8a16``: the attention norm emits
16-bit rows (``RMSNorm.a16_rows``), the attention output goes unquantised, SiLU-and-mul inside w2's loads with
``fused_down``), two launches a layer fewer; ``w13`` keeps W8A8 (its norm emits FP8). ``fp8_a16_all`` (off by
default): ``w13`` too, its norm then emitting 16-bit rows as well. ``l2_prefetch`` (off by default): the decode
attention kernel prefetches wo's weight into L2 (``Attention.l2_prefetch_limit`` bytes of it; None: all).
``int4_glu`` (on): on the ``norm_gemm`` step, SiLU-and-mul inside an int4 w2's FMA kernel where w2 has at most
``norm_gemm.INT4_GLU_MAX_K`` input features.

Backends: ``model.backend`` is passed to every fastdecode op (``"auto"``, ``"triton"``, ``"torch"``);
``"ref"`` calls the plain-PyTorch ``*_ref`` functions instead of the registered ops, so that
``torch.compile`` sees (and fuses) ordinary PyTorch code: the gpt-fast-style baseline.

Beside this module: ``fastdecode.models.int4`` (``Int4Linear``) and ``fastdecode.models.rope`` (the RoPE
tables), both importable from here too; the decode attention's ops are called from
``fastdecode.models.decode_attention``; ``RMSNorm`` lives in ``fastdecode.models.rmsnorm``. ``Linear``, ``Fp8Linear``
and the layers stay here: they call the ops by their names in this module (tests/test_engine_fp8.py shadows those
names with reference checks).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.models.config import ModelConfig
from fastdecode.models.decode_attention import decode_attend, wo_prefetch
from fastdecode.models import norm_gemm
from fastdecode.models.int4 import Int4Linear, set_int4_switches
from fastdecode.models.qk_norm import norm_heads, norm_qk_rows
from fastdecode.models.step_bytes import step_read_bytes, unique_param_bytes  # noqa: F401  (re-exported)
from fastdecode.models.rope import apply_rope, rope_cache, rope_inv_freq  # noqa: F401  (rope_inv_freq: re-exported)
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref, silu_and_mul_ref
from fastdecode.ops import int4_a8 as A8
from fastdecode.models.rmsnorm import RMSNorm
from fastdecode.ops.allreduce import all_reduce
from fastdecode.ops.gemm import linear, linear_fp8, linear_fp8_ref
from fastdecode.ops.glu_linear import silu_and_mul_linear
from fastdecode.ops.quant import quantize_fp8, quantize_fp8_ref
from fastdecode.ops.w8a16 import DECODE_MAX_M as W8A16_DECODE_MAX_M, MAX_M as W8A16_MAX_M, X_DTYPES as W8A16_X_DTYPES
from fastdecode.ops.w8a16 import linear_w8a16, linear_w8a16_ref
from fastdecode.quant.formats import method_of

MODEL_BACKENDS = ("auto", "triton", "torch", "ref")
KERNELS = ("fused_norm", "fused_act", "fused_down", "skinny_gemm", "fused_allreduce", "int4_gemm", "fused_rope",
           "norm_gemm", "int4_a8", "fp8_a16", "fp8_a16_all", "l2_prefetch", "int4_glu", "attn_wo")
# switches off by default (``bench decode``'s ``-with-<switch>`` rows turn them on): a new kernel waits here until a
# GPU has measured it (norm_gemm for int4 blocks did, sessions 17-18); int4_a8 also changes the numbers (int8
# activations), so it would stay a choice even when it wins; fp8_a16 is on since session 25: W8A16 wqkv, wo and w2 were
# faster than W8A8 in every H100 step measured (3300.7 against 3495.7 us, benchmarks/NOTES.md), with a perplexity
# closer to the unquantised model's; fp8_a16_all (w13 too) was slower there; int4_glu is on since session 31 (the
# embedded Q4_1 step on an H100: -7.7, -10.4 and -10.3 us in three processes; for small K only, models.norm_gemm)
OPT_IN_KERNELS: tuple[str, ...] = ("int4_a8", "fp8_a16_all", "l2_prefetch", "attn_wo")


def _lead(x) -> tuple:
    """Leading dims of an activation: a tensor [..., K] or an FP8 pair ``(fp8 [..., K], scale [..., 1])``."""
    return tuple((x[0] if isinstance(x, tuple) else x).shape[:-1])


# ----------------------------------------------------------------------------- building blocks


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``: the one place every matmul of the model goes through (swap it to change GEMMs)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)

        self.gemm_impl: Optional[str] = None  # None: fastdecode's dispatcher; "cublas": skinny GEMM off

    def forward(self, x: torch.Tensor, backend: str = "ref") -> torch.Tensor:
        # "ref"/"torch" are the PyTorch baselines (cuBLAS through F.linear); on the CPU, F.linear is
        # the reference too; gemm_impl "cublas" (ablation: skinny GEMM off) calls F.linear as well:
        # through the op's cuBLAS branch (torch.mm with out=) the 8B decode step measured 34 ms
        # instead of ~8.7 ms, unexplained so far (benchmarks/NOTES.md). Otherwise the dispatcher
        # picks our skinny kernel or cuBLAS per shape.
        if backend in ("ref", "torch") or not x.is_cuda or self.gemm_impl == "cublas":
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, backend=backend, impl=self.gemm_impl)

    def forward_glu(self, h: torch.Tensor, backend: str) -> Optional[torch.Tensor]:
        """``forward(silu_and_mul(h))`` as one kernel (CUDA, fastdecode's dispatcher), else None: the caller
        runs the two ops."""
        if backend in ("ref", "torch") or not h.is_cuda or self.gemm_impl == "cublas":
            return None
        return silu_and_mul_linear(h, self.weight, self.bias, backend=backend, impl=self.gemm_impl)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Fp8Linear(nn.Module):
    """W8A8: ``y = (x_fp8 @ W_fp8.T) * x_scale * w_scale (+ b)``, rounded once to ``out_dtype``.

    ``weight``: (N, K) float8_e4m3fn; ``weight_scale``: (N,) float32, one per output channel
    (``W ~= weight * weight_scale[:, None]``, a dequantisation scale). The input is an ``(x_fp8, x_scale)``
    pair as the fused norm / SiLU-and-mul kernels return it (per-token scale ``[..., 1]``), or a float
    tensor, which is quantised per token first (one extra kernel: the attention output before wo).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 out_dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, device=device, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=out_dtype), requires_grad=False)
                     if bias else None)
        self.gemm_impl: Optional[str] = None
        self.a16_max_rows = 0  # fp8_a16: up to this many rows of a 16-bit x run W8A16 (ops.w8a16), no quantisation

    def _w8a16(self, x, backend: str, glu: bool = False) -> Optional[torch.Tensor]:
        """fp8_a16: x's rows as W8A16 (the reference for the "ref" backend, fp32 (the CPU engine) and more rows than
        the kernel's: ``eval-accuracy --fp8-a16`` raises ``a16_max_rows``), or None: W8A8."""
        if isinstance(x, tuple) or x.numel() > self.a16_max_rows * x.shape[-1]:
            return None
        args = (x, self.weight, self.weight_scale, self.bias)
        if backend == "ref" or x.dtype not in W8A16_X_DTYPES or x.numel() > W8A16_MAX_M * x.shape[-1]:
            return linear_w8a16_ref(*args, glu=glu)
        return linear_w8a16(*args, glu=glu, backend=backend)

    def forward(self, x, backend: str = "ref") -> torch.Tensor:
        y = self._w8a16(x, backend)
        if y is not None:
            return y
        if isinstance(x, tuple):
            xq, xs = x
        elif backend == "ref":
            xq, xs = quantize_fp8_ref(x, per_token=True)
        else:
            xq, xs = quantize_fp8(x, per_token=True, backend=backend)
        if backend == "ref":
            return linear_fp8_ref(xq, xs, self.weight, self.weight_scale, self.bias, out_dtype=self.out_dtype)
        return linear_fp8(xq, xs, self.weight, self.weight_scale, self.bias, out_dtype=self.out_dtype,
                          backend=backend, impl=self.gemm_impl)

    def forward_glu(self, h: torch.Tensor, backend: str) -> Optional[torch.Tensor]:
        """fp8_a16: ``forward(silu_and_mul(h))`` as one W8A16 kernel (SiLU-and-mul in its loads), else None."""
        return self._w8a16(h, backend, glu=True)

    def extra_repr(self) -> str:
        a16 = f" (w8a16 up to {self.a16_max_rows} rows)" if self.a16_max_rows else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, fp8 w8a8{a16}"


# ----------------------------------------------------------------------------- layers


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, device=device, dtype=dtype)
        self.wo = Linear(cfg.q_size, cfg.dim, device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # Qwen3 (cfg.qk_norm): RMSNorm over each q / k head before RoPE (models/qk_norm.py)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device=device, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device=device, dtype=dtype) if cfg.qk_norm else None
        self.fused_rope = True  # decode: RoPE + KV write inside the attention kernel (models/decode_attention.py)
        self.int8_out = False  # ... which, up to 2 rows, emits the int8 activation of a W4A8 Int4Linear wo (int4_a8)
        self.l2_prefetch, self.l2_prefetch_limit = False, None  # ... and warms wo's weight (bytes; None: all) in L2

    def _qkv(self, x, cs, backend):
        B, S = _lead(x)
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x, backend).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k = q.view(B, S, Hq, D), k.view(B, S, Hkv, D)
        if self.q_norm is not None:
            q, k = norm_heads(self.q_norm, q, backend), norm_heads(self.k_norm, k, backend)
        return apply_rope(q, cs), apply_rope(k, cs), v.view(B, S, Hkv, D)

    def prefill(self, x, cs, k_cache, v_cache, backend="ref"):
        """x: [B, S, dim] (or an FP8 pair), positions 0..S-1; writes k_cache/v_cache[:B, :, :S]. Returns [B, S, dim]."""
        B, S = _lead(x)
        q, k, v = self._qkv(x, cs, backend)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        k_cache[:B, :, :S] = k
        v_cache[:B, :, :S] = v
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1), backend)

    def decode(self, x, rope, k_cache, v_cache, input_pos, seq_lens, backend):
        """x: [B, 1, dim]; rope: the model's [T, D/2, 2] table; input_pos: [B] int64 (each sequence's new
        position); seq_lens: [B] int32 (= input_pos + 1) or None. Writes k/v at input_pos, returns [B, 1, dim]."""
        qkv = self.wqkv(x, backend)
        return self.wo(self.attend(qkv, rope, k_cache, v_cache, input_pos, seq_lens, backend), backend)

    def attend(self, qkv, rope, k_cache, v_cache, input_pos, seq_lens, backend):
        """The attention of ``decode`` between its two projections: qkv [B, 1, (Hq + 2 Hkv) * D] -> [B, 1, Hq * D]
        (``l2_prefetch``: the kernel warms wo's weight in L2, ``wo_prefetch``)."""
        B = qkv.shape[0]
        qkv = qkv.view(B, -1)  # [B, (Hq + 2 Hkv) * D]
        if self.q_norm is not None:
            qkv = norm_qk_rows(qkv, self.q_norm, self.k_norm, self.n_heads, self.n_kv_heads, backend)
        k_cache, v_cache = k_cache[:B], v_cache[:B]
        o = decode_attend(qkv, rope, input_pos, k_cache, v_cache, seq_lens, self.n_heads, self.scale, self.fused_rope,
                          backend, int8=self.int8_out and B <= A8.DECODE_MAX_M,
                          prefetch=wo_prefetch(self.wo, self.l2_prefetch_limit) if self.l2_prefetch else None)
        return tuple(t.reshape(B, 1, -1) for t in o) if isinstance(o, tuple) else o.reshape(B, 1, -1)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        self.w13 = Linear(cfg.dim, 2 * cfg.intermediate_size, device=device, dtype=dtype)
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, device=device, dtype=dtype)
        self.fp8_act = False  # SiLU-and-mul emits (fp8, per-token scale) for an Fp8Linear w2
        self.int8_act = False  # ... or, up to 2 rows, the int8 activation of a W4A8 Int4Linear w2 (int4_a8)
        self.fused = True  # False (ablation): plain-PyTorch SiLU-and-mul
        self.fuse_down = True  # SiLU-and-mul inside w2's GEMM where w2 offers it (forward_glu); False: ablation

    def forward(self, x, backend):
        h = self.w13(x, backend)  # [.., 2I] = gate | up
        be = backend if self.fused else "ref"
        glu = getattr(self.w2, "forward_glu", None) if self.fuse_down else None  # None where w2 has no such form
        if glu is not None:
            y = glu(h, be)
            if y is not None:
                return y
        if self.int8_act and be == backend and h.numel() <= A8.DECODE_MAX_M * h.shape[-1]:
            h = A8.silu_and_mul_int8_ref(h) if be == "ref" else A8.silu_and_mul_int8(h, backend=be)
        elif self.fp8_act:
            h = silu_and_mul_fp8_ref(h) if be == "ref" else silu_and_mul_fp8(h, backend=be)
        else:
            h = silu_and_mul_ref(h) if be == "ref" else silu_and_mul(h, backend=be)
        return self.w2(h, backend)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.attention = Attention(cfg, device=device, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.feed_forward = FeedForward(cfg, device=device, dtype=dtype)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, device=None, dtype=torch.bfloat16, backend: str = "auto",
                 rope_len: Optional[int] = None, rope_freq_factors: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = cfg
        self.backend = backend
        # Built around its (uninitialised) weight, as every other parameter here: nn.Embedding's own init
        # draws normal values, and on meta that first init imports torch._dynamo (~1-6 s of start-up).
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _freeze=True,
                                           _weight=torch.empty(cfg.vocab_size, cfg.dim, device=device, dtype=dtype))
        self.layers = nn.ModuleList(Block(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.output = Linear(cfg.dim, cfg.vocab_size, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_freq_factors = rope_freq_factors
        self.quant_format: Optional[str] = None  # the format recorded on export (models.quantize); sets ``quant``
        self.head_quant: Optional[str] = None  # "fp8" / "int4" after models.quantize.quantize_head
        self.tp = None  # fastdecode.engine.sharding.TPState after apply_tp
        self.kernels = {k: k not in OPT_IN_KERNELS for k in KERNELS}
        self.rope_len = rope_len or cfg.max_seq_len
        rope_dev = None if device is None or torch.device(device).type == "meta" else device
        self.register_buffer("rope", rope_cache(cfg, self.rope_len, rope_freq_factors, rope_dev), persistent=False)

    @property
    def quant(self) -> Optional[str]:
        """"fp8" / "int4" after quantize_model or a quantised load (the method of ``quant_format``), else None."""
        return method_of(self.quant_format)

    @property
    def format_label(self) -> Optional[str]:
        """``quant_format`` with the head's format appended (``int4-w4a16-g128-zero+head-int4``,
        ``head-fp8`` alone); None when nothing is quantised."""
        parts = [self.quant_format] + ([f"head-{self.head_quant}"] if self.head_quant else [])
        return "+".join(p for p in parts if p) or None

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, b: str) -> None:
        if b not in MODEL_BACKENDS:
            raise ValueError(f"backend must be one of {MODEL_BACKENDS}, got {b!r}")
        self._backend = b

    def tie_weights(self) -> None:
        if self.config.tie_embeddings and isinstance(self.output, Linear):  # a quantised head keeps its copy
            self.output.weight = self.tok_embeddings.weight

    def setup_rope(self, max_seq_len: int, device) -> None:
        """(Re)build the RoPE table for ``max_seq_len`` positions on ``device`` (after loading on meta)."""
        self.rope_len = max_seq_len
        self.rope = rope_cache(self.config, max_seq_len, self.rope_freq_factors, device)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> [..., dim]; vocab-parallel under TP (each rank holds a row range, then all-reduce)."""
        if self.tp is None:
            return self.tok_embeddings(tokens)
        local = tokens - self.tp.vocab_start
        valid = (local >= 0) & (local < self.tp.vocab_rows)
        e = F.embedding(torch.where(valid, local, torch.zeros_like(local)), self.tok_embeddings.weight)
        return all_reduce(e * valid.unsqueeze(-1).to(e.dtype), self.tp.comm)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [..., dim] -> fp32 logits [..., V] (under TP: local rows, all-gathered in the
        model dtype, then widened to fp32: half the bytes of gathering fp32, the same values)."""
        logits = self.output(x, self.backend)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float()

    def _logits(self, h):
        return self._head(self.norm(h, self.backend))

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache, last_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens: [B, S] at positions 0..S-1 (rows right-padded). Fills cache rows [:B], positions [:S].

        Returns fp32 logits [B, S, V], or [B, V] at ``last_idx`` ([B], the last real token of each row).
        """
        B, S = tokens.shape
        if S > self.rope_len:
            raise ValueError(f"prompt of {S} tokens is longer than the RoPE table ({self.rope_len} positions)")
        be = self.backend
        cs = self.rope[:S].unsqueeze(0).expand(B, S, *self.rope.shape[1:])  # [B, S, D/2, 2]
        residual = self._embed(tokens)  # [B, S, dim]; a fresh tensor, updated in place below
        x = self.layers[0].attention_norm(residual, be)
        for i, layer in enumerate(self.layers):
            if i > 0:
                x, residual = layer.attention_norm.add_forward(x, residual, be)
            x = layer.attention.prefill(x, cs, cache.k[i], cache.v[i], be)
            x, residual = layer.ffn_norm.add_forward(x, residual, be)
            x = layer.feed_forward(x, be)
        if self.norm.comm is not None:  # x is this rank's partial sum: all-reduce + add + norm together
            h, _ = self.norm.add_forward(x, residual, be)
            head = self._head
        else:  # the norm after the row selection (fewer rows)
            h = x + residual
            head = self._logits
        if last_idx is not None:  # [B, dim]; (fp8, scale) rows alike (TP with an FP8 head)
            rows = (torch.arange(B, device=last_idx.device), last_idx)
            h = tuple(t[rows] for t in h) if isinstance(h, tuple) else h[rows]
        return head(h)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache) -> torch.Tensor:
        """One token per sequence. tokens, input_pos: [B] (int64). Returns fp32 logits [B, V].

        Static shapes and no host syncs: this is what the CUDA graph captures.
        """
        B = tokens.shape[0]
        be = self.backend
        seq_lens = None if self.kernels["fused_rope"] else (input_pos + 1).to(torch.int32)  # once, for every layer
        if norm_gemm.applies(self, B):
            return norm_gemm.decode(self, tokens, input_pos, cache, seq_lens)
        residual = self._embed(tokens.view(B, 1))  # [B, 1, dim]; fresh, updated in place below
        x = self.layers[0].attention_norm(residual, be)
        for i, layer in enumerate(self.layers):
            if i > 0:
                x, residual = layer.attention_norm.add_forward(x, residual, be)
            x = layer.attention.decode(x, self.rope, cache.k[i], cache.v[i], input_pos, seq_lens, be)
            x, residual = layer.ffn_norm.add_forward(x, residual, be)
            x = layer.feed_forward(x, be)
        x, _ = self.norm.add_forward(x, residual, be)
        return self._head(x).view(B, -1)

    def set_gemm_impl(self, impl: Optional[str]) -> None:
        """None: the linear dispatcher (skinny kernel or cuBLAS per shape); "cublas": cuBLAS only."""
        if impl not in (None, "cublas", "triton"):
            raise ValueError(f"gemm impl must be None, 'cublas' or 'triton', got {impl!r}")
        for m in self.modules():
            if isinstance(m, (Linear, Fp8Linear)):
                m.gemm_impl = impl

    def set_kernels(self, **flags: bool) -> None:
        """Switch fused kernels on/off (ablation): ``fused_norm``, ``fused_act``, ``fused_down``, ``skinny_gemm``,
        ``fused_allreduce``, ``int4_gemm``, ``fused_rope``, ``norm_gemm`` (``models.norm_gemm``), ``attn_wo``
        (``ops.attention_wo``, on that path); those in ``OPT_IN_KERNELS`` start off.

        Off means the unfused PyTorch ops (norm, activation), cuBLAS (GEMMs), NCCL/gloo all-reduce then the norm,
        dequantise + cuBLAS (``Int4Linear``), RoPE + KV write in its own kernel. Also re-derives where FP8
        activations are produced (after ``quantize_model_fp8``; never before an ``Int4Linear``, which is W4A16).
        """
        bad = sorted(set(flags) - set(KERNELS))
        if bad:
            raise ValueError(f"unknown kernel switch {bad[0]!r}; known: {', '.join(KERNELS)}")
        self.kernels.update({k: bool(v) for k, v in flags.items()})
        k = self.kernels
        # rows of wqkv, wo, w2 (fp8_a16) and of w13 (fp8_a16_all) that run W8A16 at decode
        a16 = W8A16_DECODE_MAX_M if k["fp8_a16"] or k["fp8_a16_all"] else 0
        a16_w13 = W8A16_DECODE_MAX_M if k["fp8_a16_all"] else 0
        for layer in self.layers:
            # FP8 output only where the consumer is an Fp8Linear (int4 and bf16 projections take floats)
            a, f = layer.attention, layer.feed_forward
            for norm, consumer, a16_in in ((layer.attention_norm, a.wqkv, a16), (layer.ffn_norm, f.w13, a16_w13)):
                norm.fused = k["fused_norm"]
                norm.fp8_out = isinstance(consumer, Fp8Linear) and k["fused_norm"]
                norm.a16_rows = a16_in if norm.fp8_out else 0
                if isinstance(consumer, Fp8Linear):
                    consumer.a16_max_rows = a16_in
            f.fused = k["fused_act"]
            f.fuse_down = k["fused_down"]
            a.fused_rope, a.l2_prefetch = k["fused_rope"], k["l2_prefetch"]
            f.fp8_act = isinstance(f.w2, Fp8Linear) and k["fused_act"]
            for lin in (a.wo, f.w2):
                if isinstance(lin, Fp8Linear):
                    lin.a16_max_rows = a16
        for norm in [self.norm] + [m for layer in self.layers for m in (layer.attention_norm, layer.ffn_norm)]:
            norm.fuse_comm = k["fused_allreduce"]
        self.norm.fused = k["fused_norm"]
        self.norm.fp8_out = isinstance(self.output, Fp8Linear) and k["fused_norm"]  # FP8 lm head
        if "skinny_gemm" in flags:
            self.set_gemm_impl(None if k["skinny_gemm"] else "cublas")
        set_int4_switches(self, k)

    def weight_bytes(self) -> int:
        """Bytes of all parameters (tied embeddings counted once): what one decode step must read
        (``Int4Linear``: its packed bytes without the layout's padding)."""
        seen, total = set(), 0
        for m in self.modules():
            if isinstance(m, Int4Linear):
                seen |= {id(p) for p in m.parameters()}
                total += m.weight_bytes()
        return total + unique_param_bytes(self.parameters(), seen)

    def decode_step_bytes(self, batch: int) -> int:
        """Weight bytes one decode step of ``batch`` sequences reads: every block weight, the final norm and
        the lm head whole, but only ``batch`` rows of the embedding table (tied: the table once, read whole
        by the head; a quantised head (``quantize_head``) is its own tensors, and the table then adds only its
        ``batch`` rows). Under TP: this rank's shard (its rows of the vocab-parallel embedding and head)."""
        return step_read_bytes(self.weight_bytes(), self.tok_embeddings.weight, self.output, batch)
