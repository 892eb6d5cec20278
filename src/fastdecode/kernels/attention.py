"""Decode attention: one new query token per sequence against a static KV cache, GQA, split-KV.

No policy and no checks here: ``fastdecode.ops.attention`` validates and picks the config.

Layouts: q [B, Hq, D]; k/v cache [B, Hkv, T, D] (unit stride in D); seq_lens [B] int32.
One program per (sequence, kv head, split): it loads each K/V tile once for all GROUP = Hq / Hkv query
heads that share it. Split s of a sequence covers an equal, BLOCK_N-aligned share of [0, seq_len), so
long contexts spread over many SMs; a second kernel merges the splits by their log-sum-exp.
"""

import triton
import triton.language as tl

from fastdecode.kernels.host import next_pow2
from fastdecode.kernels.int4_a8 import _store_act_int8
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait
from fastdecode.kernels.prefetch import l2_prefetch_range, prefetch_plan

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_update(m, l, s, s_mask, qk_scale):
    """One tile of the online softmax (base 2): scores ``s [BLOCK_G, BLOCK_N]``, valid columns ``s_mask``.
    Returns the new running max and sum, the rescale factor of the old state and the tile's weights."""
    s = tl.where(s_mask[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _pv(acc, alpha, p, v, USE_DOT: tl.constexpr):
    """``acc * alpha + p @ v`` (fp32; tensor cores on 16-bit v with USE_DOT)."""
    if USE_DOT:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _store_heads(out, o_ptr, b64, heads, stride_ob, stride_oh, g_mask, d, d_mask, q8_ptr, s8_ptr, sum8_ptr,
                 stride_q8, stride_s8, BLOCK_G: tl.constexpr, OUT_INT8: tl.constexpr):
    """The normalised rows ``out`` [BLOCK_G, BLOCK_D] of query heads ``heads`` of one sequence: to ``o`` in its
    dtype, or (``OUT_INT8``, head_dim 128) as row b of an int8 activation ``(q8, s8, sum8)`` for the W4A8 ``wo``
    (``kernels.int4_a8``): rounded to o's dtype first, then each head quantised as one group of 128 columns."""
    if OUT_INT8:
        y = out.to(o_ptr.dtype.element_ty).to(tl.float32)
        _store_act_int8(y, heads.to(tl.int64), g_mask, 0, q8_ptr + b64 * stride_q8, s8_ptr + b64 * stride_s8,
                        sum8_ptr + b64 * stride_s8, 128, 1, 1, BLOCK_G, 128)
    else:
        tl.store(o_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _store_split(acc, m, l, o_ptr, o_part_ptr, lse_ptr, b64, heads, split, n_heads, stride_ob, stride_oh, g_mask, d,
                 d_mask, q8_ptr, s8_ptr, sum8_ptr, stride_q8, stride_s8, BLOCK_G: tl.constexpr,
                 BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, OUT_INT8: tl.constexpr):
    """The program's output: normalised rows to ``o`` (one split; ``_store_heads``), else the split's fp32 rows to
    ``o_part`` [B, Hq, NUM_SPLITS, BLOCK_D] and their log-sum-exp (base 2) to ``lse`` [B, Hq, NUM_SPLITS] for the
    merge. A split with no position (start >= seq_len) has l == 0: weight 0 in the merge."""
    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        _store_heads(out, o_ptr, b64, heads, stride_ob, stride_oh, g_mask, d, d_mask, q8_ptr, s8_ptr, sum8_ptr,
                     stride_q8, stride_s8, BLOCK_G, OUT_INT8)
    else:
        row = (b64 * n_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(o_part_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, o_ptr, o_part_ptr, lse_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, LOG2E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < D
    heads = hkv * GROUP + g  # query heads served by this kv head
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # softmax in base 2: fold log2(e) into the scale once
    qk_scale = scale * LOG2E

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kt + d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N] fp32
        else:
            # one query row per head: a broadcast multiply-add is enough (and exact under the interpreter)
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        m, l, alpha, p = _softmax_update(m, l, s, n_mask, qk_scale)
        v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vt + d[None, :], mask=kv_mask, other=0.0)
        acc = _pv(acc, alpha, p, v, USE_DOT)

    _store_split(acc, m, l, o_ptr, o_part_ptr, lse_ptr, b64, heads, split, GROUP * tl.num_programs(1), stride_ob,
                 stride_oh, g_mask, d, d_mask, o_ptr, o_ptr, o_ptr, 0, 0, BLOCK_G, BLOCK_D, NUM_SPLITS, False)


@triton.jit
def _decode_attention_merge_kernel(
    o_part_ptr, lse_ptr, o_ptr, stride_ob, stride_oh, Hq, q8_ptr, s8_ptr, sum8_ptr, stride_q8, stride_s8,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, OUT_INT8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[b, h] = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse) (``_store_heads``: to o, or int8)."""
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b.to(tl.int64) * Hq + h) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + row0 + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = tl.where(s_mask, w, 0.0)
    o = tl.load(o_part_ptr + (row0 + s)[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :],
                other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    one = tl.arange(0, 1)  # the head as a block of one row
    _store_heads(out[None, :], o_ptr, b.to(tl.int64), h + one, stride_ob, stride_oh, one == 0, d, d < D, q8_ptr,
                 s8_ptr, sum8_ptr, stride_q8, stride_s8, 1, OUT_INT8)


def launch_decode_attention(q, k_cache, v_cache, seq_lens, out, o_part, lse, scale: float, config: dict,
                            pdl: bool = False):
    """q/out: [B, Hq, D]; caches [B, Hkv, T, D]; o_part [B, Hq, S, BLOCK_D] fp32 and lse [B, Hq, S] fp32
    when config["NUM_SPLITS"] > 1 (else unused, may be any tensor)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    splits = config["NUM_SPLITS"]
    block_d = config["BLOCK_D"]
    _decode_attention_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, seq_lens, out, o_part, lse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=config["BLOCK_G"], D=D, BLOCK_D=block_d,
        BLOCK_N=config["BLOCK_N"], NUM_SPLITS=splits, USE_DOT=config["USE_DOT"], LOG2E=LOG2E, USE_PDL=pdl,
        num_warps=config["num_warps"], num_stages=config.get("num_stages", 2), **launch_kwargs(pdl),
    )
    if splits > 1:
        _decode_attention_merge_kernel[(B, Hq)](
            o_part, lse, out, out.stride(0), out.stride(1), Hq, out, out, out, 0, 0,
            D=D, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), OUT_INT8=False, USE_PDL=pdl,
            num_warps=1 if block_d <= 128 else 2, **launch_kwargs(pdl),
        )


@triton.jit
def _rope_cos_sin(rope_ptr, pos, stride_rope_t, i, mask):
    """cos and sin of the rotation pairs ``i`` at position ``pos`` (the [T, D/2, 2] fp32 table)."""
    row = rope_ptr + pos * stride_rope_t + 2 * i
    return tl.load(row, mask=mask, other=0.0), tl.load(row + 1, mask=mask, other=0.0)


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Half-split rotation (HF / NeoX) of the fp32 halves x1, x2: ``[x1 c - x2 s, x2 c + x1 s]``."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr, rope_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_rope_t, stride_qo_b, stride_qo_h,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (b, h): h < HQ rotates query head h into q_out; HQ <= h < HQ + HKV rotates key head
    h - HQ and writes it, and the matching value head, to the caches at position pos[b].

    Half-split rotation (HF / NeoX): out = [x1 c - x2 s, x2 c + x1 s], fp32 math, one rounding.
    """
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    b64 = b.to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    cos, sin = _rope_cos_sin(rope_ptr, pos, stride_rope_t, i, m)
    row = qkv_ptr + b64 * stride_qkv + h * D  # q heads, then k heads: contiguous in one row
    x1 = tl.load(row + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + i, mask=m, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, cos, sin)
    if h < HQ:
        dst = q_out_ptr + b64 * stride_qo_b + h * stride_qo_h
        tl.store(dst + i, o1.to(q_out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + i, o2.to(q_out_ptr.dtype.element_ty), mask=m)
    else:
        hk = h - HQ
        dst = k_cache_ptr + b64 * stride_kb + hk * stride_kh + pos * stride_kt
        tl.store(dst + i, o1.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty), mask=m)
        src = qkv_ptr + b64 * stride_qkv + (HQ + HKV + hk) * D
        vdst = v_cache_ptr + b64 * stride_vb + hk * stride_vh + pos * stride_vt
        v1 = tl.load(src + i, mask=m, other=0.0)
        v2 = tl.load(src + HALF + i, mask=m, other=0.0)
        tl.store(vdst + i, v1.to(v_cache_ptr.dtype.element_ty), mask=m)
        tl.store(vdst + HALF + i, v2.to(v_cache_ptr.dtype.element_ty), mask=m)


def launch_rope_kv_write(qkv, rope, input_pos, q_out, k_cache, v_cache, n_q_heads: int, pdl: bool = False):
    """qkv: [B, (Hq + 2 Hkv) * D] rows (unit inner stride); rope: [T, D/2, 2] fp32 (cos, sin), unit stride
    in its last two dims; input_pos: [B]; q_out: [B, Hq, D]; caches [B, Hkv, T, D]."""
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    half = D // 2
    _rope_kv_write_kernel[(B, n_q_heads + Hkv)](
        qkv, rope, input_pos, q_out, k_cache, v_cache,
        qkv.stride(0), rope.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=n_q_heads, HKV=Hkv, HALF=half, BLOCK_HALF=next_pow2(half), USE_PDL=pdl,
        num_warps=1, **launch_kwargs(pdl),
    )


@triton.jit
def _merge_heads(o_part_ptr, lse_ptr, o_ptr, b64, heads, n_heads, stride_ob, stride_oh, g_mask, d, d_mask, q8_ptr,
                 s8_ptr, sum8_ptr, stride_q8, stride_s8, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, OUT_INT8: tl.constexpr):
    """``_decode_attention_merge_kernel``'s sum for the heads ``heads`` of one sequence, in split order, from
    L2 (``.cg``: the other programs' rows are not in this SM's L1)."""
    rows = (b64 * n_heads + heads) * NUM_SPLITS  # [BLOCK_G], split 0
    mx = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for si in range(NUM_SPLITS):
        mx = tl.maximum(mx, tl.load(lse_ptr + rows + si, mask=g_mask, other=float("-inf"), cache_modifier=".cg"))
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # padding heads: no NaN (never stored)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_G], dtype=tl.float32)
    for si in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_ptr + rows + si, mask=g_mask, other=float("-inf"), cache_modifier=".cg") - mx)
        o = tl.load(o_part_ptr + (rows + si)[:, None] * BLOCK_D + d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                    other=0.0, cache_modifier=".cg")
        acc += w[:, None] * o
        wsum += w
    out = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    _store_heads(out, o_ptr, b64, heads, stride_ob, stride_oh, g_mask, d, d_mask, q8_ptr, s8_ptr, sum8_ptr, stride_q8,
                 stride_s8, BLOCK_G, OUT_INT8)


@triton.jit
def _kv_tile(k_base, v_base, n, n_mask, i, h_mask, d, d_mask, stride_kt, stride_vt, HALF: tl.constexpr):
    """Cache rows ``n`` (masked rows read as 0): the keys as their two rotation halves, and the values."""
    rows_k = k_base + n[:, None].to(tl.int64) * stride_kt
    k1 = tl.load(rows_k + i[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0)
    k2 = tl.load(rows_k + HALF + i[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0)
    v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vt + d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                other=0.0)
    return k1, k2, v


@triton.jit
def _rope_attend(qkv_ptr, rope_ptr, pos_ptr, k_ptr, v_ptr, b, hkv, split, scale, stride_qkv, stride_rope_t,
                 stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, T,
                 HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_DOT: tl.constexpr, LOG2E: tl.constexpr, USE_PDL: tl.constexpr):
    """The body of ``_rope_decode_attention_kernel`` (its docstring) for program (b, hkv, split), up to the output:
    RoPE, the KV write of the new token (by the split that owns it), the PDL wait after the first cache tile's
    loads, and the online softmax over the split's positions. Returns ``(acc, m, l, heads, g_mask, d, d_mask)``:
    the unnormalised fp32 rows [BLOCK_G, BLOCK_D] of query heads ``heads``, their running max and sum (base 2),
    and the masks of the valid heads and columns."""
    b64 = b.to(tl.int64)
    D: tl.constexpr = 2 * HALF

    pos = tl.load(pos_ptr + b).to(tl.int32)
    seq_len = pos + 1
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    cached_end = tl.minimum(end, pos)  # this split's positions read from the caches
    has_new = (start <= pos) & (pos < end)  # one split per (sequence, kv head) owns the new token

    i = tl.arange(0, BLOCK_HALF)
    h_mask = i < HALF
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    k_base = k_ptr + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + hkv.to(tl.int64) * stride_vh

    # the first cache tile, in flight while the previous kernel drains (PDL). With one split (short caches) its
    # addresses do not wait for pos: rows up to the cache length T are read and those at or past pos masked at
    # use (scores to -inf, values to 0: a stale or uninitialised row may hold anything)
    n = start + tl.arange(0, BLOCK_N)
    if NUM_SPLITS == 1:
        n_mask = n < T
    else:
        n_mask = n < cached_end
    k1_nx, k2_nx, v_nx = _kv_tile(k_base, v_base, n, n_mask, i, h_mask, d, d_mask, stride_kt, stride_vt, HALF)
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()

    # RoPE (half-split, fp32 math) of this kv head's query heads and of its new key
    pos64 = pos.to(tl.int64)
    cos, sin = _rope_cos_sin(rope_ptr, pos64, stride_rope_t, i, h_mask)
    row = qkv_ptr + b64 * stride_qkv
    heads = hkv * GROUP + g
    qg_mask = g_mask[:, None] & h_mask[None, :]
    x1 = tl.load(row + heads[:, None] * D + i[None, :], mask=qg_mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + heads[:, None] * D + HALF + i[None, :], mask=qg_mask, other=0.0).to(tl.float32)
    q1, q2 = _rotate(x1, x2, cos[None, :], sin[None, :])
    q1, q2 = q1.to(qkv_ptr.dtype.element_ty), q2.to(qkv_ptr.dtype.element_ty)
    kx1 = tl.load(row + (HQ + hkv) * D + i, mask=h_mask, other=0.0).to(tl.float32)
    kx2 = tl.load(row + (HQ + hkv) * D + HALF + i, mask=h_mask, other=0.0).to(tl.float32)
    kn1, kn2 = _rotate(kx1, kx2, cos, sin)
    kn1, kn2 = kn1.to(k_ptr.dtype.element_ty), kn2.to(k_ptr.dtype.element_ty)
    vn = tl.load(row + (HQ + HKV + hkv) * D + d, mask=d_mask, other=0.0).to(v_ptr.dtype.element_ty)
    k_dst = k_base + pos64 * stride_kt
    # the masks as vectors (the interpreter takes no scalar in a store mask)
    new_h = h_mask & ((tl.zeros([BLOCK_HALF], dtype=tl.int32) + has_new.to(tl.int32)) != 0)
    new_d = d_mask & ((tl.zeros([BLOCK_D], dtype=tl.int32) + has_new.to(tl.int32)) != 0)
    new_g = (tl.zeros([BLOCK_G], dtype=tl.int32) + has_new.to(tl.int32)) != 0
    tl.store(k_dst + i, kn1, mask=new_h)
    tl.store(k_dst + HALF + i, kn2, mask=new_h)
    tl.store(v_base + pos64 * stride_vt + d, vn, mask=new_d)

    qk_scale = scale * LOG2E  # softmax in base 2
    s_new = (tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], axis=1)
             + tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], axis=1)) * qk_scale
    m = tl.where(new_g, s_new, float("-inf"))
    l = tl.where(new_g, 1.0, 0.0)
    acc = tl.where(new_g[:, None] & new_d[None, :], vn.to(tl.float32)[None, :], 0.0)

    for n0 in range(start, cached_end, BLOCK_N):
        k1 = k1_nx
        k2 = k2_nx
        s_mask = (n0 + tl.arange(0, BLOCK_N)) < cached_end
        v = tl.where(s_mask[:, None], v_nx, 0.0)
        # the next tile's loads are issued before this tile's maths
        n = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < cached_end
        k1_nx, k2_nx, v_nx = _kv_tile(k_base, v_base, n, n_mask, i, h_mask, d, d_mask, stride_kt, stride_vt, HALF)
        if USE_DOT:
            s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))  # [BLOCK_G, BLOCK_N] fp32
        else:
            s = (tl.sum(q1.to(tl.float32)[:, None, :] * k1.to(tl.float32)[None, :, :], axis=2)
                 + tl.sum(q2.to(tl.float32)[:, None, :] * k2.to(tl.float32)[None, :, :], axis=2))
        m, l, alpha, p = _softmax_update(m, l, s, s_mask, qk_scale)
        acc = _pv(acc, alpha, p, v, USE_DOT)
    return acc, m, l, heads, g_mask, d, d_mask


@triton.jit
def _rope_decode_attention_kernel(
    qkv_ptr, rope_ptr, pos_ptr, k_ptr, v_ptr, o_ptr, o_part_ptr, lse_ptr, lock_ptr, q8_ptr, s8_ptr, sum8_ptr,
    scale,
    stride_qkv, stride_rope_t,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_q8, stride_s8, T, pf_ptr, pf_bytes, pf_chunk,
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, USE_DOT: tl.constexpr, LOG2E: tl.constexpr, OUT_INT8: tl.constexpr,
    USE_PDL: tl.constexpr, L2_PF: tl.constexpr, PF_LANES: tl.constexpr,
):
    """``_rope_kv_write_kernel`` and ``_decode_attention_kernel`` in one program per (sequence, kv head, split),
    with ``seq_len = pos + 1``: the split whose range holds ``pos`` rotates this kv head's new k, writes k and v
    to the caches at ``pos`` and takes the new token's score and value from registers; every split rotates
    its GROUP query heads itself; the cached positions ``[start, min(end, pos))`` come from the caches.

    Rotation and rounding as the two kernels: q rounded to qkv's dtype, k and v to the cache's, then fp32
    scores, softmax and accumulation. Heads are kept as their two rotation halves (``s = q1 . k1 + q2 . k2``),
    so nothing is concatenated in registers.

    PDL: the program reads ``pos`` and its first cache tile before ``pdl_wait()``. That is within
    ``kernels.pdl``'s contract: neither the previous kernel (the qkv GEMM, or the q / k norm) writes them; the
    positions below ``pos`` were written by earlier steps (or the prefill), and ``pos`` by a kernel before the
    previous one, both complete when this kernel starts (the previous one started only after its own wait).

    L2_PF (sm_90+): first of all, each thread prefetches its share of the byte range ``[pf_ptr, + pf_bytes)`` (the
    next GEMV's weight: wo) into L2 (``kernels.prefetch``); weights are never written by the step's kernels.
    """
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    if L2_PF:
        l2_prefetch_range(pf_ptr, pf_bytes, pf_chunk, (b * HKV + hkv) * NUM_SPLITS + split, PF_LANES)
    b64 = b.to(tl.int64)
    acc, m, l, heads, g_mask, d, d_mask = _rope_attend(
        qkv_ptr, rope_ptr, pos_ptr, k_ptr, v_ptr, b, hkv, split, scale, stride_qkv, stride_rope_t, stride_kb,
        stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, T, HQ, HKV, GROUP, BLOCK_G, HALF, BLOCK_HALF, BLOCK_D,
        BLOCK_N, NUM_SPLITS, USE_DOT, LOG2E, USE_PDL)
    _store_split(acc, m, l, o_ptr, o_part_ptr, lse_ptr, b64, heads, split, HQ, stride_ob, stride_oh, g_mask, d,
                 d_mask, q8_ptr, s8_ptr, sum8_ptr, stride_q8, stride_s8, BLOCK_G, BLOCK_D, NUM_SPLITS, OUT_INT8)
    if MERGE_IN_KERNEL and NUM_SPLITS > 1:
        # the last split of (sequence, kv head) to arrive merges them all, as the split-K GEMMs' last program
        # sums their partials: no merge kernel. All threads' stores happen before the (release) counter bump.
        tl.debug_barrier()
        lock = lock_ptr + b * HKV + hkv
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            _merge_heads(o_part_ptr, lse_ptr, o_ptr, b64, heads, HQ, stride_ob, stride_oh, g_mask, d, d_mask, q8_ptr,
                         s8_ptr, sum8_ptr, stride_q8, stride_s8, BLOCK_G, BLOCK_D, NUM_SPLITS, OUT_INT8)
            tl.store(lock, 0)  # ready for the next launch (same stream)


def launch_rope_decode_attention(qkv, rope, input_pos, k_cache, v_cache, out, o_part, lse, n_q_heads: int,
                                 scale: float, config: dict, pdl: bool = False, locks=None, int8_out=None,
                                 prefetch=None):
    """qkv: [B, (Hq + 2 Hkv) * D] rows (unit inner stride); rope [T, D/2, 2] fp32; input_pos [B]; caches
    [B, Hkv, T, D]; out [B, Hq, D]; o_part [B, Hq, S, BLOCK_D] fp32 and lse [B, Hq, S] fp32 when
    config["NUM_SPLITS"] > 1 (else unused). config: ``ops.attention.decode_attention_config``'s, and optionally
    ``MERGE_IN_KERNEL`` (with more than one split: the last split of each (sequence, kv head) merges, no merge
    kernel; ``locks``: B * Hkv zeroed int32 counters, which the kernel leaves at 0). ``int8_out``: ``(q8, s8,
    sum8)`` rows of an int8 activation (``kernels.int4_a8``; contiguous [B, >= Hq * 128], [B, >= Hq]) written
    instead of ``out`` (then None), head_dim 128: each head one group of 128 columns. ``prefetch``: a contiguous
    1-D uint8 tensor, 16-byte aligned (the next GEMV's weight bytes), prefetched into L2 by the kernel's threads
    (sm_90+ only: inline PTX; ``kernels.prefetch``)."""
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    splits = config["NUM_SPLITS"]
    block_d = config["BLOCK_D"]
    half = D // 2
    # tl.dot needs K >= 16: the halves are padded (masked) to 16 on the dot path
    block_half = max(16, next_pow2(half)) if config["USE_DOT"] else next_pow2(half)
    merge_in_kernel = bool(config.get("MERGE_IN_KERNEL", False)) and splits > 1
    if merge_in_kernel and (locks is None or locks.numel() < B * Hkv):
        raise ValueError(f"MERGE_IN_KERNEL needs {B * Hkv} zeroed int32 counters (locks)")
    if int8_out is not None:
        if D != 128 or block_d != 128:
            raise ValueError(f"an int8 output needs head_dim 128 (one group of 128 columns a head), got {D}")
        q8, s8, sum8 = int8_out
        out, strides_o, strides_8 = qkv, (0, 0), (q8.stride(0), s8.stride(0))  # out: only its dtype is read
    else:
        q8 = s8 = sum8 = out
        strides_o, strides_8 = (out.stride(0), out.stride(1)), (0, 0)
    lanes = 32 * config["num_warps"]
    pf_bytes, pf_chunk = prefetch_plan(prefetch.numel(), B * Hkv * splits * lanes) if prefetch is not None else (0, 16)
    _rope_decode_attention_kernel[(B, Hkv, splits)](
        qkv, rope, input_pos, k_cache, v_cache, out, o_part, lse, locks if merge_in_kernel else out, q8, s8, sum8,
        scale,
        qkv.stride(0), rope.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *strides_o, *strides_8, k_cache.shape[2], prefetch if prefetch is not None else out, pf_bytes, pf_chunk,
        HQ=n_q_heads, HKV=Hkv, GROUP=n_q_heads // Hkv, BLOCK_G=config["BLOCK_G"], HALF=half, BLOCK_HALF=block_half,
        BLOCK_D=block_d, BLOCK_N=config["BLOCK_N"], NUM_SPLITS=splits, MERGE_IN_KERNEL=merge_in_kernel,
        USE_DOT=config["USE_DOT"], LOG2E=LOG2E, OUT_INT8=int8_out is not None, USE_PDL=pdl,
        L2_PF=prefetch is not None and pf_bytes > 0, PF_LANES=lanes,
        num_warps=config["num_warps"], num_stages=1, **launch_kwargs(pdl),
    )
    if splits > 1 and not merge_in_kernel:
        _decode_attention_merge_kernel[(B, n_q_heads)](
            o_part, lse, out, *strides_o, n_q_heads, q8, s8, sum8, *strides_8,
            D=D, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), OUT_INT8=int8_out is not None,
            USE_PDL=pdl, num_warps=1 if block_d <= 128 else 2, **launch_kwargs(pdl),
        )
