"""PACKED: the int4 FMA kind's K step in packed 16-bit arithmetic (``kernels.int4``; opt-in config key, fma kind).

Why: at one token the FMA kind is bound by instruction issue. Its sm_90 loop (BLOCK_N 64, 4 warps, g128) issues
5.2 SASS instructions a weight value in zero mode and 4.3 in sym mode (``benchmarks/sass_int4_loop.py --count``):
nibble -> fp32, ``q - zero`` and one FFMA per token row, each on one value. Streaming int4 at the copy rate leaves
about one instruction a value (``kernels.int4_a8``'s docstring).

How: in the layout of ``fastdecode.quant.int4`` a word holds shift p's column in bits 4p..4p+3, so shifts p and
p + 4 sit at the same place of the word's two 16-bit halves. ``((w >> 4p) & 0x000F000F) | MAGIC`` puts both nibbles
into the mantissas of a packed pair, ``MAGIC + q`` (bf16x2: 0x4300 = 128; f16x2: 0x6400 = 1024), one shift and one
LOP3 for two values; one packed FMA with ``-(MAGIC + zero)`` gives the exact integers ``q - zero`` (``q`` for
"min"); four packed FMAs with x's pairs ``(x[32p + j], x[32(p + 4) + j])`` sum the word's eight products into two
16-bit partial sums, one per half of the 256-column layout tile. With GROUP a multiple of 128 each half lies in one
group, so each partial sum becomes fp32 and takes its group's scale (and, for "min", ``min * sum(x)``). Per word and
token row: 3 SHF, 4 LOP3, 4 + 4 HFMA2, 2 conversions, 2 FFMA: about 2.4 instructions a value.

Rounding (the cost): each product and each of the four-term partial sums is rounded to x's dtype, where the FMA
kind's fp32 products are exact; the groups' sums and the rest stay fp32. That is the accuracy of a 16-bit dot of four
terms inside an fp32 sum, about one rounding of x's dtype on each product; the tests bound it against the fp32
reference. f16x2 with a bf16 model is not offered (x's range would not fit fp16).

Loads: with K a multiple of 256 the program's first token row loads x unmasked (it always exists), and with groups
of 128 columns on aligned rows (``packed_mode`` 2) a row's two groups of a step come in one load of scales (32-bit)
and one of zeros (16-bit) or mins (32-bit). sm_90 SASS (``benchmarks/sass_int4_loop.py --count``, 64 rows on 4
warps, triton 3.9): 3.27 -> 3.16 instructions a value, 28 -> 20 loads a step.

GPU: inline PTX (``fma.rn.bf16x2``: sm_80+). The interpreter runs ``_pair_diffs`` / ``_pair_dot`` in fp32 with the
same roundings (each product and partial sum rounded to x's dtype; a sum may round twice where the hardware rounds
once: the same values up to that).
"""

import torch
import triton
import triton.language as tl

from fastdecode.kernels.gemm import _load_x
from fastdecode.kernels.int4_dequant import slices_per_group
from fastdecode.kernels.prefetch import next_words


def _i32(u: int) -> int:
    """A 32-bit pattern as the signed int32 Triton takes for it."""
    return u - (1 << 32) if u >= 1 << 31 else u


# -(MAGIC) in both halves: bf16 0xC300 = -128, f16 0xE400 = -1024; OR-ing a zero point 0..15 into each half's
# mantissa gives -(MAGIC + zero) exactly
_NEG_MAGIC_BF16: tl.constexpr = tl.constexpr(_i32(0xC300C300))
_NEG_MAGIC_F16: tl.constexpr = tl.constexpr(_i32(0xE400E400))
_HI16: tl.constexpr = tl.constexpr(_i32(0xFFFF0000))

