"""Int4 nibbles to floats: the conversions of the int4 GEMM kernel (``fastdecode.kernels.int4``) and the
whole-weight dequant kernel of the large-M path (dequantise, then cuBLAS).

Dequantisation, the same in both paths and bit-identical to ``dequantize_int4``: a nibble ``q``
becomes fp32 with one OR and one subtract, ``as_float(0x4B000000 | q) - 2**23 == q`` (the magic
number puts q in the mantissa of 2**23; no int -> float conversion, and it is plain integer ops +
a bitcast, so the interpreter runs the same code as the GPU); then ``(q - zero) * scale`` (exact in
fp32: a 5-bit integer times a 16-bit-mantissa scale) or ``q * scale + min``, rounded once to the
activation dtype.

Layout (``fastdecode.quant.int4``): int32 words in tiles of 256 columns, word j of a tile holding columns
32p + j in bits 4p..4p+3 (p = 0..7); scales and zeros / mins ``(N, K // GROUP)``.
"""

import triton
import triton.language as tl
from fastdecode.kernels.host import cdiv

ZERO_SYM, ZERO_INT, ZERO_MIN = 0, 1, 2  # constexpr ZERO_MODE: "sym", "zero", "min"
_ZERO_MODES = {"sym": ZERO_SYM, "zero": ZERO_INT, "min": ZERO_MIN}


