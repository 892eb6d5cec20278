"""The decode attention and the ``wo`` projection's residual add in one kernel (``ops.attention_wo``).

No policy and no checks here: ``fastdecode.ops.attention_wo`` validates and picks the config.

Program (b, hkv, nb) of a grid (B, Hkv, NB):

1. before its PDL wait, its share of wo's rows ``[nb * BN, + BN)`` into L2 (``L2_PF``, sm_90+), and the first cache
   tile (``kernels.attention._rope_attend``);
2. RoPE, the KV write and the attention of kv head ``hkv`` (one split: the whole context), as
   ``_rope_decode_attention_kernel`` computes them; the rows of its GROUP query heads, rounded to qkv's dtype (as
   the unfused path stores the attention output), go to row ``(b, nb)`` of the scratch ``o`` [B, NB, Hq * D] fp32;
3. a counter per (b, nb): the last of the Hkv programs to arrive (acquire-release atomics, as the split-K GEMMs'
   last program) holds every head's output, reads the whole row from L2 and adds ``o @ wo[rows].T (+ bias)`` to the
   residual's rows ``[nb * BN, + BN)``: fp32 sums, one rounding, as ``ops.norm_linear.add_linear_`` (W_INT4: wo a
   packed int4 weight, dequantised in fp32 as the int4 GEMV's FMA path does). It resets the counter for the
   next launch on the stream.

Each kv head's attention is computed NB times (once for each block of wo's rows): the price of not waiting for a
second kernel. It is small where this applies (short contexts, few heads: ``ops.attention_wo``).
"""

import triton
import triton.language as tl

from fastdecode.kernels.attention import LOG2E, _rope_attend
from fastdecode.kernels.host import cdiv, next_pow2
from fastdecode.kernels.pdl import launch_kwargs
from fastdecode.kernels.prefetch import l2_prefetch_range, prefetch_plan