_DIFFS_BF16: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, one;\n"
    "mov.b32 one, 0x3F803F80;\n"
    "lop3.b32 t, $4, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 $0, t, one, $5;\n"
    "shr.u32 t, $4, 4;\n"
    "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 $1, t, one, $5;\n"
    "shr.u32 t, $4, 8;\n"
    "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 $2, t, one, $5;\n"
    "shr.u32 t, $4, 12;\n"
    "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 $3, t, one, $5;\n}"
)
_DIFFS_F16: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, one;\n"
    "mov.b32 one, 0x3C003C00;\n"
    "lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;\n"
    "fma.rn.f16x2 $0, t, one, $5;\n"
    "shr.u32 t, $4, 4;\n"
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "fma.rn.f16x2 $1, t, one, $5;\n"
    "shr.u32 t, $4, 8;\n"
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "fma.rn.f16x2 $2, t, one, $5;\n"
    "shr.u32 t, $4, 12;\n"
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "fma.rn.f16x2 $3, t, one, $5;\n}"
)
def _pair_fmas(fma: str, a: str, b: str, d: int) -> list[str]:
    """The packed FMAs of two words a block (pack 2: ``$d..$d+7`` the two words' d0..d3, then x's shifts 0-3 and
    4-7, each register the two words' columns j, j + 1): PRMT makes each word's pairs (x[32p + j], x[32(p + 4) + j]);
    the products summed into ``a`` (the first word) and ``b`` (the second) in the pairs' precision."""
    out = []
    for p in range(4):
        out += [f"prmt.b32 xp, ${d + 8 + p}, ${d + 12 + p}, 0x5410;", f"{fma} {a}, ${d + 2 * p}, xp, {a};",
                f"prmt.b32 xp, ${d + 8 + p}, ${d + 12 + p}, 0x7632;", f"{fma} {b}, ${d + 1 + 2 * p}, xp, {b};"]
    return out


def _dot_asm(fma: str, lo: str, hi: str) -> str:
    """``_pair_fmas`` from $4 (the first FMA adds -0: the product rounded once), then the halves as fp32 ($0, $1: the
    low halves of the two words; $2, $3: the high)."""
    body = ["{", ".reg .b32 a, b, xp;", ".reg .b16 l, h;", "mov.b32 a, 0x80008000;", "mov.b32 b, 0x80008000;"]
    body += _pair_fmas(fma, "a", "b", 4)
    body += [lo.format(out="$0", acc="a"), hi.format(out="$2", acc="a"), lo.format(out="$1", acc="b"),
             hi.format(out="$3", acc="b"), "}"]
    return "\n".join(body)


def _dotp_asm(fma: str) -> str:
    """SUM16: ``_pair_fmas`` from $2 into the outputs: the two words' packed sums themselves ($0, $1), left in the
    pairs' precision for ``_sum16`` to add a thread's four words before one fp32 fold."""
    body = ["{", ".reg .b32 xp;", "mov.b32 $0, 0x80008000;", "mov.b32 $1, 0x80008000;"]
    return "\n".join(body + _pair_fmas(fma, "$0", "$1", 2) + ["}"])


# bf16 is the top half of an fp32; f16 converts
_DOT_BF16: tl.constexpr = tl.constexpr(_dot_asm("fma.rn.bf16x2", "shl.b32 {out}, {acc}, 16;",
                                                "and.b32 {out}, {acc}, 0xFFFF0000;"))
_DOT_F16: tl.constexpr = tl.constexpr(_dot_asm("fma.rn.f16x2", "mov.b32 {{l, h}}, {acc};\ncvt.f32.f16 {out}, l;",
                                               "mov.b32 {{l, h}}, {acc};\ncvt.f32.f16 {out}, h;"))
_DOTP_BF16: tl.constexpr = tl.constexpr(_dotp_asm("fma.rn.bf16x2"))
_DOTP_F16: tl.constexpr = tl.constexpr(_dotp_asm("fma.rn.f16x2"))


@triton.jit
def _neg_zeros(z_lo, z_hi, ZERO_MODE: tl.constexpr, F16: tl.constexpr):
    """``-(MAGIC + zero)`` of the two halves' groups as one packed word ``[BLOCK_N, 1]`` (the zeros are the fp32
    integers 0..15 of ``_half_params``, 8 for sym; min: 0, the min is added apart)."""
    if F16:
        neg = _NEG_MAGIC_F16
    else:
        neg = _NEG_MAGIC_BF16
    if ZERO_MODE == 0:  # a constant: not derived from z_lo (s * 0 + 8 at run time)
        return neg | 8 | (8 << 16) | (z_lo * 0.0).to(tl.int32)
    elif ZERO_MODE == 1:
        return neg | z_lo.to(tl.int32) | (z_hi.to(tl.int32) << 16)
    else:
        return neg | (z_lo * 0.0).to(tl.int32)


