"""Skinny (small-M) GEMM kernels for decode: ``out = x @ weight.T (* scales) (+ bias)``.

No policy and no checks here: ``fastdecode.ops.gemm`` validates, picks the config and owns the
split-K workspace.

At decode M (tokens) is 1-64 and the weight is tens of MB, so the GEMM is a weight stream: the
kernel's job is to keep enough 16-byte weight loads in flight on every SM. One kernel, two inner
products (constexpr ``USE_DOT``):

* FMA ("gemv"): a ``[BLOCK_N, BLOCK_K]`` weight tile times each of ``BLOCK_M`` (1, 2 or 4) broadcast
  x rows, accumulated elementwise in fp32 in ``[BLOCK_N, BLOCK_K]`` register tiles and reduced along
  K once at the end (no cross-thread reduction inside the loop). With BLOCK_K = 16 bytes x 32 lanes
  x num_warps, each thread issues BLOCK_N 16-byte weight loads per step and the 1-D x row already
  has the weight tile's layout (checked in the TTGIR: the loop holds only global loads and FMAs).
  Best for M of 1-4.
* DOT (swap-AB): ``acc^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M]`` so the
  large N dimension fills the MMA's 64-row side and the few tokens sit in its narrow side (>= 16).
  The tensor cores have ~100x headroom here, so padding M to 16 costs nothing but registers.

Split-K with a deterministic in-kernel fix-up: when ``SPLIT_K > 1`` the ``SPLIT_K`` programs of one
output tile each write an fp32 partial to ``part[SPLIT_K, M, N]``, then bump the tile's counter
(acq_rel atomic); the program that sees ``SPLIT_K - 1`` sums the partials in split order 0..SPLIT_K-1
(so the result does not depend on which program finished last), applies scales and bias, writes the
output and resets the counter to 0 for the next launch. One launch, no memset, no second kernel:
a second kernel would cost ~1.5 us of graph-node gap on a 5-10 us GEMM.
"""

import triton
import triton.language as tl

from fastdecode.kernels.host import cdiv
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait
from fastdecode.kernels.prefetch import l2_prefetch_rows, slab_bytes
from fastdecode.kernels.gemm_norm import _norm_input, _norm_rows, _sum_squares

# x (activation) and w (weight) scales are applied in the epilogue by constexpr *_SCALE_MODE:
# fastdecode.constants.SCALE_NONE / SCALE_TENSOR / SCALE_VECTOR.

# FP8 tensor-core dots add each MMA's (K = 32) partial into the fp32 accumulator (see the DOT path)
FP8_PROMOTE_K = tl.constexpr(32)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, ws_ptr,
              HAS_BIAS: tl.constexpr, X_SCALE_MODE: tl.constexpr, W_SCALE_MODE: tl.constexpr,
              ACCUMULATE: tl.constexpr = False):
    """out[m, n] = acc[m, n] * x_scale[m] * w_scale[n] + bias[n] (+ out[m, n] with ACCUMULATE: the residual
    add, in place), fp32 math, one rounding. Each element of out is read and written by one thread."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    if X_SCALE_MODE == 1:
        acc = acc * tl.load(xs_ptr)
    elif X_SCALE_MODE == 2:
        acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    if W_SCALE_MODE == 1:
        acc = acc * tl.load(ws_ptr)
    elif W_SCALE_MODE == 2:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc = acc + tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr):
    """FMA path: one [BLOCK_N, BLOCK_K] fp32 accumulator per token row (up to 4) -> [BLOCK_M, BLOCK_N]."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.where(rows == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        acc += tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], 0.0)
    if BLOCK_M > 2:
        acc += tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], 0.0)
        acc += tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], 0.0)
    return acc


