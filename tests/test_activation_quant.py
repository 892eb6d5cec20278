"""SiLU-and-mul and FP8 quantisation against their references."""

import pytest
import torch

import fastdecode as fd
from helpers import FP8, assert_close, assert_fp8_close, poison_, strided_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float16  # see test_norm.py


@pytest.mark.parametrize("I", [111, 576, 4099, 14336])
@pytest.mark.parametrize("M", [1, 7, 128])
def test_silu_and_mul_sizes(M, I):
    x = torch.randn(M, 2 * I, device=DEV).bfloat16()
    out = poison_(torch.empty(M, I, dtype=x.dtype, device=DEV))
    y = fd.silu_and_mul(x, out=out, backend="triton")
    assert y is out
    assert_close(y, fd.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul_dtypes_strided_nd(dtype):
    x = strided_rows(6, 2 * 576, dtype, DEV)
    assert_close(fd.silu_and_mul(x, backend="triton"), fd.silu_and_mul_ref(x))
    x3 = torch.randn(2, 3, 2 * 111, device=DEV).to(dtype)
    y3 = fd.silu_and_mul(x3, backend="triton")
    assert y3.shape == (2, 3, 111)
    assert_close(y3, fd.silu_and_mul_ref(x3))


def test_silu_and_mul_matches_torch_functional():
    x = torch.randn(5, 2 * 300, device=DEV, dtype=torch.float32)
    g, u = x.chunk(2, dim=-1)
    assert_close(fd.silu_and_mul(x, backend="triton"), torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("I", [111, 4099, 14336, 40000])
@pytest.mark.parametrize("M", [1, 7])
@pytest.mark.parametrize("static", [False, True])
def test_silu_and_mul_fp8(M, I, static):
    x = (3 * torch.randn(M, 2 * I, device=DEV)).to(ACT)
    scale = 0.02 if static else None
    q_ref, s_ref = fd.silu_and_mul_fp8_ref(x, scale)
    out = poison_(torch.empty(M, I, dtype=FP8, device=DEV))
    q, s = fd.silu_and_mul_fp8(x, scale, out=out, backend="triton")
    assert q is out and s.shape == ((1,) if static else (M, 1))
    assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("H", [111, 4096, 40000])
@pytest.mark.parametrize("M", [1, 7, 128])
@pytest.mark.parametrize("mode", ["static", "per_tensor", "per_token"])
def test_quantize_fp8(M, H, mode):
    if H == 40000 and M == 128:
        pytest.skip("5M elements: too slow for the interpreter; the chunked path is covered at M=1, 7")
    x = (4 * torch.randn(M, H, device=DEV)).to(ACT)
    kw = {"static": {"scale": torch.tensor([0.05], device=DEV)}, "per_tensor": {},
          "per_token": {"per_token": True}}[mode]
    q_ref, s_ref = fd.quantize_fp8_ref(x, **kw)
    out = poison_(torch.empty(M, H, dtype=FP8, device=DEV))
    q, s = fd.quantize_fp8(x, out=out, backend="triton", **kw)
    assert q is out
    assert s.shape == ((M, 1) if mode == "per_token" else (1,))
    assert_fp8_close(q, q_ref, s, s_ref)
    # the reference itself: dequantised values within half an e4m3 step (relative 1/16) of x
    if mode != "static":
        deq = q_ref.float() * s_ref
        assert torch.all((deq - x.float()).abs() <= x.float().abs() / 16 + s_ref * 2**-10)


def test_quantize_fp8_strided_and_empty():
    x = strided_rows(9, 1000, torch.float32, DEV)
    q, s = fd.quantize_fp8(x, per_token=True, backend="triton")
    q_ref, s_ref = fd.quantize_fp8_ref(x, per_token=True)
    assert_fp8_close(q, q_ref, s, s_ref)
    q, s = fd.quantize_fp8(torch.empty(0, 64, device=DEV), backend="triton")
    assert q.shape == (0, 64) and s.shape == (1,) and s.item() > 0


def test_errors():
    x = torch.randn(4, 10, device=DEV)
    with pytest.raises(ValueError, match="even last dimension"):
        fd.silu_and_mul(torch.randn(4, 9, device=DEV))
    with pytest.raises(ValueError, match="x must have dtype"):
        fd.silu_and_mul(x.to(torch.int32))
    with pytest.raises(ValueError, match=r"out must be a tensor of shape \(4, 5\)"):
        fd.silu_and_mul(x, out=torch.empty(4, 10, device=DEV))
    with pytest.raises(ValueError, match="scale is only meaningful with FP8"):
        fd.ops.activation._silu(x, fp8=False, scale=1.0, out=None, backend=None, op="t")
    with pytest.raises(ValueError, match="per_token=True computes dynamic scales"):
        fd.quantize_fp8(x, scale=1.0, per_token=True)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        fd.quantize_fp8(x, scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be positive"):
        fd.silu_and_mul_fp8(x, torch.zeros(1, device=DEV))


# ----------------------------------------------------------------------------- review follow-ups


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_hidden_size_0_returns_min_scales_not_garbage(backend):
    """Width 0: nothing to launch, but dynamic scales are written (the floor, as the reference and the
    per-tensor path give) instead of left uninitialised; M = 0 stays a no-op."""
    floor = torch.tensor(fd.ops._common.FP8_MIN_SCALE).item()  # as fp32
    for M in (4, 0):
        x = torch.empty(M, 0, device=DEV)
        q, s = fd.silu_and_mul_fp8(x, backend=backend)
        q_ref, s_ref = fd.silu_and_mul_fp8_ref(x)
        assert q.shape == (M, 0) and s.shape == s_ref.shape == (M, 1)
        assert torch.equal(s, torch.full((M, 1), floor, device=DEV)) and torch.equal(s, s_ref)
        q, s = fd.quantize_fp8(x, per_token=True, backend=backend)
        assert s.shape == (M, 1) and torch.equal(s, fd.quantize_fp8_ref(x, per_token=True)[1])
        assert torch.all(s == floor)
        q, s = fd.quantize_fp8(x, backend=backend)
        assert s.shape == (1,) and s.item() == floor == fd.quantize_fp8_ref(x)[1].item()
        q, s = fd.quantize_fp8(x, scale=0.5, backend=backend)
        assert q.shape == (M, 0) and s.item() == 0.5
    # M = 0 with a real width
    x = torch.empty(0, 2 * 576, device=DEV)
    for mode, kw in (("per_token", {"per_token": True}), ("static", {"scale": 0.5})):
        q, s = fd.quantize_fp8(x[:, :576], backend=backend, **kw)
        assert q.shape == (0, 576) and s.shape == ((0, 1) if mode == "per_token" else (1,))
    q, s = fd.silu_and_mul_fp8(x, backend=backend)
    assert q.shape == (0, 576) and s.shape == (0, 1)
    y = fd.silu_and_mul(x, backend=backend)
    assert y.shape == (0, 576) and y.dtype == x.dtype


@pytest.mark.parametrize("static", [False, True])
def test_silu_and_mul_fp8_strided_rows(static):
    x = strided_rows(6, 2 * 700, ACT, DEV)
    scale = 0.02 if static else None
    q, s = fd.silu_and_mul_fp8(x, scale, backend="triton")
    q_ref, s_ref = fd.silu_and_mul_fp8_ref(x, scale)
    assert_fp8_close(q, q_ref, s, s_ref)


def test_fp8_bf16_input():
    """bf16 in, FP8 out: no bf16 rounding happens in these kernels (inputs are widened to fp32), so
    the interpreter's truncating casts do not apply and the scales match to fp32 precision."""
    x = (3 * torch.randn(7, 2 * 576, device=DEV)).bfloat16()
    for scale in (None, 0.02):
        q, s = fd.silu_and_mul_fp8(x, scale, backend="triton")
        q_ref, s_ref = fd.silu_and_mul_fp8_ref(x, scale)
        assert_fp8_close(q, q_ref, s, s_ref)
    for kw in ({"per_token": True}, {}, {"scale": 0.05}):
        q, s = fd.quantize_fp8(x, backend="triton", **kw)
        q_ref, s_ref = fd.quantize_fp8_ref(x, **kw)
        assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("M,I", [(128, 576), (7, 4096), (1, 8192)])
def test_silu_and_mul_fp8_m128_and_real_sizes(M, I):
    x = (3 * torch.randn(M, 2 * I, device=DEV)).to(ACT)
    for scale in (None, 0.02):
        out = poison_(torch.empty(M, I, dtype=FP8, device=DEV))
        q, s = fd.silu_and_mul_fp8(x, scale, out=out, backend="triton")
        q_ref, s_ref = fd.silu_and_mul_fp8_ref(x, scale)
        assert q is out
        assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("M,H", [(7, 4096), (1, 8192)])
def test_quantize_fp8_real_sizes(M, H):
    x = (4 * torch.randn(M, H, device=DEV)).to(ACT)
    for kw in ({"per_token": True}, {}, {"scale": torch.tensor([0.05], device=DEV)}):
        out = poison_(torch.empty(M, H, dtype=FP8, device=DEV))
        q, s = fd.quantize_fp8(x, out=out, backend="triton", **kw)
        q_ref, s_ref = fd.quantize_fp8_ref(x, **kw)
        assert_fp8_close(q, q_ref, s, s_ref)