@triton.jit
def _pair_diffs_asm(qw, nzz, F16: tl.constexpr):
    """The packed ``q - zero`` of shifts (p, p + 4), p = 0..3, of the words ``qw`` (four int32 tensors)."""
    if F16:
        asm: tl.constexpr = _DIFFS_F16
    else:
        asm: tl.constexpr = _DIFFS_BF16
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [qw, nzz], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _pair_dot_asm(d0, d1, d2, d3, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3, F16: tl.constexpr):
    """``sum_p d_p * (x_p, x_p+4)`` of the packed pairs ``d_p``, in the pairs' precision: (low halves, high halves) as
    fp32; ``xl_p`` / ``xh_p``: x (16-bit) at shift p's and p + 4's columns."""
    if F16:
        asm: tl.constexpr = _DOT_F16
    else:
        asm: tl.constexpr = _DOT_BF16
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r" + ",r" * 16, [d0, d1, d2, d3, xl0, xl1, xl2, xl3,
                                                                   xh0, xh1, xh2, xh3],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=2)


@triton.jit
def _pair_dotp_asm(d0, d1, d2, d3, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3, F16: tl.constexpr):
    """SUM16: ``_pair_dot_asm``'s sums as packed pairs (int32: low half the shifts 0-3, high half 4-7)."""
    if F16:
        asm: tl.constexpr = _DOTP_F16
    else:
        asm: tl.constexpr = _DOTP_BF16
    return tl.inline_asm_elementwise(asm, "=r,=r" + ",r" * 16, [d0, d1, d2, d3, xl0, xl1, xl2, xl3, xh0, xh1, xh2,
                                                                 xh3], dtype=tl.int32, is_pure=True, pack=2)


