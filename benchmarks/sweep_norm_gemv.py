"""Development sweep: the RMSNorm inside the decode GEMV (``ops.norm_linear.rms_norm_linear``, bf16, M = 1; GPU).

Session 15's decode profile found the X_NORM GEMVs 13-18 % slower than the plain GEMVs they replace (8B qkv
467.5 -> 550.9 us a step, gate_up 1792.3 -> 2036.0), which ate the saved norm kernels. This sweep times, on the
same rotated weights in one process (CUDA graphs, PDL off: ``bench.harness.time_cuda``):

* ``linear``: the plain GEMV alone (the dispatcher's pick), the floor of any fused variant;
* ``rms_norm+linear``: the default two kernels (the norm kernel, then the GEMV);
* ``rms_norm_linear``: the norm inside, with its weight (h * g rounded to bf16 in every step);
* ``rms_norm_linear_folded``: the norm inside with g folded into W (``fold_norm_weight``): the loop adds only
  h's squares to the plain GEMV's work;
* the folded kernel on other FMA tiles (BLOCK_N, warps, PREFETCH).

Every variant is checked against the fp32 reference first.

    PYTHONPATH=src python benchmarks/sweep_norm_gemv.py --out rows.json
"""

from __future__ import annotations

import argparse

import torch

from fastdecode.bench.harness import make_row, rotation_count, time_cuda, write_rows
from fastdecode.constants import SCALE_NONE
from fastdecode.ops.gemm import _choose, linear, linear_with_config
from fastdecode.ops.norm import rms_norm
from fastdecode.ops.norm_linear import fold_norm_weight, rms_norm_linear, rms_norm_linear_ref

SHAPES = {"8b.qkv": (6144, 4096), "8b.gate_up": (28672, 4096), "smollm2.qkv": (960, 576),
          "smollm2.gate_up": (3072, 576)}
EPS = 1e-5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out")
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        wbytes = N * K * 2
        n_rot = rotation_count(wbytes)
        g = (1 + 0.1 * torch.randn(K, device=dev)).to(dt)
        ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(n_rot)]
        wf = [fold_norm_weight(w, g) for w in ws]
        hs = [torch.randn(1, K, device=dev, dtype=dt) * 3 for _ in range(n_rot)]
        out = torch.empty(1, N, device=dev, dtype=dt)
        normed = torch.empty(1, K, device=dev, dtype=dt)
        which, cfg = _choose("auto", hs[0], ws[0], cublas_ok=True)
        shape = {"M": 1, "N": N, "K": K, "name": name, "dtype": "bfloat16", "table": [which, cfg]}
        ref = rms_norm_linear_ref(hs[0], g, ws[0], eps=EPS).float()
        ref_plain = (hs[0].float() @ ws[0].float().t())

        def folded_cfg(c):
            return [lambda i=i: linear_with_config(hs[i], wf[i], None, None, SCALE_NONE, None, SCALE_NONE, out, c,
                                                   eps=EPS, x_norm=True) for i in range(n_rot)]

        variants = [
            ("linear", [lambda i=i: linear(hs[i], ws[i], out=out) for i in range(n_rot)], None),
            ("rms_norm+linear", [lambda i=i: linear(rms_norm(hs[i], g, EPS, out=normed), ws[i], out=out)
                                 for i in range(n_rot)], None),
            ("rms_norm_linear", [lambda i=i: rms_norm_linear(hs[i], g, ws[i], eps=EPS, out=out)
                                 for i in range(n_rot)], None),
            ("rms_norm_linear_folded", [lambda i=i: rms_norm_linear(hs[i], None, wf[i], eps=EPS, out=out)
                                        for i in range(n_rot)], None),
        ]
        if which == "triton" and cfg["kind"] == "fma":
            seen = [{**cfg, "SPLIT_K": 1}]
            for bn in (2, 4, 8):
                for warps in (2, 4, 8):
                    for extra in ({}, {"PREFETCH": True}):
                        bk = min(8 * 32 * warps, K) if K % (8 * 32 * warps) == 0 else None
                        if bk is None:
                            continue
                        c = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                             "num_stages": 1, "SPLIT_K": 1, **extra}
                        if c not in seen:
                            seen.append(c)
            variants += [("folded_cfg", folded_cfg(c), c) for c in seen]
        base = {}
        for impl, calls, c in variants:
            out.fill_(float("nan"))
            try:
                calls[0]()
                torch.cuda.synchronize()
                r = ref_plain if impl == "linear" else ref
                err = float((out.float() - r).abs().max() / r.abs().max())
                if not err < 2e-2:
                    raise AssertionError(f"max error {err:.3g} of the output's max against the fp32 reference")
                t = time_cuda(calls, graph=True)
            except Exception as e:  # a config that does not launch or computes wrong: recorded, not timed
                rows.append(make_row("sweep_norm_gemv", impl, shape, None, error=e, config=c))
                print(f"{name:>16} {impl:<24} FAILED {e}", flush=True)
                continue
            lin = base.setdefault("linear", t.median_us)
            rows.append(make_row("sweep_norm_gemv", impl, shape, t, bytes_moved=wbytes, config=c,
                                 vs_linear=round(t.median_us / lin, 3), max_rel_err=round(err, 5)))
            print(f"{name:>16} {impl:<24} {t.median_us:8.2f} us {wbytes / t.median_us / 1e6:5.2f} TB/s "
                  f"x{t.median_us / lin:.3f} of linear  {c or ''}", flush=True)
        ws = wf = None
        torch.cuda.empty_cache()
    if a.out:
        write_rows(rows, a.out)


if __name__ == "__main__":
    main()
