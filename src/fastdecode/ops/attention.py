"""Decode attention over a static KV cache: one new query token per sequence, GQA, split-KV.

``out[b, h] = softmax(scale * q[b, h] @ K[b, h // G, :L_b].T) @ V[b, h // G, :L_b]`` with
``G = Hq / Hkv`` query heads per kv head and ``L_b = seq_lens[b]`` (the new token's K/V already written).
fp32 scores, softmax and accumulation; one rounding to q.dtype at the end.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import (
    pdl_enabled,
    check_out, check_prefetch, check_same_device, check_tensor, interpreter_on, is_tracing, l2_prefetch_bytes,
    next_pow2, resolve_backend,
)

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, merge) outweighs its share


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention_config(B: int, Hq: int, Hkv: int, T: int, D: int, dtype: torch.dtype,
                            device: torch.device, num_splits: Optional[int] = None) -> dict:
    """Launch config (heuristic). Splits are sized from the cache capacity T, not the live lengths,
    so the same config serves every step of a captured CUDA graph."""
    group = Hq // Hkv
    # tl.dot needs >= 16 rows; pad the head group to 16 on the GPU (tensor cores are idle in decode
    # anyway). Under the interpreter bf16 dots are wrong (docs/architecture.md, "The Triton interpreter"),
    # fp32 dots on GPUs would be TF32.
    use_dot = dtype in (torch.float16, torch.bfloat16) and not (interpreter_on() and dtype == torch.bfloat16)
    block_g = max(16, next_pow2(group)) if use_dot else next_pow2(group)
    block_d = next_pow2(D)
    block_n = 64 if use_dot else max(16, min(64, 4096 // (block_g * block_d)))
    if num_splits is None:
        if device.type == "cuda":
            target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        else:
            target = 8
        num_splits = max(1, min(MAX_SPLITS, math.ceil(target / (B * Hkv)), math.ceil(T / MIN_TOKENS_PER_SPLIT)))
    return {"BLOCK_G": block_g, "BLOCK_D": block_d, "BLOCK_N": block_n, "NUM_SPLITS": int(num_splits),
            "USE_DOT": use_dot, "num_warps": 4, "num_stages": 2}


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an integer in [1, {MAX_SPLITS}], got {num_splits!r}")


def _split_buffers(B: int, Hq: int, cfg: dict, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV partials (fp32 rows [B, Hq, S, BLOCK_D] and their log-sum-exp [B, Hq, S]) the merge kernel
    reads; with one split the kernel writes ``out`` directly and takes ``out`` for both (unused)."""
    S = cfg["NUM_SPLITS"]
    if S == 1:
        return out, out
    return (torch.empty((B, Hq, S, cfg["BLOCK_D"]), dtype=torch.float32, device=out.device),
            torch.empty((B, Hq, S), dtype=torch.float32, device=out.device))


# ----------------------------------------------------------------------------- registered op


@define_op("decode_attention", mutates_args=("out",))
def _decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    out: torch.Tensor, scale: float, num_splits: int, backend: str,
) -> None:
    if backend == "triton":
        from fastdecode.kernels.attention import launch_decode_attention

        B, Hq, D = q.shape
        Hkv, T = k_cache.shape[1], k_cache.shape[2]
        cfg = decode_attention_config(B, Hq, Hkv, T, D, q.dtype, q.device, num_splits or None)
        o_part, lse = _split_buffers(B, Hq, cfg, out)
        launch_decode_attention(q, k_cache, v_cache, seq_lens, out, o_part, lse, scale, cfg, pdl=pdl_enabled(q))
        return
    out.copy_(decode_attention_ref(q, k_cache, v_cache, seq_lens, scale))


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, seq_lens, out, scale, num_splits, backend):
    return None


# ----------------------------------------------------------------------------- public API


