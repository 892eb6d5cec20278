"""SiLU-and-mul kernels: ``out = silu(gate) * up`` for ``x = [gate | up]``, native, FP8 or grouped int8 output."""

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE, OUT_FP8_DYNAMIC
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.int4_a8 import _store_act_int8
from fastdecode.kernels.quant import _dynamic_scale, _nan_flags, _store_fp8  # the NaN rule of FP8 outputs
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _silu_mul(x_ptr, row_off, cols, mask, I):
    g = tl.load(x_ptr + row_off + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row_off + I + cols, mask=mask, other=0.0).to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, scale_ptr, sum_ptr, I, stride_x, stride_o, stride_s, NG,
    OUT_MODE: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """1-D grid. Native and static-FP8 modes: program p writes BLOCK columns of row p // NBLK, with
    the column block fastest so that neighbouring programs stream neighbouring memory.

    Dynamic FP8 (per-token scale) needs the whole row: one program per row; with NUM_CHUNKS == 1 the
    row stays in registers; otherwise pass 1 finds the row maximum and pass 2 recomputes and writes.
    Grouped int8 (OUT_MODE 3): column blocks as the native mode (BLOCK a multiple of 256, so the blocks cover the
    256-rounded row: its padding groups are written as zeros), the output rounded to x's dtype, then int8 per group
    of 128 columns (``kernels.int4_a8._store_act_int8``; scale_ptr / sum_ptr: (M, NG), row stride stride_s): the
    groups are independent, so unlike the per-token FP8 scale no program needs the whole row.
    """
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    pid = tl.program_id(0)
    if OUT_MODE != 2:
        nblk = tl.cdiv(I, BLOCK)
        row = (pid // nblk).to(tl.int64)
        cblk = pid % nblk
    else:
        row = pid.to(tl.int64)
        cblk = 0
    x_off = row * stride_x
    o_off = row * stride_o
    if OUT_MODE == 3:
        cols = cblk * BLOCK + tl.arange(0, BLOCK)
        y = _silu_mul(x_ptr, x_off, cols, cols < I, I).to(x_ptr.dtype.element_ty).to(tl.float32)
        rows = row + tl.zeros((1,), dtype=tl.int64)
        _store_act_int8(y[None, :], rows, rows >= 0, cblk * (BLOCK // 128), out_ptr, scale_ptr, sum_ptr, stride_o,
                        stride_s, NG, 1, BLOCK)
    elif OUT_MODE != 2:
        cols = cblk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        y = _silu_mul(x_ptr, x_off, cols, mask, I)
        if OUT_MODE == 0:
            tl.store(out_ptr + o_off + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            _store_fp8(out_ptr + o_off + cols, y / tl.load(scale_ptr), mask, FP8_MAX)
    elif NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        y = _silu_mul(x_ptr, x_off, cols, mask, I)
        s = _dynamic_scale(tl.max(tl.abs(y), axis=0), _nan_flags(y, 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, s)
        _store_fp8(out_ptr + o_off + cols, y / s, mask, FP8_MAX)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nans = tl.zeros((BLOCK,), dtype=tl.int32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < I
            y = _silu_mul(x_ptr, x_off, cols, mask, I)
            amax = tl.maximum(amax, tl.abs(y))
            nans += (y != y).to(tl.int32)
        s = _dynamic_scale(tl.max(amax, axis=0), tl.sum(nans, axis=0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, s)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < I
            y = _silu_mul(x_ptr, x_off, cols, mask, I)
            _store_fp8(out_ptr + o_off + cols, y / s, mask, FP8_MAX)


def launch_silu_and_mul(x, out, scale, out_mode, config, pdl: bool = False, sums=None):
    """x: (M, 2I) rows with unit inner stride; out: (M, I). ``config``: dict(BLOCK, num_warps). Int8 output
    (``OUT_INT8_GROUPS``): out the int8 (M, Ip) rows, ``scale`` / ``sums`` (M, Ip // 128), BLOCK a multiple of 256."""
    M = out.shape[0]
    I = x.shape[1] // 2
    block = config["BLOCK"]
    if out_mode == OUT_FP8_DYNAMIC:
        grid = (M,)
        num_chunks = cdiv(I, block)
    else:
        grid = (M * cdiv(I, block),)
        num_chunks = 1
    _silu_and_mul_kernel[grid](
        x, out, scale if scale is not None else x, sums if sums is not None else x, I, x.stride(0), out.stride(0),
        sums.stride(0) if sums is not None else 0, sums.shape[1] if sums is not None else 0,
        OUT_MODE=out_mode, BLOCK=block, NUM_CHUNKS=num_chunks,
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, USE_PDL=pdl, num_warps=config["num_warps"], **launch_kwargs(pdl),
    )
