"""Weight formats: FP8 per-channel / per-tensor (int4 packing and checkpoint imports come later)."""

from fastdecode.quant.fp8 import dequantize_fp8, quantize_activation_fp8, quantize_weight_fp8

__all__ = ["dequantize_fp8", "quantize_activation_fp8", "quantize_weight_fp8"]
