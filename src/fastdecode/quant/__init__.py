"""Weight formats: FP8 per-channel / per-tensor; int4 packing, RTN and GPTQ / AWQ / GGUF import."""

from fastdecode.quant.fp8 import dequantize_fp8, quantize_activation_fp8, quantize_weight_fp8

__all__ = ["dequantize_fp8", "quantize_activation_fp8", "quantize_weight_fp8"]
from fastdecode.quant.int4 import (  # noqa: E402
    Int4Weight, concat_n, dequantize_int4, from_awq, from_gguf_q4_0, from_gguf_q4_1, from_gptq, prepack,
    quantize_int4, rtn_group_size, slice_k, split_n, take_rows,
)

__all__ += ["Int4Weight", "concat_n", "dequantize_int4", "from_awq", "from_gguf_q4_0", "from_gguf_q4_1", "from_gptq",
            "prepack", "quantize_int4", "rtn_group_size", "slice_k", "split_n", "take_rows"]
