"""The decode attention and the ``wo`` projection's residual add in one kernel: the ``attn_wo`` kernel switch.

On the ``norm_gemm`` decode path a block is ``rms_norm_linear(h, wqkv) -> attention -> add_linear_(h, wo) ->
rms_norm_linear(h, w13) -> add_linear_(h, w2)``. This op joins the second and third kernels::

    rope_attention_add_linear_(h, qkv, rope, input_pos, k_cache, v_cache, wo)
        == add_linear_(h, rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache).reshape(B, -1), wo)

so a dense block runs 4 kernels a step instead of 5. Why it may pay: the embedded SmolLM2's step is bound by its
kernel chain, not by bytes (30 blocks, 450.01 us a step at its bf16 shapes on an H200 against a byte floor of about
60 us, ``benchmarks/results/decode_small_0f4ddd1.json``); one kernel fewer a block takes away one PDL hand-over and
wo's own wait for its input. Whether it does is for the GPU to say (``bench decode``'s
``fastdecode-graph-with-attn_wo`` row); the switch is off until it has.

How (``kernels.attention_wo``): a grid of (sequence, kv head, block of BN rows of wo). Each program computes its kv
head's attention (each block of rows repeats it: short contexts only) and stores its heads' output; the last
program of a (sequence, block) to arrive sums the whole row times its BN rows of wo into the residual.

Numerics as the two ops: the attention output rounded to qkv's dtype, then ``h + o @ wo.T (+ bias)`` in fp32, one
rounding (the sums over K in another order than the GEMV kernel's). The KV cache is written at ``input_pos`` as
``rope_decode_attention`` writes it.

Where it applies (``applies``): one split of the context (the split-KV heuristic of
``ops.attention.decode_attention_config`` would pick one: caches of at most ``MIN_TOKENS_PER_SPLIT`` positions, as the
``bench decode`` of 1 in / 128 out has), and a wo of at most ``MAX_WO_BYTES``; a longer cache keeps the two kernels,
whose split-KV spreads it over SMs, and so does a larger wo, whose GEMV spreads its bytes over every SM.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fastdecode.ops._common import (
    check_same_device, check_tensor, l2_prefetch_bytes, next_pow2, pdl_enabled, resolve_backend, warn_once,
    weight_prefetch_enabled,
)
from fastdecode.ops._registry import define_op
from fastdecode.ops.attention import (
    _check_fused_args, _num_sms, decode_attention_config, rope_decode_attention, rope_decode_attention_ref,
)
from fastdecode.ops.gemm import check_bias
from fastdecode.ops.int4 import _zm, check_x
from fastdecode.ops.int4_format import Int4Weight
from fastdecode.ops.int4_norm_linear import int4_add_linear_, int4_add_linear_ref
from fastdecode.ops.norm_linear import add_linear_, add_linear_ref, check_residual

#: the most rows of wo one block adds (a program's GEMV tile is BN x 128)
MAX_BLOCK_N = 128
#: the largest wo ``applies`` takes (bytes; Llama-3.2-1B's bf16 wo is 8 MB): at the 8B's 33.5 MB each block's last
#: program would read 1 MB of wo alone (BN 128 rows of K 4096), where wo's own GEMV spreads it over every SM. A
#: bound of the design, not measured
MAX_WO_BYTES = 8 << 20


def _block_n(B: int, Hkv: int, N: int, device: torch.device) -> int:
    """Rows of wo a block: about one program per SM over the grid (B, Hkv, N / BN), 16 to MAX_BLOCK_N."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    return max(16, min(MAX_BLOCK_N, next_pow2(-(-N * B * Hkv // sms))))


def applies(B: int, n_q_heads: int, k_cache: torch.Tensor, weight) -> bool:
    """Whether the decode step of ``B`` sequences takes this op over a cache ``k_cache`` [B, Hkv, T, D] with wo's
    ``weight`` (a tensor or an ``Int4Weight``): where the split-KV heuristic picks one split and wo's weight (an int4
    wo's packed words) has at most ``MAX_WO_BYTES`` (module docstring)."""
    _, Hkv, T, D = k_cache.shape
    w = weight.qweight if isinstance(weight, Int4Weight) else weight
    if w.numel() * w.element_size() > MAX_WO_BYTES:
        return False
    cfg = decode_attention_config(B, n_q_heads, Hkv, T, D, k_cache.dtype, k_cache.device)
    return cfg["NUM_SPLITS"] == 1


