"""W4A8 with int8 activations for decode: int4 weights times int8 activations on the CUDA cores' ``dp4a``.

    act_quant:  q[m, c] = round(x[m, c] / s[m, g]),  s[m, g] = amax(|x[m, group g]|) / 127   (groups of 128)
    int4_a8:    out[m, n] = sum_g s[m, g] * sum_{c in g} q[m, c] * w[n, c]   (+ bias),  w = dequantize_int4(W)

No policy and no checks here: ``fastdecode.ops.int4_a8`` validates and picks the config.

Why (benchmarks/NOTES.md, session 22): at one token the W4A16 kernels are bound by instruction issue, not by
memory. A weight value costs 4.5 SASS instructions in the FMA kind (nibble -> fp32, ``q - zero``, one FFMA per
token row) and ~3 in the tensor-core kind, against the ~1 a value that streaming at the copy rate leaves (132 SMs
x 4 schedulers issue ~33 Tinstr/s; 4.24 TB/s of int4 is 8.5 T values/s). With int8 activations one ``dp4a``
multiplies and sums 4 values exactly in int32, so a 32-bit word of 8 nibbles costs: one shift, two ANDs and
two PRMTs (the nibbles as bytes, 4 of one activation group in each word), then per token row two ``dp4a``, two
int -> float conversions and two FFMAs that apply the group's scales. llama.cpp's MMVQ kernels compute their
quantised GEMVs the same way (Q8_1 activations).

Layouts (the weight is ``fastdecode.quant.int4``'s, unchanged: tiles of 256 columns, word j of a tile holding
columns 32p + j in bits 4p..4p+3, p = 0..7):

* a word's nibbles as bytes: ``A = prmt(w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, 0x5410)`` holds the nibbles of
  shifts (0, 2, 1, 3) in its bytes 0..3, ``B`` (selector 0x7632) those of shifts (4, 6, 5, 7): A covers the
  tile's first 128 columns, B its last 128, one activation group each (``ACT_GROUP``);
* the quantised activation ``q`` is int8 ``(M, Kp)`` (Kp: K rounded up to 256, padding 0) in that byte order:
  byte ``256 t + 128 h + 4 j + b`` holds column ``256 t + 128 h + 32 P[b] + j``, ``P = (0, 2, 1, 3)``. So int32
  word ``64 t + j`` of a row is the A-partner of weight word j of tile t, word ``64 t + 32 + j`` its B-partner;
* per row and group g (columns 128 g ..): the fp32 scale ``s`` (``x ~= q * s``, a dequantisation scale) and
  the int32 sum of the group's q (``qsum``), for the zero points: ``sum (q_w - z) q_x = sum q_w q_x - z qsum``.

The weight's groups must be unions of activation groups: group_size a multiple of 128, or one group per row.
"""

import torch
import triton
import triton.language as tl

from fastdecode.constants import INT8_MIN_SCALE
from fastdecode.kernels.gemm import _epilogue, _fma_rows, _split_k_partial
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.int4_dequant import check_params
from fastdecode.kernels.prefetch import l2_prefetch_rows, slab_bytes
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait

ACT_GROUP = 128  # activation columns per int8 scale: half a 256-column layout tile
# a module global read inside @triton.jit code must be a constexpr (the interpreter reads any global: the compiled
# RMSNorm / SiLU-and-mul kernels failed on the plain float on the H100, session 22)
_INT8_MIN_SCALE: tl.constexpr = tl.constexpr(INT8_MIN_SCALE)
ZERO_MODES = {"sym": 0, "zero": 1, "min": 2}

# the nibbles of a word as the bytes of two words, one activation group each ($0: shifts 0, 2, 1, 3; $1: 4, 6, 5, 7)
_SPLIT_ASM: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t0, t1;\n"
    "shr.u32 t1, $2, 4;\n"
    "and.b32 t0, $2, 0x0F0F0F0F;\n"
    "and.b32 t1, t1, 0x0F0F0F0F;\n"
    "prmt.b32 $0, t0, t1, 0x5410;\n"
    "prmt.b32 $1, t0, t1, 0x7632;\n}"
)
# four unsigned weight bytes times four signed activation bytes, summed exactly in int32
_DP4A_ASM: tl.constexpr = tl.constexpr("dp4a.u32.s32 $0, $1, $2, 0;")


