"""Int4-weight GEMM for decode (W4A16, few tokens): the weight as the register operand of the tensor cores.

``out = x @ dequantize_int4(w, x.dtype).T (+ bias)`` computed transposed, ``out^T[BLOCK_N, BLOCK_M] =
W[BLOCK_N, 32] @ x^T[32, BLOCK_M]`` per 32-column shift (swap-AB, as ``kernels/gemm.py``'s skinny dot): the
weight rows fill the MMA's 64-row side and the few tokens (padded to BLOCK_M >= 16) its narrow side. The
weight never goes through shared memory as 16-bit values: Triton loads the int32 words in the MMA's
operand layout (checked in the TTGIR: one ``convert_layout``, in the epilogue), and the nibbles become
16-bit operands in registers.

Why (benchmarks/NOTES.md, session 11): at M = 1 the FMA path of ``kernels/int4.py`` is issue-bound,
4.5 SASS instructions per weight value (one LOP3, one FFMA for ``q - zero``, one FFMA per token row, plus
loads and the group fold). Here, per pair of values: one LOP3 (nibble -> 16-bit ``MAGIC + q``), one
packed add (``- (MAGIC + zero)``, exact) and, per 16 values, two PRMT and six shifts; the MMA does the
multiply-add. sm_90 SASS of the loop at BLOCK_N = 128: 2.7 instructions per value.

Conversion (constexpr ``ASM``: inline PTX on the GPU; the interpreter runs the same arithmetic on
fp32): ``pack=2`` hands the asm two neighbouring words of a row (columns k and k + 1 of the MMA operand);
``prmt`` puts their low (high) halves side by side, so that ``(v >> 4j) & 0x000F000F | MAGIC`` is a
packed pair ``MAGIC + q`` of nibble j (j + 4) of both words (bf16 ``0x4300`` = 128, fp16 ``0x6400`` =
1024: the ulp is 1 there, so q sits in the mantissa exactly). Then, by ``ZERO_MODE``:

* "sym" / "zero": ``d = v - (MAGIC + zero)``, the exact integer ``q - zero``; the MMA sums ``d * x`` in
  fp32 over a group's shifts and the group's scale multiplies that partial once (``acc += part * s``):
  the exact dequantised weight in fp32, like the FMA path (``dequantize_int4`` rounds it to x.dtype).
* "min" (GGUF Q4_1): ``w = (v - MAGIC) * scale + min`` in packed FMAs, one rounding to x.dtype, as
  ``dequantize_int4``; needs scales of x's dtype (``mma_supported``).

Layout (``fastdecode.quant.int4``): int32 words in tiles of 256 columns, word j of a tile holding columns
32p + j in bits 4p..4p+3; shift p of a tile's words is a plain 32-column slice of x. A K step is one tile.
Split-K and the epilogue are ``kernels/gemm.py``'s (deterministic, one launch).
"""

import triton
import triton.language as tl

import torch

from fastdecode.kernels.gemm import _epilogue, _split_k_partial
from fastdecode.kernels.gemm_norm import _affine, _rows_rstd, norm_tile
from fastdecode.kernels.host import cdiv
from fastdecode.kernels.int4_dequant import _ZERO_MODES, check_params, slices_per_group
from fastdecode.kernels.prefetch import l2_prefetch_rows, slab_bytes
from fastdecode.kernels.pdl import launch_kwargs, pdl_wait

# $0-$7: the packed pairs of shifts 0..7 (outputs, two columns each); $8, $9: the two words; then the
# per-shift operands (q - zero: $10-$17 the -(MAGIC + zero) pairs; min: $10-$17 the scale pairs,
# $18-$25 the min pairs). NIB(j, src) extracts nibble j of both words of a prmt-ed half.
_HEAD = """
{
.reg .b32 a, b, u, t, one, nmg;
mov.b32 one, ONE;
mov.b32 nmg, NEG_MAGIC;
prmt.b32 a, $8, $9, 0x5410;
prmt.b32 b, $8, $9, 0x7632;
"""


def _nib(j: int, src: str, dst: str) -> str:
    shift = f"shr.u32 u, {src}, {4 * j};\n" if j else f"mov.b32 u, {src};\n"
    return shift + f"lop3.b32 {dst}, u, 0x000f000f, MAGIC, 0xea;\n"


