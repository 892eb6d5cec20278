"""Per-kernel time of one decode step (GPU): where the microseconds of a token go.

    PYTHONPATH=src python benchmarks/profile_decode.py --preset llama-3.1-8b --quant fp8 --out prof.json

Builds the benchmark's random-weight model, captures the decode step as ``bench decode`` does
(``--impl fastdecode-graph`` by default), replays it ``--steps`` times under ``torch.profiler`` and
prints the kernels by total GPU time per step (name, calls per step, us per step, share). The step's
wall time between the first and the last kernel is printed too, so the idle gaps (launch latency
between kernels) show as the difference to the kernel sum.
"""

import argparse
import json
from collections import defaultdict

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--quant", default=None)
    p.add_argument("--impl", default="fastdecode-graph")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from fastdecode.bench.decode import DecodeRunner
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    dev = torch.device("cuda")
    cfg = ModelConfig.from_preset(a.preset)
    model = random_model(cfg, device=dev, dtype=torch.bfloat16, max_seq_len=256)
    if a.quant:
        from fastdecode.models.quantize import quantize_model

        quantize_model(model, a.quant)
    cache = KVCache(model.config, a.batch, 256, dtype=torch.bfloat16, device=dev)
    runner = DecodeRunner(a.impl, model, cache, a.batch)
    tok = torch.zeros(a.batch, dtype=torch.long, device=dev)
    pos = torch.full((a.batch,), 64, dtype=torch.long, device=dev)
    for _ in range(5):
        runner.step(tok, pos)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            runner.step(tok, pos)
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = defaultdict(float)
    calls = defaultdict(int)
    for e in kern:
        total[e.name] += e.device_time
        calls[e.name] += 1
    span = (max(e.time_range.end for e in kern) - min(e.time_range.start for e in kern)) / a.steps if kern else 0
    ksum = sum(total.values()) / a.steps
    rows = sorted(((n, calls[n] / a.steps, t / a.steps) for n, t in total.items()), key=lambda r: -r[2])
    print(f"{a.preset} quant={a.quant} impl={a.impl} batch={a.batch}: kernels {ksum:.1f} us/step, "
          f"span {span:.1f} us/step, {len(kern) / a.steps:.0f} kernels/step")
    for n, c, t in rows[: a.top]:
        print(f"{t:9.1f} us {c:6.1f}x {t / ksum:6.1%}  {n[:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "quant": a.quant, "impl": a.impl, "batch": a.batch,
                       "kernel_us_per_step": ksum, "span_us_per_step": span,
                       "kernels": [{"name": n, "calls_per_step": c, "us_per_step": t} for n, c, t in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