@triton.jit
def _split_k_partial(acc, part_ptr, stride_part, pid_k, lock, split_k, offs_m, offs_n, m_valid, M, N,
                     out_ptr, stride_om, bias_ptr, xs_ptr, ws_ptr, HAS_BIAS: tl.constexpr,
                     X_SCALE_MODE: tl.constexpr, W_SCALE_MODE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """Deterministic split-K in one launch: store this split's fp32 partial; the last split of the tile
    to arrive (counter ``lock``) sums all partials in split order and runs the epilogue."""
    mask = m_valid[:, None] & (offs_n < N)[None, :]
    tile_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(part_ptr + pid_k.to(tl.int64) * stride_part + tile_off, acc, mask=mask)
    # all threads' partial stores happen before the (release) counter bump
    tl.debug_barrier()
    arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    if arrived == split_k - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part_ptrs = part_ptr + tile_off
        for s in range(split_k):  # fixed order: deterministic
            # .cg: read from L2, where the other SMs' partials are (L1 is not coherent)
            total += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            part_ptrs += stride_part  # 64-bit pointer steps: no int32 overflow at large M * N
        _epilogue(total, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, ws_ptr,
                  HAS_BIAS, X_SCALE_MODE, W_SCALE_MODE, ACCUMULATE)
        tl.store(lock, 0)  # ready for the next launch (same stream)


@triton.jit
def _load_x(ptrs, mask, K, X_GLU: tl.constexpr):
    """An activation tile in x's dtype. X_GLU: x holds ``[gate | up]`` rows of 2K columns and the GEMM's
    input is ``silu(gate) * up`` (fp32 math, rounded once to x's dtype, as the SiLU-and-mul kernel stores it),
    so ``linear(silu_and_mul(h))`` runs as one kernel with the same input values. Masked: 0 (silu(0) * 0);
    ``mask`` None: every element exists (no predicate, no zero fill)."""
    if mask is None:
        g = tl.load(ptrs)
    else:
        g = tl.load(ptrs, mask=mask, other=0.0)
    if X_GLU:
        if mask is None:
            u = tl.load(ptrs + K)
        else:
            u = tl.load(ptrs + K, mask=mask, other=0.0)
        g = g.to(tl.float32)
        g = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(ptrs.dtype.element_ty)
    return g


@triton.jit
def _load_w(ptrs, EVICT: tl.constexpr):
    """A weight tile, ``evict_first`` with EVICT."""
    if EVICT:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs)


@triton.jit
def _load_w_masked(ptrs, mask, EVICT: tl.constexpr):
    """A weight tile, 0 where ``mask`` is false, ``evict_first`` with EVICT."""
    if EVICT:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _next_w(w_ptrs, kb, kb_end, offs_k, K, W_EVICT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            EVEN_K: tl.constexpr):
    """PREFETCH: the weight tile of K step ``kb`` at ``w_ptrs``; nothing loaded (zeros) for a step past the split's
    end (a splat mask, constant along K, so the EVEN_K loads stay 16-byte vectors)."""
    more = (kb + tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)) < kb_end
    if EVEN_K:
        return _load_w_masked(w_ptrs, more, W_EVICT)
    else:
        return _load_w_masked(w_ptrs, more & ((kb * BLOCK_K + offs_k) < K)[None, :], W_EVICT)


