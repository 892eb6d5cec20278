"""L2 prefetch of a byte range (sm_90+, ``cp.async.bulk.prefetch.L2``): warm the L2 with the next GEMV's weights
from a kernel that reads little memory itself.

A decode layer alternates memory-bound GEMVs with kernels that barely use the memory bus (the decode attention reads
a few hundred KB of KV cache): while those run, and while the GEMV before them drains, the bus idles. A kernel that
takes a prefetch range issues, in every one of its threads, one bulk prefetch of ``chunk`` bytes of the range (the
copy engine fetches them into L2; nothing returns to the SM), so the GEMV after it finds some or all of its weight
in L2. Weights are never written by the step's kernels, so the prefetch may run before the PDL wait
(``kernels.pdl``'s contract). It is a hint: it changes no result.

The range is split over ``programs * LANES`` threads (``prefetch_plan``); each thread's chunk is a multiple of 16
bytes from a 16-byte aligned base, as the instruction requires.

``l2_prefetch_rows``: a GEMV program's own weight slab (its rows, its split's columns), prefetched before its PDL
wait. Under PDL a GEMV's programs become resident as the previous kernel's retire (or beside a small kernel such as
the attention), so their slabs stream into L2 during the previous kernel's tail instead of after it; each program
then reads its slab from L2 (``ops._common.weight_prefetch_enabled``: a launch policy like PDL; by default only
small bf16 / fp16 weights at one token).

``next_words``: the other prefetch, into registers: the int4 kernels' words of a later K step, loaded while this
step computes.
"""

import triton
import triton.language as tl

_BULK_PREFETCH = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def l2_prefetch_range(base_ptr, nbytes, chunk, prog, LANES: tl.constexpr):
    """Thread ``lane`` of program ``prog`` prefetches bytes ``[(prog * LANES + lane) * chunk, + chunk)`` of the
    range ``[base_ptr, base_ptr + nbytes)`` (a byte pointer) into L2, clipped to the range (nothing past it)."""
    lane = tl.arange(0, LANES)
    off = (prog * LANES + lane).to(tl.int64) * chunk
    size = tl.maximum(tl.minimum(nbytes - off, chunk), 0).to(tl.int32)
    tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r", [base_ptr + off, size], dtype=tl.int32, is_pure=False,
                              pack=1)


def slab_bytes(cap: int, pdl: bool, weight, tile_bytes: int = 16) -> int:
    """The ``L2_SLAB`` constexpr of a GEMV launch: ``cap`` (bytes a program) where the prefetch may run: with PDL
    (it goes before the wait) and on a weight whose base, row stride and K tile (``tile_bytes``: where a split's
    columns start) are 16-byte aligned, as the bulk prefetch requires; else 0."""
    if not (cap and pdl):  # the default launch: no tensor queries
        return 0
    aligned = (weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
               and tile_bytes % 16 == 0)
    return int(cap) if aligned else 0


def prefetch_plan(nbytes: int, threads: int) -> tuple[int, int]:
    """``(nbytes, chunk)`` for ``l2_prefetch_range`` over ``threads`` threads in all: the range cut to a multiple of
    16 bytes and each thread's chunk, a multiple of 16 that covers it."""
    nbytes = nbytes // 16 * 16
    per = -(-nbytes // max(threads, 1))
    return nbytes, max(16, -(-per // 16) * 16)


@triton.jit
def l2_prefetch_rows(base_ptr, row0, n_rows, row_stride, col_start, col_end, ROWS: tl.constexpr,
                     LANES: tl.constexpr, MAX_BYTES: tl.constexpr):
    """Rows ``[row0, row0 + ROWS)`` (those below ``n_rows``) of a row-major byte matrix (``base_ptr``: a byte
    pointer; ``row_stride``, ``col_start`` and the base 16-byte aligned), bytes ``[col_start, col_end)`` of each, into
    L2: each row cut into up to ``max(1, LANES // ROWS)`` chunks of a multiple of 16 bytes and at least 512, one bulk
    prefetch a chunk (the row's last chunk rounded down to 16 bytes); at most ``MAX_BYTES`` a program (each row's
    first ``MAX_BYTES // ROWS``): what the resident programs prefetch must stay in L2 until they read it. A GEMV
    program's own weight slab, before its PDL wait."""
    ROW_CAP: tl.constexpr = max(16, MAX_BYTES // ROWS // 16 * 16)
    col_end = tl.minimum(col_end, col_start + ROW_CAP)
    PARTS: tl.constexpr = LANES // ROWS if LANES > ROWS else 1
    row = row0 + tl.arange(0, ROWS)[:, None]
    part = tl.arange(0, PARTS)[None, :]
    # at least 512 bytes a prefetch (fewer, larger copies; the parts past the row's end issue nothing)
    chunk = tl.maximum((tl.cdiv(col_end - col_start, PARTS) + 15) // 16 * 16, 512)
    start = col_start + part * chunk
    size = tl.minimum(col_end - start, chunk) // 16 * 16
    size = tl.where(row < n_rows, tl.maximum(size, 0), 0).to(tl.int32)
    ptr = base_ptr + row.to(tl.int64) * row_stride + start
    tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def next_words(qw_row, kb, kb_end, offs_w, KW, BLOCK_N: tl.constexpr, BK8: tl.constexpr, EVEN_K: tl.constexpr):
    """The int4 kernels' register prefetch (PREFETCH, ``kernels.int4``; PF_UNROLL, ``kernels.int4_packed``): the
    packed words of K step ``kb`` ([BLOCK_N, BK8] of the rows at ``qw_row``), zeros for a step past the split's end."""
    kw = kb * BK8 + offs_w
    more = (kb + tl.zeros((BLOCK_N, BK8), dtype=tl.int32)) < kb_end  # past the last step: nothing loaded
    if EVEN_K:
        return tl.load(qw_row + kw[None, :], mask=more, other=0)
    else:
        return tl.load(qw_row + kw[None, :], mask=more & (kw < KW)[None, :], other=0)