def _asm(mode: str, ty: str) -> str:
    magic, one, neg = {"bf16x2": ("0x43004300", "0x3f803f80", "0xc300c300"),
                       "f16x2": ("0x64006400", "0x3c003c00", "0xe400e400")}[ty]
    body = _HEAD
    for p in range(8):
        src = "a" if p < 4 else "b"
        if mode == "min":  # w = (v - MAGIC) * scale + min: one rounding
            body += _nib(p % 4, src, "t")
            body += f"fma.rn.{ty} t, t, one, nmg;\nfma.rn.{ty} ${p}, t, ${10 + p}, ${18 + p};\n"
        else:  # d = v - (MAGIC + zero): exact
            body += _nib(p % 4, src, "t")
            body += f"fma.rn.{ty} ${p}, t, one, ${10 + p};\n"
    body += "}\n"
    return body.replace("NEG_MAGIC", neg).replace("MAGIC", magic).replace("ONE", one)


# ABLATE 1 (a diagnostic, never a result): the two words' prmt-ed halves as the eight operands, no conversion
_ASM_RAW: tl.constexpr = tl.constexpr(
    (_HEAD + "".join(f"mov.b32 ${p}, {'a' if p < 4 else 'b'};\n" for p in range(8)) + "}\n")
    .replace("NEG_MAGIC", "0xc300c300").replace("ONE", "0x3f803f80"))
_ASM_ZERO_BF16: tl.constexpr = tl.constexpr(_asm("zero", "bf16x2"))
_ASM_ZERO_F16: tl.constexpr = tl.constexpr(_asm("zero", "f16x2"))
_ASM_MIN_BF16: tl.constexpr = tl.constexpr(_asm("min", "bf16x2"))
_ASM_MIN_F16: tl.constexpr = tl.constexpr(_asm("min", "f16x2"))

def _asm1(hi: bool, ty: str) -> str:
    """One shift of ``_asm("zero", ty)`` from the prmt-ed halves ($1: low halves, shifts 0-3; $2: high halves,
    shifts 4-7; $3: the -(MAGIC + zero) pair; $4: the shift, 4 * (p % 4)): the same instructions, so the eight
    shifts' operands need not be live at once."""
    magic, one = {"bf16x2": ("0x43004300", "0x3f803f80"), "f16x2": ("0x64006400", "0x3c003c00")}[ty]
    return ("{\n.reg .b32 u, t, one;\n" + f"mov.b32 one, {one};\nshr.u32 u, {'$2' if hi else '$1'}, $4;\n"
            f"lop3.b32 t, u, 0x000f000f, {magic}, 0xea;\nfma.rn.{ty} $0, t, one, $3;\n}}\n")


_HALVES: tl.constexpr = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410;\nprmt.b32 $1, $2, $3, 0x7632;")
_A1_LO_BF16: tl.constexpr = tl.constexpr(_asm1(False, "bf16x2"))
_A1_HI_BF16: tl.constexpr = tl.constexpr(_asm1(True, "bf16x2"))
_A1_LO_F16: tl.constexpr = tl.constexpr(_asm1(False, "f16x2"))
_A1_HI_F16: tl.constexpr = tl.constexpr(_asm1(True, "f16x2"))


@triton.jit
def _shift_asm(h, zp, p: tl.constexpr, W_DTYPE: tl.constexpr):
    """Shift p of the prmt-ed halves ``h`` (``_HALVES``) minus ``zp`` (MAGIC + zero, W_DTYPE), as ``_asm1``."""
    if W_DTYPE == tl.bfloat16:
        lo: tl.constexpr = _A1_LO_BF16
        hi: tl.constexpr = _A1_HI_BF16
    else:
        lo: tl.constexpr = _A1_LO_F16
        hi: tl.constexpr = _A1_HI_F16
    sh = tl.full(h.shape, 4 * (p % 4), tl.int32)
    if p < 4:
        w = tl.inline_asm_elementwise(lo, "=r,r,r,r,r,r", [h, zp, sh], dtype=zp.dtype, is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise(hi, "=r,r,r,r,r,r", [h, zp, sh], dtype=zp.dtype, is_pure=True, pack=2)
    return w


_CONS_ZERO: tl.constexpr = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 10))
_CONS_MIN: tl.constexpr = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 18))
_BF16X8: tl.constexpr = tl.constexpr((tl.bfloat16,) * 8)
_F16X8: tl.constexpr = tl.constexpr((tl.float16,) * 8)


