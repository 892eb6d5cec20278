"""The model's RMSNorm module (``RMSNorm``): native, FP8 or int8 output, the residual add and the tensor-parallel
all-reduce before it, on the ops of ``fastdecode.ops.norm`` / ``ops.allreduce`` / ``ops.int4_a8``.

It calls those ops by their names in this module (tests/test_engine_fp8.py shadows them with reference checks, as
it does the names in ``fastdecode.models.llama``).
"""

from __future__ import annotations

import torch
from torch import nn

from fastdecode.ops import int4_a8 as A8
from fastdecode.ops.allreduce import all_reduce, all_reduce_add_rms_norm
from fastdecode.ops.norm import (
    fused_add_rms_norm, fused_add_rms_norm_fp8, fused_add_rms_norm_fp8_ref, fused_add_rms_norm_ref, rms_norm,
    rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref,
)


class RMSNorm(nn.Module):
    """RMSNorm; ``fp8_out``: return ``(fp8, per-token scale)`` for an ``Fp8Linear``; ``int8_out``: up to 2 rows, the
    int8 activation of a W4A8 ``Int4Linear`` (``int4_a8``); ``comm``: a ``CommWorkspace`` when the input of
    ``add_forward`` is a tensor-parallel partial sum (all-reduced first, fused with the add and the norm unless
    ``fuse_comm`` is off; no int8 output then); ``fused=False``: plain-PyTorch ops (ablation), and no FP8 / int8
    output (the next projection then quantises in a separate kernel)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)
        self.fp8_out = False
        self.a16_rows = 0  # fp8_a16(_all): up to this many rows stay 16-bit although fp8_out (the consumer: W8A16)
        self.int8_out = False
        self.fused = True
        self.comm = None
        self.fuse_comm = True

    def _int8(self, x) -> bool:
        return self.int8_out and self.fused and self.comm is None and x.numel() <= A8.DECODE_MAX_M * x.shape[-1]

    def _fp8(self, x) -> bool:
        return self.fp8_out and x.numel() > self.a16_rows * x.shape[-1]

    def forward(self, x: torch.Tensor, backend: str):
        if not self.fused:
            backend = "ref"
        if self._int8(x):
            if backend == "ref":
                return A8.rms_norm_int8_ref(x, self.weight, self.eps)
            return A8.rms_norm_int8(x, self.weight, self.eps, backend=backend)
        if self._fp8(x):
            if backend == "ref":
                return rms_norm_fp8_ref(x, self.weight, self.eps)
            return rms_norm_fp8(x, self.weight, self.eps, backend=backend)
        if backend == "ref":
            return rms_norm_ref(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, backend=backend)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, backend: str):
        """Returns ``(rms_norm(x + residual), x + residual)``; the op version updates ``residual`` in place.

        The first element is an ``(fp8, scale)`` pair when ``fp8_out``; x is summed over ranks first with ``comm``.
        """
        if not self.fused:
            backend = "ref"
        if self.comm is not None:
            if self.fuse_comm and backend != "ref":
                return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.comm, fp8=self._fp8(x),
                                               backend=backend), residual
            x = all_reduce(x, self.comm)
        if self._int8(x):
            if backend == "ref":
                return A8.fused_add_rms_norm_int8_ref(x, residual, self.weight, self.eps)
            return A8.fused_add_rms_norm_int8(x, residual, self.weight, self.eps, backend=backend), residual
        if backend == "ref":
            if self._fp8(x):
                q, s, r = fused_add_rms_norm_fp8_ref(x, residual, self.weight, self.eps)
                return (q, s), r
            return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)
        if self._fp8(x):
            return fused_add_rms_norm_fp8(x, residual, self.weight, self.eps, backend=backend), residual
        return fused_add_rms_norm(x, residual, self.weight, self.eps, backend=backend), residual
