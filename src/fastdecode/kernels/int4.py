"""Int4-weight GEMM (W4A16): ``out = x @ dequantize_int4(w, x.dtype).T (+ bias)``, fp32 accumulation.

No policy and no checks here: ``fastdecode.ops.int4`` validates, gathers act-order columns, picks
the config and owns the split-K workspace. The weight layout is ``fastdecode.quant.int4``'s: int32
words in tiles of 256 columns, word j of a tile holding columns 32p + j in bits 4p..4p+3 (p = 0..7);
scales and zeros / mins ``(N, K // GROUP)``.

Dequantisation (the nibble -> float conversions, shared with the whole-weight dequant kernel):
``fastdecode.kernels.int4_dequant``.

A K step loads a ``[BLOCK_N, BLOCK_K // 8]`` tile of words (16-byte loads) once, then for each of
the 8 shifts p (unrolled) dequantises a ``[BLOCK_N, BLOCK_K // 8]`` slice *in the words' register
layout*; thanks to the stride-32 interleave the slice's columns are runs of 32 consecutive columns,
so its x operand is a plain 2-D load. Two inner products (constexpr ``USE_DOT``), one kernel:

* FMA (small M, weight streaming): slice x each of ``BLOCK_M`` (<= 4) broadcast x rows into
  ``[BLOCK_N, BLOCK_K // 8]`` fp32 accumulators, elementwise (no cross-thread reduction inside the
  loop; one after it).
* DOT (larger M): ``acc += tl.dot(x[BLOCK_M, BLOCK_K // 8], slice^T)`` per shift (tensor cores on
  the GPU; 8 MMAs of K = BLOCK_K // 8 per step).

Split-K: as ``kernels/gemm.py`` (fp32 partials, a per-tile arrival counter, the last program sums
the partials in split order: deterministic; one launch, counters reset by the kernel).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from fastdecode.kernels.gemm import _epilogue, _fma_rows, _load_x, _split_k_partial
from fastdecode.kernels.gemm_norm import _affine, _norm_rows, _rows_rstd, norm_tile
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.int4_dequant import (
    _ZERO_MODES, _dequant, _dequant8_asm, _group_params, _group_params8, _nibble_f32, _nibble_f32_asm, _pick8,
    _slice_params, _uniform, check_params, slices_per_group,
)
from fastdecode.kernels.int4_mma import launch_int4_mma
from fastdecode.kernels.int4_packed import check_packed, packed_mode, packed_options, packed_pairs, packed_step
from fastdecode.kernels.prefetch import l2_prefetch_rows, next_words, slab_bytes
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _fma_group(acc, t, s, z, xsum, ZERO_MODE: tl.constexpr):
    """Fold a finished group's unscaled sums ``t = sum (q - zero) x`` into ``acc``: ``acc += t * scale``
    (+ ``min * sum(x)`` for "min")."""
    acc += t * s
    if ZERO_MODE == 2:
        acc += xsum[None, :] * z
    return acc


@triton.jit
def _fold_row(acc, t, xs, d, x, s, z, FIRST: tl.constexpr, LAST: tl.constexpr, ZERO_MODE: tl.constexpr):
    """One token row of the FMA path, one shift: ``t += d * x``, ``xs += x`` (the group's sum of x, for
    "min"); the group's last shift folds them into ``acc``. Returns (acc, t, xs)."""
    if FIRST:
        t = d * x[None, :]
        xs = x
    else:
        t += d * x[None, :]
        xs += x
    if LAST:
        acc = _fma_group(acc, t, s, z, xs, ZERO_MODE)
    return acc, t, xs


