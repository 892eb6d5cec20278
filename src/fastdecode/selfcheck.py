"""``fastdecode selfcheck``: every kernel against its reference, on whatever machine this is.

On a CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by re-running this
command in a fresh process, since triton reads it at import); on a GPU they run natively.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def _checks(dev: str):
    import fastdecode as fd

    act = torch.bfloat16 if dev == "cuda" else torch.float16

    def close(a, b, tol):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
        return err <= tol, f"max rel err {err:.2e}"

    def fp8_close(q, q_ref, s, s_ref):
        deq, ref = q.float() * s, q_ref.float() * s_ref
        # one e4m3 step is 1/8 relative; the interpreter may lose a rounding carry (a factor 2) on a
        # few elements, so here we check the bulk: 95% of values within one step
        within = ((deq - ref).abs() <= ref.abs() / 8 + 1e-6).float().mean().item()
        return within >= 0.95, f"{within:.1%} within one e4m3 step"

    for M, H in ((1, 4096), (7, 4099), (64, 8192)):
        x = torch.randn(M, H, device=dev, dtype=act)
        r = torch.randn(M, H, device=dev, dtype=act)
        w = torch.randn(H, device=dev, dtype=act)
        y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
        q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(x, r, w)
        r1 = r.clone()
        yield f"fused_add_rms_norm      M={M:<3} H={H}", close(fd.fused_add_rms_norm(x, r1, w), y_ref, 1e-2)
        r1 = r.clone()
        q, s = fd.fused_add_rms_norm_fp8(x, r1, w)
        yield f"fused_add_rms_norm_fp8  M={M:<3} H={H}", fp8_close(q, q_ref, s, s_ref)
        gu = torch.randn(M, 2 * H, device=dev, dtype=act)
        yield f"silu_and_mul            M={M:<3} I={H}", close(fd.silu_and_mul(gu), fd.silu_and_mul_ref(gu), 1e-2)
        q, s = fd.silu_and_mul_fp8(gu)
        yield f"silu_and_mul_fp8        M={M:<3} I={H}", fp8_close(q, *fd.silu_and_mul_fp8_ref(gu)[:1], s,
                                                                   fd.silu_and_mul_fp8_ref(gu)[1])
        q, s = fd.quantize_fp8(x, per_token=True)
        q_ref, s_ref = fd.quantize_fp8_ref(x, per_token=True)
        yield f"quantize_fp8 per-token  M={M:<3} H={H}", fp8_close(q, q_ref, s, s_ref)


def main(argv=None) -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "fastdecode", "selfcheck", *(argv or [])], env)
    os.environ.setdefault("FASTDECODE_BACKEND", "triton")
    where = "GPU " + torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter"
    print(f"fastdecode selfcheck: Triton kernels against their PyTorch references ({where})")
    failed = 0
    t0 = time.time()
    for name, (ok, detail) in _checks(dev):
        failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    print(f"{'all kernels match their references' if not failed else f'{failed} checks FAILED'}"
          f" ({time.time() - t0:.1f} s)")
    if dev == "cuda" and not failed:
        print("GPU found: benchmark them with `fastdecode bench all`")
    return 1 if failed else 0