@triton.jit
def _int4_rows(o_row, qw_ptr, s_ptr, zm_ptr, rows, r_mask, stride_qw, stride_sn, K: tl.constexpr, GS: tl.constexpr,
               ZERO_MODE: tl.constexpr, BN: tl.constexpr):
    """W_INT4: ``sum_k o[k] * W[n, k]`` for the rows ``rows`` of a packed int4 weight (``ops.int4_format``: tiles of
    256 columns, 32 words a row a tile, nibble p of word j holding column 32 p + j; scales, and zeros (ZERO_MODE 1,
    uint8) or mins (2) per group of GS columns; 0: symmetric, q - 8), each weight dequantised in fp32, not
    rounded to the activation dtype, as the int4 GEMV's FMA path computes it (``kernels.int4``); o's row from L2
    (``.cg``) -> [BN] fp32."""
    p = tl.arange(0, 8)
    j = tl.arange(0, 32)
    r64 = rows.to(tl.int64)
    y = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, 256):
        cols = k0 + 32 * p[:, None] + j[None, :]  # [8, 32]: the columns of nibble p of word j
        x = tl.load(o_row + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
        words = tl.load(qw_ptr + r64[:, None] * stride_qw + k0 // 8 + j[None, :], mask=r_mask[:, None], other=0)
        q = ((words[:, None, :] >> (4 * p)[None, :, None]) & 15).to(tl.float32)  # [BN, 8, 32]
        grp = r64[:, None] * stride_sn + ((k0 + 32 * p) // GS)[None, :]  # [BN, 8]: a group holds whole runs of 32
        g_mask = r_mask[:, None] & ((k0 + 32 * p) < K)[None, :]
        sc = tl.load(s_ptr + grp, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        if ZERO_MODE == 0:
            w = (q - 8.0) * sc
        elif ZERO_MODE == 1:
            w = (q - tl.load(zm_ptr + grp, mask=g_mask, other=0).to(tl.float32)[:, :, None]) * sc
        else:
            w = q * sc + tl.load(zm_ptr + grp, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        y += tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
    return y


@triton.jit
def _rope_attention_wo_kernel(
    qkv_ptr, rope_ptr, pos_ptr, k_ptr, v_ptr, w_ptr, s_ptr, zm_ptr, bias_ptr, h_ptr, o_ptr, lock_ptr,
    scale,
    stride_qkv, stride_rope_t,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_wn, stride_sn, stride_hb, T, N, pf_ptr, pf_row_bytes, pf_chunk,
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
    LOG2E: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, W_INT4: tl.constexpr,
    GS: tl.constexpr, ZERO_MODE: tl.constexpr, USE_PDL: tl.constexpr, L2_PF: tl.constexpr, PF_LANES: tl.constexpr,
):
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    nb = tl.program_id(2)
    NB = tl.num_programs(2)
    if L2_PF:  # this block's wo rows, shared out over its Hkv programs' threads
        rows_here = tl.minimum(N - nb * BN, BN)
        l2_prefetch_range(pf_ptr + (nb * BN).to(tl.int64) * pf_row_bytes, rows_here * pf_row_bytes, pf_chunk, hkv,
                          PF_LANES)
    b64 = b.to(tl.int64)
    D: tl.constexpr = 2 * HALF
    K: tl.constexpr = HQ * D
    acc, m, l, heads, g_mask, d, d_mask = _rope_attend(
        qkv_ptr, rope_ptr, pos_ptr, k_ptr, v_ptr, b, hkv, 0, scale, stride_qkv, stride_rope_t, stride_kb, stride_kh,
        stride_kt, stride_vb, stride_vh, stride_vt, T, HQ, HKV, GROUP, BLOCK_G, HALF, BLOCK_HALF, BLOCK_D, BLOCK_N,
        1, USE_DOT, LOG2E, USE_PDL)
    # one split holds the new token: l >= 1 on every valid head
    out = (acc / tl.where(l > 0, l, 1.0)[:, None]).to(qkv_ptr.dtype.element_ty).to(tl.float32)
    o_row = o_ptr + (b64 * NB + nb) * K
    tl.store(o_row + heads[:, None] * D + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    # every thread's stores before the (release) counter bump
    tl.debug_barrier()
    lock = lock_ptr + b * NB + nb
    if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == HKV - 1:
        rows = nb * BN + tl.arange(0, BN)
        r_mask = rows < N
        if W_INT4:
            y = _int4_rows(o_row, w_ptr, s_ptr, zm_ptr, rows, r_mask, stride_wn, stride_sn, K, GS, ZERO_MODE, BN)
        else:
            y = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_mask = kk < K
                # the other programs' rows: from L2, not this SM's L1
                x = tl.load(o_row + kk, mask=k_mask, other=0.0, cache_modifier=".cg")
                w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                            mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                y += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        h_rows = h_ptr + b64 * stride_hb + rows
        y += tl.load(h_rows, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(h_rows, y.to(h_ptr.dtype.element_ty), mask=r_mask)
        tl.store(lock, 0)  # ready for the next launch (same stream)


def launch_rope_attention_wo(qkv, rope, input_pos, k_cache, v_cache, weight, bias, residual, o_scratch, locks,
                             n_q_heads: int, scale: float, config: dict, pdl: bool = False, prefetch=None,
                             int4=None):
    """qkv [B, (Hq + 2 Hkv) * D] rows (unit inner stride); rope [T, D/2, 2] fp32; input_pos [B]; caches
    [B, Hkv, T, D] (written at input_pos); weight (wo) [N, Hq * D] unit stride in K, or with ``int4`` its packed
    int32 words (N, Kp / 8) contiguous; ``int4``: ``(scales, zeros or mins or None, group_size, zero_mode)`` of the
    packed weight (``ops.int4_format``); bias [N] or None; residual [B, N] (row stride, unit inner stride; updated
    in place); o_scratch: >= B * NB * Hq * D fp32; locks: >= B * NB zeroed int32 counters (left at 0). config: the
    attention's (``ops.attention.decode_attention_config``, one split) plus ``BN`` (wo rows a block, a power of
    two). ``prefetch``: the weight's bytes as a contiguous 1-D uint8 tensor, 16-byte aligned rows (sm_90+;
    ``kernels.prefetch``)."""
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    N = weight.shape[0]
    scales, zm, gs, zero_mode = int4 if int4 is not None else (weight, None, 1, "sym")
    bn = config["BN"]
    nb = cdiv(N, bn)
    half = D // 2
    block_half = max(16, next_pow2(half)) if config["USE_DOT"] else next_pow2(half)
    lanes = 32 * config["num_warps"]
    row_bytes = weight.stride(0) * weight.element_size()
    pf_bytes, pf_chunk = prefetch_plan(bn * row_bytes, Hkv * lanes) if prefetch is not None else (0, 16)
    pf_chunk = max(pf_chunk, 512)  # fewer, larger copies (as kernels.prefetch.l2_prefetch_rows); the rest issue none
    _rope_attention_wo_kernel[(B, Hkv, nb)](
        qkv, rope, input_pos, k_cache, v_cache, weight, scales, zm if zm is not None else scales,
        bias if bias is not None else weight, residual, o_scratch, locks,
        scale,
        qkv.stride(0), rope.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        weight.stride(0), scales.stride(0), residual.stride(0), k_cache.shape[2], N,
        prefetch if prefetch is not None else weight, row_bytes, pf_chunk,
        HQ=n_q_heads, HKV=Hkv, GROUP=n_q_heads // Hkv, BLOCK_G=config["BLOCK_G"], HALF=half, BLOCK_HALF=block_half,
        BLOCK_D=config["BLOCK_D"], BLOCK_N=config["BLOCK_N"], USE_DOT=config["USE_DOT"], LOG2E=LOG2E, BN=bn,
        BLOCK_K=min(128, next_pow2(n_q_heads * D)), HAS_BIAS=bias is not None, W_INT4=int4 is not None, GS=gs,
        ZERO_MODE=("sym", "zero", "min").index(zero_mode), USE_PDL=pdl,
        L2_PF=prefetch is not None and pf_bytes > 0 and row_bytes % 16 == 0, PF_LANES=lanes,
        num_warps=config["num_warps"], num_stages=1, **launch_kwargs(pdl),
    )
