"""Tolerances and comparisons shared by the tests (one table, STYLE.md habit 7)."""

import os
import socket

import torch

FP8 = torch.float8_e4m3fn

# Absolute/relative tolerances of a kernel output against its fp32-math reference, per output dtype.
# The reference rounds exactly as the kernel does, so what is left is summation order in fp32
# (rows up to 16K elements: ~1e-6 relative) plus one rounding step of the output dtype where the
# different order puts a value on the other side of a rounding boundary.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),   # one fp16 ulp at |y| ~ 1 is 1e-3
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),  # one bf16 ulp at |y| ~ 1 is 7.8e-3
}
# The interpreter casts fp32 -> bf16 by truncation (see assert_rounding_equal): a truncated residual
# feeds a truncated output, so two bf16 ulps there.
INTERPRETER_BF16 = dict(atol=1.6e-2, rtol=1.6e-2)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def assert_close(actual, expected, dtype=None):
    dtype = dtype or expected.dtype
    tol = INTERPRETER_BF16 if (dtype == torch.bfloat16 and interpreter_on()) else TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn values around |v| (3 mantissa bits; subnormal spacing 2^-9)."""
    a = v.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def assert_fp8_close(q, q_ref, scale=None, scale_ref=None, *, max_mismatch=0.05):
    """FP8 outputs agree within one e4m3 step, elementwise, after dequantisation.

    Under the Triton interpreter (triton 3.6-3.9) the fp32 -> float8e4nv cast drops the carry when a
    value rounds up to the next power of two (e.g. 125.3 -> 64 instead of 128), on ~2% of elements:
    those, and only those, are accepted there (value exactly half a power-of-two reference).
    """
    assert q.dtype == FP8 and q_ref.dtype == FP8, (q.dtype, q_ref.dtype)
    a, b = q.float(), q_ref.float()
    assert not torch.isnan(a).any(), "NaN in FP8 output (unwritten or overflowed)"
    if scale is not None:
        torch.testing.assert_close(scale.float(), scale_ref.float(), atol=0, rtol=1e-5)
    ok = (a - b).abs() <= e4m3_step(b) * 1.0001
    if interpreter_on():
        log2b = torch.log2(b.abs())
        lost_carry = (log2b == log2b.round()) & (a == b / 2)
        ok |= lost_carry
    bad = (~ok).sum().item()
    assert bad == 0, f"{bad} of {a.numel()} FP8 values differ by more than one e4m3 step"
    mismatch = (a != b).float().mean().item()
    if interpreter_on() and a.numel() < 2000:
        # ~2-3% of elements round differently there; over a hundred elements that fraction is noisy
        max_mismatch = max(max_mismatch, 0.15)
    assert mismatch <= max_mismatch, f"{mismatch:.1%} of FP8 values differ from the reference"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or 0xFF bytes for FP8: NaN too) so unwritten elements fail."""
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        t.fill_(float("nan"))
    return t


def strided_rows(M, H, dtype, device="cpu", pad=13):
    """(M, H) view with a row stride of H + pad: non-contiguous in the row dimension."""
    base = torch.randn(M, H + pad, dtype=torch.float32, device=device).to(dtype)
    return base[:, :H]


def assert_rounding_equal(actual, expected):
    """Equal bit for bit, as the kernel and its reference round the same way.

    Exception: the Triton interpreter casts fp32 -> bf16 by truncation rather than round-to-nearest,
    so there a bf16 result may sit one bf16 ulp (toward zero) from the reference.
    """
    if interpreter_on() and expected.dtype == torch.bfloat16:
        ulp = torch.exp2(torch.floor(torch.log2(expected.float().abs().clamp(min=2.0**-126))) - 7)
        assert torch.all((actual.float() - expected.float()).abs() <= ulp), "more than one bf16 ulp apart"
    else:
        assert torch.equal(actual, expected), "results that should round identically differ"


def free_port() -> int:
    """A free TCP port on the loopback interface, for a test's own process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
