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


WDTYPES = ["fp32", "bf16", "fp8"]


def _operands(M, N, K, wdtype):
    """x (strided rows), w and its per-channel scale (FP8 only: W8A16, a bf16 x as ``ops.w8a16``)."""
    x = strided_rows(M, K, torch.float32, DEV)
    w = torch.randn(N, K, device=DEV) / K**0.5
    scale = None
    if wdtype == "fp8":
        scale = torch.rand(N, device=DEV) * 0.02 + 0.01
        w, x = (w / scale[:, None] / 64).to(FP8), x.bfloat16()
    elif wdtype == "bf16":
        w, x = w.bfloat16(), x.bfloat16()
    return x, w, scale


@pytest.fixture(scope="module")
def two_tiles_compiled():
    """On a GPU, the next test's 54 launches compiled first in parallel threads (``helpers.precompile_calls``, as
    ``test_gemm_gpu.py``'s): one after another they took 14.5 s of session 44's H100 suite."""
    if not CUDA:
        return
    from functools import partial

    import fastdecode.kernels.gemm as KG
    from helpers import precompile_calls

    calls = []
    for (M, N, K, bn, bk, split), wdtype in [(c, d) for c in CASES for d in WDTYPES]:
        x, w, scale = _operands(M, N, K, wdtype)
        calls += [partial(_run, x, w, _cfg(M, bn, bk, split, p), scale) for p in (False, True, 2)]
    precompile_calls(calls, [(KG, "_skinny_linear_kernel")])


@pytest.mark.parametrize("M,N,K,bn,bk,split", CASES)
@pytest.mark.parametrize("wdtype", WDTYPES)
def test_two_tiles_in_flight_give_the_same_bits(two_tiles_compiled, M, N, K, bn, bk, split, wdtype):
    x, w, scale = _operands(M, N, K, wdtype)
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


@pytest.mark.parametrize("wdtype", ["bf16", "fp8"])
def test_the_norm_inside_with_two_tiles_in_flight(wdtype):
    """X_NORM (one split): the squares of h summed beside the products, the same with the weights loaded early; with
    FP8 weights (W8A16's ``rms_norm_linear_w8a16``, wqkv in the FP8 step) also with them in x's layout."""
    M, N, K = 3, 17, 330
    h = (torch.randn(M, K, device=DEV) * 3).bfloat16()
    g = (torch.rand(K, device=DEV) + 0.5).bfloat16()
    w = torch.randn(N, K, device=DEV) / K**0.5
    scale = None
    if wdtype == "fp8":
        scale = torch.rand(N, device=DEV) * 0.02 + 0.01
        w = (w / scale[:, None] / 64).to(FP8)
    else:
        w = w.bfloat16()
    layouts = ({}, {"X_LAYOUT": True}) if wdtype == "fp8" else ({},)
    outs = [_run(h, w, {**_cfg(M, 8, 64, 1, p), **lay}, scale, norm_weight=g) for p in (False, True, 2)
            for lay in layouts]
    assert torch.isfinite(outs[0].float()).all()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_prefetch_depth_takes_only_zero_to_two():
    assert [prefetch_depth({"PREFETCH": p}) for p in (False, True, 0, 1, 2)] == [0, 1, 0, 1, 2]
    assert prefetch_depth({}) == 0
    for bad in (3, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="PREFETCH"):
            prefetch_depth({"PREFETCH": bad})


# ----------------------------------------------------------------------------- X_LAYOUT (W8A16's weights in x's layout)


@pytest.mark.parametrize("M,N,K,bn,bk,split,glu", [(1, 19, 512, 8, 64, 1, False), (3, 13, 300, 4, 32, 3, False),
                                                     (2, 21, 256, 4, 64, 2, True)])
