"""Numeric constants shared by kernels and ops (no imports: any layer may use them)."""

#: Largest finite value of float8_e4m3fn.
FP8_MAX = 448.0
#: Lower bound of a dynamic FP8 scale (real = fp8 * scale), so an all-zero row never divides by 0.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

# How a GEMM operand's FP8 scale is given (kernels/linear.py, ops/gemm.py)
SCALE_NONE = 0
SCALE_TENSOR = 1  # one fp32 element
SCALE_VECTOR = 2  # x: one per row (M,), w: one per output channel (N,)
