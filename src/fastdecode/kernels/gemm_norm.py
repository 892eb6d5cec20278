"""The RMSNorm inside the GEMMs (X_NORM): the helpers of ``kernels.gemm``'s skinny kernel and of the int4 kernels.

Two forms. Where a program streams its whole x row (one split), the row's squares are summed beside the products and
its ``rsqrt(mean(h^2) + eps)`` scales the fp32 sums once at the end: the skinny kernel's FMA kind (``_sum_squares``,
``_norm_rows``). Where it sees a slice of K (split-K, the int4 kernels' tensor-core kinds), a pass over whole rows
first (``_rows_rstd``, ``norm_tile``).
"""

import triton
import triton.language as tl

from fastdecode.kernels.host import next_pow2


@triton.jit
def _norm_input(h, g, NORM_AFFINE: tl.constexpr):
    """X_NORM: the GEMM's input before the row's rstd, in fp32: ``h * g`` rounded to h's dtype (as the norm kernel
    rounds its output) with NORM_AFFINE, else h itself (no norm weight, or one folded into the GEMM's weight).
    The product is taken in fp32 and rounded (the interpreter's bf16 arithmetic is wrong: docs/architecture.md)."""
    if NORM_AFFINE:
        return (h.to(tl.float32) * g.to(tl.float32)).to(h.dtype).to(tl.float32)
    else:
        return h.to(tl.float32)


@triton.jit
def _sum_squares(h, BLOCK_K: tl.constexpr, NORM_VEC: tl.constexpr):
    """X_NORM: h's squares in fp32, summed over each run of NORM_VEC elements (the 16 bytes one thread loads: the
    sum stays in the thread, one register a row instead of NORM_VEC; ptxas: 72 registers against 83 on the 8B
    qkv tile, the plain GEMV's occupancy) -> [BLOCK_K // NORM_VEC]."""
    hf = h.to(tl.float32)
    return tl.sum(tl.reshape(hf * hf, (BLOCK_K // NORM_VEC, NORM_VEC)), axis=1)


@triton.jit
def _norm_rows(ss0, ss1, ss2, ss3, K, eps, BLOCK_M: tl.constexpr):
    """X_NORM: ``rsqrt(mean(h^2) + eps)`` of each token row from its per-thread partial sums of squares (``ss*``,
    ``_sum_squares``) -> [BLOCK_M] (rows past 3 unused: BLOCK_M <= 4 on the FMA path)."""
    rows = tl.arange(0, BLOCK_M)
    r = tl.where(rows == 0, tl.rsqrt(tl.sum(ss0, axis=0) / K + eps), 1.0)
    if BLOCK_M > 1:
        r = tl.where(rows == 1, tl.rsqrt(tl.sum(ss1, axis=0) / K + eps), r)
    if BLOCK_M > 2:
        r = tl.where(rows == 2, tl.rsqrt(tl.sum(ss2, axis=0) / K + eps), r)
        r = tl.where(rows == 3, tl.rsqrt(tl.sum(ss3, axis=0) / K + eps), r)
    return r


@triton.jit
def _rows_rstd(x_ptr, offs_m, M, stride_xm, K, eps, BLOCK_M: tl.constexpr, NB: tl.constexpr, RM: tl.constexpr):
    """``rsqrt(mean(x[m, :K]^2) + eps)`` of the token rows ``offs_m`` (rows >= M wrap onto valid ones and are
    never stored) in one pass over whole rows, NB columns a step: the RMSNorm scale for kernels whose programs
    see only a slice of K (split-K; the int4 kernels' X_NORM) -> [BLOCK_M] fp32.

    RM (``norm_tile``): the rows the pass loads. RM == BLOCK_M: the program's rows. RM < BLOCK_M (then
    M <= RM, one program along M): only the M distinct rows, RM at a time, their scales spread onto the BLOCK_M
    wrapped rows after the pass; a tile padded to 16 tokens at M = 1 would load one row 16 times, NB = 2048 / 16
    columns a step: 32 dependent L2 round trips at K = 4096 instead of 2."""
    if RM < BLOCK_M:
        r = tl.arange(0, RM)
        rows = x_ptr + (r % M).to(tl.int64)[:, None] * stride_xm
    else:
        rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm
    ss = tl.zeros((RM, NB), dtype=tl.float32)
    for k in range(0, K, NB):
        cols = k + tl.arange(0, NB)
        v = tl.load(rows + cols[None, :], mask=(cols < K)[None, :], other=0.0).to(tl.float32)
        ss += v * v
    rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    if RM < BLOCK_M:  # row m takes the scale of loaded row m % M (a one-hot sum: no register gather)
        pick = (offs_m % M)[:, None] == r[None, :]
        rstd = tl.sum(tl.where(pick, rstd[None, :], 0.0), axis=1)
    return rstd


@triton.jit
def _affine(x, g_ptr, cols, mask, XDT: tl.constexpr):
    """X_NORM with a norm weight, on kernels whose loop loads x as a tile: x times the norm weight at ``cols``,
    rounded to x's dtype as the norm kernel rounds its output (the product in fp32: the interpreter's bf16
    arithmetic is wrong) -> XDT."""
    g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * g).to(XDT)


def norm_tile(block_m: int, m: int) -> tuple[int, int]:
    """X_NORM's pass over whole rows (``_rows_rstd``): (RM, NB), the rows it loads (the program's BLOCK_M, or
    the M distinct rows rounded up to a power of two when fewer) and the columns a step, 2048 values in flight a
    program."""
    rm = min(block_m, next_pow2(max(1, m)))
    return rm, max(16, 2048 // rm)