@triton.jit
def _portable(qw, p: tl.constexpr, s, z, ZERO_MODE: tl.constexpr, W_DTYPE: tl.constexpr):
    """Shift p of ``qw`` as the asm computes it, in fp32: ``q - zero`` (exact), or ``q * scale + min`` rounded
    once to W_DTYPE (``as_float(0x4B000000 | q) - 2**23 == q``: no int -> float conversion)."""
    q = (((qw >> (4 * p)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    if ZERO_MODE == 2:
        w = q * s[:, None] + z[:, None]
    else:
        w = q - z[:, None]
    return w.to(W_DTYPE)


@triton.jit
def _tile_params(s_ptr, z_ptr, prow, G, k0, j: tl.constexpr, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr):
    """fp32 scale and zero (or min) ``[BLOCK_N]`` of the j-th group of the layout tile at column k0
    (clamped: padding columns >= K may point past the last group; their x is 0). ``int4_dequant._group_params``
    computes the same as ``[BLOCK_N, 1]``; here it stays 1-D: loaded 2-D, the triton 3.6 sm_90 compile put the
    whole converted weight tile through shared memory (session 11, benchmarks/NOTES.md). ``prow``: the rows'
    offsets in the row-major (N, G) scales and zeros / mins, ``rn * G`` (computed once, in the kernel)."""
    if GROUP <= 256:
        gi = k0 // GROUP + j
    else:
        gi = k0 // GROUP
    offs = prow + tl.minimum(gi, G - 1)
    s = tl.load(s_ptr + offs).to(tl.float32)
    if ZERO_MODE == 0:
        z = s * 0.0 + 8.0
    else:
        z = tl.load(z_ptr + offs).to(tl.float32)
    return s, z


@triton.jit
def _tile_scales(s_ptr, prow, G, k0, GROUP: tl.constexpr, SPG: tl.constexpr):
    """fp32 scales ``[BLOCK_N]`` of the tile's groups (8 // SPG of them; the rest repeat the first)."""
    NG: tl.constexpr = 8 // SPG
    s0, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 0, GROUP, 0)
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    if NG > 1:
        s1, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 1, GROUP, 0)
    if NG > 2:
        s2, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 2, GROUP, 0)
        s3, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 3, GROUP, 0)
    if NG > 4:
        s4, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 4, GROUP, 0)
        s5, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 5, GROUP, 0)
        s6, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 6, GROUP, 0)
        s7, _ = _tile_params(s_ptr, s_ptr, prow, G, k0, 7, GROUP, 0)
    return (s0, s1, s2, s3, s4, s5, s6, s7)


