"""Public ops: validate -> allocate -> one registered custom op (``torch.ops.fastdecode.*``).

Each op has a ``*_ref`` plain-PyTorch reference beside it; see ``_common`` for the backend switch.
"""

from fastdecode.ops.norm import (
    fused_add_rms_norm, fused_add_rms_norm_fp8, fused_add_rms_norm_fp8_ref, fused_add_rms_norm_ref,
    rms_norm, rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref,
)
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref, silu_and_mul_ref
from fastdecode.ops.quant import quantize_fp8, quantize_fp8_ref
from fastdecode.ops.allreduce import CommWorkspace, all_reduce, all_reduce_add_rms_norm, all_reduce_ref
from fastdecode.ops.gemm import get_linear_config, linear, linear_fp8, linear_fp8_ref, linear_ref
from fastdecode.ops.glu_linear import silu_and_mul_linear
from fastdecode.ops.norm_linear import add_linear_, add_linear_ref, rms_norm_linear, rms_norm_linear_ref
from fastdecode.ops.int4 import get_int4_config, int4_linear, int4_linear_fp8, int4_linear_fp8_ref, int4_linear_ref
from fastdecode.ops.int4_norm_linear import (
    int4_add_linear_, int4_add_linear_ref, int4_rms_norm_linear, int4_rms_norm_linear_ref,
)
from fastdecode.ops.int4_a8 import (
    fused_add_rms_norm_int8, fused_add_rms_norm_int8_ref, int4_linear_a8, int4_linear_a8_ref, quantize_act_int8,
    quantize_act_int8_ref, rms_norm_int8, rms_norm_int8_ref, silu_and_mul_int8, silu_and_mul_int8_ref,
)
from fastdecode.ops.argmax import argmax, argmax_ref
from fastdecode.ops._common import (
    pdl_enabled, pdl_override, set_pdl, set_weight_prefetch, weight_prefetch_bytes, weight_prefetch_enabled,
    weight_prefetch_override,
)

__all__ = [
    "fused_add_rms_norm", "fused_add_rms_norm_fp8", "fused_add_rms_norm_fp8_ref", "fused_add_rms_norm_ref",
    "rms_norm", "rms_norm_fp8", "rms_norm_fp8_ref", "rms_norm_ref",
    "silu_and_mul", "silu_and_mul_fp8", "silu_and_mul_fp8_ref", "silu_and_mul_ref",
    "quantize_fp8", "quantize_fp8_ref",
    "CommWorkspace", "all_reduce", "all_reduce_add_rms_norm", "all_reduce_ref",
    "get_linear_config", "linear", "linear_fp8", "linear_fp8_ref", "linear_ref", "silu_and_mul_linear",
    "add_linear_", "add_linear_ref", "rms_norm_linear", "rms_norm_linear_ref",
    "get_int4_config", "int4_linear", "int4_linear_fp8", "int4_linear_fp8_ref", "int4_linear_ref",
    "int4_add_linear_", "int4_add_linear_ref", "int4_rms_norm_linear", "int4_rms_norm_linear_ref",
    "int4_linear_a8", "int4_linear_a8_ref", "quantize_act_int8", "quantize_act_int8_ref",
    "rms_norm_int8", "rms_norm_int8_ref", "fused_add_rms_norm_int8", "fused_add_rms_norm_int8_ref",
    "silu_and_mul_int8", "silu_and_mul_int8_ref",
    "argmax", "argmax_ref",
    "pdl_enabled", "pdl_override", "set_pdl", "set_weight_prefetch", "weight_prefetch_bytes", "weight_prefetch_enabled",
    "weight_prefetch_override",
]