@triton.jit(do_not_specialize=["M", "split_k", "stride_part"])
def _int4_linear_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, xs_ptr, out_ptr, part_ptr, lock_ptr, nw_ptr, eps,
    M, N, K, G, KW, stride_xm, stride_om, stride_part, split_k,
    GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
    UNIFORM: tl.constexpr, SPG: tl.constexpr, EVEN_K: tl.constexpr, X_SCALE_MODE: tl.constexpr,
    FAST_CVT: tl.constexpr, PREFETCH: tl.constexpr, SCALE_PF: tl.constexpr, NORM_LOOP: tl.constexpr,
    LOP3_ASM: tl.constexpr, USE_PDL: tl.constexpr, PACKED: tl.constexpr, PF_UNROLL: tl.constexpr,
    SUM16: tl.constexpr,
    X_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, NORM_NB: tl.constexpr, NORM_RM: tl.constexpr,
    ACCUMULATE: tl.constexpr, X_GLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    L2_SLAB: tl.constexpr, PF_LANES: tl.constexpr,
):
    """Grid (m tiles, split_k, n tiles). BLOCK_K is a multiple of 256 (whole layout tiles); KW is the
    number of words per weight row (Kp // 8); columns >= K are masked (x and scales read as 0).

    FMA path (weight streaming): nibbles become fp32 ``2**23 + q * 16**j`` in place (``_nibble_f32``,
    no shifts, no int -> float conversion, no 16-bit rounding; on the GPU one LOP3 of inline PTX,
    LOP3_ASM, since ptxas leaves the portable AND and OR as two); ``d = f * 16**-j - (2**(23 - 4j) + zero)``
    is one FFMA of exact terms, so d is the exact integer ``q - zero`` (``q`` for "min"); with UNIFORM
    slices the scale is applied once per group, not per value: ``t += d * x`` over the slices of a group,
    then ``acc += t * scale`` — per value one LOP3 and one FFMA, plus one FFMA per token row (sm_90 SASS
    of the M = 1, BLOCK_N = 64 loop: 4.5 instructions per value, 6.1 before LOP3_ASM and the one-FFMA d).
    So this path computes with the exact dequantised weight in fp32 (``dequantize_int4`` rounds it to
    x.dtype; the difference is below that rounding).

    DOT path: ``acc = tl.dot(x, w^T, acc)`` per shift, with ``w`` dequantised to x.dtype as
    ``dequantize_int4`` does: on the GPU (FAST_CVT) eight shifts per word by the packed-pair PTX of
    ``_dequant8_asm``, in the interpreter by ``_dequant``.

    SPG (> 0 when BLOCK_K == 256 and the groups tile the layout tile: GROUP divides 256, 256 divides
    GROUP, or one group per row; else 0): shifts per group, for the per-group scaling of the FMA path
    and for FAST_CVT (which needs SPG > 0).

    W4A8 (x is FP8, X_SCALE_MODE 1 per tensor / 2 per token): the FMA path as above; the DOT path
    converts the integers ``q - zero`` (or ``q`` for "min"), exact in e4m3, to FP8 and runs FP8
    ``tl.dot`` per shift (32 columns, one group: UNIFORM is required), then ``acc += dot * scale[n]``
    (+ ``min[n] * sum(x)`` for "min"); x_scale in the epilogue.

    X_NORM (16-bit x, any path and split): x holds the residual stream h and the input is ``rms_norm(h) * nw``:
    each program first sums its rows' squares over the whole of K (``_rows_rstd``). With NORM_LOOP (opt-in) on the
    FMA path with one split, the loop sums them instead, as it loads every column of its rows once (as
    ``kernels.gemm``'s skinny kernel does; session 31; in the embedded step on an H100 its qkv ran 0.26 us a call
    slower so, session 32). A split sees only its slice of K, and a dot tile's loads are not the row's once each.
    The loop multiplies ``h * nw`` rounded to x's dtype (NORM_AFFINE; else h: a norm
    without weight) with the weights, and the per-row ``rsqrt(mean(h^2) + eps)`` scales the fp32 sums (or this
    split's partial: the scale is linear) before the bias (``ops.int4_norm_linear``). NORM_NB, NORM_RM:
    columns a step and rows of that pass (``kernels.gemm_norm.norm_tile``). ACCUMULATE: out += the result (the
    residual add after wo / w2, in place; ``_epilogue``).

    X_GLU (FMA path, 16-bit x, no X_NORM): x holds ``[gate | up]`` rows of 2K columns and the input is
    ``silu(gate) * up``, computed at each load and rounded to x's dtype as the SiLU-and-mul kernel stores it
    (``kernels.gemm._load_x``): w2 with SiLU-and-mul inside, the int4 ``int4_glu`` switch (session 30).

    L2_SLAB (bytes, 0: off; with USE_PDL, sm_90+; PF_LANES: the program's threads): before its PDL wait the program
    prefetches up to that much of its packed weight words (its BLOCK_N rows, its split's words) into L2, as
    ``kernels.gemm``'s skinny kernel does.
    """
    X_FP8: tl.constexpr = X_SCALE_MODE != 0
    NORM_IN_LOOP: tl.constexpr = X_NORM and NORM_LOOP and not (USE_DOT or SPLIT)  # the rows' squares in the loop
    # the next step's group parameters loaded with its words (FMA, one group a shift's slice)
    SCALES_NEXT: tl.constexpr = SCALE_PF and PREFETCH and not USE_DOT and SPG > 0
    tl.static_assert(not (X_NORM and X_FP8), "X_NORM takes a 16-bit residual stream, not an FP8 x")
    tl.static_assert(not (X_GLU and (USE_DOT or X_NORM or X_FP8)), "X_GLU: the FMA path, 16-bit x, no X_NORM")
    tl.static_assert(not PACKED or (not USE_DOT and not X_FP8 and SPG % 4 == 0 and SPG > 0 and not SCALE_PF),
                     "PACKED: the FMA kind, 16-bit x, groups of a multiple of 128 columns, no SCALE_PF")
    tl.static_assert(not PF_UNROLL or (PACKED and PREFETCH == 2), "PF_UNROLL: PACKED with PREFETCH 2")
    tl.static_assert(not SUM16 or (PACKED and ZERO_MODE != 2), "SUM16: PACKED, not min")
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    num_m = tl.num_programs(0)
    BK8: tl.constexpr = BLOCK_K // 8
    if X_FP8:
        W_DTYPE: tl.constexpr = tl.float32
    else:
        W_DTYPE: tl.constexpr = x_ptr.dtype.element_ty

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows wrap onto valid ones (loads stay unmasked); they are never stored
    rn = (offs_n % N).to(tl.int64)
    m_valid = offs_m < M

    kb_total = tl.cdiv(KW * 8, BLOCK_K)
    kb_per = tl.cdiv(kb_total, split_k)
    kb_start = pid_k * kb_per
    kb_end = tl.minimum(kb_start + kb_per, kb_total)
    if L2_SLAB:  # weights only (never written by the step's kernels): before the wait
        l2_prefetch_rows(qw_ptr.to(tl.pointer_type(tl.uint8)), pid_n * BLOCK_N, N, KW * 4, kb_start * BK8 * 4,
                         tl.minimum(kb_end * BK8, KW) * 4, BLOCK_N, PF_LANES, L2_SLAB)
    if USE_PDL and not PREFETCH:  # programmatic dependent launch: kernels.pdl (with PREFETCH: below)
        pdl_wait()

    offs_w = tl.arange(0, BK8)
    # column of shift 0 of each word of a tile: 256 * (j // 32) + j % 32 (stride-32 interleave)
    col0 = (offs_w // 32) * 256 + offs_w % 32
    qw_row = qw_ptr + rn[:, None] * KW

    if USE_DOT:
        rm = (offs_m % M).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        if SUM16:  # a thread's four words of a step summed before the fold (kernels.int4_packed._sum16)
            ACC_W: tl.constexpr = BK8 // 4
        else:
            ACC_W: tl.constexpr = BK8
        acc0 = tl.zeros((BLOCK_N, ACC_W), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, ACC_W), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, ACC_W), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, ACC_W), dtype=tl.float32)
        t0 = tl.zeros((BLOCK_N, BK8), dtype=tl.float32)
        t1 = tl.zeros((BLOCK_N, BK8), dtype=tl.float32)
        t2 = tl.zeros((BLOCK_N, BK8), dtype=tl.float32)
        t3 = tl.zeros((BLOCK_N, BK8), dtype=tl.float32)
        xs0 = tl.zeros((BK8,), dtype=tl.float32)
        xs1 = tl.zeros((BK8,), dtype=tl.float32)
        xs2 = tl.zeros((BK8,), dtype=tl.float32)
        xs3 = tl.zeros((BK8,), dtype=tl.float32)
        if NORM_IN_LOOP or PACKED:  # h's squares, per thread, reduced after the loop (``_norm_rows``)
            ss0 = tl.zeros((BK8,), dtype=tl.float32)
            ss1 = tl.zeros((BK8,), dtype=tl.float32)
            ss2 = tl.zeros((BK8,), dtype=tl.float32)
            ss3 = tl.zeros((BK8,), dtype=tl.float32)
        x0_ptr = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm
        r0 = pid_m * BLOCK_M + tl.zeros((BK8,), dtype=tl.int32)  # a splat: the tile's first row
    if PREFETCH:  # register double buffer: the next step's words are in flight during this step's maths
        kw = kb_start * BK8 + offs_w
        if EVEN_K:
            qw_next = tl.load(qw_row + kw[None, :])
        else:
            qw_next = tl.load(qw_row + kw[None, :], mask=(kw < KW)[None, :], other=0)
        if PREFETCH == 2:  # and the step after it (a split has at least one step; this one may be past its end)
            qw_next2 = next_words(qw_row, kb_start + 1, kb_end, offs_w, KW, BLOCK_N, BK8, EVEN_K)
        if SCALES_NEXT:  # the scales (and zeros / mins) of the first step too: weights, never written by a kernel
            gs0n, gs1n, gs2n, gs3n, gs4n, gs5n, gs6n, gs7n, gz0n, gz1n, gz2n, gz3n, gz4n, gz5n, gz6n, gz7n = \
                _group_params8(s_ptr, z_ptr, rn, G, kb_start * BLOCK_K, GROUP, ZERO_MODE)
        if USE_PDL:  # the first weight words are in flight while the previous kernel finishes
            pdl_wait()
    if X_NORM and not NORM_IN_LOOP:  # after the wait (h is the previous kernel's output), the first words in flight
        rstd = _rows_rstd(x_ptr, offs_m, M, stride_xm, K, eps, BLOCK_M, NORM_NB, NORM_RM)
    if PF_UNROLL:  # PACKED, PREFETCH 2: two buffers, the loop unrolled by two (kernels.int4_packed.packed_pairs)
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = packed_pairs(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw_next, qw_next2, qw_row, kb_start, kb_end, offs_w, KW, x0_ptr,
            stride_xm, r0, M, col0, K, s_ptr, z_ptr, rn, G, nw_ptr, GROUP, ZERO_MODE, W_DTYPE, LOP3_ASM, EVEN_K,
            BLOCK_K, BLOCK_M, BLOCK_N, X_GLU, NORM_AFFINE, NORM_IN_LOOP, PACKED, SUM16)
    else:
        for kb in range(kb_start, kb_end):
            k0 = kb * BLOCK_K
            if PREFETCH == 2:  # two steps ahead: ptxas sinks the load late into the body (benchmarks/sass_int4_loop.py)
                qw = qw_next
                qw_next = qw_next2
                qw_next2 = next_words(qw_row, kb + 2, kb_end, offs_w, KW, BLOCK_N, BK8, EVEN_K)
            elif PREFETCH:
                qw = qw_next
                qw_next = next_words(qw_row, kb + 1, kb_end, offs_w, KW, BLOCK_N, BK8, EVEN_K)
            else:
                kw = kb * BK8 + offs_w
                if EVEN_K:  # K % BLOCK_K == 0: no masks, so loads stay 16-byte vectors
                    qw = tl.load(qw_row + kw[None, :])
                else:
                    qw = tl.load(qw_row + kw[None, :], mask=(kw < KW)[None, :], other=0)
            if SCALES_NEXT:  # this step's from the last, the next step's now (clamped to the last group past the end)
                gs0, gs1, gs2, gs3, gs4, gs5, gs6, gs7 = gs0n, gs1n, gs2n, gs3n, gs4n, gs5n, gs6n, gs7n
                gz0, gz1, gz2, gz3, gz4, gz5, gz6, gz7 = gz0n, gz1n, gz2n, gz3n, gz4n, gz5n, gz6n, gz7n
                gs0n, gs1n, gs2n, gs3n, gs4n, gs5n, gs6n, gs7n, gz0n, gz1n, gz2n, gz3n, gz4n, gz5n, gz6n, gz7n = \
                    _group_params8(s_ptr, z_ptr, rn, G, k0 + BLOCK_K, GROUP, ZERO_MODE)
            if USE_DOT and FAST_CVT:
                ws = _dequant8_asm(qw, s_ptr, z_ptr, rn, G, k0, GROUP, ZERO_MODE, W_DTYPE)
                for p in tl.static_range(8):
                    kcol = k0 + col0 + 32 * p
                    if EVEN_K:
                        k_mask = col0 < BLOCK_K
                    else:
                        k_mask = kcol < K
                    x = tl.load(x_ptr + rm[:, None] * stride_xm + kcol[None, :],
                                mask=m_valid[:, None] & k_mask[None, :], other=0.0)
                    if NORM_AFFINE:
                        x = _affine(x, nw_ptr, kcol[None, :], k_mask[None, :], W_DTYPE)
                    acc = tl.dot(x, tl.trans(ws[p]), acc)
            elif PACKED:  # the FMA kind in packed 16-bit pairs (kernels.int4_packed; LOP3_ASM: its inline PTX)
                acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = packed_step(
                    acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw, x0_ptr, stride_xm, r0, M, k0, col0, K, s_ptr, z_ptr,
                    rn, G, nw_ptr, GROUP, ZERO_MODE, W_DTYPE, LOP3_ASM, EVEN_K, BLOCK_K, BLOCK_M, X_GLU, NORM_AFFINE,
                    NORM_IN_LOOP, PACKED, SUM16)
            else:
                qw_hi = qw >> 16
                for p in tl.static_range(8):
                    kcol = k0 + col0 + 32 * p  # the columns of shift p: runs of 32 consecutive columns
                    if EVEN_K:
                        k_mask = col0 < BLOCK_K  # all true, constant along K (vectorisable)
                    else:
                        k_mask = kcol < K
                    if USE_DOT and X_FP8:
                        s, z = _slice_params(s_ptr, z_ptr, rn, kcol, k_mask, G, p, k0, GROUP, ZERO_MODE, UNIFORM)
                        x = tl.load(x_ptr + rm[:, None] * stride_xm + kcol[None, :],
                                    mask=m_valid[:, None] & k_mask[None, :], other=0.0)
                        nib = (qw >> (4 * p)) & 0xF
                        qf = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                        if ZERO_MODE == 0:
                            qf = qf - 8.0
                        elif ZERO_MODE == 1:
                            qf = qf - z
                        part = tl.dot(x, tl.trans(qf.to(tl.float8e4nv)))  # [BLOCK_M, BLOCK_N], exact integers
                        acc += part * tl.reshape(s, (1, BLOCK_N))
                        if ZERO_MODE == 2:
                            xsum = tl.sum(x.to(tl.float32), axis=1)
                            acc += xsum[:, None] * tl.reshape(z, (1, BLOCK_N))
                    elif USE_DOT:
                        s, z = _slice_params(s_ptr, z_ptr, rn, kcol, k_mask, G, p, k0, GROUP, ZERO_MODE, UNIFORM)
                        w = _dequant(qw, p, s, z, ZERO_MODE, W_DTYPE)  # [BLOCK_N, BK8]
                        x = tl.load(x_ptr + rm[:, None] * stride_xm + kcol[None, :],
                                    mask=m_valid[:, None] & k_mask[None, :], other=0.0)
                        if NORM_AFFINE:
                            x = _affine(x, nw_ptr, kcol[None, :], k_mask[None, :], W_DTYPE)
                        acc = tl.dot(x, tl.trans(w), acc)
                    else:
                        # fp32 2**23 + q * 16**j (j = p % 4), then d = f * 16**-j - (2**(23 - 4j) + zero) in one
                        # FFMA: both terms are exact, so d = q - zero exactly (q for "min")
                        if LOP3_ASM:
                            f = _nibble_f32_asm(qw, qw_hi, p)
                        else:
                            f = _nibble_f32(qw, qw_hi, p)
                        INV = 1.0 / (16.0 ** (p % 4))
                        BIAS = 8388608.0 * INV
                        x0 = _load_x(x0_ptr + kcol, k_mask & (r0 < M), K, X_GLU)
                        if BLOCK_M > 1:
                            x1 = _load_x(x0_ptr + stride_xm + kcol, k_mask & (r0 + 1 < M), K, X_GLU)
                        if BLOCK_M > 2:
                            x2 = _load_x(x0_ptr + 2 * stride_xm + kcol, k_mask & (r0 + 2 < M), K, X_GLU)
                            x3 = _load_x(x0_ptr + 3 * stride_xm + kcol, k_mask & (r0 + 3 < M), K, X_GLU)
                        if NORM_IN_LOOP:  # h itself, before the norm weight (masked columns and rows load 0)
                            ss0 += x0.to(tl.float32) * x0.to(tl.float32)
                            if BLOCK_M > 1:
                                ss1 += x1.to(tl.float32) * x1.to(tl.float32)
                            if BLOCK_M > 2:
                                ss2 += x2.to(tl.float32) * x2.to(tl.float32)
                                ss3 += x3.to(tl.float32) * x3.to(tl.float32)
                        if NORM_AFFINE:  # one load of the norm weight for the BLOCK_M rows
                            g = tl.load(nw_ptr + kcol, mask=k_mask, other=0.0).to(tl.float32)
                            x0 = (x0.to(tl.float32) * g).to(W_DTYPE)
                            if BLOCK_M > 1:
                                x1 = (x1.to(tl.float32) * g).to(W_DTYPE)
                            if BLOCK_M > 2:
                                x2 = (x2.to(tl.float32) * g).to(W_DTYPE)
                                x3 = (x3.to(tl.float32) * g).to(W_DTYPE)
                        x0 = x0.to(tl.float32)
                        if BLOCK_M > 1:
                            x1 = x1.to(tl.float32)
                        if BLOCK_M > 2:
                            x2 = x2.to(tl.float32)
                            x3 = x3.to(tl.float32)
                        if SPG > 0:
                            first = p % SPG == 0
                            last = p % SPG == SPG - 1
                            if SCALES_NEXT:
                                s = _pick8(p, gs0, gs1, gs2, gs3, gs4, gs5, gs6, gs7)
                                z = _pick8(p, gz0, gz1, gz2, gz3, gz4, gz5, gz6, gz7)
                            else:
                                s, z = _group_params(s_ptr, z_ptr, rn, G, k0, p, GROUP, ZERO_MODE)
                            if ZERO_MODE == 0:
                                d = f * INV - (BIAS + 8.0)  # constants: one FFMA
                            elif ZERO_MODE == 1:
                                d = f * INV - (BIAS + z)
                            else:
                                d = f * INV - BIAS
                            acc0, t0, xs0 = _fold_row(acc0, t0, xs0, d, x0, s, z, first, last, ZERO_MODE)
                            if BLOCK_M > 1:
                                acc1, t1, xs1 = _fold_row(acc1, t1, xs1, d, x1, s, z, first, last, ZERO_MODE)
                            if BLOCK_M > 2:
                                acc2, t2, xs2 = _fold_row(acc2, t2, xs2, d, x2, s, z, first, last, ZERO_MODE)
                                acc3, t3, xs3 = _fold_row(acc3, t3, xs3, d, x3, s, z, first, last, ZERO_MODE)
                        else:  # a slice spans groups: per-value scale and zero (a gather; L1 hits)
                            s, z = _slice_params(s_ptr, z_ptr, rn, kcol, k_mask, G, p, k0, GROUP, ZERO_MODE,
                                                 UNIFORM)
                            if ZERO_MODE == 2:
                                w = (f * INV - BIAS) * s + z
                            else:
                                w = (f * INV - (BIAS + z)) * s
                            acc0 += w * x0[None, :]
                            if BLOCK_M > 1:
                                acc1 += w * x1[None, :]
                            if BLOCK_M > 2:
                                acc2 += w * x2[None, :]
                                acc3 += w * x3[None, :]
    if not USE_DOT:
        acc = _fma_rows(acc0, acc1, acc2, acc3, BLOCK_M)
    if NORM_IN_LOOP:
        acc = acc * _norm_rows(ss0, ss1, ss2, ss3, K, eps, BLOCK_M)[:, None]
    elif X_NORM:
        acc = acc * rstd[:, None]

    if not SPLIT:
        _epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, bias_ptr,
                  HAS_BIAS, X_SCALE_MODE, 0, ACCUMULATE)
    else:
        _split_k_partial(acc, part_ptr, stride_part, pid_k, lock_ptr + pid_n * num_m + pid_m, split_k,
                         offs_m, offs_n, m_valid, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, bias_ptr,
                         HAS_BIAS, X_SCALE_MODE, 0, BLOCK_M, BLOCK_N, ACCUMULATE)


