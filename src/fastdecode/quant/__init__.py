"""Weight formats: FP8 per-channel / per-tensor (int4 packing and checkpoint imports come later)."""

from fastdecode.quant.fp8 import dequantize_fp8, quantize_activation_fp8, quantize_weight_fp8

__all__ = ["dequantize_fp8", "quantize_activation_fp8", "quantize_weight_fp8"]
from fastdecode.quant.int4 import (  # noqa: E402
    Int4Weight, dequantize_int4, from_awq, from_gguf_q4_0, from_gguf_q4_1, from_gptq, prepack, quantize_int4,
)

__all__ += ["Int4Weight", "dequantize_int4", "from_awq", "from_gguf_q4_0", "from_gguf_q4_1", "from_gptq",
            "prepack", "quantize_int4"]