def _int4(weight, scales, zm, group_size: int, zero_mode: str, K: int) -> Int4Weight:
    """The ``Int4Weight`` the registered op's tensors describe (``weight``: its packed words)."""
    return Int4Weight(weight, scales, zm if zero_mode == "zero" else None, zm if zero_mode == "min" else None,
                      group_size, zero_mode, k=K)


@define_op("rope_attention_add_linear_", mutates_args=("residual", "k_cache", "v_cache"))
def _rope_attention_add_linear_op(
    residual: torch.Tensor, qkv: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor], zm: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], n_q_heads: int, scale: float, block_n: int, group_size: int, zero_mode: str,
    backend: str,
) -> None:
    """weight: wo dense, or (``scales`` given) an int4 wo's packed words, with its zeros / mins ``zm``."""
    K = n_q_heads * k_cache.shape[3]
    if backend == "triton":
        from fastdecode.kernels.attention_wo import launch_rope_attention_wo
        from fastdecode.ops._tuned import split_k_locks, split_k_partials

        B, D = qkv.shape[0], k_cache.shape[3]
        Hkv, T = k_cache.shape[1], k_cache.shape[2]
        N = weight.shape[0]
        bn = block_n or _block_n(B, Hkv, N, qkv.device)
        nb = -(-N // bn)
        locks = split_k_locks(qkv.device, B * nb)
        if locks is not None:
            cfg = {**decode_attention_config(B, n_q_heads, Hkv, T, D, qkv.dtype, qkv.device, 1), "BN": bn}
            scratch = split_k_partials(qkv.device, B * nb * n_q_heads * D)
            # its wo rows into L2 before the PDL wait where the GEMVs' weight-slab policy has them prefetch theirs (by
            # default a small dense weight at one token; an int4 weight only where the policy is forced on)
            pf_on = weight_prefetch_enabled(residual, weight if scales is None else None)
            pf = l2_prefetch_bytes(weight) if weight.is_contiguous() and pf_on else None
            int4 = None if scales is None else (scales, zm, group_size, zero_mode)
            launch_rope_attention_wo(qkv, rope, input_pos, k_cache, v_cache, weight, bias, residual, scratch, locks,
                                     n_q_heads, scale, cfg, pdl=pdl_enabled(qkv), prefetch=pf, int4=int4)
            return
        # inside a CUDA-graph capture before any counters exist (``ops._tuned.split_k_locks``): the two ops
        warn_once("fastdecode: rope_attention_add_linear_'s counters were not allocated before CUDA-graph capture; "
                  "this capture runs the attention and wo as two kernels (run one step before capturing)")
        o = rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale, num_splits=1,
                                  backend="triton")
        if scales is None:
            add_linear_(residual, o.reshape(B, -1), weight, bias, backend="triton")
        else:
            int4_add_linear_(residual, o.reshape(B, -1), _int4(weight, scales, zm, group_size, zero_mode, K), bias,
                             backend="triton")
        return
    w = weight if scales is None else _int4(weight, scales, zm, group_size, zero_mode, K)
    residual.copy_(rope_attention_add_linear_ref(residual, qkv, rope, input_pos, k_cache, v_cache, w, bias, n_q_heads,
                                                 scale))


@_rope_attention_add_linear_op.register_fake
def _(residual, qkv, rope, input_pos, k_cache, v_cache, weight, scales, zm, bias, n_q_heads, scale, block_n,
      group_size, zero_mode, backend):
    return None


def _check_block_n(block_n) -> None:
    ok = isinstance(block_n, int) and not isinstance(block_n, bool) and 16 <= block_n <= MAX_BLOCK_N \
        and block_n & (block_n - 1) == 0
    if block_n is not None and not ok:
        raise ValueError(f"block_n must be None or a power of two in [16, {MAX_BLOCK_N}], got {block_n!r}")


