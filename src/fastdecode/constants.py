"""Numeric constants shared by kernels and ops (no imports: any layer may use them)."""

#: Largest finite value of float8_e4m3fn.
FP8_MAX = 448.0
#: Lower bound of a dynamic FP8 scale (real = fp8 * scale), so an all-zero row never divides by 0.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

# How a GEMM operand's FP8 scale is given (kernels/gemm.py, ops/gemm.py)
SCALE_NONE = 0
SCALE_TENSOR = 1  # one fp32 element
SCALE_VECTOR = 2  # x: one per row (M,), w: one per output channel (N,)

# Output modes of the row kernels (norm, SiLU-and-mul, fused all-reduce): constexpr OUT_MODE
OUT_NATIVE = 0  # out has a float dtype; y is rounded once
OUT_FP8_STATIC = 1  # out = fp8(clamp(y / scale)), scale given (one fp32 element)
OUT_FP8_DYNAMIC = 2  # per-row scale = max(amax(|y|) / 448, min_scale), written to scale[row]
OUT_INT8_GROUPS = 3  # int8 per row and group of 128 columns (ops.int4_a8): out, scale[row, g], sums[row, g]
#: Lower bound of an int8 activation group's scale (an all-zero group: q = 0 whatever the scale).
INT8_MIN_SCALE = 1e-30
