"""Benchmark: fused add+RMSNorm, SiLU-and-mul, FP8 quantisation, greedy argmax vs PyTorch eager and
torch.compile.

Every row is timed as CUDA-graph replays of 20 back-to-back calls over rotated inputs (see harness),
the same for our kernels and the baselines. Bytes are the fewest a kernel must move:

* add+RMSNorm: read x and residual, write residual and out   -> M*H*(3*e + e_out)  (+4*M for scales)
* SiLU-and-mul: read gate and up, write out                   -> M*I*(2*e + e_out)
* quantize_fp8: read x, write q                               -> M*H*(e + 1)
* argmax (fp32 logits, as the engine's): read x, write M int64 -> M*V*4 + 8*M
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import fastdecode as fd
from fastdecode.bench.harness import make_row, merge_rows, print_table, rotation_count, time_cuda, write_rows
from fastdecode.ops.quant import quantize_fp8_ref

FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- baselines
#
# The FP8 baselines compute what our kernels compute (same clamp, same minimum scale), so that a
# speed-up is not a different amount of work: tests/test_activation_quant.py checks them against
# the references.


def to_fp8(y, scale=None, per_token: bool = True):
    """fp32 y -> (fp8, scale), ``real = fp8 * scale``: static scale, or dynamic per row / per tensor
    (the ops' own plain-PyTorch quantisation, so the baselines round as the kernels do)."""
    return quantize_fp8_ref(y, scale, per_token=per_token)


def add_rms_eager(x, r, w, eps=1e-6):
    h = x + r
    r.copy_(h)
    return F.rms_norm(h, (h.shape[-1],), w, eps)


def add_rms_manual(x, r, w, eps=1e-6):
    h = x.float() + r.float()
    r.copy_(h)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def add_rms_fp8_manual(x, r, w, scale=None, eps=1e-6):
    """add + RMSNorm + FP8: dynamic per-token scales (``scale=None``) or a static scale."""
    h = x.float() + r.float()
    r.copy_(h)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return to_fp8(y, scale)


def silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul_fp8(gu, scale=None):
    g, u = gu.chunk(2, dim=-1)
    return to_fp8(F.silu(g.float()) * u.float(), scale)


def quant_per_token(x):
    return to_fp8(x.float())


def quant_per_tensor(x):
    return to_fp8(x.float(), per_token=False)


def quant_static(x, scale):
    return to_fp8(x.float(), scale)


# ----------------------------------------------------------------------------- runner


def _compiled(fn):
    # one specialisation per shape, as a user compiling for a fixed decode batch gets; the sweep
    # compiles ~20 shapes x modes per function, past dynamo's default recompile limit of 8
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    return torch.compile(fn, fullgraph=True, dynamic=False)


@dataclass
class Runner:
    """Where and how the suites run. The defaults time on the GPU; tests pass a CPU device, a fake
    timer and no compilation to check the rows a suite produces."""

    device: str = "cuda"
    timer: Callable = functools.partial(time_cuda, graph=True)
    compile: Callable = _compiled

    def bench(self, rows, op, impl, shape, make_call: Callable[[dict], Callable[[], object]], inputs, nbytes):
        calls = [make_call(d) for d in inputs]
        try:
            t = self.timer(calls)
        except Exception as e:  # a baseline that fails to compile or capture is recorded, not fatal
            rows.append(make_row(op, impl, shape, None, bytes_moved=nbytes, error=e))
            print(f"{op} {impl} {shape}: {rows[-1]['error']}", flush=True)
            return
        rows.append(make_row(op, impl, shape, t, bytes_moved=nbytes))


def bench_add_rms_norm(rows, Hs=(4096, 8192), Ms=(1, 16, 256, 4096, 32768), dtype=torch.bfloat16, *,
                       runner: Runner | None = None):
    run = runner or Runner()
    dev = run.device
    e = torch.tensor([], dtype=dtype).element_size()
    c_native, c_fp8 = run.compile(add_rms_manual), run.compile(add_rms_fp8_manual)
    for H in Hs:
        w = (1 + 0.1 * torch.randn(H, device=dev)).to(dtype)
        scale = torch.tensor([0.05], device=dev)
        for M in Ms:
            nb = M * H * 3 * e
            n_rot = rotation_count(nb + M * H * e)
            inputs = [{"x": torch.randn(M, H, device=dev, dtype=dtype),
                       "r": torch.randn(M, H, device=dev, dtype=dtype)} for _ in range(n_rot)]
            shape = {"M": M, "H": H, "dtype": str(dtype).replace("torch.", "")}
            b16, b8 = nb + M * H * e, nb + M * H + 4 * M
            op = "add_rms_norm"
            run.bench(rows, op, "fastdecode", shape, lambda d: lambda: fd.fused_add_rms_norm(d["x"], d["r"], w),
                      inputs, b16)
            run.bench(rows, op, "torch_eager", shape, lambda d: lambda: add_rms_eager(d["x"], d["r"], w), inputs, b16)
            run.bench(rows, op, "torch_compile", shape, lambda d: lambda: c_native(d["x"], d["r"], w), inputs, b16)
            op = "add_rms_norm_fp8"
            for mode, s, nbytes in (("dynamic", None, b8), ("static", scale, b8 - 4 * M)):
                run.bench(rows, op, f"fastdecode_{mode}", shape,
                          lambda d, s=s: lambda: fd.fused_add_rms_norm_fp8(d["x"], d["r"], w, scale=s), inputs, nbytes)
                run.bench(rows, op, f"torch_eager_{mode}", shape,
                          lambda d, s=s: lambda: add_rms_fp8_manual(d["x"], d["r"], w, s), inputs, nbytes)
                run.bench(rows, op, f"torch_compile_{mode}", shape,
                          lambda d, s=s: lambda: c_fp8(d["x"], d["r"], w, s), inputs, nbytes)
            del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()


def bench_silu_and_mul(rows, Is=(14336, 28672), Ms=(1, 16, 256, 4096, 32768), dtype=torch.bfloat16, *,
                       runner: Runner | None = None):
    run = runner or Runner()
    dev = run.device
    e = torch.tensor([], dtype=dtype).element_size()
    c_native, c_fp8 = run.compile(silu_mul), run.compile(silu_mul_fp8)
    scale = torch.tensor([0.05], device=dev)
    for I in Is:
        for M in Ms:
            nb_in = M * 2 * I * e
            n_rot = rotation_count(nb_in + M * I * e)
            inputs = [{"x": torch.randn(M, 2 * I, device=dev, dtype=dtype)} for _ in range(n_rot)]
            shape = {"M": M, "I": I, "dtype": str(dtype).replace("torch.", "")}
            b16, b8 = nb_in + M * I * e, nb_in + M * I + 4 * M
            op = "silu_and_mul"
            run.bench(rows, op, "fastdecode", shape, lambda d: lambda: fd.silu_and_mul(d["x"]), inputs, b16)
            run.bench(rows, op, "torch_eager", shape, lambda d: lambda: silu_mul(d["x"]), inputs, b16)
            run.bench(rows, op, "torch_compile", shape, lambda d: lambda: c_native(d["x"]), inputs, b16)
            op = "silu_and_mul_fp8"
            for mode, s, nbytes in (("dynamic", None, b8), ("static", scale, b8 - 4 * M)):
                run.bench(rows, op, f"fastdecode_{mode}", shape,
                          lambda d, s=s: lambda: fd.silu_and_mul_fp8(d["x"], s), inputs, nbytes)
                run.bench(rows, op, f"torch_eager_{mode}", shape, lambda d, s=s: lambda: silu_mul_fp8(d["x"], s),
                          inputs, nbytes)
                run.bench(rows, op, f"torch_compile_{mode}", shape, lambda d, s=s: lambda: c_fp8(d["x"], s),
                          inputs, nbytes)
            del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()


def bench_quantize_fp8(rows, Hs=(8192,), Ms=(1, 256, 32768), dtype=torch.bfloat16, *, runner: Runner | None = None):
    run = runner or Runner()
    dev = run.device
    e = torch.tensor([], dtype=dtype).element_size()
    scale = torch.tensor([0.05], device=dev)
    modes = (  # mode, our call, eager baseline, bytes beyond x and q
        ("per_token", lambda x: fd.quantize_fp8(x, per_token=True), quant_per_token, lambda M: 4 * M),
        ("per_tensor", lambda x: fd.quantize_fp8(x), quant_per_tensor, lambda M: 4),
        ("static", lambda x: fd.quantize_fp8(x, scale), lambda x: quant_static(x, scale), lambda M: 0),
    )
    compiled = {mode: run.compile(base) for mode, _, base, _ in modes}
    for H in Hs:
        for M in Ms:
            nb = M * H * (e + 1)
            inputs = [{"x": torch.randn(M, H, device=dev, dtype=dtype)} for _ in range(rotation_count(nb))]
            shape = {"M": M, "H": H, "dtype": str(dtype).replace("torch.", "")}
            op = "quantize_fp8"
            for mode, ours, base, extra in modes:
                for impl, fn in (("fastdecode", ours), ("torch_eager", base), ("torch_compile", compiled[mode])):
                    run.bench(rows, op, f"{impl}_{mode}", shape, lambda d, f=fn: lambda: f(d["x"]), inputs,
                              nb + extra(M))
            del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()


def argmax_eager(x):
    return torch.argmax(x, dim=-1)


def bench_argmax(rows, Vs=(49152, 128256, 151936), Ms=(1, 8, 64, 256), dtype=torch.float32, *,
                 runner: Runner | None = None):
    """Greedy token choice over a vocabulary (SmolLM2, Llama-3, Qwen): ``fastdecode.argmax`` vs torch's."""
    run = runner or Runner()
    dev = run.device
    e = torch.tensor([], dtype=dtype).element_size()
    compiled = run.compile(argmax_eager)
    for V in Vs:
        for M in Ms:
            nb = M * V * e + 8 * M
            inputs = [{"x": torch.randn(M, V, device=dev, dtype=dtype)} for _ in range(rotation_count(nb))]
            shape = {"M": M, "V": V, "dtype": str(dtype).replace("torch.", "")}
            for impl, fn in (("fastdecode", fd.argmax), ("torch_eager", argmax_eager), ("torch_compile", compiled)):
                run.bench(rows, "argmax", impl, shape, lambda d, f=fn: lambda: f(d["x"]), inputs, nb)
            del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()


SUITES = {"norm": bench_add_rms_norm, "silu": bench_silu_and_mul, "quant": bench_quantize_fp8,
          "argmax": bench_argmax}


def run(which=("norm", "silu", "quant", "argmax"), out=None, quick=False, *, merge: bool = True) -> list[dict]:
    """Run the suites in ``which`` and write their rows to ``out``: merged into the file (rows of the
    same op, impl and shape replaced, the others kept) unless ``merge=False``, which overwrites it."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks need a CUDA GPU; on the CPU run `fastdecode selfcheck`")
    rows: list[dict] = []
    for name in which:
        kw = {"Ms": (1, 256, 32768)} if quick and name != "argmax" else {}
        SUITES[name](rows, **kw)
    if out:
        (merge_rows if merge else write_rows)(rows, out)
    print_table([r for r in rows if r["median_us"] is not None])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("which", nargs="*", default=list(SUITES), choices=list(SUITES))
    p.add_argument("--out", default=None)
    p.add_argument("--replace", action="store_true", help="overwrite --out instead of merging into it")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    run(a.which, a.out, a.quick, merge=not a.replace)


if __name__ == "__main__":
    main()