def test_weights_in_xs_layout_give_the_same_bits(M, N, K, bn, bk, split, glu):
    """``X_LAYOUT`` only narrows the FP8 weight loads to x's 8 elements a thread: the products and their order are
    the same, with and without PREFETCH."""
    scale = torch.rand(N, device=DEV) * 0.02 + 0.01
    w = (torch.randn(N, K, device=DEV) / K**0.5 / scale[:, None] / 64).to(FP8)
    x = strided_rows(M, 2 * K if glu else K, torch.bfloat16, DEV)
    base = _run(x, w, _cfg(M, bn, bk, split, False), scale, glu=glu)
    assert torch.isfinite(base.float()).all()
    for p in (False, True, 2):
        assert torch.equal(_run(x, w, {**_cfg(M, bn, bk, split, p), "X_LAYOUT": True}, scale, glu=glu), base), p


def test_x_layout_applies_only_to_fma_weights_narrower_than_x():
    from fastdecode.kernels.gemm import x_layout_vec

    x16, x8 = torch.empty(1, 8, dtype=torch.bfloat16), torch.empty(1, 8, dtype=FP8)
    w8, w16 = torch.empty(4, 8, dtype=FP8), torch.empty(4, 8, dtype=torch.bfloat16)
    fma = {"kind": "fma", "X_LAYOUT": True}
    assert x_layout_vec(fma, x16, w8) == 8  # W8A16: bf16 x's 16-byte load
    assert x_layout_vec({**fma, "X_LAYOUT": False}, x16, w8) == 0
    assert x_layout_vec({"kind": "fma"}, x16, w8) == 0
    assert x_layout_vec({**fma, "kind": "dot"}, x16, w8) == 0
    assert x_layout_vec(fma, x8, w8) == 0 and x_layout_vec(fma, x16, w16) == 0  # same widths: the layouts agree


X_LAYOUT_CASES = [(8, 1024, 4, False, False), (4, 2048, 4, False, False), (8, 1024, 4, True, False),
                  (8, 1024, 4, False, True)]


def _x_layout_kw(bn, bk, warps, glu, norm):
    return dict(num_warps=warps, aligned=True, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=False, PF_LANES=32 * warps,
                X_GLU=glu, X_NORM=norm, NORM_AFFINE=norm, SPLIT=not norm)  # norm: wqkv's rms_norm_linear_w8a16


@pytest.fixture(scope="module")
def x_layout_ptx():
    """The X_LAYOUT test's eight compiles at once (``helpers.sm90_ptx_ahead``)."""
    from helpers import sm90_ptx_ahead, w8a16_job

    sm90_ptx_ahead([w8a16_job(**_x_layout_kw(*case), **extra) for case in X_LAYOUT_CASES
                    for extra in ({}, {"W_VEC": 8})])


@pytest.mark.parametrize("bn,bk,warps,glu,norm", X_LAYOUT_CASES)
def test_sm90_w8a16_loop_with_x_layout_has_no_shared_memory_round_trip(x_layout_ptx, bn, bk, warps, glu, norm):
    """No GPU needed: with real shapes' alignment the W8A16 K loop loads 16 FP8 weights a thread against x's 8 bf16
    and converts x through shared memory every step (bar.sync); ``X_LAYOUT`` (W_VEC 8) loads the weights 8 bytes at a
    time in x's layout: no barrier, no shared memory in the loop, x still one 16-byte load."""
    import re

    from helpers import k_loop, w8a16_ptx

    kw = _x_layout_kw(bn, bk, warps, glu, norm)
    plain = k_loop(w8a16_ptx(**kw))
    assert "bar.sync" in plain  # the defect X_LAYOUT is for (if Triton stops shuffling, the key is moot)
    body = k_loop(w8a16_ptx(**kw, W_VEC=8))
    assert "bar.sync" not in body and "shared" not in body
    loads = re.findall(r"ld\.global(?:\.[\w:]+)*\.(v[24])\.b32", body)
    assert loads.count("v2") == bn * bk // (8 * 32 * warps), loads  # one 8-byte load a row a chunk of 8 weights
    # x (gate and up with glu; h and the norm weight with the norm inside)
    assert loads.count("v4") == (2 if glu or norm else 1) * bk // (8 * 32 * warps), loads
