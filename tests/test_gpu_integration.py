"""GPU-only: full sizes, torch.compile(fullgraph=True) with Inductor, CUDA-graph capture and replay."""

import pytest
import torch

import fastdecode as fd
from helpers import assert_close, assert_fp8_close

pytestmark = pytest.mark.gpu


def test_full_size_large_m():
    M, H, I = 32768, 8192, 14336
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(x, r, w)
    r2 = r.clone()
    q, s = fd.fused_add_rms_norm_fp8(x, r2, w)
    assert torch.equal(r2, r_ref)
    assert_fp8_close(q, q_ref, s, s_ref)
    y = fd.fused_add_rms_norm(x, r, w)
    assert torch.equal(r, r_ref)
    assert_close(y, y_ref)
    del x, r, r2
    gu = torch.randn(4096, 2 * I, device="cuda", dtype=torch.bfloat16)
    assert_close(fd.silu_and_mul(gu), fd.silu_and_mul_ref(gu))
    q, s = fd.silu_and_mul_fp8(gu)
    assert_fp8_close(q, *fd.silu_and_mul_fp8_ref(gu)[:1], s, fd.silu_and_mul_fp8_ref(gu)[1])


def test_inductor_fullgraph():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(16, 2 * 14336, device="cuda", dtype=torch.bfloat16)

    def f(x, r, w, gu):
        q, s = fd.fused_add_rms_norm_fp8(x, r, w)
        a, sa = fd.silu_and_mul_fp8(gu)
        qq, sq = fd.quantize_fp8(gu, per_token=True)
        return q, s, a, sa, qq, sq, fd.rms_norm(x, w)

    r1, r2 = r.clone(), r.clone()
    exp = f(x, r1, w, gu)
    got = torch.compile(f, fullgraph=True)(x, r2, w, gu)
    assert torch.equal(r1, r2)
    for a, b in zip(got, exp):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("M", [1, 7, 128])
def test_cuda_graph_capture_and_replay(M):
    H, I = 8192, 14336
    x = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    r = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    gu = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.02], device="cuda")
    x.normal_(), r.normal_(), gu.normal_()

    def step():
        q, s = fd.fused_add_rms_norm_fp8(x, r, w)
        y = fd.fused_add_rms_norm(x, r, w)
        a, sa = fd.silu_and_mul_fp8(gu, scale)
        return q, s, y, a, sa

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for _ in range(3):  # fresh inputs copied into the static buffers each replay
        x.normal_(), r.normal_(), gu.normal_()
        r0 = r.clone()
        q_ref, s_ref, r_mid = fd.fused_add_rms_norm_fp8_ref(x, r0, w)
        y_ref, r_end = fd.fused_add_rms_norm_ref(x, r_mid, w)
        a_ref, sa_ref = fd.silu_and_mul_fp8_ref(gu, scale)
        g.replay()
        torch.cuda.synchronize()
        q, s, y, a, sa = outs
        assert_fp8_close(q, q_ref, s, s_ref)
        assert torch.equal(r, r_end)
        assert_close(y, y_ref)
        assert_fp8_close(a, a_ref)