@triton.jit
def _store_act_int8(y, rows64, row_mask, g0, q_ptr, s_ptr, sum_ptr, stride_q, stride_s, NG,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Quantise ``y`` ([BLOCK_M, BLOCK_H] fp32: rows ``rows64``, the columns of groups g0 .. g0 + BLOCK_H // 128 in
    their natural order, 0 past the row's K) per group of 128 columns and store the int8 values in the kernel byte
    order (module docstring), the fp32 scales and the int32 sums of groups < NG. The NaN rule of the FP8 outputs
    (``kernels.quant``): a group holding a NaN gets a NaN scale (its values 0), so the GEMV's output is NaN. Called
    by every kernel that writes an int8 activation (``_act_quant_kernel``, the RMSNorm and SiLU-and-mul kernels)."""
    NGB: tl.constexpr = BLOCK_H // 128
    y3 = tl.reshape(y, (BLOCK_M, NGB, 128))
    amax = tl.max(tl.abs(y3), axis=2)
    nans = tl.sum((y3 != y3).to(tl.int32), axis=2)
    s = tl.maximum(amax / 127.0, _INT8_MIN_SCALE)
    v = y3 / s[:, :, None]
    # round half to even (|v| <= 127): fp32 addition of 1.5 * 2**23 rounds v to an integer, as torch.round does
    q = tl.minimum(tl.maximum((v + 12582912.0) - 12582912.0, -127.0), 127.0)
    q = tl.where(v != v, 0.0, q).to(tl.int32)  # NaN (or inf / inf): 0, the group's scale says NaN
    g = g0 + tl.arange(0, NGB)
    c = tl.arange(0, 128)
    # column 32 p + j of a group -> byte 4 j + b with p = P[b], P = (0, 2, 1, 3) (the dp4a partner of the weight's
    # nibbles): with p = 2 hi + lo that is b = 2 lo + hi, so the group's [hi, lo, j] values are transposed to
    # [j, lo, hi] in registers and stored contiguously. Storing the natural order at scattered byte addresses cost
    # 4.4 us of the 8B int8 RMSNorm's 6.8 us on the H100 (benchmarks/NOTES.md, session 24).
    qb = tl.reshape(tl.permute(tl.reshape(q, (BLOCK_M, NGB, 2, 2, 32)), (0, 1, 4, 3, 2)), (BLOCK_M, NGB, 128))
    gmask = row_mask[:, None] & (g < NG)[None, :]
    qaddr = rows64[:, None, None] * stride_q + g[None, :, None] * 128 + c[None, None, :]
    tl.store(q_ptr + qaddr, qb.to(tl.int8), mask=gmask[:, :, None])
    saddr = rows64[:, None] * stride_s + g[None, :]
    tl.store(s_ptr + saddr, tl.where(nans > 0, float("nan"), s), mask=gmask)
    tl.store(sum_ptr + saddr, tl.sum(q, axis=2), mask=gmask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, sum_ptr, K, NG, stride_xm, stride_qm, stride_sm,
                      GPP: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (rows, cdiv(NG, GPP)): GPP groups of 128 columns of one row a program (``_store_act_int8``)."""
    if USE_PDL:  # programmatic dependent launch: kernels.pdl
        pdl_wait()
    row = tl.program_id(0).to(tl.int64) + tl.zeros((1,), dtype=tl.int64)
    g0 = tl.program_id(1) * GPP
    cols = g0 * 128 + tl.arange(0, GPP * 128)
    x = tl.load(x_ptr + row[:, None] * stride_xm + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    _store_act_int8(x.to(tl.float32), row, row >= 0, g0, q_ptr, s_ptr, sum_ptr, stride_qm, stride_sm, NG,
                    1, GPP * 128)


@triton.jit
def _split(w, ASM: tl.constexpr):
    """The nibbles of int32 words ``w`` as the bytes of (A, B): A holds shifts (0, 2, 1, 3), B (4, 6, 5, 7)."""
    if ASM:
        a, b = tl.inline_asm_elementwise(_SPLIT_ASM, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True,
                                         pack=1)
    else:
        t0 = w & 0x0F0F0F0F
        t1 = (w >> 4) & 0x0F0F0F0F
        a = (t0 & 0xFFFF) | ((t1 & 0xFFFF) << 16)
        b = ((t0 >> 16) & 0xFFFF) | (((t1 >> 16) & 0xFFFF) << 16)
    return a, b


@triton.jit
def _dp4a(a, x, ASM: tl.constexpr):
    """sum over the 4 bytes of ``a`` (unsigned) times those of ``x`` (signed), in int32: one ``dp4a`` each."""
    if ASM:
        return tl.inline_asm_elementwise(_DP4A_ASM, "=r,r,r", [a, x], dtype=tl.int32, is_pure=True, pack=1)
    d = ((a & 0xFF) * ((x << 24) >> 24)) + (((a >> 8) & 0xFF) * ((x << 16) >> 24))
    return d + (((a >> 16) & 0xFF) * ((x << 8) >> 24)) + (((a >> 24) & 0xFF) * (x >> 24))


@triton.jit
def _token(acc, zt, a, b, s_a, s_b, c_a, c_b, xw_ptr, xs_ptr, xsum_ptr, row, M, tile, offs_w, stride_xw,
           stride_xs, ASM: tl.constexpr):
    """One token row, one layout tile: ``acc += dp4a sums * s_w * s_x`` per word ([BLOCK_N, 32] fp32) and the
    zero-point term of the tile's two groups into ``zt`` ([BLOCK_N, 1])."""
    row = tl.minimum(row, M - 1)  # rows past M wrap onto a valid one (loads unmasked); their results are never stored
    xrow = xw_ptr + row.to(tl.int64) * stride_xw + tile * 64
    xa = tl.load(xrow + offs_w)  # [32]: the A partners of the tile's words, then the B partners
    xb = tl.load(xrow + 32 + offs_w)
    srow = row.to(tl.int64) * stride_xs + 2 * tile
    xs_a = tl.load(xs_ptr + srow)
    xs_b = tl.load(xs_ptr + srow + 1)
    qs_a = tl.load(xsum_ptr + srow).to(tl.float32)
    qs_b = tl.load(xsum_ptr + srow + 1).to(tl.float32)
    # two FFMAs a word (acc + d * s, twice); the products of the scales once a row
    BN: tl.constexpr = a.shape[0]
    da = tl.sum(tl.reshape(_dp4a(a, xa[None, :], ASM), (BN, 8, 4)), axis=2)
    db = tl.sum(tl.reshape(_dp4a(b, xb[None, :], ASM), (BN, 8, 4)), axis=2)
    acc += da.to(tl.float32) * (s_a * xs_a)
    acc += db.to(tl.float32) * (s_b * xs_b)
    zt += c_a * (xs_a * qs_a) + c_b * (xs_b * qs_b)
    return acc, zt


@triton.jit
def _params(s_rows, z_rows, G, tile, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr):
    """Weight scales and zero-point coefficients [BLOCK_N, 1] of the A (first 128 columns) and B halves of a
    tile (``s_rows`` / ``z_rows``: the rows' first scale / zero): out = sum acc - sum_halves c * s_x * qsum, with
    c = scale * zero ("sym": 8) or -min."""
    ga = tl.minimum((tile * 256) // GROUP, G - 1)  # padding halves past K may point past the last group (x is 0)
    gb = tl.minimum((tile * 256 + 128) // GROUP, G - 1)
    ws_a = tl.load(s_rows + ga).to(tl.float32)
    ws_b = tl.load(s_rows + gb).to(tl.float32)
    if ZERO_MODE == 0:
        c_a = ws_a * 8.0
        c_b = ws_b * 8.0
    elif ZERO_MODE == 1:
        c_a = ws_a * tl.load(z_rows + ga).to(tl.float32)
        c_b = ws_b * tl.load(z_rows + gb).to(tl.float32)
    else:
        c_a = -tl.load(z_rows + ga).to(tl.float32)
        c_b = -tl.load(z_rows + gb).to(tl.float32)
    return ws_a, ws_b, c_a, c_b


@triton.jit
def _step(acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3, w, st, s_rows, z_rows, G, xw_ptr, xs_ptr, xsum_ptr, r0, M,
          offs_w, stride_xw, stride_xs, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, ASM: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """One K step (layout tile ``st``, its words ``w``) for the program's BLOCK_M token rows."""
    a, b = _split(w, ASM)
    s_a, s_b, c_a, c_b = _params(s_rows, z_rows, G, st, GROUP, ZERO_MODE)
    acc0, zt0 = _token(acc0, zt0, a, b, s_a, s_b, c_a, c_b, xw_ptr, xs_ptr, xsum_ptr, r0, M, st, offs_w,
                       stride_xw, stride_xs, ASM)
    if BLOCK_M > 1:
        acc1, zt1 = _token(acc1, zt1, a, b, s_a, s_b, c_a, c_b, xw_ptr, xs_ptr, xsum_ptr, r0 + 1, M, st,
                           offs_w, stride_xw, stride_xs, ASM)
    if BLOCK_M > 2:
        acc2, zt2 = _token(acc2, zt2, a, b, s_a, s_b, c_a, c_b, xw_ptr, xs_ptr, xsum_ptr, r0 + 2, M, st,
                           offs_w, stride_xw, stride_xs, ASM)
        acc3, zt3 = _token(acc3, zt3, a, b, s_a, s_b, c_a, c_b, xw_ptr, xs_ptr, xsum_ptr, r0 + 3, M, st,
                           offs_w, stride_xw, stride_xs, ASM)
    return acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3


# M and the split count change per call: not specialising them keeps one compiled kernel per config
@triton.jit(do_not_specialize=["M", "split_k", "stride_part"])
def _int4_a8_kernel(
    xw_ptr, xs_ptr, xsum_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, G, KW, stride_xw, stride_xs, stride_om, stride_part, split_k,
    GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
    USE_PDL: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, L2_SLAB: tl.constexpr, PF_LANES: tl.constexpr,
    PREFETCH: tl.constexpr = 1,
):
    """Grid (m tiles, split_k, n tiles). A loop step is one layout tile of BLOCK_N rows (``[BLOCK_N, 32]`` words,
    16-byte loads; register double buffer: the next step's words are in flight during this step's maths); splits
    take whole steps. BLOCK_M <= 4 token rows, each with its own ``[BLOCK_N, 8]`` fp32 accumulator: a thread's
    four words of a row (one 16-byte load) are summed in int32 first (``dp4a`` results, exact), then converted and
    scaled once (no cross-thread reduction in the loop; sm_90 SASS of the M = 1, BLOCK_N = 64 loop: ~15
    instructions a word, 8 values).

    Weights are read before the PDL wait (no kernel of the step writes them: ``kernels.pdl``); the activation,
    its scales and sums after it. xw_ptr: the int32 view of the quantised activation ((M, Kp // 4), row stride
    stride_xw); xs / xsum: (M, NG) fp32 / int32, row stride stride_xs. ACCUMULATE: out += the result. L2_SLAB (with
    USE_PDL; bytes, 0: off; PF_LANES: the program's threads): up to that much of the rest of the program's weight
    words into L2 before the wait (``kernels.prefetch.l2_prefetch_rows``). PREFETCH 2: two register buffers and the
    loop unrolled by two, so the words of the next two steps are in flight (the int4 PACKED kind's PREFETCH 2 won
    every M = 1 shape on the H200, benchmarks/NOTES.md session 40); the last steps load the split's last words
    again, as with 1."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    num_m = tl.num_programs(0)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)  # rows past N wrap onto valid ones (loads unmasked); never stored
    m_valid = offs_m < M

    n_steps = KW // 32
    per = tl.cdiv(n_steps, split_k)
    st0 = pid_k * per
    st1 = tl.minimum(st0 + per, n_steps)

    offs_w = tl.arange(0, 32)
    w_ptrs = qw_ptr + rn[:, None] * KW + offs_w[None, :]
    w_next = tl.load(w_ptrs + st0 * 32)  # every split has >= 1 step
    if L2_SLAB:
        l2_prefetch_rows(qw_ptr.to(tl.pointer_type(tl.uint8)), pid_n * BLOCK_N, N, KW * 4, (st0 + 1) * 32 * 4,
                         st1 * 32 * 4, BLOCK_N, PF_LANES, L2_SLAB)
    if USE_PDL:
        pdl_wait()
    r0 = pid_m * BLOCK_M
    acc0 = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
    zt0 = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    zt1 = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    zt2 = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    zt3 = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    s_rows = s_ptr + rn[:, None] * G
    z_rows = z_ptr + rn[:, None] * G
    if PREFETCH == 2:  # two buffers, the loop unrolled by two: no register copies (a rotated triple buffer cost 44
        # moves a step at BLOCK_N 64, benchmarks/NOTES.md session 41); each buffer takes its next words (two steps
        # on) right after its step, so two steps' words are in flight
        w_b = tl.load(w_ptrs + tl.minimum(st0 + 1, st1 - 1) * 32)
        for st in range(st0, st1 - 1, 2):
            w = w_next
            w_next = tl.load(w_ptrs + tl.minimum(st + 2, st1 - 1) * 32)
            acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3 = _step(
                acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3, w, st, s_rows, z_rows, G, xw_ptr, xs_ptr, xsum_ptr, r0,
                M, offs_w, stride_xw, stride_xs, GROUP, ZERO_MODE, ASM, BLOCK_M)
            w = w_b
            w_b = tl.load(w_ptrs + tl.minimum(st + 3, st1 - 1) * 32)
            acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3 = _step(
                acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3, w, st + 1, s_rows, z_rows, G, xw_ptr, xs_ptr, xsum_ptr,
                r0, M, offs_w, stride_xw, stride_xs, GROUP, ZERO_MODE, ASM, BLOCK_M)
        if (st1 - st0) % 2 == 1:  # an odd split: its last step is in the first buffer
            acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3 = _step(
                acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3, w_next, st1 - 1, s_rows, z_rows, G, xw_ptr, xs_ptr,
                xsum_ptr, r0, M, offs_w, stride_xw, stride_xs, GROUP, ZERO_MODE, ASM, BLOCK_M)
    else:
        for st in range(st0, st1):
            w = w_next
            # the last step loads its own words again (L1 / L2 hits): no mask, no zeroed registers in the loop
            w_next = tl.load(w_ptrs + tl.minimum(st + 1, st1 - 1) * 32)
            acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3 = _step(
                acc0, acc1, acc2, acc3, zt0, zt1, zt2, zt3, w, st, s_rows, z_rows, G, xw_ptr, xs_ptr, xsum_ptr, r0,
                M, offs_w, stride_xw, stride_xs, GROUP, ZERO_MODE, ASM, BLOCK_M)
    y = _fma_rows(acc0 - zt0 / 8.0, acc1 - zt1 / 8.0, acc2 - zt2 / 8.0, acc3 - zt3 / 8.0, BLOCK_M)
    if not SPLIT:
        _epilogue(y, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, bias_ptr, bias_ptr, HAS_BIAS, 0, 0,
                  ACCUMULATE)
    else:
        _split_k_partial(y, part_ptr, stride_part, pid_k, lock_ptr + pid_n * num_m + pid_m, split_k,
                         offs_m, offs_n, m_valid, M, N, out_ptr, stride_om, bias_ptr, bias_ptr, bias_ptr,
                         HAS_BIAS, 0, 0, BLOCK_M, BLOCK_N, ACCUMULATE)


def launch_act_quant(x, q, scales, sums, pdl: bool = False, groups_per_program: int = 4):
    """x (M, K) 16-bit (or fp32), unit stride in K; q int8 (M, Kp); scales fp32 / sums int32 (M, Kp // 128)."""
    M, K = x.shape
    NG = scales.shape[1]
    gpp = groups_per_program
    _act_quant_kernel[(M, cdiv(NG, gpp))](
        x, q, scales, sums, K, NG, x.stride(0), q.stride(0), scales.stride(0),
        GPP=gpp, USE_PDL=pdl, num_warps=4, **launch_kwargs(pdl),
    )


def split_k_of(KW: int, config: dict) -> int:
    """The effective SPLIT_K of ``config`` for KW words a row (a step is one 256-column tile, 32 words): never
    more splits than steps, no empty split."""
    n_steps = KW // 32
    split = max(1, min(int(config.get("SPLIT_K", 1)), n_steps))
    return cdiv(n_steps, cdiv(n_steps, split))


def launch_int4_a8(q, scales_x, sums_x, qweight, scales, zm, group_size: int, zero_mode: str, bias, out, part,
                   locks, config: dict, asm: bool, pdl: bool = False, accumulate: bool = False,
                   warmup: bool = False, l2_slab: int = 0):
    """Launch on 2-D views: q int8 (M, Kp) contiguous rows (``launch_act_quant``'s), scales_x / sums_x (M, Kp // 128),
    qweight (N, Kp // 8) int32, scales / zm (N, G) contiguous (zm: zeros uint8, mins, or None), out (M, N).
    ``part`` (fp32, SPLIT_K * M * N) and ``locks`` (zeroed int32, one per output tile) only when the effective
    SPLIT_K > 1 (``split_k_of``). ``config``: dict(BLOCK_M (<= 4), BLOCK_N, SPLIT_K, num_warps; optional PREFETCH 1
    or 2, default 1). ``asm``: the inline PTX (compiled CUDA only; else the portable integer maths). ``warmup``:
    compile only. ``l2_slab`` (with ``pdl``, sm_90+; bytes, 0: off): each program prefetches up to that much of its
    weight words into L2 before its PDL wait."""
    check_params(scales, zm, "the W4A8 kernel")
    prefetch = int(config.get("PREFETCH", 1))
    if prefetch not in (1, 2):
        raise ValueError(f"the W4A8 kernel's PREFETCH is 1 (double buffer) or 2 (triple), got {prefetch}")
    M = q.shape[0]
    N, KW = qweight.shape
    split = split_k_of(KW, config)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    grid = (cdiv(M, bm), split, cdiv(N, bn))
    xw = q.view(torch.int32)
    kernel = _int4_a8_kernel.warmup if warmup else _int4_a8_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    kernel(
        xw, scales_x, sums_x, qweight, scales, zm if zm is not None else scales, bias if bias is not None else out,
        out, part if split > 1 else out, locks if split > 1 else out,
        M, N, scales.shape[1], KW, xw.stride(0), scales_x.stride(0), out.stride(0), M * N, split,
        GROUP=group_size, ZERO_MODE=ZERO_MODES[zero_mode], HAS_BIAS=bias is not None, ASM=asm, USE_PDL=pdl,
        ACCUMULATE=bool(accumulate), BLOCK_M=bm, BLOCK_N=bn, SPLIT=split > 1,
        L2_SLAB=slab_bytes(l2_slab, pdl, qweight), PF_LANES=32 * config.get("num_warps", 4), PREFETCH=prefetch,
        num_warps=config.get("num_warps", 4), num_stages=1, **launch_kwargs(pdl), **extra,
    )
