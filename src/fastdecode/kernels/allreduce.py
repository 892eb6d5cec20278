"""All-reduce kernels over peer-visible (symmetric) memory: one-shot, two-shot, one-shot fused with
residual-add + RMSNorm (+FP8). No policy here; ``fastdecode.ops.allreduce`` owns the workspace.

Every rank's workspace has the same layout; ``*_ptrs[p]`` are int64 tensors with rank p's addresses.

One-shot (push): program b of each rank keeps a call counter ``c`` (local memory, advanced once per
launch of program b; identical on all ranks since all ranks launch the same grids in the same
order). It writes its part of x into slab ``(b, c % 2, rank)`` of every rank's push region, then
stores ``c`` into flag ``(b, rank)`` of every rank (release), waits until its own flags
``(b, p)`` reach ``c`` (acquire), and sums the slabs ``(b, c % 2, p)`` locally. One exchange per call
and no closing barrier: a rank can run at most one call ahead of a peer (it waits for the peer's
flag of every call), so the other parity's slabs are never overwritten while being read.
Every thread of the program must use the same ``c`` (``_next_call``); counters and flags wrap at
2**31 calls, so the parity is ``c & 1`` and "reached" is ``flag - c >= 0`` in int32 arithmetic.

Two-shot: barriers with stateless flags: slot ``(barrier, block, peer)`` is set to 1 by ``peer``
(release store) and consumed back to 0 by the owner (acquire compare-and-swap 1 -> 0).
Both schemes keep no host-side state, so captured CUDA graphs can be replayed any number of times.
"""

import triton
import triton.language as tl

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE
from fastdecode.kernels.host import cdiv, next_pow2
from fastdecode.kernels.norm import _finish_row


@triton.jit
def _signal(addr, value):
    """Thread 0 of the program does ``st.release.sys.u32 [addr], value``: a flag write that orders
    the program's earlier writes (after a bar.sync) before it, with no return trip."""
    addrs = addr + tl.zeros((1,), dtype=tl.int32)  # the asm takes tensors; tid.x == 0 alone stores
    vals = value + tl.zeros((1,), dtype=tl.int32)
    tl.inline_asm_elementwise(
        """
        {
            .reg .u32 %fd_t;
            .reg .pred %p;
            mov.u32 %fd_t, %tid.x;
            setp.eq.u32 %p, %fd_t, 0;
            @%p st.release.sys.global.u32 [$1], $2;
            mov.u32 $0, 0;
        }
        """,
        "=r,l,r",
        [addrs, vals],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _next_call(cnt_ptr):
    """This program's call number ``c``, advanced by one, the same in every thread of the program.

    One atomic, done by one thread, its old value broadcast by Triton. Not a plain load then store:
    every thread loaded the counter but thread 0 alone stored ``c``, with no barrier between, so a
    warp whose load came after that store took ``c + 1``. That warp pushed its columns into the other
    parity's slabs (peers summed stale data there), waited for a flag of the next call and fell out of
    step with the program's barriers (its reductions mixed with other warps' partial sums): now and
    then wrong rows on every rank, and per-token FP8 scales far outside what a norm can give.
    """
    return tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="relaxed", scope="gpu") + 1


