"""RMSNorm / fused add + RMSNorm (native and FP8 output) against their references.

On the CPU the Triton kernels run under the interpreter (conftest.py); on a GPU they run for real.
"""

import pytest
import torch

import fastdecode as fd
from helpers import FP8, assert_close, assert_fp8_close, assert_rounding_equal, poison_, strided_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [111, 576, 4096, 4099, 8192, 16384]
# FP8 tests compare scales tightly: under the interpreter bf16 casts truncate (helpers.py), which
# moves dynamic scales by up to a bf16 ulp, so the CPU runs them in fp16 and the GPU in bf16.
ACT = torch.bfloat16 if DEV == "cuda" else torch.float16


def _inputs(M, H, dtype, strided=False):
    x = strided_rows(M, H, dtype, DEV) if strided else torch.randn(M, H, device=DEV).to(dtype)
    r = torch.randn(M, H, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(dtype)
    return x, r, w


@pytest.mark.parametrize("H", SIZES)
@pytest.mark.parametrize("M", [1, 7, 128])
def test_fused_add_rms_norm_sizes(M, H):
    x, r, w = _inputs(M, H, torch.bfloat16)
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w, 1e-6)
    out = poison_(torch.empty_like(x))
    y = fd.fused_add_rms_norm(x, r, w, 1e-6, out=out, backend="triton")
    assert y is out
    assert_rounding_equal(r, r_ref)
    assert_close(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_dtypes_and_strided_rows(dtype, strided):
    x, r, w = _inputs(7, 4099, dtype, strided=strided)
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    y = fd.fused_add_rms_norm(x, r, w, backend="triton")
    assert_close(r, r_ref)
    assert_close(y, y_ref)
    assert_close(fd.rms_norm(x, w, backend="triton"), fd.rms_norm_ref(x, w))


def test_strided_residual_is_updated_in_place():
    x, _, w = _inputs(5, 576, torch.float16)
    r_big = torch.randn(5, 600, device=DEV).half()
    r = r_big[:, :576]
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    before_pad = r_big[:, 576:].clone()
    y = fd.fused_add_rms_norm(x, r, w, backend="triton")
    assert torch.equal(r_big[:, :576], r_ref)
    assert torch.equal(r_big[:, 576:], before_pad), "the kernel wrote outside the residual view"
    assert_close(y, y_ref)


def test_mixed_precision_residual_and_nd_input():
    # bf16 activations with an fp32 residual stream, and a (batch, seq, H) input
    x = torch.randn(2, 3, 576, device=DEV).bfloat16()
    r = torch.randn(2, 3, 576, device=DEV)
    w = torch.randn(576, device=DEV).bfloat16()
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    y = fd.fused_add_rms_norm(x, r, w, backend="triton")
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert_close(r, r_ref)
    assert_close(y, y_ref)


def test_wide_rows_take_the_chunked_path():
    x, r, w = _inputs(3, 40000, torch.float32)  # > 32768: chunked, re-reads from L2
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    y = fd.fused_add_rms_norm(x, r, w, backend="triton")
    assert_close(r, r_ref)
    assert_close(y, y_ref)
    q, s = fd.rms_norm_fp8(x, w, backend="triton")
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w)
    assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("H", [111, 4096, 8192])
@pytest.mark.parametrize("M", [1, 7, 128])
@pytest.mark.parametrize("static", [False, True])
def test_fused_add_rms_norm_fp8(M, H, static):
    x, r, w = _inputs(M, H, ACT)
    scale = torch.tensor([0.01], device=DEV) if static else None
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w, 1e-5, scale=scale)
    out = poison_(torch.empty(M, H, dtype=FP8, device=DEV))
    q, s = fd.fused_add_rms_norm_fp8(x, r, w, 1e-5, scale=scale, out=out, backend="triton")
    assert q is out
    assert_rounding_equal(r, r_ref)
    assert s.dtype == torch.float32
    assert s.shape == ((1,) if static else (M, 1))
    assert_fp8_close(q, q_ref, s, s_ref)
    # the dynamic scale makes each row's largest value land on +-448
    if not static:
        assert torch.all(q.float().abs().amax(-1) >= 416)


def test_fp8_static_scale_saturates():
    x, _, w = _inputs(4, 576, torch.float32)
    q, s = fd.rms_norm_fp8(x, w, scale=1e-4, backend="triton")  # |y|/scale >> 448
    assert q.float().abs().max().item() == 448.0
    q_ref, _ = fd.rms_norm_fp8_ref(x, w, scale=1e-4)
    assert_fp8_close(q, q_ref)


