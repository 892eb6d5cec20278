"""``fastdecode selfcheck``: the single-device kernels against their references, on whatever machine this is.

Checked: RMSNorm and fused add + RMSNorm (native, FP8 dynamic and static output; the in-place
residual too), SiLU-and-mul (same three outputs), FP8 quantisation (per token, per tensor, static),
the skinny ``linear``, W8A8 ``linear_fp8`` and ``int4_linear``, our Triton kernels forced. Not here:
the all-reduce (needs two GPUs) and decode attention (its own tests); ``--quick``: tiny sizes only.

On a CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by re-running this
command in a fresh process, since triton reads it at import); on a GPU they run natively.
"""

from __future__ import annotations

import os
import sys
import time
import unittest.mock

import torch


def _close(a, b, tol=1e-2):
    """Max error relative to the largest reference value (the outputs are O(1))."""
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    return err <= tol, f"max rel err {err:.2e}"


def _fp8_close(q, q_ref, s, s_ref):
    """Scales equal up to fp32 summation order, and every FP8 value within one e4m3 step of the
    reference's. Under the interpreter the fp32 -> fp8 cast may drop the carry into the next power
    of two (DESIGN.md): a value p where the reference has 2p (within a step) is accepted there."""
    from fastdecode.ops._common import interpreter_on
    from fastdecode.quant.fp8 import fp8_mismatches

    s_err = ((s.float() - s_ref.float()).abs() / s_ref.float().abs()).max().item()
    bad, lost = fp8_mismatches(q, q_ref, lost_carry_ok=interpreter_on())
    detail = f"{bad} of {q.numel()} values off by > 1 e4m3 step"
    if lost:
        detail += f" (+{lost} interpreter lost carries)"
    return bad == 0 and s_err <= 1e-4, f"{detail}, scale rel err {s_err:.1e}"


def _fp8_pair(got, ref):
    """_fp8_close of two (q, scale) pairs."""
    return _fp8_close(got[0], ref[0], got[1], ref[1])


def _with_residual(result, r1, r_ref):
    """``result`` and the in-place residual update: bit for bit the reference's rounding."""
    ok, detail = result
    same = torch.equal(r1, r_ref)
    return ok and same, f"{detail}; residual {'exact' if same else 'DIFFERS from the reference'}"


def _row_checks(dev, act, M, H):
    """Norm, SiLU-and-mul and quantisation, every output mode, at one (M, H)."""
    import fastdecode as fd

    x = torch.randn(M, H, device=dev, dtype=act)
    r = torch.randn(M, H, device=dev, dtype=act)
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(act)
    tag = f"M={M:<3} H={H}"

    yield f"rms_norm                    {tag}", _close(fd.rms_norm(x, w), fd.rms_norm_ref(x, w))
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w)
    yield f"rms_norm_fp8 dynamic        {tag}", _fp8_pair(fd.rms_norm_fp8(x, w), (q_ref, s_ref))
    static = s_ref.max().reshape(1)  # a realistic per-tensor scale: the largest per-token one
    yield f"rms_norm_fp8 static         {tag}", _fp8_pair(fd.rms_norm_fp8(x, w, scale=static),
                                                          fd.rms_norm_fp8_ref(x, w, scale=static))

    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    r1 = r.clone()
    yield f"fused_add_rms_norm          {tag}", _with_residual(
        _close(fd.fused_add_rms_norm(x, r1, w), y_ref), r1, r_ref)
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w)
    r1 = r.clone()
    yield f"fused_add_rms_norm_fp8 dyn  {tag}", _with_residual(
        _fp8_pair(fd.fused_add_rms_norm_fp8(x, r1, w), (q_ref, s_ref)), r1, r_ref)
    static = s_ref.max().reshape(1)
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w, scale=static)
    r1 = r.clone()
    yield f"fused_add_rms_norm_fp8 stat {tag}", _with_residual(
        _fp8_pair(fd.fused_add_rms_norm_fp8(x, r1, w, scale=static), (q_ref, s_ref)), r1, r_ref)

    gu = torch.randn(M, 2 * H, device=dev, dtype=act)
    tag_i = f"M={M:<3} I={H}"
    yield f"silu_and_mul                {tag_i}", _close(fd.silu_and_mul(gu), fd.silu_and_mul_ref(gu))
    q_ref, s_ref = fd.silu_and_mul_fp8_ref(gu)
    yield f"silu_and_mul_fp8 dynamic    {tag_i}", _fp8_pair(fd.silu_and_mul_fp8(gu), (q_ref, s_ref))
    static = s_ref.max().reshape(1)
    yield f"silu_and_mul_fp8 static     {tag_i}", _fp8_pair(fd.silu_and_mul_fp8(gu, static),
                                                            fd.silu_and_mul_fp8_ref(gu, static))

    for mode, kw in (("per-token", {"per_token": True}), ("per-tensor", {}),
                     ("static", {"scale": x.float().abs().amax().reshape(1) / 448})):
        yield f"quantize_fp8 {mode:<14} {tag}", _fp8_pair(fd.quantize_fp8(x, **kw), fd.quantize_fp8_ref(x, **kw))