# M and the split count change per call: not specialising them keeps one compiled kernel per config
@triton.jit(do_not_specialize=["M", "split_k", "stride_part"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, xs_ptr, ws_ptr, out_ptr, part_ptr, lock_ptr, nw_ptr, eps,
    M, N, K, stride_xm, stride_wn, stride_om, stride_part, split_k,
    HAS_BIAS: tl.constexpr, X_SCALE_MODE: tl.constexpr, W_SCALE_MODE: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP8: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, W_EVICT: tl.constexpr, X_GLU: tl.constexpr, X_NORM: tl.constexpr,
    NORM_VEC: tl.constexpr, NORM_AFFINE: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    L2_SLAB: tl.constexpr, PF_LANES: tl.constexpr, W_VEC: tl.constexpr,
):
    """Grid (m tiles, split_k, n tiles): the M tiles sharing a weight tile launch side by side (L2).

    X_GLU: x is the ``[gate | up]`` output of the projection before (``(M, 2K)``, row stride stride_xm) and
    the input is ``silu(gate) * up`` computed at each load (``_load_x``): SiLU-and-mul fused into the GEMM.

    X_NORM (FMA path, no split): x holds the residual stream h and the input is ``rms_norm(h) * nw`` (RMSNorm
    with weight ``nw``, epsilon ``eps``). Each program streams its whole x row anyway (no split), so the row's
    sum of squares is accumulated beside the products of ``h * nw`` (rounded to x's dtype) with the weights, and
    the per-row ``rsqrt(mean(h^2) + eps)`` scales the fp32 sums once at the end: no pass over x before the
    weights (``ops.norm_linear.rms_norm_linear``). NORM_VEC: the elements of one thread's 16-byte x load.
    NORM_AFFINE: False for a norm without weight (nw_ptr unused), as when nw is folded into the GEMM's weight.
    ACCUMULATE: out += the result (the residual add after wo / w2, in place; ``_epilogue``).

    USE_PDL (programmatic dependent launch): this grid may be scheduled while the previous kernel
    of the stream finishes. It waits for that kernel (and its memory) before touching any tensor,
    except, with PREFETCH (FMA path), its first weight tile: weights are never written by the
    kernel right before a linear. Then it lets the next PDL kernel be scheduled as it drains.

    W_EVICT: weight loads carry ``evict_first`` (each weight byte is read once per call; the hint
    keeps x, the split-K partials and the next kernel's inputs in L2). Rows of x are re-read by
    every program and keep the default policy.

    L2_SLAB (bytes, 0: off; with USE_PDL, sm_90+; PF_LANES: the threads of a program): before its PDL wait the
    program prefetches up to L2_SLAB bytes of its weight slab (its BLOCK_N rows, its split's columns; with PREFETCH
    but the first tile, which it loads) into L2 (``kernels.prefetch.l2_prefetch_rows``): the slabs of the programs
    resident early stream during the previous kernel's tail.
    """
    tl.static_assert(not (X_NORM and (USE_DOT or SPLIT or X_GLU)), "X_NORM: FMA path, one split, no X_GLU")
    tl.static_assert(not (W_VEC and USE_DOT), "W_VEC (X_LAYOUT): FMA path only")
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    num_m = tl.num_programs(0)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # wrap out-of-range rows onto valid ones instead of masking: loads stay unmasked (vectorised)
    # and the wrapped results are never stored
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    m_valid = offs_m < M

    # this program's K range, in whole BLOCK_K blocks
    kb_total = tl.cdiv(K, BLOCK_K)
    kb_per = tl.cdiv(kb_total, split_k)
    kb_start = pid_k * kb_per
    kb_end = tl.minimum(kb_start + kb_per, kb_total)
    k0 = kb_start * BLOCK_K
    if L2_SLAB:  # weights only (never written by the step's kernels): before the wait
        WB: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        first = k0 + BLOCK_K if (PREFETCH and not USE_DOT) else k0  # PREFETCH loads the first tile itself
        l2_prefetch_rows(w_ptr.to(tl.pointer_type(tl.uint8)), pid_n * BLOCK_N, N, stride_wn * WB, first * WB,
                         tl.minimum(kb_end * BLOCK_K, K) * WB, BLOCK_N, PF_LANES, L2_SLAB)
    if USE_PDL and (USE_DOT or not PREFETCH):
        pdl_wait()

    offs_kw = offs_k
    if W_VEC:  # weights narrower than x (W8A16): W_VEC elements a thread a load, x's own layout
        offs_kw = tl.max_contiguous(offs_k, W_VEC)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + offs_kw)[None, :]
    if USE_DOT:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + offs_k)[None, :]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            if EVEN_K:
                w = _load_w(w_ptrs, W_EVICT)
                x = _load_x(x_ptrs, m_valid[:, None], K, X_GLU)
            else:
                k_mask = (kb * BLOCK_K + offs_k) < K
                w = _load_w_masked(w_ptrs, k_mask[None, :], W_EVICT)
                x = _load_x(x_ptrs, m_valid[:, None] & k_mask[None, :], K, X_GLU)
            if DOT_FP8:
                # Hopper's FP8 MMA adds into a reduced-precision accumulator; by default Triton lets it
                # run over the whole K (max_num_imprecise_acc = 2**30): 1e-3 relative errors, seen on
                # the H200 at K = 64. Promoting into the fp32 accumulator after every MMA (K = 32) keeps
                # the "fp32 accumulation" this kernel promises, as _scaled_mm's default does.
                acc_t = tl.dot(w, tl.trans(x), acc_t, max_num_imprecise_acc=FP8_PROMOTE_K)
            elif w.dtype.is_fp8() and x.dtype.is_fp8():
                # e4m3 values are exact in fp16 (max 448, 3 mantissa bits)
                acc_t = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)), acc_t)
            elif w.dtype.is_fp8():
                # W8A16 (ops.w8a16): e4m3 values are exact in bf16 and fp16 alike, so the weight takes x's dtype
                # (a bf16 x cast to fp16 would overflow beyond 65504)
                acc_t = tl.dot(w.to(x.dtype), tl.trans(x), acc_t)
            elif w.dtype == tl.float32:
                acc_t = tl.dot(w, tl.trans(x), acc_t, input_precision="ieee")  # no TF32
            else:
                acc_t = tl.dot(w, tl.trans(x), acc_t)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.trans(acc_t)
    else:
        # one 2-D [BLOCK_N, BLOCK_K] fp32 accumulator per x row (BLOCK_M <= 4, unrolled at compile
        # time): each is in the weight tile's own register layout, so the loop is loads and FMAs
        # only; the cross-thread reduction along K happens once, after the loop
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # BLOCK_K = (16 bytes) x 32 lanes x num_warps makes the 1-D x load's layout the weight
        # tile's layout sliced along N: no per-step layout conversion through shared memory
        x0_ptrs = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm + k0 + offs_k
        row0 = pid_m * BLOCK_M + tl.zeros((BLOCK_K,), dtype=tl.int32)  # a splat: constant along K
        if X_NORM:  # per-row sums of squares of h: one partial per thread (NORM_VEC elements), reduced after the loop
            ss0 = tl.zeros((BLOCK_K // NORM_VEC,), dtype=tl.float32)
            ss1 = tl.zeros((BLOCK_K // NORM_VEC,), dtype=tl.float32)
            ss2 = tl.zeros((BLOCK_K // NORM_VEC,), dtype=tl.float32)
            ss3 = tl.zeros((BLOCK_K // NORM_VEC,), dtype=tl.float32)
        ok0 = row0 < M
        ok1 = row0 + 1 < M
        ok2 = row0 + 2 < M
        ok3 = row0 + 3 < M
        if PREFETCH:
            # register double buffer: the next step's weight tile is in flight while this one is
            # multiplied (2x the bytes in flight per thread); every split has >= 1 block
            if EVEN_K:
                w_next = _load_w(w_ptrs, W_EVICT)
            else:
                w_next = _load_w_masked(w_ptrs, ((k0 + offs_k) < K)[None, :], W_EVICT)
            if PREFETCH == 2:  # and the tile after it (3x the bytes in flight; nothing past the split's end)
                w_next2 = _next_w(w_ptrs + BLOCK_K, kb_start + 1, kb_end, offs_k, K, W_EVICT, BLOCK_N, BLOCK_K,
                                  EVEN_K)
            if USE_PDL:
                pdl_wait()
        for kb in range(kb_start, kb_end):
            if EVEN_K:  # row masks constant along K: the x loads stay vectorised
                m0, m1, m2, m3 = ok0, ok1, ok2, ok3
            else:
                k_mask = (kb * BLOCK_K + offs_k) < K
                m0, m1, m2, m3 = k_mask & ok0, k_mask & ok1, k_mask & ok2, k_mask & ok3
            if PREFETCH == 2:  # two tiles ahead
                w = w_next.to(tl.float32)
                w_next = w_next2
                w_next2 = _next_w(w_ptrs + 2 * BLOCK_K, kb + 2, kb_end, offs_k, K, W_EVICT, BLOCK_N, BLOCK_K, EVEN_K)
            elif PREFETCH:
                w = w_next.to(tl.float32)
                w_next = _next_w(w_ptrs + BLOCK_K, kb + 1, kb_end, offs_k, K, W_EVICT, BLOCK_N, BLOCK_K, EVEN_K)
            elif EVEN_K:
                w = _load_w(w_ptrs, W_EVICT).to(tl.float32)
            else:
                w = _load_w_masked(w_ptrs, k_mask[None, :], W_EVICT).to(tl.float32)
            if X_NORM:
                # h rows (times the norm weight with NORM_AFFINE, rounded to x's dtype as the norm kernel rounds
                # its output) widened for the FMAs; h's squares summed in fp32
                if NORM_AFFINE:
                    if EVEN_K:
                        g = tl.load(nw_ptr + kb * BLOCK_K + offs_k)
                    else:
                        g = tl.load(nw_ptr + kb * BLOCK_K + offs_k, mask=k_mask, other=0.0)
                else:
                    g = 0.0  # unused
                h0 = _load_x(x0_ptrs, m0, K, False)
                ss0 += _sum_squares(h0, BLOCK_K, NORM_VEC)
                acc0 += w * _norm_input(h0, g, NORM_AFFINE)[None, :]
                if BLOCK_M > 1:
                    h1 = _load_x(x0_ptrs + stride_xm, m1, K, False)
                    ss1 += _sum_squares(h1, BLOCK_K, NORM_VEC)
                    acc1 += w * _norm_input(h1, g, NORM_AFFINE)[None, :]
                if BLOCK_M > 2:
                    h2 = _load_x(x0_ptrs + 2 * stride_xm, m2, K, False)
                    ss2 += _sum_squares(h2, BLOCK_K, NORM_VEC)
                    acc2 += w * _norm_input(h2, g, NORM_AFFINE)[None, :]
                    h3 = _load_x(x0_ptrs + 3 * stride_xm, m3, K, False)
                    ss3 += _sum_squares(h3, BLOCK_K, NORM_VEC)
                    acc3 += w * _norm_input(h3, g, NORM_AFFINE)[None, :]
            else:
                acc0 += w * _load_x(x0_ptrs, m0, K, X_GLU).to(tl.float32)[None, :]
                if BLOCK_M > 1:
                    acc1 += w * _load_x(x0_ptrs + stride_xm, m1, K, X_GLU).to(tl.float32)[None, :]
                if BLOCK_M > 2:
                    acc2 += w * _load_x(x0_ptrs + 2 * stride_xm, m2, K, X_GLU).to(tl.float32)[None, :]
                    acc3 += w * _load_x(x0_ptrs + 3 * stride_xm, m3, K, X_GLU).to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x0_ptrs += BLOCK_K
        acc = _fma_rows(acc0, acc1, acc2, acc3, BLOCK_M)
        if X_NORM:  # one rsqrt(mean(h^2) + eps) per row scales that row's fp32 sums
            acc = acc * _norm_rows(ss0, ss1, ss2, ss3, K, eps, BLOCK_M)[:, None]

    if not SPLIT:
        _epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, ws_ptr,
                  HAS_BIAS, X_SCALE_MODE, W_SCALE_MODE, ACCUMULATE)
    else:
        _split_k_partial(acc, part_ptr, stride_part, pid_k, lock_ptr + pid_n * num_m + pid_m, split_k,
                         offs_m, offs_n, m_valid, M, N, out_ptr, stride_om, bias_ptr, xs_ptr, ws_ptr,
                         HAS_BIAS, X_SCALE_MODE, W_SCALE_MODE, BLOCK_M, BLOCK_N, ACCUMULATE)


def prefetch_depth(config: dict) -> int:
    """A config's ``PREFETCH`` as the FMA path's number of weight tiles in flight ahead of the one being multiplied:
    0 (absent / False), 1 (True: a register double buffer) or 2 (a triple buffer)."""
    p = config.get("PREFETCH", False)
    if p not in (0, 1, 2) or isinstance(p, float):
        raise ValueError(f"config PREFETCH must be False / True / 0 / 1 / 2, got {p!r}")
    return int(p)


def x_layout_vec(config: dict, x, weight) -> int:
    """``X_LAYOUT`` (FMA configs whose weights are narrower than x, W8A16): the weight's elements a thread loads at a
    time, set to x's 16-byte load (8 for bf16 x), so the weight tile takes x's register layout; 0 otherwise.
    Without it the FP8 tile's 16-byte loads hold 16 weights a thread against x's 8, and the sm_90 K loop converts
    x through shared memory every step (2 STS, 4 LDS, 4 BAR; benchmarks/NOTES.md, session 40)."""
    if not config.get("X_LAYOUT", False) or config["kind"] != "fma" or weight.element_size() >= x.element_size():
        return 0
    return 16 // x.element_size()


def split_k_blocks(K: int, config: dict) -> tuple[int, int]:
    """(number of BLOCK_K blocks, effective SPLIT_K): never more splits than blocks, no empty split."""
    kb_total = cdiv(K, config["BLOCK_K"])
    split = max(1, min(int(config.get("SPLIT_K", 1)), kb_total))
    # with cdiv(kb_total, split) blocks per split, the last splits could be empty: shrink split
    split = cdiv(kb_total, cdiv(kb_total, split))
    return kb_total, split


def launch_skinny_linear(x, weight, bias, x_scale, x_scale_mode, w_scale, w_scale_mode,
                         out, part, locks, config, pdl: bool = False, glu: bool = False,
                         norm_weight=None, eps: float = 0.0, accumulate: bool = False, x_norm: bool = False,
                         l2_slab: int = 0):
    """Launch on 2-D views: x (M, K) unit stride in K, weight (N, K) contiguous, out (M, N) contiguous.

    ``part``: fp32 workspace of ``SPLIT_K * M * N`` elements and ``locks``: zeroed int32 counters
    (one per output tile), both needed only when the effective SPLIT_K > 1.
    ``config``: dict(kind="fma"|"dot", BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages,
    DOT_FP8 (fp8 operands straight into tl.dot), PDL (programmatic dependent launch, sm_90+),
    PREFETCH (FMA path: register double buffer of the weight tile; 2: a triple buffer, the tiles of the next two
    steps in flight), EVICT (weights ``evict_first``), X_LAYOUT (FMA path, weights narrower than x: loaded in x's
    register layout, ``x_layout_vec``)).
    ``pdl``: programmatic dependent launch (``kernels.pdl``) whatever the config says.
    ``glu``: x is (M, 2K) ``[gate | up]`` and the input is ``silu(gate) * up`` (SiLU-and-mul fused in).
    ``norm_weight`` (K,): the input is ``rms_norm(x) * norm_weight`` with ``eps`` (FMA config, one split only);
    ``x_norm`` without ``norm_weight``: the input is ``rms_norm(x)`` with no weight (one folded into ``weight``).
    ``accumulate``: ``out += x @ weight.T (+ bias)``, one rounding (out's old values read in the epilogue).
    ``l2_slab`` (bytes, 0: off; with PDL, sm_90+ only: inline PTX): each program prefetches up to that much of its
    weight slab into L2 before its PDL wait; taken only where the weight's rows are 16-byte aligned.
    """
    M = x.shape[0]
    N, K = weight.shape
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    _, split = split_k_blocks(K, config)
    grid = (cdiv(M, bm), split, cdiv(N, bn))
    dummy = out
    pdl = pdl or bool(config.get("PDL", False))
    x_norm = x_norm or norm_weight is not None
    if x_norm and (config["kind"] != "fma" or split > 1 or glu):
        raise ValueError("the RMSNorm in the GEMV needs an FMA config with one split and no glu (the caller checks)")
    norm_vec = min(16 // x.element_size(), bk)  # one thread's 16-byte load of x (BLOCK_K: a power of 2)
    l2_slab = slab_bytes(l2_slab, pdl, weight, bk * weight.element_size())
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else dummy,
        x_scale if x_scale is not None else dummy, w_scale if w_scale is not None else dummy,
        out, part if split > 1 else dummy, locks if split > 1 else dummy,
        norm_weight if norm_weight is not None else dummy, float(eps),
        M, N, K, x.stride(0), weight.stride(0), out.stride(0), M * N, split,
        HAS_BIAS=bias is not None, X_SCALE_MODE=x_scale_mode, W_SCALE_MODE=w_scale_mode,
        USE_DOT=config["kind"] == "dot", DOT_FP8=bool(config.get("DOT_FP8", False)),
        EVEN_K=(K % bk == 0), USE_PDL=pdl, PREFETCH=prefetch_depth(config), W_VEC=x_layout_vec(config, x, weight),
        W_EVICT=bool(config.get("EVICT", False)), X_GLU=glu, X_NORM=x_norm,
        NORM_VEC=norm_vec, NORM_AFFINE=norm_weight is not None, ACCUMULATE=accumulate,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1, L2_SLAB=l2_slab,
        PF_LANES=32 * config.get("num_warps", 4),
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3), **launch_kwargs(pdl),
    )