def test_zero_rows_and_empty_input():
    x = torch.zeros(3, 576, device=DEV)
    w = torch.ones(576, device=DEV)
    q, s = fd.rms_norm_fp8(x, w, backend="triton")
    assert torch.all(q.float() == 0) and torch.all(s > 0)
    e = torch.empty(0, 576, device=DEV)
    assert fd.rms_norm(e, w, backend="triton").shape == (0, 576)
    q, s = fd.fused_add_rms_norm_fp8(e, e.clone(), w, backend="triton")
    assert q.shape == (0, 576) and s.shape == (0, 1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backends_agree(backend):
    x, r, w = _inputs(7, 576, torch.float16)
    r2 = r.clone()
    y1 = fd.fused_add_rms_norm(x, r, w, backend=backend)
    y2, r_ref = fd.fused_add_rms_norm_ref(x, r2, w)
    assert_rounding_equal(r, r_ref)
    assert_close(y1, y2)


# ----------------------------------------------------------------------------- bad input


def _expect(match, fn, *args, exc=ValueError, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def test_errors_name_the_argument_and_leave_residual_untouched():
    x, r, w = _inputs(4, 576, torch.float16)
    r0 = r.clone()
    _expect("x must have dtype", fd.fused_add_rms_norm, x.int(), r, w)
    _expect("residual must have the shape", fd.fused_add_rms_norm, x, r[:, :500], w)
    _expect("weight must have 576 elements", fd.fused_add_rms_norm, x, r, w[:500])
    _expect("weight must be 1-D", fd.fused_add_rms_norm, x, r, w.view(2, 288))
    _expect("eps must be a non-negative", fd.fused_add_rms_norm, x, r, w, -1.0)
    _expect("scale must be positive", fd.fused_add_rms_norm_fp8, x, r, w, scale=torch.tensor([-1.0], device=DEV))
    _expect("scale must be a positive finite", fd.fused_add_rms_norm_fp8, x, r, w, scale=0.0)
    _expect("scale must hold one element", fd.fused_add_rms_norm_fp8, x, r, w, scale=torch.ones(4, device=DEV))
    _expect("scale must be float32", fd.fused_add_rms_norm_fp8, x, r, w, scale=torch.ones(1, device=DEV).half())
    _expect("out must be a tensor of shape", fd.fused_add_rms_norm, x, r, w, out=torch.empty(4, 575, device=DEV))
    _expect("out must be a tensor of shape", fd.fused_add_rms_norm_fp8, x, r, w, out=torch.empty_like(x))
    _expect("backend must be one of", fd.fused_add_rms_norm, x, r, w, backend="cuda")
    _expect("residual must be a torch.Tensor", fd.fused_add_rms_norm, x, None, w)
    r_t = torch.randn(576, 4, device=DEV).half().t()  # inner stride 4: cannot be updated in place
    _expect("residual must have unit stride", fd.fused_add_rms_norm, x, r_t, w)
    assert torch.equal(r, r0), "a rejected call wrote to residual"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 devices")
def test_device_mismatch():
    x, r, w = _inputs(4, 576, torch.float16)
    _expect("weight is on", fd.fused_add_rms_norm, x, r, w.to("cuda:1"))


def test_device_mismatch_cpu_meta():
    x, r, w = _inputs(4, 576, torch.float16)
    _expect("is on meta", fd.fused_add_rms_norm, x, r, w.to("meta"))


def test_fp8_needs_sm89(monkeypatch):
    """FP8 output on a GPU older than sm_89 is a RuntimeError, checked before anything runs."""
    import fastdecode.ops._common as common

    monkeypatch.setattr(common, "device_capability", lambda d: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake A100")
    with pytest.raises(RuntimeError, match="FP8 output needs a GPU with compute capability >= 8.9"):
        common.require_sm(torch.device("cuda", 0), 8, 9, "FP8 output")


# ----------------------------------------------------------------------------- review follow-ups


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_norm_hidden_size_0_returns_min_scales_not_garbage(backend):
    """H = 0: nothing to launch, but the dynamic scales must still be written (the floor, as the
    reference and the per-tensor quantiser give), not left uninitialised."""
    w = torch.empty(0, device=DEV)
    for M in (4, 0):
        x = torch.empty(M, 0, device=DEV)
        q, s = fd.rms_norm_fp8(x, w, backend=backend)
        q_ref, s_ref = fd.rms_norm_fp8_ref(x, w)
        assert q.shape == (M, 0) and s.shape == s_ref.shape == (M, 1)
        assert torch.equal(s, torch.full((M, 1), fd.ops._common.FP8_MIN_SCALE, device=DEV))
        assert torch.equal(s, s_ref)
        q, s = fd.fused_add_rms_norm_fp8(x, x.clone(), w, backend=backend)
        q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(x, x.clone(), w)
        assert torch.equal(s, s_ref) and s.shape == (M, 1)
    # and for M = 0 with a real hidden size (a no-op that leaves residual alone)
    x, r, w = _inputs(0, 576, torch.float16)
    q, s = fd.fused_add_rms_norm_fp8(x, r, w, backend=backend)
    assert q.shape == (0, 576) and s.shape == (0, 1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_native_fused_add_rms_norm_m0_is_a_no_op(backend):
    x, r, w = _inputs(0, 576, torch.float16)
    y = fd.fused_add_rms_norm(x, r, w, backend=backend)
    assert y.shape == (0, 576) and y.dtype == torch.float16
    assert fd.rms_norm(x, w, backend=backend).shape == (0, 576)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expanded_or_overlapping_residual_is_rejected(backend):
    """Regression: a stride-0 (expanded) residual reached the kernel, which then wrote one memory row
    from several rows (the torch backend failed inside copy_). Now a ValueError, nothing written."""
    x, _, w = _inputs(4, 64, torch.float16)
    base = torch.randn(1, 64, device=DEV).half()
    before = base.clone()
    with pytest.raises(ValueError, match=r"residual has rows that overlap in memory \(row stride 0 < 64"):
        fd.fused_add_rms_norm(x, base.expand(4, 64), w, backend=backend)
    with pytest.raises(ValueError, match="residual has rows that overlap"):
        fd.fused_add_rms_norm_fp8(x, base.expand(4, 64), w, backend=backend)
    assert torch.equal(base, before)
    flat = torch.randn(4 * 32 + 32, device=DEV).half()
    overlapping = flat.as_strided((4, 64), (32, 1))  # row i shares half its memory with row i + 1
    flat0 = flat.clone()
    with pytest.raises(ValueError, match=r"row stride 32 < 64"):
        fd.fused_add_rms_norm(x, overlapping, w, backend=backend)
    assert torch.equal(flat, flat0)
    # one row: any row stride is fine, an expanded single row included
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x[:1], base, w)
    r1 = base.clone().as_strided((1, 64), (0, 1))
    assert_close(fd.fused_add_rms_norm(x[:1], r1, w, backend=backend), y_ref)
    assert_rounding_equal(r1, r_ref)


def test_fp8_norm_strided_rows():
    """Strided x and a strided (in place) residual, FP8 output, dynamic and static."""
    M, H = 5, 1000
    x = strided_rows(M, H, ACT, DEV)
    r_big = torch.randn(M, H + 24, device=DEV).to(ACT)
    r = r_big[:, :H]
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(ACT)
    pad = r_big[:, H:].clone()
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w)
    q, s = fd.fused_add_rms_norm_fp8(x, r, w, backend="triton")
    assert_rounding_equal(r, r_ref)
    assert torch.equal(r_big[:, H:], pad), "the kernel wrote outside the residual view"
    assert_fp8_close(q, q_ref, s, s_ref)
    q, s = fd.rms_norm_fp8(x, w, scale=0.01, backend="triton")
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w, scale=0.01)
    assert_fp8_close(q, q_ref, s, s_ref)
    q, s = fd.rms_norm_fp8(x, w, backend="triton")
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w)
    assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_norm_bf16_input(static):
    """bf16 in, FP8 out. The residual is rounded to bf16 in the kernel, which the interpreter does by
    truncation (helpers.py): so the FP8 output is compared with the reference of RMSNorm applied to
    the residual the kernel wrote (exact in any case), and that residual with the reference's
    within one bf16 ulp (assert_rounding_equal)."""
    x, r, w = _inputs(7, 576, torch.bfloat16)
    scale = 0.02 if static else None
    _, _, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w, scale=scale)
    out = poison_(torch.empty(7, 576, dtype=FP8, device=DEV))
    q, s = fd.fused_add_rms_norm_fp8(x, r, w, scale=scale, out=out, backend="triton")
    assert_rounding_equal(r, r_ref)
    q_ref, s_ref = fd.rms_norm_fp8_ref(r, w, scale=scale)
    assert_fp8_close(q, q_ref, s, s_ref)
    # no bf16 rounding inside rms_norm_fp8: compared with its reference directly, scales to 1e-5
    q, s = fd.rms_norm_fp8(x, w, scale=scale, backend="triton")
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w, scale=scale)
    assert_fp8_close(q, q_ref, s, s_ref)


@pytest.mark.parametrize("M,H", [(7, 576), (1, 16384)])
def test_fp8_norm_real_sizes(M, H):
    x, r, w = _inputs(M, H, ACT)
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w)
    out = poison_(torch.empty(M, H, dtype=FP8, device=DEV))
    q, s = fd.fused_add_rms_norm_fp8(x, r, w, out=out, backend="triton")
    assert_rounding_equal(r, r_ref)
    assert_fp8_close(q, q_ref, s, s_ref)
    q, s = fd.rms_norm_fp8(x, w, scale=0.01, backend="triton")
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w, scale=0.01)
    assert_fp8_close(q, q_ref, s, s_ref)
