"""Host time per eager call of the ops a patched transformers model runs (GPU): where ``bench hf``'s patched rows
lose to plain transformers.

    PYTHONPATH=src python benchmarks/profile_eager_overhead.py --out eager_overhead.json

``bench hf`` (H200, 66600ae, 8B shapes, batch 1): plain eager 20.8 ms a step, patched (fused norms and SiLU) 32.5,
patched with FP8 linears 75.6, with int4 linears 61.9. A decode step of an eager model is host-bound, so what
decides is each call's host time. For every op, at Llama-3.1-8B shapes and M = 1, bf16 on CUDA:

* ``torch``: what the plain model runs instead (transformers' RMSNorm arithmetic, ``F.silu(g) * u``, ``F.linear``,
  ``torch._scaled_mm`` with row-wise scales);
* ``fastdecode``: the public op as the patch calls it (argument checks, dispatch, the registered custom op);
* ``registered_op``: the registered ``torch.ops.fastdecode`` op alone, on prepared arguments (its dispatcher
  cost; a ``torch.library.Library`` definition since session 8, ``torch.library.custom_op`` before).

``host_us``: wall time of ``n`` back-to-back calls (one synchronisation at the end) / n: the host's rate when it
is slower than the GPU, else the GPU's (``gpu_us``, CUDA events around the same loop, tells which). Then
cProfile of the public calls (the functions with the most own time). PDL off and on for the norms.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch.nn.functional as F


def _time(fn, n: int) -> dict:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"host_us": round(host / n * 1e6, 2), "gpu_us": round(e0.elapsed_time(e1) / n * 1e3, 2)}


def _profile(fn, n: int, top: int) -> list:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{file.split('site-packages/')[-1].split('src/')[-1]}:{line}:{name}",
                     "own_us_per_call": round(tt / n * 1e6, 2), "cum_us_per_call": round(ct / n * 1e6, 2),
                     "calls_per_call": round(nc / n, 2)})
    rows.sort(key=lambda r: -r["own_us_per_call"])
    return rows[:top]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from fastdecode.models.int4 import Int4Linear
    from fastdecode.models.llama import Fp8Linear
    from fastdecode.ops import _common
    from fastdecode.ops.activation import silu_and_mul
    from fastdecode.ops.norm import _rms_norm_op, fused_add_rms_norm, rms_norm
    from fastdecode.quant.fp8 import quantize_weight_fp8
    from fastdecode.models.quantize import quantize_weight_int4

    dev, bf = torch.device("cuda"), torch.bfloat16
    H, I, N = 4096, 14336, 4096
    x = torch.randn(1, H, device=dev, dtype=bf)
    res = torch.randn(1, H, device=dev, dtype=bf)
    w = torch.rand(H, device=dev, dtype=bf) + 0.5
    gu = torch.randn(1, 2 * I, device=dev, dtype=bf)
    lin = torch.randn(N, H, device=dev, dtype=bf) * 0.02
    out = torch.empty_like(x)

    def hf_rms():  # transformers' LlamaRMSNorm.forward
        h = x.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(v + 1e-5)).to(bf)

    def hf_add_rms():
        r = res + x
        h = r.to(torch.float32)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf), r

    fp8 = Fp8Linear(H, N, device=dev)
    q, s = quantize_weight_fp8(lin, "channel")
    fp8.weight.data.copy_(q)
    fp8.weight_scale.data.copy_(s.reshape(-1))
    i4 = Int4Linear.from_weight(quantize_weight_int4(lin), None, dtype=bf)
    xq = x.to(torch.float8_e4m3fn)
    xs = torch.ones(1, 1, device=dev)
    wt = fp8.weight.t()
    ws = fp8.weight_scale.reshape(1, -1)

    rows = []
    cases = {
        "rms_norm": {"torch": hf_rms, "fastdecode": lambda: rms_norm(x, w, 1e-5, backend="triton"),
                     "registered_op": lambda: _rms_norm_op(x, None, w, out, None, None, 1e-5, "triton")},
        "add_rms_norm": {"torch": hf_add_rms,
                         "fastdecode": lambda: fused_add_rms_norm(res.clone(), x.clone(), w, 1e-5, backend="triton"),
                         "clone_x2 (inside the fastdecode row)": lambda: (res.clone(), x.clone())},
        "silu_and_mul": {"torch": lambda: F.silu(gu[:, :I]) * gu[:, I:],
                         "fastdecode": lambda: silu_and_mul(gu, backend="triton")},
        "linear_4096x4096": {"torch bf16": lambda: F.linear(x, lin),
                             "torch _scaled_mm rowwise": lambda: torch._scaled_mm(xq, wt, xs, ws, out_dtype=bf),
                             "fastdecode fp8 (quantise + GEMM)": lambda: fp8(x, "triton"),
                             "fastdecode int4": lambda: i4(x, "triton")},
    }
    for pdl in (False, True):
        with _common.pdl_override(pdl):
            for op, impls in cases.items():
                for impl, fn in impls.items():
                    try:
                        r = {"op": op, "impl": impl, "pdl": pdl, **_time(fn, a.n)}
                    except Exception as e:  # a path that does not run here is reported, not fatal
                        r = {"op": op, "impl": impl, "pdl": pdl, "error": f"{type(e).__name__}: {e}"[:300]}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    prof = {name: _profile(fn, 300, a.top) for name, fn in (
        ("rms_norm", cases["rms_norm"]["fastdecode"]), ("silu_and_mul", cases["silu_and_mul"]["fastdecode"]),
        ("fp8 linear", cases["linear_4096x4096"]["fastdecode fp8 (quantise + GEMM)"]),
        ("int4 linear", cases["linear_4096x4096"]["fastdecode int4"]))}
    for name, top in prof.items():
        print(f"\n== cProfile {name}: own us per call")
        for r in top[:12]:
            print(f"{r['own_us_per_call']:8.2f} {r['cum_us_per_call']:8.2f} {r['calls_per_call']:5.1f}  {r['fn']}")
    if a.out:
        env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows, "cprofile": prof}, f, indent=1)


if __name__ == "__main__":
    main()
