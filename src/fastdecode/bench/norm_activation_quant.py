"""Benchmark: fused add+RMSNorm, SiLU-and-mul, FP8 quantisation vs PyTorch eager and torch.compile.

Every row is timed as CUDA-graph replays of 20 back-to-back calls over rotated inputs (see harness),
the same for our kernels and the baselines. Bytes are the fewest a kernel must move:

* add+RMSNorm: read x and residual, write residual and out   -> M*H*(3*e + e_out)  (+4*M for scales)
* SiLU-and-mul: read gate and up, write out                   -> M*I*(2*e + e_out)
* quantize_fp8: read x, write q                               -> M*H*(e + 1)
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

import fastdecode as fd
from fastdecode.bench.harness import make_row, print_table, rotation_count, time_cuda, write_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ----------------------------------------------------------------------------- baselines


def add_rms_eager(x, r, w, eps=1e-6):
    h = x + r
    r.copy_(h)
    return F.rms_norm(h, (h.shape[-1],), w, eps)


def add_rms_manual(x, r, w, eps=1e-6):
    h = x.float() + r.float()
    r.copy_(h)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def add_rms_fp8_manual(x, r, w, eps=1e-6):
    h = x.float() + r.float()
    r.copy_(h)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    s = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (y / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul_fp8(gu):
    g, u = gu.chunk(2, dim=-1)
    y = F.silu(g.float()) * u.float()
    s = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (y / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def quant_per_token(x):
    y = x.float()
    s = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (y / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


# ----------------------------------------------------------------------------- runner


def _compiled(fn):
    # one specialisation per shape, as a user compiling for a fixed decode batch gets; the sweep
    # compiles ~10 shapes per function, past dynamo's default recompile limit of 8
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _bench(rows, op, impl, shape, make_call: Callable[[dict], Callable[[], object]], inputs, nbytes):
    calls = [make_call(d) for d in inputs]
    try:
        t = time_cuda(calls, graph=True)
    except Exception as e:  # a baseline that fails to compile or capture is recorded, not fatal
        rows.append({"op": op, "impl": impl, "shape": shape, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(f"{op} {impl} {shape}: {rows[-1]['error']}", flush=True)
        return
    rows.append(make_row(op, impl, shape, t, bytes_moved=nbytes))


def bench_add_rms_norm(rows, Hs=(4096, 8192), Ms=(1, 16, 256, 4096, 32768), dtype=torch.bfloat16):
    e = torch.tensor([], dtype=dtype).element_size()
    c_native, c_fp8 = _compiled(add_rms_manual), _compiled(add_rms_fp8_manual)
    for H in Hs:
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype)
        scale = torch.tensor([0.05], device="cuda")
        for M in Ms:
            nb = M * H * 3 * e
            n_rot = rotation_count(nb + M * H * e)
            inputs = [{"x": torch.randn(M, H, device="cuda", dtype=dtype),
                       "r": torch.randn(M, H, device="cuda", dtype=dtype)} for _ in range(n_rot)]
            shape = {"M": M, "H": H, "dtype": str(dtype).replace("torch.", "")}
            b16, b8 = nb + M * H * e, nb + M * H + 4 * M
            op = "add_rms_norm"
            _bench(rows, op, "fastdecode", shape, lambda d: lambda: fd.fused_add_rms_norm(d["x"], d["r"], w), inputs, b16)
            _bench(rows, op, "torch_eager", shape, lambda d: lambda: add_rms_eager(d["x"], d["r"], w), inputs, b16)
            _bench(rows, op, "torch_compile", shape, lambda d: lambda: c_native(d["x"], d["r"], w), inputs, b16)
            op = "add_rms_norm_fp8"
            _bench(rows, op, "fastdecode_dynamic", shape,
                   lambda d: lambda: fd.fused_add_rms_norm_fp8(d["x"], d["r"], w), inputs, b8)
            _bench(rows, op, "fastdecode_static", shape,
                   lambda d: lambda: fd.fused_add_rms_norm_fp8(d["x"], d["r"], w, scale=scale), inputs, b8 - 4 * M)
            _bench(rows, op, "torch_compile_dynamic", shape, lambda d: lambda: c_fp8(d["x"], d["r"], w), inputs, b8)
            del inputs
        torch.cuda.empty_cache()


def bench_silu_and_mul(rows, Is=(14336, 28672), Ms=(1, 16, 256, 4096, 32768), dtype=torch.bfloat16):
    e = torch.tensor([], dtype=dtype).element_size()
    c_native, c_fp8 = _compiled(silu_mul), _compiled(silu_mul_fp8)
    scale = torch.tensor([0.05], device="cuda")
    for I in Is:
        for M in Ms:
            nb_in = M * 2 * I * e
            n_rot = rotation_count(nb_in + M * I * e)
            inputs = [{"x": torch.randn(M, 2 * I, device="cuda", dtype=dtype)} for _ in range(n_rot)]
            shape = {"M": M, "I": I, "dtype": str(dtype).replace("torch.", "")}
            b16, b8 = nb_in + M * I * e, nb_in + M * I + 4 * M
            op = "silu_and_mul"
            _bench(rows, op, "fastdecode", shape, lambda d: lambda: fd.silu_and_mul(d["x"]), inputs, b16)
            _bench(rows, op, "torch_eager", shape, lambda d: lambda: silu_mul(d["x"]), inputs, b16)
            _bench(rows, op, "torch_compile", shape, lambda d: lambda: c_native(d["x"]), inputs, b16)
            op = "silu_and_mul_fp8"
            _bench(rows, op, "fastdecode_dynamic", shape, lambda d: lambda: fd.silu_and_mul_fp8(d["x"]), inputs, b8)
            _bench(rows, op, "fastdecode_static", shape,
                   lambda d: lambda: fd.silu_and_mul_fp8(d["x"], scale), inputs, b8 - 4 * M)
            _bench(rows, op, "torch_compile_dynamic", shape, lambda d: lambda: c_fp8(d["x"]), inputs, b8)
            del inputs
        torch.cuda.empty_cache()


def bench_quantize_fp8(rows, Hs=(8192,), Ms=(1, 256, 32768), dtype=torch.bfloat16):
    e = torch.tensor([], dtype=dtype).element_size()
    c_tok = _compiled(quant_per_token)
    for H in Hs:
        for M in Ms:
            nb = M * H * (e + 1)
            inputs = [{"x": torch.randn(M, H, device="cuda", dtype=dtype)} for _ in range(rotation_count(nb))]
            shape = {"M": M, "H": H, "dtype": str(dtype).replace("torch.", "")}
            op = "quantize_fp8"
            _bench(rows, op, "fastdecode_per_token", shape,
                   lambda d: lambda: fd.quantize_fp8(d["x"], per_token=True), inputs, nb + 4 * M)
            _bench(rows, op, "fastdecode_per_tensor", shape, lambda d: lambda: fd.quantize_fp8(d["x"]), inputs, nb)
            _bench(rows, op, "torch_eager_per_token", shape, lambda d: lambda: quant_per_token(d["x"]), inputs, nb + 4 * M)
            _bench(rows, op, "torch_compile_per_token", shape, lambda d: lambda: c_tok(d["x"]), inputs, nb + 4 * M)
            del inputs
        torch.cuda.empty_cache()


SUITES = {"norm": bench_add_rms_norm, "silu": bench_silu_and_mul, "quant": bench_quantize_fp8}


def run(which=("norm", "silu", "quant"), out=None, quick=False) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks need a CUDA GPU; on the CPU run `fastdecode selfcheck`")
    rows: list[dict] = []
    for name in which:
        kw = {"Ms": (1, 256, 32768)} if quick else {}
        SUITES[name](rows, **kw)
    if out:
        write_rows(rows, out)
    print_table([r for r in rows if "median_us" in r])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("which", nargs="*", default=list(SUITES), choices=list(SUITES))
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    run(a.which, a.out, a.quick)


if __name__ == "__main__":
    main()