@triton.jit
def _tile_zeros(z_ptr, prow, G, k0, GROUP: tl.constexpr, SPG: tl.constexpr, ZERO_MODE: tl.constexpr,
                W_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``-(MAGIC + zero)`` of the tile's groups as ``[BLOCK_N, 32]`` W_DTYPE operands of ``_shift_asm`` ("sym": 8)."""
    if W_DTYPE == tl.bfloat16:
        MAGIC: tl.constexpr = 128.0
    else:
        MAGIC: tl.constexpr = 1024.0
    NG: tl.constexpr = 8 // SPG
    if ZERO_MODE == 0:
        z0 = _wide(tl.zeros((BLOCK_N,), dtype=tl.float32) - (MAGIC + 8.0), BLOCK_N, W_DTYPE)
        return (z0, z0, z0, z0, z0, z0, z0, z0)
    _, z0 = _tile_params(z_ptr, z_ptr, prow, G, k0, 0, GROUP, 1)
    z1, z2, z3, z4, z5, z6, z7 = z0, z0, z0, z0, z0, z0, z0
    if NG > 1:
        _, z1 = _tile_params(z_ptr, z_ptr, prow, G, k0, 1, GROUP, 1)
    if NG > 2:
        _, z2 = _tile_params(z_ptr, z_ptr, prow, G, k0, 2, GROUP, 1)
        _, z3 = _tile_params(z_ptr, z_ptr, prow, G, k0, 3, GROUP, 1)
    if NG > 4:
        _, z4 = _tile_params(z_ptr, z_ptr, prow, G, k0, 4, GROUP, 1)
        _, z5 = _tile_params(z_ptr, z_ptr, prow, G, k0, 5, GROUP, 1)
        _, z6 = _tile_params(z_ptr, z_ptr, prow, G, k0, 6, GROUP, 1)
        _, z7 = _tile_params(z_ptr, z_ptr, prow, G, k0, 7, GROUP, 1)
    return (_wide(-(MAGIC + z0), BLOCK_N, W_DTYPE), _wide(-(MAGIC + z1), BLOCK_N, W_DTYPE),
            _wide(-(MAGIC + z2), BLOCK_N, W_DTYPE), _wide(-(MAGIC + z3), BLOCK_N, W_DTYPE),
            _wide(-(MAGIC + z4), BLOCK_N, W_DTYPE), _wide(-(MAGIC + z5), BLOCK_N, W_DTYPE),
            _wide(-(MAGIC + z6), BLOCK_N, W_DTYPE), _wide(-(MAGIC + z7), BLOCK_N, W_DTYPE))


@triton.jit
def _wide(v, BLOCK_N: tl.constexpr, W_DTYPE: tl.constexpr):
    """``[BLOCK_N]`` fp32 -> ``[BLOCK_N, 32]`` W_DTYPE (a broadcast: the asm's per-row operand)."""
    return tl.broadcast_to(v.to(W_DTYPE)[:, None], (BLOCK_N, 32))


@triton.jit
def _convert(qw, s_ptr, z_ptr, prow, G, k0, GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, SPG: tl.constexpr,
             ASM: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, RAW: tl.constexpr = False):
    """The eight shifts of ``qw [BLOCK_N, 32]`` as W_DTYPE MMA operands: ``q - zero`` (exact) for "sym" /
    "zero", ``q * scale + min`` (one rounding) for "min". Also returns the scales of the tile's groups (fp32,
    up to 8 of them; unused ones repeat) for the per-group fold of "sym" / "zero"."""
    if W_DTYPE == tl.bfloat16:
        MAGIC: tl.constexpr = 128.0
    else:
        MAGIC: tl.constexpr = 1024.0
    NG: tl.constexpr = 8 // SPG
    s0, z0 = _tile_params(s_ptr, z_ptr, prow, G, k0, 0, GROUP, ZERO_MODE)
    s1, z1, s2, z2, s3, z3 = s0, z0, s0, z0, s0, z0
    s4, z4, s5, z5, s6, z6, s7, z7 = s0, z0, s0, z0, s0, z0, s0, z0
    if NG > 1:
        s1, z1 = _tile_params(s_ptr, z_ptr, prow, G, k0, 1, GROUP, ZERO_MODE)
    if NG > 2:
        s2, z2 = _tile_params(s_ptr, z_ptr, prow, G, k0, 2, GROUP, ZERO_MODE)
        s3, z3 = _tile_params(s_ptr, z_ptr, prow, G, k0, 3, GROUP, ZERO_MODE)
    if NG > 4:
        s4, z4 = _tile_params(s_ptr, z_ptr, prow, G, k0, 4, GROUP, ZERO_MODE)
        s5, z5 = _tile_params(s_ptr, z_ptr, prow, G, k0, 5, GROUP, ZERO_MODE)
        s6, z6 = _tile_params(s_ptr, z_ptr, prow, G, k0, 6, GROUP, ZERO_MODE)
        s7, z7 = _tile_params(s_ptr, z_ptr, prow, G, k0, 7, GROUP, ZERO_MODE)
    # the scale / zero of each shift p: group p // SPG
    gs = (s0, s1, s2, s3, s4, s5, s6, s7)
    gz = (z0, z1, z2, z3, z4, z5, z6, z7)
    ps0, ps1, ps2, ps3 = gs[0 // SPG], gs[1 // SPG], gs[2 // SPG], gs[3 // SPG]
    ps4, ps5, ps6, ps7 = gs[4 // SPG], gs[5 // SPG], gs[6 // SPG], gs[7 // SPG]
    pz0, pz1, pz2, pz3 = gz[0 // SPG], gz[1 // SPG], gz[2 // SPG], gz[3 // SPG]
    pz4, pz5, pz6, pz7 = gz[4 // SPG], gz[5 // SPG], gz[6 // SPG], gz[7 // SPG]
    if ASM and RAW:  # ABLATE: the words as operands (the zero operands passed and unused)
        if W_DTYPE == tl.bfloat16:
            tys: tl.constexpr = _BF16X8
        else:
            tys: tl.constexpr = _F16X8
        ws = tl.inline_asm_elementwise(
            _ASM_RAW, _CONS_ZERO,
            [qw, _wide(pz0, BLOCK_N, W_DTYPE), _wide(pz1, BLOCK_N, W_DTYPE), _wide(pz2, BLOCK_N, W_DTYPE),
             _wide(pz3, BLOCK_N, W_DTYPE), _wide(pz4, BLOCK_N, W_DTYPE), _wide(pz5, BLOCK_N, W_DTYPE),
             _wide(pz6, BLOCK_N, W_DTYPE), _wide(pz7, BLOCK_N, W_DTYPE)],
            dtype=tys, is_pure=True, pack=2)
    elif ASM:
        if ZERO_MODE == 2:
            if W_DTYPE == tl.bfloat16:
                asm: tl.constexpr = _ASM_MIN_BF16
                tys: tl.constexpr = _BF16X8
            else:
                asm: tl.constexpr = _ASM_MIN_F16
                tys: tl.constexpr = _F16X8
            ws = tl.inline_asm_elementwise(
                asm, _CONS_MIN,
                [qw, _wide(ps0, BLOCK_N, W_DTYPE), _wide(ps1, BLOCK_N, W_DTYPE), _wide(ps2, BLOCK_N, W_DTYPE),
                 _wide(ps3, BLOCK_N, W_DTYPE), _wide(ps4, BLOCK_N, W_DTYPE), _wide(ps5, BLOCK_N, W_DTYPE),
                 _wide(ps6, BLOCK_N, W_DTYPE), _wide(ps7, BLOCK_N, W_DTYPE),
                 _wide(pz0, BLOCK_N, W_DTYPE), _wide(pz1, BLOCK_N, W_DTYPE), _wide(pz2, BLOCK_N, W_DTYPE),
                 _wide(pz3, BLOCK_N, W_DTYPE), _wide(pz4, BLOCK_N, W_DTYPE), _wide(pz5, BLOCK_N, W_DTYPE),
                 _wide(pz6, BLOCK_N, W_DTYPE), _wide(pz7, BLOCK_N, W_DTYPE)],
                dtype=tys, is_pure=True, pack=2)
        else:
            if W_DTYPE == tl.bfloat16:
                asm: tl.constexpr = _ASM_ZERO_BF16
                tys: tl.constexpr = _BF16X8
            else:
                asm: tl.constexpr = _ASM_ZERO_F16
                tys: tl.constexpr = _F16X8
            ws = tl.inline_asm_elementwise(
                asm, _CONS_ZERO,
                [qw, _wide(-(MAGIC + pz0), BLOCK_N, W_DTYPE), _wide(-(MAGIC + pz1), BLOCK_N, W_DTYPE),
                 _wide(-(MAGIC + pz2), BLOCK_N, W_DTYPE), _wide(-(MAGIC + pz3), BLOCK_N, W_DTYPE),
                 _wide(-(MAGIC + pz4), BLOCK_N, W_DTYPE), _wide(-(MAGIC + pz5), BLOCK_N, W_DTYPE),
                 _wide(-(MAGIC + pz6), BLOCK_N, W_DTYPE), _wide(-(MAGIC + pz7), BLOCK_N, W_DTYPE)],
                dtype=tys, is_pure=True, pack=2)
    else:  # the interpreter (and a portable GPU build): the same values from fp32 arithmetic
        ws = (_portable(qw, 0, ps0, pz0, ZERO_MODE, W_DTYPE), _portable(qw, 1, ps1, pz1, ZERO_MODE, W_DTYPE),
              _portable(qw, 2, ps2, pz2, ZERO_MODE, W_DTYPE), _portable(qw, 3, ps3, pz3, ZERO_MODE, W_DTYPE),
              _portable(qw, 4, ps4, pz4, ZERO_MODE, W_DTYPE), _portable(qw, 5, ps5, pz5, ZERO_MODE, W_DTYPE),
              _portable(qw, 6, ps6, pz6, ZERO_MODE, W_DTYPE), _portable(qw, 7, ps7, pz7, ZERO_MODE, W_DTYPE))
    return ws, gs


@triton.jit(do_not_specialize=["M", "split_k", "stride_part"])
def _int4_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, nw_ptr, eps,
    M, N, K, G, KW, stride_xm, stride_om, stride_part, split_k,
    GROUP: tl.constexpr, ZERO_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SPG: tl.constexpr,
    EVEN_K: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, L2_PREFETCH: tl.constexpr,
    X_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, NORM_NB: tl.constexpr, NORM_RM: tl.constexpr,
    ACCUMULATE: tl.constexpr, MASK_X: tl.constexpr, TILES: tl.constexpr, CVT1: tl.constexpr, ABLATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, L2_SLAB: tl.constexpr, PF_LANES: tl.constexpr,
):
    """Grid (m tiles, split_k, n tiles); a K step is one 256-column layout tile (32 words a row). KW is the
    number of words per weight row (a multiple of 32); columns >= K read x as 0.

    SPG: 32-column shifts per group inside a tile (1, 2, 4 or 8: groups of 32, 64, 128 or >= 256 / whole
    rows). L2_PREFETCH (with USE_PDL): before waiting for the previous kernel, each row's first two weight
    tiles of this program are prefetched into L2 (weights are never written by the step's kernels); L2_SLAB (with
    USE_PDL; bytes, 0: off; PF_LANES: the program's threads): up to that much of its words instead
    (``kernels.prefetch.l2_prefetch_rows``).

    X_NORM, NORM_AFFINE, NORM_NB, NORM_RM, ACCUMULATE: the RMSNorm of x and the residual add, as
    ``kernels.int4``'s kernel (its docstring).

    MASK_X: the padding tokens of the tile (rows >= M) are masked loads (zeros, no memory traffic) instead of
    copies of valid rows: at M = 1 the wrapped tile read x's row 16 times a step. TILES: layout tiles a loop step
    (1 or 2; KW // 32 must then be a multiple of TILES per split, which ``launch_int4_mma`` checks).

    ABLATE (a diagnostic: the outputs are not the product; ``benchmarks/diag_int4_gemv.py --ablate``): 0 the kernel;
    1 no conversion (the words' halves go to the MMA as they are, inline PTX only); 2 no MMA (the converted
    operands are XOR-ed into a register tile instead: no x loads, no wgmma, no scale fold); 3 both (ptxas then drops
    the scale and zero loads too: nothing reads them; sm_90 SASS, session 35)."""
    W_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    num_m = tl.num_programs(0)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows and tokens wrap onto valid ones (loads stay unmasked); they are never stored
    rn = (offs_n % N).to(tl.int64)
    rm = (offs_m % M).to(tl.int64)
    prow = rn * G  # the rows' scales and zeros / mins (row-major (N, G))
    m_valid = offs_m < M

    kb_total = KW // (32 * TILES)
    kb_per = tl.cdiv(kb_total, split_k)
    kb_start = pid_k * kb_per
    kb_end = tl.minimum(kb_start + kb_per, kb_total)

    offs_w = tl.arange(0, 32)
    qw_rows = qw_ptr + rn[:, None] * KW + offs_w[None, :]
    if USE_PDL:
        if L2_SLAB:
            l2_prefetch_rows(qw_ptr.to(tl.pointer_type(tl.uint8)), pid_n * BLOCK_N, N, KW * 4,
                             kb_start * 32 * TILES * 4, kb_end * 32 * TILES * 4, BLOCK_N, PF_LANES, L2_SLAB)
        elif L2_PREFETCH:
            first = qw_ptr + rn * KW + kb_start * 32 * TILES  # one 128-byte line per row and tile
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [first],
                                      dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l",
                                      [first + tl.where(kb_start + 1 < kb_end, 32 * TILES, 0)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        pdl_wait()
    if X_NORM:  # whole rows' RMSNorm scale, after the wait (h is the previous kernel's output)
        rstd = _rows_rstd(x_ptr, offs_m, M, stride_xm, K, eps, BLOCK_M, NORM_NB, NORM_RM)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if ABLATE >= 2:
        sink = tl.zeros((BLOCK_N, 32), dtype=tl.int16)
    if MASK_X:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_w[None, :]
    else:
        x_rows = x_ptr + rm[:, None] * stride_xm + offs_w[None, :]
    for kb in range(kb_start, kb_end):
        for t in tl.static_range(TILES):
            k0 = (kb * TILES + t) * 256
            qw = tl.load(qw_rows + (kb * TILES + t) * 32)
            if CVT1:  # one shift converted at a time (sym / zero, inline PTX): fewer operand registers live
                h = tl.inline_asm_elementwise(_HALVES, "=r,=r,r,r", [qw], dtype=tl.int32, is_pure=True, pack=2)
                gs = _tile_scales(s_ptr, prow, G, k0, GROUP, SPG)
                zg = _tile_zeros(z_ptr, prow, G, k0, GROUP, SPG, ZERO_MODE, W_DTYPE, BLOCK_N)
            else:
                ws, gs = _convert(qw, s_ptr, z_ptr, prow, G, k0, GROUP, ZERO_MODE, SPG, ASM, W_DTYPE, BLOCK_N,
                                  ABLATE % 2 == 1)
            for p in tl.static_range(8):
                if CVT1:
                    wp = _shift_asm(h, zg[p // SPG], p, W_DTYPE)
                else:
                    wp = ws[p]
                if ABLATE >= 2:  # no MMA: the operand XOR-ed into a register tile (kept live to the end)
                    sink = sink ^ wp.to(tl.int16, bitcast=True)
                else:
                    xp = x_rows + (k0 + 32 * p)
                    if EVEN_K and MASK_X:
                        xt = tl.load(xp, mask=m_valid[:, None], other=0.0)
                    elif EVEN_K:
                        xt = tl.load(xp)
                    elif MASK_X:
                        xt = tl.load(xp, mask=m_valid[:, None] & (k0 + 32 * p + offs_w < K)[None, :], other=0.0)
                    else:
                        xt = tl.load(xp, mask=(k0 + 32 * p + offs_w < K)[None, :], other=0.0)
                    if NORM_AFFINE:  # h * nw rounded to x's dtype
                        cols = k0 + 32 * p + offs_w
                        xt = _affine(xt, nw_ptr, cols[None, :], (cols < K)[None, :], W_DTYPE)
                    if ZERO_MODE == 2:  # the weight is already scaled
                        acc = tl.dot(wp, tl.trans(xt), acc)
                    else:  # the exact integers q - zero; the group's scale once per partial
                        if p % SPG == 0:
                            part = tl.dot(wp, tl.trans(xt))
                        else:
                            part = tl.dot(wp, tl.trans(xt), part)
                        if p % SPG == SPG - 1:
                            acc += part * gs[p // SPG][:, None]
    if ABLATE >= 2:
        acc += tl.sum(sink.to(tl.float32), axis=1)[:, None] * 0.0
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if X_NORM:
        out = out * rstd[:, None]
    if not SPLIT:
        _epilogue(out, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, bias_ptr, bias_ptr,
                  HAS_BIAS, 0, 0, ACCUMULATE)
    else:
        _split_k_partial(out, part_ptr, stride_part, pid_k, lock_ptr + pid_n * num_m + pid_m, split_k,
                         offs_m, offs_n, m_valid, M, N, out_ptr, stride_om, bias_ptr, bias_ptr, bias_ptr,
                         HAS_BIAS, 0, 0, BLOCK_M, BLOCK_N, ACCUMULATE)


def mma_supported(x_dtype, scale_dtype, zero_mode: str, group_size: int, K: int) -> bool:
    """Whether the mma kind computes this weight: 16-bit activations (W4A8 has its own paths), groups that tile
    the 256-column layout tile (32, 64, 128, multiples of 256, or one group per row), and for "min" scales
    (and mins) of x's dtype (its packed FMAs compute in x's dtype; see ``kernels.int4.fast_cvt_ok`` for what
    other scale dtypes would do)."""
    if x_dtype not in (torch.bfloat16, torch.float16) or slices_per_group(group_size, K, 256) == 0:
        return False
    return zero_mode != "min" or scale_dtype == x_dtype


def launch_int4_mma(x, qweight, scales, zm, group_size: int, zero_mode: str, bias, out, part, locks,
                    config: dict, split: int, asm: bool, warmup: bool = False, pdl: bool = False,
                    norm_weight=None, eps: float = 0.0, x_norm: bool = False, accumulate: bool = False,
                    l2_slab: int = 0):
    """Launch on 2-D views: x (M, K) bf16/fp16 unit stride in K (kernel column order), qweight (N, Kp // 8)
    int32, scales / zm (N, K // group_size) contiguous (zm: zeros uint8, mins, or None), out (M, N)
    contiguous; ``part`` / ``locks`` as ``kernels.int4.launch_int4_linear`` (split-K only), ``split`` the effective
    split count (``kernels.int4.split_k_blocks``).

    ``config``: dict(kind="mma", BLOCK_M (tokens, >= 16), BLOCK_N (weight rows: 64 or more a warpgroup for
    wgmma; fewer compile to ``mma.sync``),
    BLOCK_K (256: one layout tile a step), SPLIT_K, num_warps, num_stages, L2_PREFETCH (optional, default
    True)); ``asm``: the inline-PTX conversion (CUDA, not the interpreter). The caller checks
    ``mma_supported``. ``norm_weight``, ``eps``, ``x_norm``, ``accumulate``, ``l2_slab``: as
    ``kernels.int4.launch_int4_linear``."""
    check_params(scales, zm, "the int4 mma kind")
    M, K = x.shape
    N = qweight.shape[0]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    tiles = int(config.get("TILES", 1))
    if tiles not in (1, 2) or (qweight.shape[1] // 32) % tiles:
        tiles = 1  # whole steps only
    grid = (cdiv(M, bm), split, cdiv(N, bn))
    # X_NORM only: without it the constants stay those of the tile (one compiled variant, whatever M)
    norm_rm, norm_nb = norm_tile(bm, M if x_norm else bm)
    kernel = _int4_mma_kernel.warmup if warmup else _int4_mma_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    kernel(
        x, qweight, scales, zm if zm is not None else scales, bias if bias is not None else out, out,
        part if split > 1 else out, locks if split > 1 else out,
        norm_weight if norm_weight is not None else out, float(eps),
        M, N, K, scales.shape[1], qweight.shape[1], x.stride(0), out.stride(0), M * N, split,
        GROUP=group_size, ZERO_MODE=_ZERO_MODES[zero_mode], HAS_BIAS=bias is not None,
        SPG=slices_per_group(group_size, K, 256), EVEN_K=K % 256 == 0, ASM=asm, USE_PDL=pdl,
        L2_PREFETCH=bool(config.get("L2_PREFETCH", True)),
        X_NORM=bool(x_norm), NORM_AFFINE=bool(x_norm) and norm_weight is not None,
        NORM_RM=norm_rm, NORM_NB=norm_nb,
        ACCUMULATE=bool(accumulate), MASK_X=bool(config.get("MASK_X", False)), TILES=tiles,
        CVT1=bool(config.get("CVT1", False)) and asm and zero_mode != "min", ABLATE=int(config.get("_ABLATE", 0)),
        BLOCK_M=bm, BLOCK_N=bn, SPLIT=split > 1, L2_SLAB=slab_bytes(l2_slab, pdl, qweight),
        PF_LANES=32 * config.get("num_warps", 4),
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2), **launch_kwargs(pdl),
        **extra,
    )
