"""Greedy token choice: the index of the largest value of each row (``torch.argmax(x, dim=-1)``'s rule).

Two launches, so that a long row (a 128K vocabulary) is read by many SMs at once: torch's own argmax of one
row is one block (13.2 us for a 49152-wide row, 27.7 us for 128256 on the H200, ``benchmarks/NOTES.md``).

* ``_argmax_chunks_kernel``: program (c, r) finds the first maximum of chunk c (BLOCK values) of row r and
  stores its column (int32) in ``part[r, c]``.
* ``_argmax_rows_kernel``: program r gathers its chunks' winners from x (at most ``PBLOCK``) and keeps the
  first maximum among them, as int64.

The rule, both stages (ATen's ``GreaterOrNan``): a NaN beats every number and the first NaN wins; otherwise
the largest value, the first column among equals. A row of -inf gives column 0. Values compare in fp32 (an
exact upcast of bf16 / fp16).
"""

import triton
import triton.language as tl

NO_COLUMN = 2**31 - 1  # larger than any column


@triton.jit
def _first_max(v, col, valid, NONE: tl.constexpr):
    """(the first column of a NaN if ``v`` has one, else of the largest value) over the ``valid`` lanes."""
    nan = valid & (v != v)
    first_nan = tl.min(tl.where(nan, col, NONE), axis=0)
    num = valid & (v == v)
    w = tl.where(num, v, float("-inf"))
    m = tl.max(w, axis=0)
    first_max = tl.min(tl.where(num & (w == m), col, NONE), axis=0)
    return tl.where(first_nan < NONE, first_nan, first_max)


@triton.jit
def _argmax_chunks_kernel(x_ptr, part_ptr, V, stride_x, n_chunks, BLOCK: tl.constexpr, NONE: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    v = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    tl.store(part_ptr + row * n_chunks + c, _first_max(v, cols, valid, NONE))


@triton.jit
def _argmax_rows_kernel(x_ptr, part_ptr, out_ptr, stride_x, n_chunks, PBLOCK: tl.constexpr, NONE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PBLOCK)
    valid = p < n_chunks
    cols = tl.load(part_ptr + row * n_chunks + p, mask=valid, other=0)
    v = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row, _first_max(v, cols, valid, NONE).to(tl.int64))


def launch_argmax(x, part, out, config):
    """x: (B, V) rows with unit inner stride, V >= 1; part: (B, cdiv(V, BLOCK)) int32 scratch; out: (B,) int64.
    ``config``: dict(BLOCK, PBLOCK >= cdiv(V, BLOCK), num_warps)."""
    B, V = x.shape
    n_chunks = part.shape[1]
    _argmax_chunks_kernel[(n_chunks, B)](x, part, V, x.stride(0), n_chunks, BLOCK=config["BLOCK"], NONE=NO_COLUMN,
                                         num_warps=config["num_warps"])
    _argmax_rows_kernel[(B,)](x, part, out, x.stride(0), n_chunks, PBLOCK=config["PBLOCK"], NONE=NO_COLUMN,
                              num_warps=1)