def decode_attention(q, k_cache, v_cache, seq_lens, scale: Optional[float] = None, *,
                     num_splits: Optional[int] = None, out=None, backend: Optional[str] = None) -> torch.Tensor:
    """Attention of one new token per sequence over the first ``seq_lens[b]`` cache positions.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, T, D] (any strides, unit stride in D; Hq % Hkv == 0);
    seq_lens: [B] int32 with 1 <= seq_lens[b] <= T (values checked on CPU only: reading them back from a
    GPU would sync); scale defaults to 1/sqrt(D); num_splits overrides the split-KV heuristic.
    Returns out [B, Hq, D] in q.dtype.
    """
    check_tensor("q", q, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    B, Hq, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    Bk, Hkv, T, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k_cache must have shape ({B}, Hkv, T, {D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k_cache.shape)}")
    if Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's kv heads ({Hkv})")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must have {B} elements (one per sequence), got {seq_lens.shape[0]}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if D > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    _check_num_splits(num_splits)
    if seq_lens.device.type == "cpu" and B > 0 and not is_tracing():
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1 or hi > T:
            raise ValueError(f"seq_lens must lie in [1, {T}] (the cache length), got values in [{lo}, {hi}]")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    check_out("out", out, q.shape, q.dtype, q.device)
    be = resolve_backend(backend, q.device, "decode_attention")
    if q.stride(2) != 1:
        q = q.contiguous()
    if not seq_lens.is_contiguous():
        seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if B > 0:
        _decode_attention_op(q, k_cache, v_cache, seq_lens, out, scale, num_splits or 0, be)
    return out


# ----------------------------------------------------------------------------- reference


def decode_attention_ref(q, k_cache, v_cache, seq_lens, scale: Optional[float] = None) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`decode_attention` (fp32 math; no host syncs, graph-capturable)."""
    B, Hq, D = q.shape
    if q.device.type == "cpu" and B > 0 and not is_tracing():  # no sync on a CPU: skip the unused tail
        T_live = max(1, int(seq_lens.max()))
        k_cache, v_cache = k_cache[:, :, :T_live], v_cache[:, :, :T_live]
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k_cache.float()) * scale  # [B, Hkv, G, T]
    valid = torch.arange(T, device=q.device)[None, :] < seq_lens[:, None]  # [B, T]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    # positions past seq_len weigh 0, whatever they hold (0 * NaN would not)
    v = v_cache.float().masked_fill(~valid[:, None, :, None], 0.0)
    o = torch.einsum("bhgt,bhtd->bhgd", p, v)
    return o.reshape(B, Hq, D).to(q.dtype)


# ----------------------------------------------------------------------------- RoPE + KV-cache write


def _check_rope_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads) -> tuple[int, int]:
    """The checks :func:`rope_kv_write` and :func:`rope_decode_attention` share; returns (B, D)."""
    check_tensor("qkv", qkv, ndim=2)
    check_tensor("rope", rope, dtypes=(torch.float32,), ndim=3)
    check_tensor("input_pos", input_pos, dtypes=(torch.int32, torch.int64), ndim=1)
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    B, W = qkv.shape
    Bk, Hkv, T, D = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"got {tuple(v_cache.shape)} {v_cache.dtype}")
    if Bk != B:
        raise ValueError(f"k_cache must hold {B} sequences (qkv has {B} rows), got {Bk}")
    if not isinstance(n_q_heads, int) or n_q_heads < 1 or n_q_heads % Hkv:
        raise ValueError(f"n_q_heads must be a positive multiple of the kv heads ({Hkv}), got {n_q_heads!r}")
    if W != (n_q_heads + 2 * Hkv) * D:
        raise ValueError(f"qkv must have (n_q_heads + 2 * Hkv) * D = {(n_q_heads + 2 * Hkv) * D} columns, got {W}")
    if D % 2 or tuple(rope.shape[1:]) != (D // 2, 2):
        raise ValueError(f"rope must have shape (T, {D // 2}, 2) for head_dim {D}, got {tuple(rope.shape)}")
    if input_pos.shape[0] != B:
        raise ValueError(f"input_pos must have {B} elements, got {input_pos.shape[0]}")
    check_same_device(qkv=qkv, rope=rope, input_pos=input_pos, k_cache=k_cache, v_cache=v_cache)
    if qkv.stride(1) != 1 or rope.stride(2) != 1 or rope.stride(1) != 2:
        raise ValueError("qkv must have unit stride in its last dimension and rope must be contiguous in (D/2, 2)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if input_pos.device.type == "cpu" and B > 0 and not is_tracing():
        lo, hi = int(input_pos.min()), int(input_pos.max())
        if lo < 0 or hi >= min(T, rope.shape[0]):
            raise ValueError(f"input_pos must lie in [0, {min(T, rope.shape[0]) - 1}], got values in [{lo}, {hi}]")
    return B, D


@define_op("rope_kv_write", mutates_args=("q_out", "k_cache", "v_cache"))
def _rope_kv_write_op(
    qkv: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor, q_out: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, n_q_heads: int, backend: str,
) -> None:
    if backend == "triton":
        from fastdecode.kernels.attention import launch_rope_kv_write

        launch_rope_kv_write(qkv, rope, input_pos, q_out, k_cache, v_cache, n_q_heads, pdl=pdl_enabled(qkv))
        return
    q_out.copy_(rope_kv_write_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads))


@_rope_kv_write_op.register_fake
def _(qkv, rope, input_pos, q_out, k_cache, v_cache, n_q_heads, backend):
    return None


def rope_kv_write(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int, *, out=None,
                  backend: Optional[str] = None) -> torch.Tensor:
    """The decode step's attention prologue in one op: rotate q and k by RoPE at ``input_pos``, write k and v
    into the caches there, return the rotated q.

    qkv: [B, (Hq + 2 Hkv) * D] (q | k | v, HF half-split head layout); rope: [T, D/2, 2] fp32 (cos, sin)
    per position; input_pos: [B] int (0 <= pos < T_cache, checked on CPU only); k_cache, v_cache:
    [B, Hkv, T_cache, D], written in place. Returns q [B, Hq, D] in qkv.dtype (fp32 math, one rounding).
    """
    B, D = _check_rope_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads)
    check_out("out", out, (B, n_q_heads, D), qkv.dtype, qkv.device)
    be = resolve_backend(backend, qkv.device, "rope_kv_write")
    out = torch.empty((B, n_q_heads, D), dtype=qkv.dtype, device=qkv.device) if out is None else out
    if B > 0:
        _rope_kv_write_op(qkv, rope, input_pos, out, k_cache, v_cache, n_q_heads, be)
    return out


def rope_kv_write_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int) -> torch.Tensor:
    """Reference of :func:`rope_kv_write` (writes the caches in place, returns q). Graph-capturable."""
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    h = D // 2
    x = qkv.view(B, -1, D)  # [B, Hq + 2 Hkv, D]
    qk = x[:, :n_q_heads + Hkv].float()
    cs = rope[input_pos]  # [B, D/2, 2]
    cos, sin = cs[:, None, :, 0], cs[:, None, :, 1]
    x1, x2 = qk[..., :h], qk[..., h:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rows = torch.arange(B, device=qkv.device)
    k_cache[rows, :, input_pos] = rot[:, n_q_heads:].to(k_cache.dtype)
    v_cache[rows, :, input_pos] = x[:, n_q_heads + Hkv:].to(v_cache.dtype)
    return rot[:, :n_q_heads].to(qkv.dtype)


# ----------------------------------------------------------------------------- RoPE + KV write + attention, one op


@define_op("rope_decode_attention", mutates_args=("out", "k_cache", "v_cache"))
def _rope_decode_attention_op(
    qkv: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    out: torch.Tensor, n_q_heads: int, scale: float, num_splits: int, prefetch: Optional[torch.Tensor], backend: str,
) -> None:
    if backend == "triton":
        from fastdecode.kernels.attention import launch_rope_decode_attention

        B, D = qkv.shape[0], k_cache.shape[3]
        Hkv, T = k_cache.shape[1], k_cache.shape[2]
        # decode_attention's configs: on the H200 (benchmarks/sweep_attention.py, 8B heads, T 129) 4 warps and
        # 64-row tiles were the fastest of BLOCK_N 16-128 x 4 / 8 warps, although ptxas spills a little on 4 warps
        cfg = decode_attention_config(B, n_q_heads, Hkv, T, D, qkv.dtype, qkv.device, num_splits or None)
        o_part, lse = _split_buffers(B, n_q_heads, cfg, out)
        launch_rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, out, o_part, lse, n_q_heads, scale,
                                     cfg, pdl=pdl_enabled(qkv), prefetch=l2_prefetch_bytes(prefetch))
        return
    out.copy_(rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale))


@_rope_decode_attention_op.register_fake
def _(qkv, rope, input_pos, k_cache, v_cache, out, n_q_heads, scale, num_splits, prefetch, backend):
    return None


def _check_fused_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int, scale, num_splits, prefetch):
    """The checks of the fused RoPE + attention ops (this module's and ``ops.int4_a8``'s int8-output one): ``(B, D,
    scale)``, the scale defaulting to ``1 / sqrt(D)``."""
    B, D = _check_rope_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads)
    if k_cache.dtype != qkv.dtype:
        raise ValueError(f"k_cache and v_cache must have qkv's dtype {qkv.dtype}, got {k_cache.dtype}")
    _check_num_splits(num_splits)
    check_prefetch(prefetch, qkv.device)
    return B, D, 1.0 / math.sqrt(D) if scale is None else float(scale)


def rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int, scale: Optional[float] = None, *,
                          num_splits: Optional[int] = None, out=None, prefetch: Optional[torch.Tensor] = None,
                          backend: Optional[str] = None) -> torch.Tensor:
    """:func:`rope_kv_write` then :func:`decode_attention` over ``seq_lens = input_pos + 1``, in one kernel (plus
    the split merge when split-KV has more than one split): rotate q and k at ``input_pos``, write k and v into
    the caches there, attend over positions ``0..input_pos``.

    Arguments as :func:`rope_kv_write` (qkv [B, (Hq + 2 Hkv) * D], rope [T, D/2, 2] fp32, input_pos [B] int,
    caches [B, Hkv, T_cache, D] written in place; here the caches must have qkv's dtype), scale and num_splits
    as :func:`decode_attention`. Returns out [B, Hq, D] in qkv.dtype. The rotated q is rounded to qkv's dtype
    before the scores, as the two ops round it.

    ``prefetch`` (a hint; no result changes): a contiguous, 16-byte aligned tensor on qkv's device, typically the
    next projection's weight (wo), whose bytes the kernel's threads prefetch into L2 while the memory bus would
    idle (``fastdecode.kernels.prefetch``; Triton backend on sm_90+, ignored elsewhere).
    """
    B, D, scale = _check_fused_args(qkv, rope, input_pos, k_cache, v_cache, n_q_heads, scale, num_splits, prefetch)
    check_out("out", out, (B, n_q_heads, D), qkv.dtype, qkv.device)
    be = resolve_backend(backend, qkv.device, "rope_decode_attention")
    out = torch.empty((B, n_q_heads, D), dtype=qkv.dtype, device=qkv.device) if out is None else out
    if B > 0:
        _rope_decode_attention_op(qkv, rope, input_pos, k_cache, v_cache, out, n_q_heads, scale, num_splits or 0,
                                  prefetch, be)
    return out


def rope_decode_attention_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads: int,
                              scale: Optional[float] = None) -> torch.Tensor:
    """Reference of :func:`rope_decode_attention`: the two references composed (writes the caches in place)."""
    q = rope_kv_write_ref(qkv, rope, input_pos, k_cache, v_cache, n_q_heads)
    return decode_attention_ref(q, k_cache, v_cache, (input_pos + 1).to(torch.int32), scale)
