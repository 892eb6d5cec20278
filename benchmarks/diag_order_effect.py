"""Development check (GPU): is the first decode row of a process faster because it is first, or because of its graph?

Session 47 (H100, 8B int4, `fastdecode bench decode --impl fastdecode-graph` four times in one process): the first row
2373.4 us a step, the three after it 2401.1 / 2402.3 / 2401.3, the same kernels each time, SM clock 1980 MHz and no
throttle reason throughout. Each row captures its own graph and the row before it is deleted first. This keeps two
graph runners alive and times them in turn (A, B, A, B, ...), each on a fresh prompt, so the two questions separate:

* A stays fast after B is captured and B is slow: the difference goes with the graph (what its capture allocated or
  where), not with the time or the GPU's state;
* A turns slow once B exists, or both drift with time: it goes with the process's state (memory, L2, clocks).

A third runner C is captured after ``torch.cuda.empty_cache()`` with A and B deleted, then timed::

    PYTHONPATH=src python benchmarks/diag_order_effect.py --preset llama-3.1-8b --quant int4 --out rows.json
"""

from __future__ import annotations

import argparse
import gc
import statistics


def main(argv=None) -> int:
    import torch

    from fastdecode.bench.decode import DecodeRunner, build_bench_model
    from fastdecode.bench.harness import env_info, write_rows
    from fastdecode.engine.kv_cache import KVCache

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--quant", default="int4", choices=("fp8", "int4", "none"))
    p.add_argument("--impl", default="fastdecode-graph")
    p.add_argument("--iters", type=int, default=10, help="generate calls in each timed turn")
    p.add_argument("--rounds", type=int, default=3, help="turns of A then B")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default=None, help="default cuda when available (the CPU: a smoke run of torch-eager)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    quant = None if a.quant == "none" else a.quant
    max_seq = 1 + a.output_len
    built = build_bench_model(a.preset, batch=1, max_seq=max_seq, quant=quant, device=a.device)
    model, cfg, device = built.model, built.config, built.device
    cache = KVCache(model.config, 1, max_seq, dtype=next(model.parameters()).dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, turn = [], 0

    def timed(name: str, runner) -> None:
        nonlocal turn
        prompts = [torch.randint(0, cfg.vocab_size, (1, 1), device=device, generator=gen) for _ in range(a.iters + 1)]
        runner.generate(prompts[0], a.output_len)  # one warm-up generate a turn
        steps = sorted(d / (a.output_len - 1) * 1e6 for _, d in (runner.generate(q, a.output_len)
                                                                   for q in prompts[1:]))
        turn += 1
        row = {"op": "diag_order_effect", "runner": name, "turn": turn, "impl": a.impl, "iters": a.iters,
               "shape": {"model": a.preset, "quant": a.quant, "batch": 1, "output_len": a.output_len},
               "median_us": round(statistics.median(steps), 2), "min_us": round(steps[0], 2),
               "max_us": round(steps[-1], 2), **env_info()}
        rows.append(row)
        print(f"turn {turn:>2} runner {name}: {row['median_us']:9.2f} us a step (min {row['min_us']:.2f})", flush=True)

    runner_a = DecodeRunner(a.impl, model, cache, 1)
    timed("A", runner_a)
    runner_b = DecodeRunner(a.impl, model, cache, 1)
    for _ in range(a.rounds):
        timed("B", runner_b)
        timed("A", runner_a)
    del runner_a, runner_b
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    runner_c = DecodeRunner(a.impl, model, cache, 1)
    timed("C", runner_c)
    timed("C", runner_c)
    if a.out:
        write_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
