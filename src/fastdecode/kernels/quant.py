"""FP8 e4m3 quantisation kernels: static per-tensor, dynamic per-token, dynamic per-tensor."""

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE

QUANT_STATIC = 1  # scale_ptr[0] given
QUANT_PER_TOKEN = 2  # scale_ptr[row] = max(amax(row) / 448, min)
QUANT_FROM_AMAX = 3  # per-tensor: amax_ptr holds the float bits of amax(|x|); scale_ptr[0] written


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, H, stride_x,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """amax_ptr (int32, zeroed) <- max over programs of the bits of amax(|x|).

    |x| >= 0, and non-negative IEEE floats order like their bit patterns as integers, so an integer
    atomic max is an exact float max.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    tl.atomic_max(amax_ptr, amax.to(tl.int32, bitcast=True))


@triton.jit
def _quant_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, M, H, stride_x, stride_o,
                  MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
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
        s = tl.maximum(amax / FP8_MAX, MIN_SCALE)
        if pid == 0:
            tl.store(scale_ptr, s)
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if MODE == 2:
            s = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
            q = x / s[:, None]
        else:
            q = x / s
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(o_rows + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if MODE == 2:
            acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = row_mask[:, None] & (cols < H)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
            s = tl.maximum(tl.max(acc, axis=1) / FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
            s = s[:, None]
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = row_mask[:, None] & (cols < H)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / s, -FP8_MAX), FP8_MAX)
            tl.store(o_rows + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def launch_quantize_fp8(x, out, scale, amax_bits, mode, config):
    """x, out: (M, H) rows; scale: (1,) or (M, 1) fp32; amax_bits: zeroed (1,) int32 for QUANT_FROM_AMAX."""
    M, H = x.shape
    block_m, block_h = config["BLOCK_M"], config["BLOCK_H"]
    num_chunks = triton.cdiv(H, block_h)
    grid = (triton.cdiv(M, block_m),)
    if mode == QUANT_FROM_AMAX:
        _amax_kernel[grid](x, amax_bits, M, H, x.stride(0), BLOCK_M=block_m, BLOCK_H=block_h,
                           NUM_CHUNKS=num_chunks, num_warps=config["num_warps"])
    _quant_kernel[grid](
        x, out, scale, amax_bits if amax_bits is not None else scale, M, H, x.stride(0), out.stride(0),
        MODE=mode, BLOCK_M=block_m, BLOCK_H=block_h, NUM_CHUNKS=num_chunks,
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, num_warps=config["num_warps"],
    )