@triton.jit
def _add_bf16x2(a, b):
    return tl.inline_asm_elementwise("add.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _add_f16x2(a, b):
    return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _add_bf16_ref(a, b):
    return (a + b).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _add_f16_ref(a, b):
    return (a + b).to(tl.float16).to(tl.float32)


@triton.jit
def _sum16(v, F16: tl.constexpr, REF: tl.constexpr):
    """SUM16: ``v [BLOCK_N, BK8]`` summed over each run of four words (one row, one group's 32-column slice in each
    half) -> ``[BLOCK_N, BK8 // 4]``: packed pairs (int32) added by ``add.rn`` in their precision, or (REF, the
    interpreter) fp32 values rounded to it after each add. In the words' register layout (four words a thread, one
    16-byte load) the sum stays in the thread (``tl.reduce``: correct whatever the layout)."""
    v = tl.reshape(v, (v.shape[0], v.shape[1] // 4, 4))
    if REF and F16:
        return tl.reduce(v, 2, _add_f16_ref)
    elif REF:
        return tl.reduce(v, 2, _add_bf16_ref)
    elif F16:
        return tl.reduce(v, 2, _add_f16x2)
    else:
        return tl.reduce(v, 2, _add_bf16x2)


@triton.jit
def _diff_ref(qw, p: tl.constexpr, z, ZERO_MODE: tl.constexpr):
    """Interpreter: shift p's ``q - zero`` (``q`` for "min") as exact fp32."""
    q = ((qw >> (4 * p)) & 0xF).to(tl.float32)
    if ZERO_MODE == 2:
        return q
    return q - z


@triton.jit
def _dot_ref(qw, z_lo, z_hi, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3, ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr):
    """Interpreter: the partial sums of ``_pair_dot_asm`` (rounded to W_DTYPE after each product and sum)."""
    lo = (_diff_ref(qw, 0, z_lo, ZERO_MODE) * xl0.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    hi = (_diff_ref(qw, 4, z_hi, ZERO_MODE) * xh0.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    lo = (lo + _diff_ref(qw, 1, z_lo, ZERO_MODE) * xl1.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    hi = (hi + _diff_ref(qw, 5, z_hi, ZERO_MODE) * xh1.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    lo = (lo + _diff_ref(qw, 2, z_lo, ZERO_MODE) * xl2.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    hi = (hi + _diff_ref(qw, 6, z_hi, ZERO_MODE) * xh2.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    lo = (lo + _diff_ref(qw, 3, z_lo, ZERO_MODE) * xl3.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    hi = (hi + _diff_ref(qw, 7, z_hi, ZERO_MODE) * xh3.to(tl.float32)[None, :]).to(W_DTYPE).to(tl.float32)
    return lo, hi


@triton.jit
def _x_shift(x_row, kc, OFF: tl.constexpr, col0, row_ok, K, nw_ptr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
             X_GLU: tl.constexpr, NORM_AFFINE: tl.constexpr, W_DTYPE: tl.constexpr):
    """One token row's x at the columns ``kc + OFF`` (those that exist, of a row that exists; EVEN_K: every column,
    a mask constant along K; ``row_ok`` None, with EVEN_K only: the program's first row, which always exists, no
    mask) in W_DTYPE (SiLU-and-mul inside with X_GLU; times the norm weight with NORM_AFFINE), and h itself as fp32
    (for the rows' squares of the norm in the loop)."""
    if row_ok is None:  # no predicate, no zero fill of the registers (CS2R) a step
        mask = None
    elif EVEN_K:
        mask = (col0 < BLOCK_K) & row_ok
    else:
        mask = (kc + OFF < K) & row_ok
    h = _load_x(x_row + kc + OFF, mask, K, X_GLU)
    x = h
    if NORM_AFFINE:  # the norm weight's columns, masked as x's
        x = (h.to(tl.float32) * _load_x(nw_ptr + kc + OFF, mask, K, False).to(tl.float32)).to(W_DTYPE)
    return x, h.to(tl.float32)


@triton.jit
def _row_step(acc, ss, qw, d0, d1, d2, d3, z_lo, z_hi, s_lo, s_hi, x_row, row_ok, k0, col0, K, nw_ptr,
              ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, X_GLU: tl.constexpr, NORM_AFFINE: tl.constexpr,
              NORM_IN_LOOP: tl.constexpr, SUM16: tl.constexpr):
    """One token row of a K step: ``acc += s_lo * sum_lo + s_hi * sum_hi`` (+ the mins' terms); ``ss``: h's squares
    (NORM_IN_LOOP); ``row_ok``: whether the row exists (None: it does, and every column, ``_x_shift``). SUM16 (not
    "min"): each word's packed sums stay 16-bit pairs and a thread's four words are added in them before the fp32
    fold (``acc`` is ``[BLOCK_N, BK8 // 4]``): a 16-product partial sum, one fold pair per four words."""
    kc = k0 + col0
    xl0, hl0 = _x_shift(x_row, kc, 0, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xl1, hl1 = _x_shift(x_row, kc, 32, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xl2, hl2 = _x_shift(x_row, kc, 64, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xl3, hl3 = _x_shift(x_row, kc, 96, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xh0, hh0 = _x_shift(x_row, kc, 128, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xh1, hh1 = _x_shift(x_row, kc, 160, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xh2, hh2 = _x_shift(x_row, kc, 192, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    xh3, hh3 = _x_shift(x_row, kc, 224, col0, row_ok, K, nw_ptr, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, W_DTYPE)
    if NORM_IN_LOOP:
        ss += hl0 * hl0 + hl1 * hl1 + hl2 * hl2 + hl3 * hl3 + hh0 * hh0 + hh1 * hh1 + hh2 * hh2 + hh3 * hh3
    if SUM16 and ASM:
        lo, hi = _pair(_sum16(_pair_dotp_asm(d0, d1, d2, d3, xl0[None, :], xl1[None, :], xl2[None, :], xl3[None, :],
                                             xh0[None, :], xh1[None, :], xh2[None, :], xh3[None, :], F16), F16, False),
                       W_DTYPE)
    elif ASM:
        lo, hi = _pair_dot_asm(d0, d1, d2, d3, xl0[None, :], xl1[None, :], xl2[None, :], xl3[None, :], xh0[None, :],
                               xh1[None, :], xh2[None, :], xh3[None, :], F16)
    else:
        lo, hi = _dot_ref(qw, z_lo, z_hi, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3, ZERO_MODE, W_DTYPE)
        if SUM16:
            lo = _sum16(lo, F16, True)
            hi = _sum16(hi, F16, True)
    acc += lo * s_lo  # two FFMAs
    acc += hi * s_hi
    if ZERO_MODE == 2:  # q * scale + min: the mins times the halves' sums of x (not with SUM16)
        xs_lo = xl0.to(tl.float32) + xl1.to(tl.float32) + xl2.to(tl.float32) + xl3.to(tl.float32)
        xs_hi = xh0.to(tl.float32) + xh1.to(tl.float32) + xh2.to(tl.float32) + xh3.to(tl.float32)
        acc += xs_lo[None, :] * z_lo + xs_hi[None, :] * z_hi
    return acc, ss


@triton.jit
def _pair(w, DT: tl.constexpr):
    """The two 16-bit values of DT in a 32-bit word (low half, high half) as fp32 (bf16: the halves' bits in place)."""
    if DT == tl.bfloat16:
        return (w << 16).to(tl.float32, bitcast=True), (w & _HI16).to(tl.float32, bitcast=True)
    else:
        lo = w.to(tl.int16).to(DT, bitcast=True).to(tl.float32)
        return lo, (w >> 16).to(tl.int16).to(DT, bitcast=True).to(tl.float32)


@triton.jit
def _half_params(s_ptr, z_ptr, rn, G, k0, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, EVEN_K: tl.constexpr,
                 PAIRS: tl.constexpr):
    """fp32 scales and zeros / mins ``[BLOCK_N, 1]`` of the two halves of the layout tile at column ``k0``: the
    rows' pointers (loop invariant) plus one scalar group index, the second half's at +1 (group 128); clamped only
    without EVEN_K (a padded last tile: its high half may lie past the last group; its x is 0).
    PAIRS (group 128, EVEN_K, an even G, the rows of 16-bit scales / mins 4-byte and of uint8 zeros 2-byte aligned:
    ``packed_mode`` checks it at launch): the two groups of a row are adjacent, one load each (32-bit scales and
    mins, 16-bit zeros) instead of two."""
    s_row = s_ptr + rn[:, None] * G
    z_row = z_ptr + rn[:, None] * G
    if PAIRS:
        pair = k0 // (2 * GROUP)
        s_lo, s_hi = _pair(tl.load(s_row.to(tl.pointer_type(tl.int32)) + pair), s_ptr.dtype.element_ty)
    else:
        gi = k0 // GROUP
        if GROUP < 256:
            gj = gi + 1
        else:
            gj = gi
        if not EVEN_K:
            gi = tl.minimum(gi, G - 1)
            gj = tl.minimum(gj, G - 1)
        s_lo = tl.load(s_row + gi).to(tl.float32)
        s_hi = tl.load(s_row + gj).to(tl.float32)
    if ZERO_MODE == 0:
        z_lo = s_lo * 0.0 + 8.0
        z_hi = z_lo
    elif not PAIRS:
        z_lo = tl.load(z_row + gi).to(tl.float32)
        z_hi = tl.load(z_row + gj).to(tl.float32)
    elif ZERO_MODE == 1:  # uint8 zeros
        zp = tl.load(z_row.to(tl.pointer_type(tl.uint16)) + pair).to(tl.int32)
        z_lo = (zp & 0xFF).to(tl.float32)
        z_hi = (zp >> 8).to(tl.float32)
    else:
        z_lo, z_hi = _pair(tl.load(z_row.to(tl.pointer_type(tl.int32)) + pair), z_ptr.dtype.element_ty)
    return s_lo, z_lo, s_hi, z_hi


@triton.jit
def packed_step(acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw, x0_ptr, stride_xm, r0, M, k0, col0, K,
                s_ptr, z_ptr, rn, G, nw_ptr, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr,
                ASM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                X_GLU: tl.constexpr, NORM_AFFINE: tl.constexpr, NORM_IN_LOOP: tl.constexpr, PACKED: tl.constexpr,
                SUM16: tl.constexpr):
    """One K step (one 256-column layout tile, ``qw [BLOCK_N, 32]``) of the FMA kind for up to 4 token rows, the
    words' conversion shared by the rows. Returns the updated accumulators and squares."""
    tl.static_assert(BLOCK_K == 256, "PACKED: one 256-column layout tile a K step")
    F16: tl.constexpr = W_DTYPE == tl.float16
    s_lo, z_lo, s_hi, z_hi = _half_params(s_ptr, z_ptr, rn, G, k0, GROUP, ZERO_MODE, EVEN_K, PACKED == 2)
    if ASM:
        d0, d1, d2, d3 = _pair_diffs_asm(qw, _neg_zeros(z_lo, z_hi, ZERO_MODE, F16), F16)
    else:  # unused by the interpreter's _dot_ref
        d0 = qw
        d1 = qw
        d2 = qw
        d3 = qw
    if EVEN_K:  # the program's first row exists (r0 < M): no masks on it
        ok0 = None
    else:
        ok0 = r0 < M
    acc0, ss0 = _row_step(acc0, ss0, qw, d0, d1, d2, d3, z_lo, z_hi, s_lo, s_hi, x0_ptr, ok0, k0, col0, K, nw_ptr,
                          ZERO_MODE, W_DTYPE, F16, ASM, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE, NORM_IN_LOOP, SUM16)
    if BLOCK_M > 1:
        acc1, ss1 = _row_step(acc1, ss1, qw, d0, d1, d2, d3, z_lo, z_hi, s_lo, s_hi, x0_ptr + stride_xm, r0 + 1 < M,
                              k0, col0, K, nw_ptr, ZERO_MODE, W_DTYPE, F16, ASM, EVEN_K, BLOCK_K, X_GLU, NORM_AFFINE,
                              NORM_IN_LOOP, SUM16)
    if BLOCK_M > 2:
        acc2, ss2 = _row_step(acc2, ss2, qw, d0, d1, d2, d3, z_lo, z_hi, s_lo, s_hi, x0_ptr + 2 * stride_xm,
                              r0 + 2 < M, k0, col0, K, nw_ptr, ZERO_MODE, W_DTYPE, F16, ASM, EVEN_K, BLOCK_K, X_GLU,
                              NORM_AFFINE, NORM_IN_LOOP, SUM16)
        acc3, ss3 = _row_step(acc3, ss3, qw, d0, d1, d2, d3, z_lo, z_hi, s_lo, s_hi, x0_ptr + 3 * stride_xm,
                              r0 + 3 < M, k0, col0, K, nw_ptr, ZERO_MODE, W_DTYPE, F16, ASM, EVEN_K, BLOCK_K, X_GLU,
                              NORM_AFFINE, NORM_IN_LOOP, SUM16)
    return acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3


@triton.jit
def packed_pairs(acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw_a, qw_b, qw_row, kb_start, kb_end, offs_w, KW,
                 x0_ptr, stride_xm, r0, M, col0, K, s_ptr, z_ptr, rn, G, nw_ptr, GROUP: tl.constexpr,
                 ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, X_GLU: tl.constexpr,
                 NORM_AFFINE: tl.constexpr, NORM_IN_LOOP: tl.constexpr, PACKED: tl.constexpr,
                 SUM16: tl.constexpr):
    """PF_UNROLL (PACKED with PREFETCH 2): the split's K loop with two buffers of words and the loop unrolled by two,
    ``qw_a`` / ``qw_b`` holding the words of its first two steps (``next_words``: zeros past its end). Each buffer
    takes the words of two steps on right after its own step, so two steps' words are in flight as with the rotated
    triple buffer of the plain loop, without its register copies (sm_90, 64 rows on 4 warps: 435 -> ~405 instructions
    a step, ``benchmarks/sass_int4_loop.py --count``; W4A8's same change, ``kernels.int4_a8``: +15 % -> +2.5 % over
    PREFETCH 1). Returns the updated accumulators and squares: bit-equal to the plain loop's under the interpreter;
    on an H100 not so in fp16 with mins, within the product bound (session 43; by how much and why not found)."""
    BK8: tl.constexpr = BLOCK_K // 8
    for kb in range(kb_start, kb_end - 1, 2):
        qw = qw_a
        qw_a = next_words(qw_row, kb + 2, kb_end, offs_w, KW, BLOCK_N, BK8, EVEN_K)
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = packed_step(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw, x0_ptr, stride_xm, r0, M, kb * BLOCK_K, col0, K, s_ptr,
            z_ptr, rn, G, nw_ptr, GROUP, ZERO_MODE, W_DTYPE, ASM, EVEN_K, BLOCK_K, BLOCK_M, X_GLU, NORM_AFFINE,
            NORM_IN_LOOP, PACKED, SUM16)
        qw = qw_b
        qw_b = next_words(qw_row, kb + 3, kb_end, offs_w, KW, BLOCK_N, BK8, EVEN_K)
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = packed_step(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw, x0_ptr, stride_xm, r0, M, (kb + 1) * BLOCK_K, col0, K,
            s_ptr, z_ptr, rn, G, nw_ptr, GROUP, ZERO_MODE, W_DTYPE, ASM, EVEN_K, BLOCK_K, BLOCK_M, X_GLU,
            NORM_AFFINE, NORM_IN_LOOP, PACKED, SUM16)
    if (kb_end - kb_start) % 2 == 1:  # an odd split: its last step's words are in the first buffer
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = packed_step(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, qw_a, x0_ptr, stride_xm, r0, M, (kb_end - 1) * BLOCK_K, col0,
            K, s_ptr, z_ptr, rn, G, nw_ptr, GROUP, ZERO_MODE, W_DTYPE, ASM, EVEN_K, BLOCK_K, BLOCK_M, X_GLU,
            NORM_AFFINE, NORM_IN_LOOP, PACKED, SUM16)
    return acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3


def groups_fit(group_size: int, K: int, block_k: int = 256) -> bool:
    """Whether each half of a K step's layout tile lies in one group: BLOCK_K 256 and groups of a multiple of 128
    columns, or one group a row (the rule ``check_packed`` and the int4 tuner's PACKED candidates share)."""
    return slices_per_group(group_size, K, block_k) in (4, 8)


def packed_mode(config: dict, group_size: int, K: int, scales, zm) -> int:
    """The kernel's PACKED: 0 off; 1 on; 2 on with the groups' parameters loaded in pairs (``_half_params``' PAIRS:
    group 128, K a multiple of 256, an even number of groups a row, 16-bit scales (and mins) at 4-byte addresses,
    uint8 zeros at even ones)."""
    if not config.get("PACKED"):
        return 0
    zm_ok = zm is None or (zm.element_size() == 1 and zm.data_ptr() % 2 == 0) or (
        zm.element_size() == 2 and zm.data_ptr() % 4 == 0)
    pairs = (group_size == 128 and K % 256 == 0 and scales.shape[1] % 2 == 0 and scales.element_size() == 2
             and scales.data_ptr() % 4 == 0 and zm_ok)
    return 2 if pairs else 1


def packed_options(config: dict, packed: int, zero_mode: str) -> tuple[bool, bool]:
    """The PACKED step's opt-in keys (PF_UNROLL, SUM16) of ``config`` for a launch whose ``packed_mode`` is
    ``packed``; ValueError where one is set and does not apply: PF_UNROLL needs PACKED with PREFETCH 2, SUM16 needs
    PACKED and zeros or a symmetric weight (not mins)."""
    pf_unroll, sum16 = bool(config.get("PF_UNROLL", False)), bool(config.get("SUM16", False))
    if pf_unroll and not (packed and int(config.get("PREFETCH", False)) == 2):
        raise ValueError(f"the int4 PF_UNROLL key needs PACKED with PREFETCH 2, got {config}")
    if sum16 and not (packed and zero_mode != "min"):
        raise ValueError(f"the int4 SUM16 key needs PACKED and zeros or a symmetric weight (not mins), got "
                         f"{config} with zero mode {zero_mode!r}")
    return pf_unroll, sum16


def check_packed(config: dict, group_size: int, K: int, x_dtype, x_scale_mode: int = 0) -> None:
    """Raise ValueError unless the PACKED key applies (``kernels.int4_packed``): the fma kind, BLOCK_K 256, 16-bit
    activations (W4A16), groups of a multiple of 128 columns (or one group a row), no SCALE_PF."""
    why = []
    if config.get("kind") != "fma":
        why.append(f"kind {config.get('kind')!r} (the fma kind only)")
    if x_scale_mode != 0 or x_dtype not in (torch.bfloat16, torch.float16):
        why.append(f"activations {x_dtype} (bf16 or fp16 only)")
    if not groups_fit(group_size, K, config["BLOCK_K"]):
        why.append(f"BLOCK_K {config['BLOCK_K']} with group {group_size} (BLOCK_K 256 and a group of a multiple of "
                   "128 columns, or one group a row)")
    if config.get("SCALE_PF"):
        why.append("SCALE_PF")
    if why:
        raise ValueError("the int4 PACKED key does not apply: " + "; ".join(why))
