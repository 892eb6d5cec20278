"""SiLU-and-mul inside the MLP's down projection: ``linear(silu_and_mul(h), weight, bias)`` as one skinny GEMM.

The GEMM's activation loads read ``[gate | up]`` and compute ``silu(gate) * up`` in fp32, rounded once to h's
dtype (the values the SiLU-and-mul kernel stores), so the result equals the two kernels bit for bit and the
(M, K) intermediate never goes through memory (``X_GLU`` in ``fastdecode.kernels.gemm``). The dispatcher is the
linear one (``fastdecode.ops.gemm``): where its table picks cuBLAS, SiLU-and-mul runs first as its own kernel.
Measured on the H200 (benchmarks/NOTES.md, session 10): the 8B bf16 decode step 4098.0 -> 4079.8 us. The int4
GEMM has it through the ``int4_glu`` switch (``int4_add_linear_(..., glu=True)``, session 30), on by default only for
a w2 of small K (``models.norm_gemm.INT4_GLU_MAX_K``): on the 8B its issue-bound loop ran slower fused (+201 us a
step, session 11). FP8 W8A8 has no such form: its activation is
quantised per token over the whole row before the GEMM (``silu_and_mul_fp8``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.constants import SCALE_NONE
from fastdecode.ops._common import check_same_device, check_tensor
from fastdecode.ops._registry import define_op
from fastdecode.ops.gemm import (
    LINEAR_DTYPES, _check_weight, _choose, _cublas_linear, check_bias, linear_ref, linear_with_config, run_linear,
)


@define_op("silu_and_mul_linear", mutates_args=("out",))
def _silu_and_mul_linear_op(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            out: torch.Tensor, impl: str) -> None:
    """h (M, 2K) unit stride in its last dimension; weight (N, K) contiguous; out (M, N) contiguous."""
    from fastdecode.ops.activation import silu_and_mul, silu_and_mul_ref

    if impl == "torch":
        out.copy_(linear_ref(silu_and_mul_ref(h), weight, bias))
        return
    which, cfg = _choose(impl, h, weight, cublas_ok=True)
    if which == "cublas":  # where the table picks cuBLAS for the shape: the two kernels
        _cublas_linear(silu_and_mul(h, backend="triton"), weight, bias, out)
    else:
        linear_with_config(h, weight, bias, None, SCALE_NONE, None, SCALE_NONE, out, cfg, glu=True)


@_silu_and_mul_linear_op.register_fake
def _(h, weight, bias, out, impl):
    return None



def silu_and_mul_linear(h, weight, bias=None, *, out=None, backend: Optional[str] = None,
                        impl: Optional[str] = None) -> torch.Tensor:
    """``linear(silu_and_mul(h), weight, bias)`` in one kernel: the GEMM computes ``silu(gate) * up`` as it loads
    its input (rounded to h.dtype, the values ``silu_and_mul`` would store), so the MLP's down projection needs
    no separate activation kernel and no (..., K) intermediate.

    h: (..., 2K) ``[gate | up]``, bf16/fp16/fp32 (rows may be strided); weight: (N, K) contiguous, h's dtype;
    bias: (N,) or None. Returns (..., N) (or ``out``). impl: as ``linear`` (where the dispatcher picks cuBLAS,
    SiLU-and-mul runs first, as two kernels).
    """
    check_tensor("h", h, dtypes=LINEAR_DTYPES)
    if h.dim() == 0:
        raise ValueError("h must have at least 1 dimension (..., 2K), got a scalar")
    check_tensor("weight", weight, dtypes=LINEAR_DTYPES, ndim=2)
    K = weight.shape[1]
    if h.shape[-1] != 2 * K:
        raise ValueError(f"h must have shape (..., 2 * K) = (..., {2 * K}) for a weight of shape "
                         f"{tuple(weight.shape)} ([gate | up], each K wide), got {tuple(h.shape)}")
    N = _check_weight(weight, K, LINEAR_DTYPES, x_name="h's gate half")
    if weight.dtype != h.dtype:
        raise ValueError(f"weight must have the dtype of h ({h.dtype}), got {weight.dtype}")
    bias = check_bias(bias, N, (h.dtype,))
    check_same_device(h=h, weight=weight, bias=bias)
    return run_linear("silu_and_mul_linear", "h", h, K, N, bias, out, impl, backend,
                      lambda h2, out2, impl_s: _silu_and_mul_linear_op(h2, weight, bias, out2, impl_s))


__all__ = ["silu_and_mul_linear"]
