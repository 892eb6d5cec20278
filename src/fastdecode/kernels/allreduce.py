"""All-reduce kernels over peer-visible (symmetric) memory: one-shot, two-shot, one-shot fused with
residual-add + RMSNorm (+FP8). No policy here; ``fastdecode.ops.allreduce`` owns the workspace.

Memory of every rank's workspace (bytes, same layout on all ranks):
``[flags: int32[2 * MAX_BLOCKS * WORLD]] [input region] [result region]``; ``buf_ptrs[p]`` holds the
address of rank p's input region, ``res_ptrs[p]`` of its result region, ``flag_ptrs[p]`` of its flags.

Barriers are stateless between calls, so a captured CUDA graph can replay them any number of times:
slot ``(barrier, block, peer)`` of a rank's flags is set to 1 by ``peer`` (a release store over
NVLink) and consumed back to 0 by the owner (acquire compare-and-swap 1 -> 0).
"""

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE
from fastdecode.kernels.norm import _finish_row


@triton.jit
def _signal(addr):
    """Thread 0 of the program does ``st.release.sys.u32 [addr], 1``: a flag write that orders all
    of this thread's earlier writes before it (no return trip, unlike an atomic)."""
    addrs = addr + tl.zeros((1,), dtype=tl.int32)  # the asm takes tensors; tid.x == 0 alone stores
    tl.inline_asm_elementwise(
        """
        {
            .reg .u32 %fd_t, %fd_one;
            .reg .pred %p;
            mov.u32 %fd_t, %tid.x;
            mov.u32 %fd_one, 1;
            setp.eq.u32 %p, %fd_t, 0;
            @%p st.release.sys.global.u32 [$1], %fd_one;
            mov.u32 $0, 0;
        }
        """,
        "=r,l",
        [addrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _barrier(flag_ptrs, slot, rank, WORLD: tl.constexpr):
    """All ranks' programs with the same id meet here. ``slot`` = barrier * MAX_BLOCKS + block."""
    tl.debug_barrier()  # every thread's earlier writes precede the release below
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        _signal(peer_flags + slot * WORLD + rank)
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(my_flags + slot * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # no thread reads peer data before the acquire above


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, n, buf_ptrs, flag_ptrs, rank,
                     WORLD: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over ranks of x (flat, n elements): copy in, barrier, read all peers, barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    my_buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(my_buf + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(flag_ptrs, pid, rank, WORLD)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):  # same order on every rank: identical results everywhere
            peer = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
            acc += tl.load(peer + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    # nobody may overwrite its input region (next call) while a peer still reads it
    _barrier(flag_ptrs, MAX_BLOCKS + pid, rank, WORLD)


@triton.jit
def _two_shot_kernel(x_ptr, out_ptr, n, buf_ptrs, res_ptrs, flag_ptrs, rank,
                     WORLD: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """Reduce-scatter then all-gather over chunks of BLOCK elements.

    Chunk c belongs to program c % nprog in every phase and on every rank (the barriers are per
    program), and is reduced by rank (c // nprog) % WORLD, which sums it from every peer's input
    region and writes the sum into every peer's result region; after barrier 2 each rank copies its
    result region out. No closing barrier: peers read a rank's input region only before barrier 2
    of the same call, and write its result region only after barrier 1 of the next call.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    nchunks = tl.cdiv(n, BLOCK)
    my_buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    for c in range(pid, nchunks, nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(my_buf + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(flag_ptrs, pid, rank, WORLD)
    for c in range(pid + rank * nprog, nchunks, WORLD * nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            peer = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
            acc += tl.load(peer + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        s = acc.to(dtype)
        for p in tl.static_range(WORLD):
            peer_res = tl.load(res_ptrs + p).to(tl.pointer_type(dtype))
            tl.store(peer_res + offs, s, mask=mask)
    _barrier(flag_ptrs, MAX_BLOCKS + pid, rank, WORLD)
    my_res = tl.load(res_ptrs + rank).to(tl.pointer_type(dtype))
    for c in range(pid, nchunks, nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(my_res + offs, mask=mask, cache_modifier=".cv"), mask=mask)


@triton.jit
def _one_shot_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, buf_ptrs, flag_ptrs, rank,
    M, H, stride_x, stride_r, stride_o, eps,
    WORLD: tl.constexpr, MAX_BLOCKS: tl.constexpr, OUT_MODE: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    """Row m (program m % nprog): s = sum_p x_p[m] rounded to x.dtype (what a plain all-reduce
    returns), residual[m] <- s + residual[m], out[m] = rmsnorm(residual[m]) * w (native or FP8)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    my_buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    for m in range(pid, M, nprog):
        row = m.to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cmask)
        tl.store(my_buf + row * H + cols, x, mask=cmask)
    _barrier(flag_ptrs, pid, rank, WORLD)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for m in range(pid, M, nprog):
        row = m.to(tl.int64)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            peer = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
            acc += tl.load(peer + row * H + cols, mask=cmask, other=0.0, cache_modifier=".cv").to(tl.float32)
        s = acc.to(dtype).to(tl.float32)
        r_ptrs = res_ptr + row * stride_r + cols
        r = tl.load(r_ptrs, mask=cmask, other=0.0)
        v = (s + r.to(tl.float32)).to(r.dtype)
        tl.store(r_ptrs, v, mask=cmask)
        v = v.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
        y = v * rstd * w
        rows = m + tl.arange(0, 1)
        _finish_row(y[None, :], out_ptr + row * stride_o + cols[None, :], cmask[None, :], scale_ptr,
                    rows, rows < M, OUT_MODE, FP8_MAX, MIN_SCALE)
    _barrier(flag_ptrs, MAX_BLOCKS + pid, rank, WORLD)


def launch_all_reduce(x, out, bufs, res_bufs, flags, rank, world, two_shot, max_blocks, config):
    """x, out: contiguous, same numel. bufs / res_bufs / flags: int64 tensors of peer addresses."""
    n = x.numel()
    block = config["BLOCK"]
    grid = (max(1, min(triton.cdiv(n, block), max_blocks)),)
    if two_shot:
        _two_shot_kernel[grid](x, out, n, bufs, res_bufs, flags, rank, WORLD=world, MAX_BLOCKS=max_blocks,
                               BLOCK=block, num_warps=config["num_warps"])
    else:
        _one_shot_kernel[grid](x, out, n, bufs, flags, rank, WORLD=world, MAX_BLOCKS=max_blocks,
                               BLOCK=block, num_warps=config["num_warps"])


def launch_all_reduce_add_rms_norm(x, residual, weight, out, scale, eps, out_mode, bufs, flags, rank,
                                   world, max_blocks, num_warps):
    """x, residual, out: (M, H) rows (unit inner stride)."""
    M, H = x.shape
    grid = (max(1, min(M, max_blocks)),)
    _one_shot_add_rms_norm_kernel[grid](
        x, residual, weight, out, scale if scale is not None else weight, bufs, flags, rank,
        M, H, x.stride(0), residual.stride(0), out.stride(0), eps,
        WORLD=world, MAX_BLOCKS=max_blocks, OUT_MODE=out_mode, BLOCK_H=triton.next_power_of_2(H),
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, num_warps=num_warps,
    )