@triton.jit
def _publish_and_wait(eflag_ptrs, c, rank, WORLD: tl.constexpr):
    pid = tl.program_id(0)
    tl.debug_barrier()  # every thread's pushes precede the release below
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(eflag_ptrs + p).to(tl.pointer_type(tl.int32))
        _signal(peer_flags + pid * WORLD + rank, c)
    my_flags = tl.load(eflag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        # a peer's flag is c (this call) or c + 1 (it is one call ahead); the difference, not a plain
        # ``< c``, stays right when the int32 counters wrap
        while tl.atomic_add(my_flags + pid * WORLD + p, 0, sem="acquire", scope="sys") - c < 0:
            pass
    tl.debug_barrier()  # no thread reads the slabs before the acquire above


@triton.jit
def _barrier(flag_ptrs, slot, rank, WORLD: tl.constexpr):
    """All ranks' programs with the same id meet here. ``slot`` = barrier * MAX_BLOCKS + block."""
    tl.debug_barrier()  # every thread's earlier writes precede the release below
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        _signal(peer_flags + slot * WORLD + rank, 1)
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(my_flags + slot * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # no thread reads peer data before the acquire above


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, n, push_ptrs, eflag_ptrs, cnt_ptr, rank, SLAB,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over ranks of x (flat, n elements). Chunk j of this program (element offset
    (pid + j * nprog) * BLOCK) travels in slab position j * BLOCK."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    c = _next_call(cnt_ptr)
    par = c & 1
    mine = ((pid * 2 + par) * WORLD + rank).to(tl.int64) * SLAB
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        j = (start - pid * BLOCK) // (nprog * BLOCK)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask)
        for p in tl.static_range(WORLD):
            peer = tl.load(push_ptrs + p).to(tl.pointer_type(dtype))
            tl.store(peer + mine + j * BLOCK + tl.arange(0, BLOCK), v, mask=mask)
    _publish_and_wait(eflag_ptrs, c, rank, WORLD)
    my_push = tl.load(push_ptrs + rank).to(tl.pointer_type(dtype))
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        j = (start - pid * BLOCK) // (nprog * BLOCK)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):  # same order on every rank: identical results everywhere
            slab = ((pid * 2 + par) * WORLD + p).to(tl.int64) * SLAB
            acc += tl.load(my_push + slab + j * BLOCK + tl.arange(0, BLOCK), mask=mask, other=0.0,
                           cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)


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
    x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, push_ptrs, eflag_ptrs, cnt_ptr, rank,
    M, H, stride_x, stride_r, stride_o, eps, SLAB,
    WORLD: tl.constexpr, OUT_MODE: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    """Row m = pid + j * nprog: s = sum_p x_p[m] rounded to x.dtype (what a plain all-reduce
    returns), residual[m] <- s + residual[m], out[m] = rmsnorm(residual[m]) * w (native or FP8)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    c = _next_call(cnt_ptr)
    par = c & 1
    mine = ((pid * 2 + par) * WORLD + rank).to(tl.int64) * SLAB
    for m in range(pid, M, nprog):
        j = (m - pid) // nprog
        x = tl.load(x_ptr + m.to(tl.int64) * stride_x + cols, mask=cmask)
        for p in tl.static_range(WORLD):
            peer = tl.load(push_ptrs + p).to(tl.pointer_type(dtype))
            tl.store(peer + mine + j * H + cols, x, mask=cmask)
    _publish_and_wait(eflag_ptrs, c, rank, WORLD)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    my_push = tl.load(push_ptrs + rank).to(tl.pointer_type(dtype))
    for m in range(pid, M, nprog):
        j = (m - pid) // nprog
        row = m.to(tl.int64)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for p in tl.static_range(WORLD):
            slab = ((pid * 2 + par) * WORLD + p).to(tl.int64) * SLAB
            acc += tl.load(my_push + slab + j * H + cols, mask=cmask, other=0.0,
                           cache_modifier=".cv").to(tl.float32)
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


def launch_all_reduce(x, out, ws, two_shot, config):
    """x, out: contiguous, same numel; ``ws`` gives the peer address tensors and sizes."""
    n = x.numel()
    block = config["BLOCK"]
    grid = (max(1, min(cdiv(n, block), ws.max_blocks)),)
    if two_shot:
        _two_shot_kernel[grid](x, out, n, ws.buf_ptrs, ws.res_ptrs, ws.flag_ptrs, ws.rank, WORLD=ws.world,
                               MAX_BLOCKS=ws.max_blocks, BLOCK=block, num_warps=config["num_warps"])
    else:
        _one_shot_kernel[grid](x, out, n, ws.push_ptrs, ws.eflag_ptrs, ws.counters, ws.rank,
                               ws.slab_elems(x.element_size()), WORLD=ws.world, BLOCK=block,
                               num_warps=config["num_warps"])


def launch_all_reduce_add_rms_norm(x, residual, weight, out, scale, eps, out_mode, ws, num_warps):
    """x, residual, out: (M, H) rows (unit inner stride)."""
    M, H = x.shape
    grid = (max(1, min(M, ws.max_blocks)),)
    _one_shot_add_rms_norm_kernel[grid](
        x, residual, weight, out, scale if scale is not None else weight, ws.push_ptrs, ws.eflag_ptrs,
        ws.counters, ws.rank, M, H, x.stride(0), residual.stride(0), out.stride(0), eps,
        ws.slab_elems(x.element_size()),
        WORLD=ws.world, OUT_MODE=out_mode, BLOCK_H=next_pow2(H),
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, num_warps=num_warps,
    )
