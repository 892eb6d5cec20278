"""RMSNorm kernels: plain, fused with a residual add, with bf16/fp16/fp32, FP8 e4m3 or grouped int8 output.

No policy and no checks here: ``fastdecode.ops.norm`` validates and picks the config.
"""

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.int4_a8 import _store_act_int8
from fastdecode.kernels.quant import _dynamic_scale, _nan_flags, _store_fp8  # the NaN rule of FP8 outputs
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait


@triton.jit
def _finish_row(y, out_ptrs, mask, scale_ptr, rows, row_mask,
                OUT_MODE: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Write y (BLOCK_M, BLOCK_H) fp32 to out in the requested output mode."""
    if OUT_MODE == 0:
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        if OUT_MODE == 1:
            s = tl.load(scale_ptr)
            q = y / s
        else:
            s = _dynamic_scale(tl.max(tl.abs(y), axis=1), _nan_flags(y, 1), FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
            q = y / s[:, None]
        _store_fp8(out_ptrs, q, mask, FP8_MAX)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, sum_ptr,
    M, H, stride_x, stride_r, stride_o, stride_s, NG, eps,
    HAS_RESIDUAL: tl.constexpr, OUT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Each program normalises BLOCK_M rows.

    NUM_CHUNKS == 1: the row lives in registers, one pass over memory. OUT_MODE 3 (``OUT_INT8_GROUPS``, this path
    only, BLOCK_H >= the row's 256-rounded width): the output rounded to x's dtype (as the native output), then
    int8 per group of 128 columns for the W4A8 GEMV (``kernels.int4_a8._store_act_int8``; out: the int8 rows,
    scale_ptr / sum_ptr: (M, NG) scales and sums, row stride stride_s).
    NUM_CHUNKS > 1 (very wide rows): pass 1 sums squares (and writes the residual), the last pass
    re-reads the row from L2 to write the output; FP8 dynamic adds a pass for the row maximum.
    """
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)

    if NUM_CHUNKS == 1:
        col_mask = cols < H
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_ptrs = res_ptr + rows64[:, None] * stride_r + cols[None, :]
            r = tl.load(r_ptrs, mask=mask, other=0.0)
            # the residual is stored in its own dtype; the norm reads that rounded value back
            s = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(r_ptrs, s, mask=mask)
            v = s.to(tl.float32)
        else:
            v = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = v * rstd[:, None] * w[None, :]
        if OUT_MODE == 3:
            _store_act_int8(y.to(x_ptr.dtype.element_ty).to(tl.float32), rows64, row_mask, 0, out_ptr, scale_ptr,
                            sum_ptr, stride_o, stride_s, NG, BLOCK_M, BLOCK_H)
        else:
            out_ptrs = out_ptr + rows64[:, None] * stride_o + cols[None, :]
            _finish_row(y, out_ptrs, mask, scale_ptr, rows, row_mask, OUT_MODE, FP8_MAX, MIN_SCALE)
    else:
        # pass 1: residual add, sum of squares
        acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            mask = row_mask[:, None] & (cc < H)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cc[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r_ptrs = res_ptr + rows64[:, None] * stride_r + cc[None, :]
                r = tl.load(r_ptrs, mask=mask, other=0.0)
                s = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
                tl.store(r_ptrs, s, mask=mask)
                v = s.to(tl.float32)
            else:
                v = x.to(tl.float32)
            acc += v * v
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / H + eps)
        # the source of the normalised values: the updated residual, or x
        if HAS_RESIDUAL:
            src_ptr = res_ptr
            stride_s = stride_r
        else:
            src_ptr = x_ptr
            stride_s = stride_x
        if OUT_MODE == 2:
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            nans = tl.zeros((BLOCK_M,), dtype=tl.int32)
            for c in range(NUM_CHUNKS):
                cc = c * BLOCK_H + cols
                cmask = cc < H
                mask = row_mask[:, None] & cmask[None, :]
                v = tl.load(src_ptr + rows64[:, None] * stride_s + cc[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
                y = v.to(tl.float32) * rstd[:, None] * w[None, :]
                amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
                nans += _nan_flags(y, 1)
            s = _dynamic_scale(amax, nans, FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + rows, s, mask=row_mask)
        elif OUT_MODE == 1:
            s = tl.load(scale_ptr)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            cmask = cc < H
            mask = row_mask[:, None] & cmask[None, :]
            v = tl.load(src_ptr + rows64[:, None] * stride_s + cc[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
            y = v.to(tl.float32) * rstd[:, None] * w[None, :]
            out_ptrs = out_ptr + rows64[:, None] * stride_o + cc[None, :]
            if OUT_MODE == 0:
                tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                if OUT_MODE == 1:
                    q = y / s
                else:
                    q = y / s[:, None]
                _store_fp8(out_ptrs, q, mask, FP8_MAX)


def launch_rms_norm(x, residual, weight, out, scale, eps, out_mode, config, pdl: bool = False, sums=None):
    """Launch on 2-D row views. ``config``: dict(BLOCK_M, BLOCK_H, num_warps). Int8 output (out_mode 3): out the
    int8 (M, Kp) rows, ``scale`` / ``sums`` (M, Kp // 128), one chunk (BLOCK_H >= Kp; the op checks)."""
    M, H = x.shape
    block_m, block_h = config["BLOCK_M"], config["BLOCK_H"]
    num_chunks = cdiv(H, block_h)
    has_res = residual is not None
    grid = (cdiv(M, block_m),)
    _rms_norm_kernel[grid](
        x, residual if has_res else x, weight, out, scale if scale is not None else weight,
        sums if sums is not None else weight,
        M, H, x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
        sums.stride(0) if sums is not None else 0, sums.shape[1] if sums is not None else 0, eps,
        HAS_RESIDUAL=has_res, OUT_MODE=out_mode,
        BLOCK_M=block_m, BLOCK_H=block_h, NUM_CHUNKS=num_chunks,
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, USE_PDL=pdl,
        num_warps=config["num_warps"], **launch_kwargs(pdl),
    )
