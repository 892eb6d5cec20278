"""Int4-weight linear on a real GPU: bf16, real Llama sizes, odd M, every group size and zero mode,
both kernel paths and every tuner candidate on one shape, the dequant + cuBLAS path, W4A8 on the
FP8 tensor cores, split-K determinism, CUDA-graph capture and torch.compile(fullgraph=True).

Skipped without CUDA (conftest.py); the CPU interpreter suite is test_int4.py.
"""

import pytest
import torch

import fastdecode.ops.int4 as I
from fastdecode.bench.int4 import candidates
from fastdecode.quant import quantize_activation_fp8
from fastdecode.quant import int4 as Q

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = [(6144, 4096), (4096, 14336), (28672, 4096), (200, 4160)]  # (N, K); the last is odd (K = 16.25 tiles)


def _packed(N, K, g, fmt="sym", dtype=torch.bfloat16):
    w = torch.randn(N, K, device=DEV) / K**0.5
    if fmt == "min":  # GGUF Q4_1 style: mins
        G = K // g
        q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=DEV)
        s = (torch.rand(N, G, device=DEV) * 0.02 / K**0.25).to(dtype)
        m = (-7.5 * s.float()).to(dtype)
        return Q.prepack(q, s, group_size=g, mins=m)
    return Q.quantize_int4(w, g, symmetric=fmt == "sym", scale_dtype=dtype)


def _close(y, ref):
    # one bf16 rounding of the output; the error of fp32 sums over K is far below that
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * max(ref.float().abs().max().item(), 1e-3))


@pytest.mark.parametrize("impl", [None, "triton"])
@pytest.mark.parametrize("M", [1, 3, 16, 33, 64, 257])
@pytest.mark.parametrize("N,K", SHAPES)
def test_int4_linear_bf16_real_sizes(N, K, M, impl):
    w = _packed(N, K, 128 if K % 128 == 0 else K)
    x = torch.randn(M, K, device=DEV).bfloat16()
    b = torch.randn(N, device=DEV).bfloat16()
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = I.int4_linear(x, w, b, out=out, impl=impl)
    _close(y, I.int4_linear_ref(x, w, b))


@pytest.mark.parametrize("fmt", ["sym", "zero", "min"])
@pytest.mark.parametrize("g", [32, 64, 128, 4096])
@pytest.mark.parametrize("M", [1, 5, 48, 300])
def test_int4_linear_every_group_and_mode(M, g, fmt):
    N, K = 1024, 4096
    w = _packed(N, K, g, fmt, torch.float16 if fmt == "zero" else torch.bfloat16)
    x = torch.randn(M, K, device=DEV).bfloat16()
    _close(I.int4_linear(x, w, impl="triton"), I.int4_linear_ref(x, w))
    xh = x.half()
    _close(I.int4_linear(xh, w, impl="triton"), I.int4_linear_ref(xh, w))


@pytest.mark.parametrize("M", [256, 1024])
def test_dequant_cublas_path(M):
    w = _packed(4096, 4096, 128, "zero")
    x = torch.randn(M, 4096, device=DEV).bfloat16()
    _close(I.int4_linear(x, w, impl="dequant"), I.int4_linear_ref(x, w))


@pytest.mark.parametrize("M", [1, 4, 16, 64, 256])
def test_every_tuner_candidate(M):
    N, K = 1024, 4096
    w = _packed(N, K, 128)
    x = torch.randn(M, K, device=DEV).bfloat16()
    ref = I.int4_linear_ref(x, w)
    for cfg in candidates(M, N, K):
        if cfg["SPLIT_K"] not in (1, 4):  # the other split counts run the same code
            continue
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        I._triton_int4_linear(x, w, None, out, cfg)
        _close(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8")
@pytest.mark.parametrize("fmt,g", [("sym", 128), ("zero", 32), ("min", 64)])
@pytest.mark.parametrize("M", [1, 7, 64, 512])
def test_w4a8(M, fmt, g):
    N, K = 2048, 4096
    w = _packed(N, K, g, fmt)
    xq, xs = quantize_activation_fp8(torch.randn(M, K, device=DEV))
    ref = I.int4_linear_fp8_ref(xq, xs, w)
    _close(I.int4_linear_fp8(xq, xs, w), ref)
    xq2, xs2 = quantize_activation_fp8(torch.randn(M, K, device=DEV), 0.02)  # per-tensor
    _close(I.int4_linear_fp8(xq2, xs2, w), I.int4_linear_fp8_ref(xq2, xs2, w))


def test_act_order_gptq_on_gpu():
    N, K, g = 512, 4096, 128
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = (torch.rand(N, K // g) * 0.01).half()
    z = torch.randint(0, 16, (N, K // g), dtype=torch.uint8)
    perm = torch.randperm(K)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // g
    w = Q.prepack(q, s, group_size=g, zeros=z, g_idx=g_idx).to(DEV)
    x = torch.randn(9, K, device=DEV).half()
    _close(I.int4_linear(x, w), I.int4_linear_ref(x, w))


def test_split_k_deterministic_graph_capture_and_compile():
    N, K = 4096, 4096
    w = _packed(N, K, 128)
    x = torch.randn(1, K, device=DEV).bfloat16()
    cfg = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 8, "num_warps": 4, "num_stages": 1}
    outs = []
    for _ in range(3):
        out = torch.empty(1, N, device=DEV, dtype=torch.bfloat16)
        I._triton_int4_linear(x, w, None, out, cfg)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # graph capture: allocate once (warm-up), capture, replay with fresh inputs
    out = torch.empty(1, N, device=DEV, dtype=torch.bfloat16)
    I.int4_linear(x, w, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        I.int4_linear(x, w, out=out)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    _close(out, I.int4_linear_ref(x, w))
    f = torch.compile(lambda a: I.int4_linear(a, w), fullgraph=True)
    _close(f(x), I.int4_linear_ref(x, w))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,g", [("sym", 128), ("zero", 32), ("min", 64), ("sym", 4096), ("zero", 96)])
def test_dot_fast_conversion_equals_portable(fmt, g, x_dtype):
    """The packed-pair PTX conversion (fast_cvt) against the bitcast form the interpreter runs: the same
    dequantised operand up to the rounding of the scale to x.dtype, so results agree to the output rounding."""
    N, K, M = 1024, 4224 if g == 96 else 4096, 48  # 4224 = 44 groups of 96
    w = _packed(N, K, g, fmt)
    x = torch.randn(M, K, device=DEV).to(x_dtype)
    cfg = dict(kind="dot", BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3)
    fast = torch.full((M, N), float("nan"), device=DEV, dtype=x_dtype)
    slow = torch.full((M, N), float("nan"), device=DEV, dtype=x_dtype)
    I._triton_int4_linear(x, w, None, fast, cfg)
    I._triton_int4_linear(x, w, None, slow, {**cfg, "fast_cvt": False})
    _close(fast, slow)
    _close(fast, I.int4_linear_ref(x, w))
