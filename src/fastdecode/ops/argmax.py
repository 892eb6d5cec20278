"""Greedy decoding's token choice: ``argmax(logits)``, the column of each row's largest value.

Same result as ``torch.argmax(x, dim=-1)``, NaN included (a NaN is the largest value, the first NaN wins; among
equal values the first column). On CUDA two short kernels (``kernels/argmax.py``) spread each row over many
SMs, where torch's reduction of one row runs in one block (on the H200 13.2 us for SmolLM2's 49152 logits,
27.7 us for Llama-3's 128256: ``benchmarks/NOTES.md``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import as_rows, cdiv, check_out, check_tensor, next_pow2, resolve_backend

MAX_CHUNKS = 4096  # the second kernel reads every chunk's winner of a row at once


def argmax_config(V: int) -> dict:
    """BLOCK columns a program of the first kernel (2048: 63 programs a row at a 128K vocabulary), PBLOCK >= the
    number of chunks."""
    block = min(next_pow2(V), 2048)
    while cdiv(V, block) > MAX_CHUNKS:
        block *= 2
    return {"BLOCK": block, "PBLOCK": next_pow2(cdiv(V, block)), "num_warps": max(1, min(8, block // 512))}


@define_op("argmax", mutates_args=("out",))
def _argmax_op(x: torch.Tensor, out: torch.Tensor, backend: str) -> None:
    """x: (B, V) rows with unit inner stride, V >= 1; out: (B,) int64."""
    if backend == "triton":
        from fastdecode.kernels.argmax import launch_argmax

        cfg = argmax_config(x.shape[1])
        part = torch.empty(x.shape[0], cdiv(x.shape[1], cfg["BLOCK"]), dtype=torch.int32, device=x.device)
        launch_argmax(x, part, out, cfg)
        return
    out.copy_(torch.argmax(x, dim=-1))


@_argmax_op.register_fake
def _(x, out, backend):
    return None


def argmax(x: torch.Tensor, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)``: int64 of shape ``x.shape[:-1]`` (x: bf16 / fp16 / fp32, at least 1-D, a
    non-empty last dimension; rows may be strided)."""
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be (..., V) with V >= 1 to take an argmax over V, got shape {tuple(x.shape)}")
    shape = tuple(x.shape[:-1])
    check_out("out", out, shape, torch.int64, x.device)
    be = resolve_backend(backend, x.device, "argmax")
    out = torch.empty(shape, dtype=torch.int64, device=x.device) if out is None else out
    rows = as_rows("x", x)
    if rows.shape[0] > 0:
        _argmax_op(rows, out.view(-1), be)
    return out


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`argmax`."""
    return torch.argmax(x, dim=-1)
