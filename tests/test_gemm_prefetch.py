"""The skinny GEMV's FMA path with two weight tiles in flight (``PREFETCH: 2``, ``kernels.gemm``).

PREFETCH only moves the weight loads earlier: the products and their order of accumulation are those of PREFETCH 0
and 1, so every output is the same bit for bit. Checked on the device that runs the suite (the interpreter on the
CPU: fp32 and bf16 / fp8 weights on the FMA path, which has no ``tl.dot``), with odd sizes, K not a multiple of
BLOCK_K, splits whose last one is short, SiLU-and-mul in the loads (W8A16's w2) and the RMSNorm inside (X_NORM).
The sm_90 code: ``test_gemm.py``'s PTX guards run PREFETCH 2 too.
"""

import pytest
import torch

from fastdecode.constants import SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR
from fastdecode.kernels.gemm import prefetch_depth
from fastdecode.ops.gemm import linear_with_config
from helpers import FP8, poison_, strided_rows

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _cfg(M, bn, bk, split, prefetch):
    return dict(kind="fma", BLOCK_M=min(4, 1 << max(M - 1, 0).bit_length()), BLOCK_N=bn, BLOCK_K=bk,
                SPLIT_K=split, num_warps=1 if not CUDA else 2, num_stages=1, PREFETCH=prefetch)


def _run(x, w, cfg, w_scale=None, glu=False, norm_weight=None):
    M, N = x.shape[0], w.shape[0]
    out = poison_(torch.empty(M, N, device=DEV, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype))
    w_mode = SCALE_NONE if w_scale is None else (SCALE_TENSOR if w_scale.numel() == 1 else SCALE_VECTOR)
    linear_with_config(x, w, None, None, SCALE_NONE, w_scale, w_mode, out, cfg, glu=glu, norm_weight=norm_weight,
                       eps=1e-6)
    return out


# (M, N, K, BLOCK_N, BLOCK_K, SPLIT_K): one K step a split (the prefetches past the end load nothing), K not a
# multiple of BLOCK_K (masked last tile), a split count whose last split is short, several row tiles
CASES = [(1, 19, 256, 8, 64, 1), (1, 37, 200, 4, 64, 1), (3, 13, 300, 4, 32, 3), (2, 24, 64, 8, 64, 1),
         (4, 9, 416, 4, 32, 5), (1, 33, 64, 8, 32, 2)]


@pytest.mark.parametrize("M,N,K,bn,bk,split", CASES)
@pytest.mark.parametrize("wdtype", ["fp32", "bf16", "fp8"])
def test_two_tiles_in_flight_give_the_same_bits(M, N, K, bn, bk, split, wdtype):
    x = strided_rows(M, K, torch.float32, DEV)
    w = torch.randn(N, K, device=DEV) / K**0.5
    scale = None
    if wdtype == "fp8":  # W8A16: FP8 weights with per-channel scales, a bf16 x (ops.w8a16)
        scale = torch.rand(N, device=DEV) * 0.02 + 0.01
        w, x = (w / scale[:, None] / 64).to(FP8), x.bfloat16()
    elif wdtype == "bf16":
        w, x = w.bfloat16(), x.bfloat16()
    outs = [_run(x, w, _cfg(M, bn, bk, split, p), scale) for p in (False, True, 2)]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[2], outs[1]) and torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("M,K,split", [(1, 300, 1), (2, 256, 3)])
def test_silu_and_mul_in_the_loads_with_two_tiles_in_flight(M, K, split):
    """W8A16's w2 (``glu``): x is ``[gate | up]`` and the loads compute ``silu(gate) * up``."""
    N = 21
    scale = torch.rand(N, device=DEV) * 0.02 + 0.01
    w = (torch.randn(N, K, device=DEV) / K**0.5 / scale[:, None] / 64).to(FP8)
    h = torch.randn(M, 2 * K, device=DEV).bfloat16()
    outs = [_run(h, w, _cfg(M, 4, 64, split, p), scale, glu=True) for p in (False, True, 2)]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[2], outs[1]) and torch.equal(outs[1], outs[0])


def test_the_norm_inside_with_two_tiles_in_flight():
    """X_NORM (one split): the squares of h summed beside the products, the same with the weights loaded early."""
    M, N, K = 3, 17, 330
    h = (torch.randn(M, K, device=DEV) * 3).bfloat16()
    g = (torch.rand(K, device=DEV) + 0.5).bfloat16()
    w = (torch.randn(N, K, device=DEV) / K**0.5).bfloat16()
    outs = [_run(h, w, _cfg(M, 8, 64, 1, p), norm_weight=g) for p in (False, True, 2)]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[2], outs[1]) and torch.equal(outs[1], outs[0])


def test_prefetch_depth_takes_only_zero_to_two():
    assert [prefetch_depth({"PREFETCH": p}) for p in (False, True, 0, 1, 2)] == [0, 1, 0, 1, 2]
    assert prefetch_depth({}) == 0
    for bad in (3, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="PREFETCH"):
            prefetch_depth({"PREFETCH": bad})