def split_k_blocks(K: int, config: dict) -> tuple[int, int]:
    """(number of BLOCK_K blocks, effective SPLIT_K): never more splits than blocks, no empty split."""
    kb_total = cdiv(cdiv(K, 256) * 256, config["BLOCK_K"])
    split = max(1, min(int(config.get("SPLIT_K", 1)), kb_total))
    split = cdiv(kb_total, cdiv(kb_total, split))
    return kb_total, split


@functools.cache
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def lop3_asm_ok(x) -> bool:
    """The FMA path's one-instruction nibble extraction (inline PTX): compiled CUDA only."""
    return x.device.type == "cuda" and not _interpreting()


def fast_cvt_ok(x, uniform: bool, x_scale_mode: int = 0, scale_dtype=None) -> bool:
    """The packed-pair PTX conversion of the dot path: CUDA (not the interpreter), 16-bit activations,
    scales (and mins) of the activations' dtype, one group per 32-column slice, and sm_80+
    (``fma.rn.bf16x2``).

    The conversion computes in x's dtype, so scales of another dtype (GGUF's fp16 ``d`` and ``m`` under
    bf16 activations) would be rounded to it before use: each weight then carries the scale's and the
    min's rounding, coherent over its group, on top of its own. On the embedded SmolLM2 (Q4_1) that put
    the int4 model's logits 6x as far from the fp32 model as the bf16 model's (1 - cos 0.0038 against
    0.00065, H200). Those weights take the portable path: fp32 ``q * scale + min``, one rounding, as
    ``dequantize_int4``."""
    if x.device.type != "cuda" or x_scale_mode != 0 or not uniform or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if scale_dtype is not None and scale_dtype != x.dtype:
        return False
    if _interpreting():
        return False
    return _sm_major(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 8


def launch_int4_linear(x, qweight, scales, zm, group_size: int, zero_mode: str, bias, out, part, locks,
                       config: dict, x_scale=None, x_scale_mode: int = 0, warmup: bool = False, pdl: bool = False,
                       norm_weight=None, eps: float = 0.0, x_norm: bool = False, accumulate: bool = False,
                       l2_slab: int = 0, x_glu: bool = False):
    """Launch on 2-D views: x (M, K) unit stride in K (kernel column order), qweight (N, Kp // 8) int32,
    scales / zm (N, K // group_size) contiguous (zm: zeros uint8, mins, or None), out (M, N) contiguous.

    ``part`` (fp32, SPLIT_K * M * N) and ``locks`` (zeroed int32, one per output tile) are needed only
    when the effective SPLIT_K > 1. ``config``: dict(kind="fma"|"dot", BLOCK_M, BLOCK_N, BLOCK_K
    (a power-of-2 multiple of 256), SPLIT_K, num_warps, num_stages).
    W4A8: x is float8_e4m3fn, ``x_scale`` fp32 (1,) (x_scale_mode 1) or (M,) (mode 2); the dot path
    then needs every 32-column slice of a tile in one group (BLOCK_K == 256 or a multiple of it
    dividing group_size). Optional config keys: PREFETCH (register double buffer of the weight words; 2: a
    triple buffer, the words of two steps ahead in flight), SCALE_PF (with PREFETCH, the fma kind where a shift's
    slice is one group: the next step's scales and zeros / mins loaded with its words), NORM_LOOP (with x_norm, the
    fma kind with one split: the loop sums the rows' squares instead of a pass before it),
    fast_cvt (default True: the packed-pair PTX conversion where it applies), PACKED (off unless the config sets it, as
    the H100 SXM's table does at one and two tokens: the fma kind's step in packed 16-bit pairs,
    ``kernels.int4_packed``; ``check_packed`` says where it applies, ``packed_mode`` picks its paired loads),
    PF_UNROLL (opt-in, PACKED with PREFETCH 2 only: two buffers and the loop unrolled by two instead of the rotated
    triple buffer, ``int4_packed.packed_pairs``), SUM16 (opt-in, PACKED without mins: a thread's four words' packed
    sums added in 16-bit pairs before one fp32 fold, ``int4_packed._sum16``; more rounding, fewer instructions).
    ``warmup``: compile (or, under ``kernels.precompile``, queue the compile of) the kernel, launch nothing.
    ``pdl``: programmatic dependent launch (``kernels.pdl``).
    ``x_norm``: x is the residual stream h and the input ``rms_norm(h, norm_weight, eps)`` (norm_weight (K,) in
    kernel column order, or None for a norm without weight); ``accumulate``: out += the result (the kernel's
    docstring; every kind, 16-bit x).
    ``config["kind"] == "mma"``: the weight-as-register-operand tensor-core kernel of ``kernels.int4_mma``
    (W4A16 only; the caller checks ``int4_mma.mma_supported``); optional key ``asm`` (default True): its
    inline-PTX conversion where ``lop3_asm_ok``.
    ``l2_slab`` (bytes, 0: off; with ``pdl``, sm_90+ only: inline PTX): each program prefetches up to that much of its
    weight words into L2 before its PDL wait (the mma kind: instead of its first two tiles).
    ``x_glu`` (the fma kind, 16-bit x, not ``x_norm``; ``ops.int4.int4_linear_with_config`` checks it): x is (M, 2K)
    ``[gate | up]`` and the input ``silu(gate) * up`` (X_GLU in the kernel).
    """
    M, K = x.shape[0], x.shape[1] // (2 if x_glu else 1)
    _, split = split_k_blocks(K, config)
    packed = packed_mode(config, group_size, K, scales, zm)
    if packed:
        check_packed(config, group_size, K, x.dtype, x_scale_mode)
    pf_unroll, sum16 = packed_options(config, packed, zero_mode)
    if config["kind"] == "mma":
        return launch_int4_mma(x, qweight, scales, zm, group_size, zero_mode, bias, out, part, locks, config, split,
                               asm=bool(config.get("asm", True)) and lop3_asm_ok(x), warmup=warmup, pdl=pdl,
                               norm_weight=norm_weight, eps=eps, x_norm=x_norm, accumulate=accumulate,
                               l2_slab=l2_slab)
    check_params(scales, zm, f"the int4 {config['kind']} kind")
    N = qweight.shape[0]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    grid = (cdiv(M, bm), split, cdiv(N, bn))
    l2_slab = slab_bytes(l2_slab, pdl, qweight)
    uniform = _uniform(group_size, bk)
    spg = slices_per_group(group_size, K, bk)
    # only the dot path reads FAST_CVT: skip the device checks on the decode (fma) launches
    fast_cvt = (config["kind"] == "dot" and bool(config.get("fast_cvt", True))
                and fast_cvt_ok(x, spg > 0, x_scale_mode, scales.dtype))
    # X_NORM only: without it the constants stay those of the tile (one compiled variant, whatever M)
    norm_rm, norm_nb = norm_tile(bm, M if x_norm else bm)
    kernel = functools.partial(_int4_linear_kernel.warmup, grid=grid) if warmup else _int4_linear_kernel[grid]
    kernel(
        x, qweight, scales, zm if zm is not None else scales, bias if bias is not None else out,
        x_scale if x_scale is not None else out, out, part if split > 1 else out, locks if split > 1 else out,
        norm_weight if norm_weight is not None else out, float(eps),
        M, N, K, scales.shape[1], qweight.shape[1], x.stride(0), out.stride(0), M * N, split,
        GROUP=group_size, ZERO_MODE=_ZERO_MODES[zero_mode], HAS_BIAS=bias is not None,
        USE_DOT=config["kind"] == "dot", UNIFORM=uniform, SPG=spg, EVEN_K=K % bk == 0,
        X_SCALE_MODE=x_scale_mode, FAST_CVT=fast_cvt, PREFETCH=int(config.get("PREFETCH", False)),
        SCALE_PF=bool(config.get("SCALE_PF", False)), NORM_LOOP=bool(config.get("NORM_LOOP", False)),
        LOP3_ASM=config["kind"] == "fma" and lop3_asm_ok(x), USE_PDL=pdl, PACKED=packed, PF_UNROLL=pf_unroll,
        SUM16=sum16,
        X_NORM=bool(x_norm), NORM_AFFINE=bool(x_norm) and norm_weight is not None,
        NORM_RM=norm_rm, NORM_NB=norm_nb,
        ACCUMULATE=bool(accumulate), X_GLU=bool(x_glu), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1,
        L2_SLAB=l2_slab, PF_LANES=32 * config.get("num_warps", 4),
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3), **launch_kwargs(pdl),
    )
