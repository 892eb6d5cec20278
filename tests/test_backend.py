"""The backend switch, fallback logging, and torch.compile / custom-op integration on the CPU."""

import logging

import pytest
import torch

import fastdecode as fd
from fastdecode.ops import _common
from helpers import assert_close, interpreter_on


def test_explicit_torch_backend_runs_reference(monkeypatch):
    x = torch.randn(3, 64)
    w = torch.randn(64)
    assert torch.equal(fd.rms_norm(x, w, backend="torch"), fd.rms_norm_ref(x, w))


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("FASTDECODE_BACKEND", "torch")
    assert _common.resolve_backend(None, torch.device("cpu"), "op") == "torch"
    monkeypatch.setenv("FASTDECODE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        _common.resolve_backend(None, torch.device("cpu"), "op")


def test_auto_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("FASTDECODE_BACKEND", raising=False)
    _common._logged_fallbacks.clear()
    with caplog.at_level(logging.INFO, logger="fastdecode"):
        for _ in range(3):
            assert _common.resolve_backend("auto", torch.device("cpu"), "rms_norm") == "torch"
    lines = [r for r in caplog.records if "rms_norm uses the torch backend" in r.getMessage()]
    assert len(lines) == 1


def test_explicit_triton_that_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton' was requested but tensors are on the CPU"):
        _common.resolve_backend("triton", torch.device("cpu"), "rms_norm")


def test_ops_are_registered_custom_ops():
    for name in ("rms_norm", "silu_and_mul", "quantize_fp8"):
        assert hasattr(torch.ops.fastdecode, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    """fullgraph=True: the ops trace as single custom-op calls, no graph break (aot_eager: no C++).

    CPU tensors; Triton runs on them under the interpreter only (the GPU suite compiles with
    Inductor on CUDA tensors in test_gpu_integration.py).
    """
    if backend == "triton" and not interpreter_on():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (GPU machine: see test_gpu_integration)")
    x = torch.randn(4, 96, dtype=torch.float16)
    r = torch.randn(4, 96, dtype=torch.float16)
    w = torch.randn(96, dtype=torch.float16)
    gu = torch.randn(4, 192, dtype=torch.float16)

    def f(x, r, w, gu):
        y = fd.fused_add_rms_norm(x, r, w, 1e-6, backend=backend)
        q, s = fd.rms_norm_fp8(y, w, backend=backend)
        a = fd.silu_and_mul(gu, backend=backend)
        qa, sa = fd.quantize_fp8(a, per_token=True, backend=backend)
        return y, q, s, a, qa, sa

    r_eager = r.clone()
    expected = f(x, r_eager, w, gu)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    r_comp = r.clone()
    got = compiled(x, r_comp, w, gu)
    assert torch.equal(r_comp, r_eager), "the in-place residual update was lost under compile"
    for a, b in zip(got, expected):
        assert_close(a.float(), b.float(), dtype=torch.float32)