def _gemm_checks(dev, act, M, N, K):
    """The skinny linear (bf16 on a GPU; fp16 on the CPU, whose interpreter gets bf16 dots wrong),
    W8A8 linear_fp8 and the int4-weight linear, our Triton kernels forced (not cuBLAS)."""
    import fastdecode as fd
    from fastdecode.quant import quantize_activation_fp8, quantize_int4, quantize_weight_fp8

    x = torch.randn(M, K, device=dev, dtype=act)
    w = (torch.randn(N, K, device=dev) / K**0.5).to(act)  # outputs O(1)
    b = torch.randn(N, device=dev, dtype=act)
    tag = f"M={M:<3} N={N} K={K}"
    yield f"linear                      {tag}", _close(fd.linear(x, w, b, impl="triton"), fd.linear_ref(x, w, b))
    wq, ws = quantize_weight_fp8(w, "channel")
    xq, xs = quantize_activation_fp8(x)
    yield f"linear_fp8                  {tag}", _close(fd.linear_fp8(xq, xs, wq, ws, b, out_dtype=act, impl="triton"),
                                                       fd.linear_fp8_ref(xq, xs, wq, ws, b, out_dtype=act))
    packed = quantize_int4(w, 128, scale_dtype=act)
    yield f"int4_linear                 {tag}", _close(fd.int4_linear(x, packed, b, impl="triton"),
                                                       fd.int4_linear_ref(x, packed, b))


def _checks(dev: str, quick: bool = False):
    act = torch.bfloat16 if dev == "cuda" else torch.float16
    rows = ((1, 256), (3, 111)) if quick else ((1, 4096), (7, 4099), (64, 8192))
    gemms = ((1, 64, 256), (3, 40, 256)) if quick else ((1, 256, 1024), (16, 200, 1024))
    for M, H in rows:
        yield from _row_checks(dev, act, M, H)
    for M, N, K in gemms:
        yield from _gemm_checks(dev, act, M, N, K)


def main(argv=None) -> int:
    argv = list(argv or [])
    quick = "--quick" in argv
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "fastdecode", "selfcheck", *argv], env)
    where = "GPU " + torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter"
    print(f"fastdecode selfcheck: Triton kernels against their PyTorch references ({where})")
    failed = 0
    t0 = time.time()
    # the kernels, never a silent fallback to the references
    with unittest.mock.patch.dict(os.environ, FASTDECODE_BACKEND="triton"):
        for name, (ok, detail) in _checks(dev, quick):
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    print(f"{'all kernels match their references' if not failed else f'{failed} checks FAILED'}"
          f" ({time.time() - t0:.1f} s)")
    if dev == "cuda" and not failed:
        print("GPU found: benchmark them with `fastdecode bench kernels`, `bench linear` and `bench int4`")
    return 1 if failed else 0