def rope_attention_add_linear_(residual, qkv, rope, input_pos, k_cache, v_cache, weight, bias=None, *,
                               n_q_heads: int, scale: Optional[float] = None, block_n: Optional[int] = None,
                               backend: Optional[str] = None) -> torch.Tensor:
    """``residual += rope_decode_attention(qkv, ...).reshape(B, -1) @ weight.T + bias`` in place, in one kernel
    (module docstring); writes k and v into the caches at ``input_pos``. Returns residual.

    qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale: as ``ops.attention.rope_decode_attention`` (the whole
    context is one split, whatever its length); weight: wo, (N, n_q_heads * D), qkv's dtype, unit stride in its
    last dimension, or an ``Int4Weight`` of that shape without act-order (qkv bf16 / fp16; W4A16, the weight
    dequantised in fp32 as the int4 GEMV's FMA kernel does, not rounded to the activation dtype);
    bias: (N,) or None; residual: (B, N), qkv's dtype, contiguous.
    ``block_n``: rows of wo a program adds (a power of two, 16 to ``MAX_BLOCK_N``; default: about one program per
    SM). Where the GEMVs' weight-slab prefetch is on (``ops._common.weight_prefetch_enabled``: by default one token
    and a small bf16 / fp16 dense weight), the programs prefetch their block's rows of wo into L2 before their PDL
    wait.
    """
    B, D, scale = _check_fused_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale, None, None)
    K = n_q_heads * D
    packed = weight if isinstance(weight, Int4Weight) else None
    if packed is not None:
        check_x("qkv (an int4 wo's activation dtype)", qkv[:, :K], packed)
        if packed.perm is not None:
            raise ValueError("an act-order int4 wo (perm) is not supported: its columns would need the attention "
                             "output permuted")
        weight = packed.qweight
    else:
        check_tensor("weight", weight, dtypes=(qkv.dtype,), ndim=2)
        if weight.shape[1] != K:
            raise ValueError(f"weight must have n_q_heads * head_dim = {K} columns (the attention output), got "
                             f"{tuple(weight.shape)}")
        if weight.shape[1] > 1 and weight.stride(1) != 1:
            raise ValueError(f"weight must have unit stride in its last dimension, got strides {weight.stride()}")
    N = weight.shape[0]
    bias = check_bias(bias, N, (qkv.dtype,))
    check_residual(residual, (B, N), qkv.dtype)
    check_same_device(qkv=qkv, weight=weight, bias=bias, residual=residual,
                      scales=packed.scales if packed is not None else None)
    _check_block_n(block_n)
    be = resolve_backend(backend, qkv.device, "rope_attention_add_linear_")
    if B > 0 and N == 0:  # nothing to add; the caches are still written
        rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale, backend=backend)
    elif B > 0:
        scales, zm = (packed.scales, _zm(packed)) if packed is not None else (None, None)
        gs, mode = (packed.group_size, packed.zero_mode) if packed is not None else (0, "")
        _rope_attention_add_linear_op(residual, qkv, rope, input_pos, k_cache, v_cache, weight, scales, zm, bias,
                                      n_q_heads, float(scale), block_n or 0, gs, mode, be)
    return residual


def rope_attention_add_linear_ref(residual, qkv, rope, input_pos, k_cache, v_cache, weight, bias, n_q_heads: int,
                                  scale: Optional[float] = None) -> torch.Tensor:
    """Reference of :func:`rope_attention_add_linear_` (out of place; writes the caches): the two references
    composed."""
    B, D = qkv.shape[0], k_cache.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale)
    if isinstance(weight, Int4Weight):
        return int4_add_linear_ref(residual, o.reshape(B, -1), weight, bias)
    return add_linear_ref(residual, o.reshape(B, -1), weight, bias)


__all__ = ["MAX_BLOCK_N", "MAX_WO_BYTES", "applies", "rope_attention_add_linear_", "rope_attention_add_linear_ref"]
