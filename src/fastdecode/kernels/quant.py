"""FP8 e4m3 quantisation kernels: static per-tensor, dynamic per-token, dynamic per-tensor."""

import os

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait

QUANT_STATIC = 1  # scale_ptr[0] given
QUANT_PER_TOKEN = 2  # scale_ptr[row] = max(amax(row) / 448, min)
QUANT_FROM_AMAX = 3  # per-tensor: amax_ptr holds the float bits of amax(|x|); scale_ptr[0] written

# NaN rule of every FP8 output (docs/engine.md, "FP8 W8A8"): as in PyTorch, a NaN propagates. A row (or, per
# tensor, a tensor) holding a NaN gets a NaN dynamic scale and NaN FP8 values; a NaN value under a given
# scale stays NaN. tl.maximum / tl.minimum and the max reductions have fmax semantics (they drop NaN), so
# the helpers below test for NaN explicitly. Inf needs nothing: amax = inf gives scale = inf, x / inf = 0 or
# NaN (inf / inf), as in the reference; such a row dequantises to NaN.


# The interpreter's fp32 -> e4m3 cast turns a NaN into 256; only there is the NaN byte patched in (a
# module constexpr, so the compiled kernels carry none of it).
_INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _store_fp8(ptrs, q, mask, FP8_MAX: tl.constexpr):
    """Store fp8(clamp(q, -FP8_MAX, FP8_MAX)) with NaN kept NaN (tl.minimum / tl.maximum turn a NaN into
    +-FP8_MAX). Compiled: the clamp skips NaN and the cast (cvt.rn.satfinite) gives the e4m3 NaN. Under the
    interpreter, whose cast turns NaN into 256, 0x7F is OR-ed into the byte (0x7F / 0xFF: the NaNs of
    e4m3fn). (Doing that bitcast on the GPU too left NaN bytes in test_norm::test_fp8_norm_strided_rows'
    output on the H200 with finite inputs; not diagnosed, the compiled path keeps the plain cast.)"""
    c = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if _INTERPRET:
        b = c.to(ptrs.dtype.element_ty).to(tl.uint8, bitcast=True)
        b = tl.where(q != q, (b | 0x7F).to(tl.uint8), b)
        tl.store(ptrs, b.to(ptrs.dtype.element_ty, bitcast=True), mask=mask)
    else:
        c = tl.where(q != q, q, c)
        tl.store(ptrs, c.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _nan_flags(y, AXIS: tl.constexpr):
    """int32 count of NaN along AXIS (> 0: the row holds a NaN)."""
    return tl.sum((y != y).to(tl.int32), axis=AXIS)


@triton.jit
def _dynamic_scale(amax, nan_count, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """max(amax / FP8_MAX, MIN_SCALE), NaN where nan_count > 0 (amax from a max reduction misses NaN)."""
    s = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    return tl.where(nan_count > 0, float("nan"), s)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, H, stride_x,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    """amax_ptr (int32, zeroed) <- max over programs of the bits of amax(|x|).

    |x| >= 0, and non-negative IEEE floats order like their bit patterns as integers, so an integer
    atomic max is an exact float max.
    """
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    nans = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        acc = tl.maximum(acc, tl.abs(xf))
        nans += (xf != xf).to(tl.int32)
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    bits = amax.to(tl.int32, bitcast=True)
    # a NaN anywhere: the bits of a positive quiet NaN (0x7FC00000), above those of every non-negative
    # float, so they win the integer max and the tensor's scale is NaN
    bits = tl.where(tl.sum(tl.sum(nans, axis=1), axis=0) > 0, 2143289344, bits)
    tl.atomic_max(amax_ptr, bits)


@triton.jit
def _quant_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, M, H, stride_x, stride_o,
                  MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_x
    o_rows = out_ptr + rows64[:, None] * stride_o
    if MODE == 1:
        s = tl.load(scale_ptr)
    elif MODE == 3:
        amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        s = _dynamic_scale(amax, (amax != amax).to(tl.int32), FP8_MAX, MIN_SCALE)
        if pid == 0:
            tl.store(scale_ptr, s)
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if MODE == 2:
            s = _dynamic_scale(tl.max(tl.abs(x), axis=1), _nan_flags(x, 1), FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
            q = x / s[:, None]
        else:
            q = x / s
        _store_fp8(o_rows + cols[None, :], q, mask, FP8_MAX)
    else:
        if MODE == 2:
            acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
            nans = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.int32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = row_mask[:, None] & (cols < H)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
                nans += (x != x).to(tl.int32)
            s = _dynamic_scale(tl.max(acc, axis=1), tl.sum(nans, axis=1), FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
            s = s[:, None]
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = row_mask[:, None] & (cols < H)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _store_fp8(o_rows + cols[None, :], x / s, mask, FP8_MAX)


def launch_quantize_fp8(x, out, scale, amax_bits, mode, config, pdl: bool = False):
    """x, out: (M, H) rows; scale: (1,) or (M, 1) fp32; amax_bits: zeroed (1,) int32 for QUANT_FROM_AMAX."""
    M, H = x.shape
    block_m, block_h = config["BLOCK_M"], config["BLOCK_H"]
    num_chunks = cdiv(H, block_h)
    grid = (cdiv(M, block_m),)
    if mode == QUANT_FROM_AMAX:
        _amax_kernel[grid](x, amax_bits, M, H, x.stride(0), BLOCK_M=block_m, BLOCK_H=block_h,
                           NUM_CHUNKS=num_chunks, USE_PDL=pdl, num_warps=config["num_warps"], **launch_kwargs(pdl))
    _quant_kernel[grid](
        x, out, scale, amax_bits if amax_bits is not None else scale, M, H, x.stride(0), out.stride(0),
        MODE=mode, BLOCK_M=block_m, BLOCK_H=block_h, NUM_CHUNKS=num_chunks,
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, USE_PDL=pdl, num_warps=config["num_warps"], **launch_kwargs(pdl),
    )