@triton.jit
def _slice_params(s_ptr, z_ptr, rn, kcol, k_mask, G, p, k0, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr,
                  UNIFORM: tl.constexpr):
    """fp32 scale and zero (or min) of shift ``p``'s columns ``kcol`` (``[BK8]``) of rows ``rn``:
    ``[BLOCK_N, 1]`` when they all lie in one group (UNIFORM: the tile is one 256-column layout tile,
    or lies inside one group), else a ``[BLOCK_N, BK8]`` gather of a few distinct values (L1 hits)."""
    if UNIFORM:
        # padding columns (>= K) may point past the last group: clamp (their x is 0 anyway)
        offs = rn[:, None] * G + tl.minimum((k0 + 32 * p) // GROUP, G - 1)
        s = tl.load(s_ptr + offs).to(tl.float32)
        if ZERO_MODE == 0:
            z = s * 0.0 + 8.0
        else:
            z = tl.load(z_ptr + offs).to(tl.float32)
    else:
        offs = rn[:, None] * G + (kcol // GROUP)[None, :]
        s = tl.load(s_ptr + offs, mask=k_mask[None, :], other=0.0).to(tl.float32)
        if ZERO_MODE == 0:
            z = s * 0.0 + 8.0
        else:
            z = tl.load(z_ptr + offs, mask=k_mask[None, :], other=0).to(tl.float32)
    return s, z


@triton.jit
def _dequant(qw, p, s, z, ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr):
    """Shift ``p`` of the words ``qw [BN, BK8]`` -> ``[BN, BK8]`` values in W_DTYPE (same layout)."""
    nib = (qw >> (4 * p)) & 0xF
    f = (nib | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q, exactly
    if ZERO_MODE == 2:
        w = (f - 8388608.0) * s + z
    else:
        w = (f - (z + 8388608.0)) * s
    return w.to(W_DTYPE)


@triton.jit
def _nibble_f32(qw, qw_hi, p: tl.constexpr):
    """Shift ``p`` of the words as fp32 ``2**23 + q * 16**(p % 4)``, exactly, with one AND-OR (a LOP3)
    and no shift: nibbles 0-3 are masked in place in ``qw``, nibbles 4-7 in ``qw_hi = qw >> 16``
    (16**3 * 15 < 2**23, so the nibble stays inside the mantissa)."""
    if p < 4:
        base = qw
    else:
        base = qw_hi
    MASK: tl.constexpr = 0xF << (4 * (p % 4))
    return ((base & MASK) | 0x4B000000).to(tl.float32, bitcast=True)


# _nibble_f32 as one LOP3 with both constants as immediates ((word & MASK) | 0x4B000000, lut 0xEA); ptxas
# does not fuse the AND and the OR of the portable form. GPU only (inline PTX); the interpreter runs
# _nibble_f32, the same bits.
_LOP3_ASM_0: tl.constexpr = tl.constexpr("lop3.b32 $0, $1, 0x0000000F, 0x4B000000, 0xEA;")
_LOP3_ASM_1: tl.constexpr = tl.constexpr("lop3.b32 $0, $1, 0x000000F0, 0x4B000000, 0xEA;")
_LOP3_ASM_2: tl.constexpr = tl.constexpr("lop3.b32 $0, $1, 0x00000F00, 0x4B000000, 0xEA;")
_LOP3_ASM_3: tl.constexpr = tl.constexpr("lop3.b32 $0, $1, 0x0000F000, 0x4B000000, 0xEA;")


@triton.jit
def _nibble_f32_asm(qw, qw_hi, p: tl.constexpr):
    """``_nibble_f32`` in one instruction (inline PTX, GPU only)."""
    if p < 4:
        base = qw
    else:
        base = qw_hi
    if p % 4 == 0:
        asm: tl.constexpr = _LOP3_ASM_0
    elif p % 4 == 1:
        asm: tl.constexpr = _LOP3_ASM_1
    elif p % 4 == 2:
        asm: tl.constexpr = _LOP3_ASM_2
    else:
        asm: tl.constexpr = _LOP3_ASM_3
    return tl.inline_asm_elementwise(asm, "=r,r", [base], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _group_params(s_ptr, z_ptr, rn, G, k0, p: tl.constexpr, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr):
    """fp32 scale and zero (or min) ``[BLOCK_N, 1]`` of shift ``p``'s group in the layout tile at column
    ``k0`` (a multiple of 256; GROUP divides 256 or 256 divides GROUP, or one group per row), clamped:
    padding columns >= K may point past the last group (their x is 0). The offset is written as
    ``k0 // GROUP + constant`` so that the shifts of one group share one load."""
    if GROUP <= 256:
        gi = k0 // GROUP + (32 * p) // GROUP
    else:
        gi = k0 // GROUP
    offs = rn[:, None] * G + tl.minimum(gi, G - 1)
    s = tl.load(s_ptr + offs).to(tl.float32)
    if ZERO_MODE == 0:
        z = s * 0.0 + 8.0
    else:
        z = tl.load(z_ptr + offs).to(tl.float32)
    return s, z


@triton.jit
def _group_params8(s_ptr, z_ptr, rn, G, k0, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr):
    """``_group_params`` of the eight shifts of the layout tile at column ``k0``: (s0, ..., s7, z0, ..., z7)."""
    s0, z0 = _group_params(s_ptr, z_ptr, rn, G, k0, 0, GROUP, ZERO_MODE)
    s1, z1 = _group_params(s_ptr, z_ptr, rn, G, k0, 1, GROUP, ZERO_MODE)
    s2, z2 = _group_params(s_ptr, z_ptr, rn, G, k0, 2, GROUP, ZERO_MODE)
    s3, z3 = _group_params(s_ptr, z_ptr, rn, G, k0, 3, GROUP, ZERO_MODE)
    s4, z4 = _group_params(s_ptr, z_ptr, rn, G, k0, 4, GROUP, ZERO_MODE)
    s5, z5 = _group_params(s_ptr, z_ptr, rn, G, k0, 5, GROUP, ZERO_MODE)
    s6, z6 = _group_params(s_ptr, z_ptr, rn, G, k0, 6, GROUP, ZERO_MODE)
    s7, z7 = _group_params(s_ptr, z_ptr, rn, G, k0, 7, GROUP, ZERO_MODE)
    return s0, s1, s2, s3, s4, s5, s6, s7, z0, z1, z2, z3, z4, z5, z6, z7


@triton.jit
def _pick8(p: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    """The ``p``-th of eight values (p a compile-time shift)."""
    if p == 0:
        return a0
    elif p == 1:
        return a1
    elif p == 2:
        return a2
    elif p == 3:
        return a3
    elif p == 4:
        return a4
    elif p == 5:
        return a5
    elif p == 6:
        return a6
    else:
        return a7


# Fast 4-bit -> 16-bit conversion on the GPU (inline PTX; the interpreter runs the bitcast forms):
# per 32-bit word, (word >> 4j) & 0x000F000F | MAGIC puts nibbles j and j+4 into the mantissas of a
# packed pair of 16-bit floats MAGIC + q (bf16 0x4300 = 128, fp16 0x6400 = 1024: the ulp is 1 there),
# one LOP3 for two values; then two packed FMAs per pair: ``t = t * 1 - (MAGIC + zero)`` (exact: q - zero)
# and ``w = t * scale + c`` (c = -0 or the GGUF min; one rounding, as dequantize_int4's). $0-$7 are the
# eight 16-bit outputs (shift p), $8 the word, $9-$12 the scale pairs (p, p+4), $13-$16 the
# -(MAGIC + zero) pairs, $17-$20 the c pairs.
_CVT_ASM = """
{
.reg .b32 t0, t1, t2, t3, u, one, mg;
mov.b32 one, ONE;
mov.b32 mg, MAGIC;
lop3.b32 t0, $8, 0x000f000f, mg, 0xea;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000f000f, mg, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, mg, 0xea;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000f000f, mg, 0xea;
fma.rn.TY t0, t0, one, $13;
fma.rn.TY t1, t1, one, $14;
fma.rn.TY t2, t2, one, $15;
fma.rn.TY t3, t3, one, $16;
fma.rn.TY t0, t0, $9, $17;
fma.rn.TY t1, t1, $10, $18;
fma.rn.TY t2, t2, $11, $19;
fma.rn.TY t3, t3, $12, $20;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
"""
_CVT_ASM_BF16: tl.constexpr = tl.constexpr(
    _CVT_ASM.replace("ONE", "0x3f803f80").replace("MAGIC", "0x43004300").replace("TY", "bf16x2"))
_CVT_ASM_F16: tl.constexpr = tl.constexpr(
    _CVT_ASM.replace("ONE", "0x3c003c00").replace("MAGIC", "0x64006400").replace("TY", "f16x2"))
_CVT_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 13))


@triton.jit
def _pair_bits(lo, hi, W_DTYPE: tl.constexpr):
    """Two fp32 ``[BN, 1]`` -> int32 holding (lo, hi) as a packed W_DTYPE pair (lo in the low half)."""
    lb = lo.to(W_DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hb = hi.to(W_DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lb | (hb << 16)


@triton.jit
def _dequant8_asm(qw, s_ptr, z_ptr, rn, G, k0, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr,
                  W_DTYPE: tl.constexpr):
    """All eight shifts of ``qw [BN, BK8]`` -> eight ``[BN, BK8]`` W_DTYPE tensors (GPU, one group per
    32-column slice: UNIFORM)."""
    if W_DTYPE == tl.bfloat16:
        MAGIC: tl.constexpr = 128.0
    else:
        MAGIC: tl.constexpr = 1024.0
    s0, s1, s2, s3, s4, s5, s6, s7, z0, z1, z2, z3, z4, z5, z6, z7 = _group_params8(s_ptr, z_ptr, rn, G, k0, GROUP,
                                                                                   ZERO_MODE)
    if ZERO_MODE == 2:  # w = q * scale + min
        n0, n1, n2, n3 = -MAGIC + 0 * s0, -MAGIC + 0 * s0, -MAGIC + 0 * s0, -MAGIC + 0 * s0
        c0, c1, c2, c3 = _pair_bits(z0, z4, W_DTYPE), _pair_bits(z1, z5, W_DTYPE), \
            _pair_bits(z2, z6, W_DTYPE), _pair_bits(z3, z7, W_DTYPE)
        n0, n1, n2, n3 = _pair_bits(n0, n0, W_DTYPE), _pair_bits(n1, n1, W_DTYPE), \
            _pair_bits(n2, n2, W_DTYPE), _pair_bits(n3, n3, W_DTYPE)
    else:  # w = (q - zero) * scale
        n0, n1 = _pair_bits(-(MAGIC + z0), -(MAGIC + z4), W_DTYPE), _pair_bits(-(MAGIC + z1), -(MAGIC + z5), W_DTYPE)
        n2, n3 = _pair_bits(-(MAGIC + z2), -(MAGIC + z6), W_DTYPE), _pair_bits(-(MAGIC + z3), -(MAGIC + z7), W_DTYPE)
        c0 = (rn[:, None] * 0).to(tl.int32)  # + 0: one rounding of (q - zero) * scale
        c1, c2, c3 = c0, c0, c0
    p0, p1 = _pair_bits(s0, s4, W_DTYPE), _pair_bits(s1, s5, W_DTYPE)
    p2, p3 = _pair_bits(s2, s6, W_DTYPE), _pair_bits(s3, s7, W_DTYPE)
    if W_DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            _CVT_ASM_BF16, _CVT_CONSTRAINTS, [qw, p0, p1, p2, p3, n0, n1, n2, n3, c0, c1, c2, c3],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            _CVT_ASM_F16, _CVT_CONSTRAINTS, [qw, p0, p1, p2, p3, n0, n1, n2, n3, c0, c1, c2, c3],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                   tl.float16), is_pure=True, pack=1)


def check_params(scales, zm, kernel: str) -> None:
    """Raise ValueError unless the (N, G) scales and the zeros / mins (or None) are contiguous: every int4 kernel
    reads them row-major, ``row * G + group``, and would read another layout's values without an error.
    ``ops.int4_format.Int4Weight.validate`` checks the same for the ops; every int4 launch asks too (the launchers
    are the benchmarks' and the tuner's entry points): the common case returns at once. ``kernel``: for the
    message."""
    for name, t in (("scales", scales), ("zeros / mins", zm)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{kernel} reads int4 {name} row-major (contiguous); got strides {t.stride()} for "
                             f"shape {tuple(t.shape)} (call .contiguous() once when preparing the weight)")


def slices_per_group(group_size: int, K: int, bk: int) -> int:
    """32-column shifts per group inside a 256-column layout tile (8 when a tile lies in one group), or 0
    when the kernel's per-group paths do not apply (BLOCK_K > 256, or groups that straddle tiles)."""
    if bk != 256:
        return 0
    if group_size % 256 == 0 or group_size >= K:
        return 8
    return group_size // 32 if 256 % group_size == 0 else 0


def _uniform(group_size: int, bk: int) -> bool:
    # shift p of a tile covers one group: a single layout tile (columns 32p..32p+31 of it), or a
    # tile inside one group
    return bk == 256 or group_size % bk == 0


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, G, KW,
                         GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, UNIFORM: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out (N, K) = the dequantised weight in out's dtype (for the large-M dequant + cuBLAS path)."""
    BK8: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)
    offs_w = tl.arange(0, BK8)
    kw = pid_k * BK8 + offs_w
    qw = tl.load(qw_ptr + rn[:, None] * KW + kw[None, :], mask=(kw < KW)[None, :], other=0)
    k0 = pid_k * BLOCK_K
    col0 = (offs_w // 32) * 256 + offs_w % 32
    n_mask = offs_n < N
    for p in tl.static_range(8):
        kcol = k0 + col0 + 32 * p
        k_mask = kcol < K
        s, z = _slice_params(s_ptr, z_ptr, rn, kcol, k_mask, G, p, k0, GROUP, ZERO_MODE, UNIFORM)
        w = _dequant(qw, p, s, z, ZERO_MODE, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rn[:, None] * K + kcol[None, :], w, mask=n_mask[:, None] & k_mask[None, :])


def launch_int4_dequant(qweight, scales, zm, group_size: int, zero_mode: str, out, block_n: int = 16,
                        block_k: int = 256):
    """out (N, K) contiguous bf16/fp16 <- dequantised qweight (N, Kp // 8), kernel column order."""
    N, K = out.shape
    check_params(scales, zm, "the int4 dequant kernel")
    grid = (cdiv(N, block_n), cdiv(qweight.shape[1] * 8, block_k))
    _int4_dequant_kernel[grid](
        qweight, scales, zm if zm is not None else scales, out, N, K, scales.shape[1], qweight.shape[1],
        GROUP=group_size, ZERO_MODE=_ZERO_MODES[zero_mode], UNIFORM=_uniform(group_size, block_k),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
