"""Development check (GPU): why the first decode row of a process is faster than every row after it.

Session 47 (H100, 8B int4, `fastdecode bench decode --impl fastdecode-graph` four times in one process): the first row
2373.4 us a step, the three after it 2401.1 / 2402.3 / 2401.3, the same kernels each time, SM clock 1980 MHz and no
throttle reason throughout. Each row captures its own graph after the row before it was deleted.

``--mode runners`` keeps two graph runners alive and times them in turn (A, B, A, B, ...), then a third, C, after both
are gone and the allocator's cache is emptied. Session 47: A 2330.27 us before B existed, then A and B 2356-2358, C
2358.5: the first graph slows down once a second is captured.

``--mode probes`` times runner A alone, then after each probe in turn, each probe kept alive to the end (the last ones
are the ones that were found to slow A): eager decode steps on the current and on a side stream, ``empty_cache``, a
one-kernel graph of a PyTorch op, a one-kernel graph of a fastdecode Triton kernel (``rms_norm``) with programmatic
dependent launch off, the same with it on, and last a second decode graph runner; a decode graph captured without
PDL (N) is timed before the probes and after them. Session 47 ran the probes (not N) one at a
time (printed, no file): only the captures with PDL on slowed A, by ~28 us, and deleting the graph did not undo it::

    PYTHONPATH=src python benchmarks/diag_order_effect.py --mode probes --quant int4 --out rows.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics

PROBES = ("eager decode x3", "eager decode x3, side stream", "empty_cache", "torch graph, one kernel",
          "triton graph, one kernel, PDL off", "triton graph, one kernel, PDL on", "a second decode graph runner")
GPU_PROBES = PROBES[2:]  # the rest run on the CPU too (a smoke run)


def main(argv=None) -> int:
    import torch

    from fastdecode.bench.decode import DecodeRunner, build_bench_model
    from fastdecode.bench.harness import env_info, write_rows
    from fastdecode.engine.kv_cache import KVCache

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="probes", choices=("probes", "runners"))
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--quant", default="int4", choices=("fp8", "int4", "none"))
    p.add_argument("--impl", default="fastdecode-graph")
    p.add_argument("--iters", type=int, default=10, help="generate calls in each timed turn")
    p.add_argument("--rounds", type=int, default=3, help="runners: turns of B then A")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default=None, help="default cuda when available (the CPU: a smoke run of torch-eager)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    quant = None if a.quant == "none" else a.quant
    max_seq = 1 + a.output_len
    built = build_bench_model(a.preset, batch=1, max_seq=max_seq, quant=quant, device=a.device)
    model, cfg, device = built.model, built.config, built.device
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, 1, max_seq, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = device.type == "cuda"
    rows, turn = [], 0
    base = {"op": "diag_order_effect", "mode": a.mode, "impl": a.impl, "iters": a.iters,
            "shape": {"model": a.preset, "quant": a.quant, "batch": 1, "output_len": a.output_len}}

    def timed(name: str, runner, after: str = "") -> None:
        nonlocal turn
        prompts = [torch.randint(0, cfg.vocab_size, (1, 1), device=device, generator=gen) for _ in range(a.iters + 1)]
        runner.generate(prompts[0], a.output_len)  # one warm-up generate a turn
        steps = sorted(d / (a.output_len - 1) * 1e6 for _, d in (runner.generate(q, a.output_len)
                                                                   for q in prompts[1:]))
        turn += 1
        row = {**base, "runner": name, "turn": turn, "after": after, "median_us": round(statistics.median(steps), 2),
               "min_us": round(steps[0], 2), "max_us": round(steps[-1], 2), **env_info()}
        rows.append(row)
        print(f"turn {turn:>2} runner {name}{' after ' + after if after else ''}: {row['median_us']:9.2f} us a step "
              f"(min {row['min_us']:.2f})", flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    runner_a = DecodeRunner(a.impl, model, cache, 1)
    timed("A", runner_a)
    if a.mode == "runners":
        runner_b = DecodeRunner(a.impl, model, cache, 1)
        for _ in range(a.rounds):
            timed("B", runner_b)
            timed("A", runner_a)
        del runner_a, runner_b
        gc.collect()
        sync()
        if cuda:
            torch.cuda.empty_cache()
        runner_c = DecodeRunner(a.impl, model, cache, 1)
        timed("C", runner_c)
        timed("C", runner_c)
    else:
        timed("A", runner_a, "nothing")
        # a graph without PDL (its capture does not trigger it: session 47), timed here and after the probes:
        # is a non-PDL graph slowed too once a second PDL graph exists?
        runner_n = DecodeRunner("fastdecode-graph-no-pdl", model, cache, 1) if cuda else None
        if runner_n is not None:
            timed("N (no PDL)", runner_n, "its own capture")
            timed("A", runner_a, "a graph without PDL")
        else:
            rows.append({**base, "runner": "N (no PDL)", "skipped": "needs CUDA", **env_info()})
        from fastdecode import ops
        from fastdecode.ops import pdl_override

        tok = torch.zeros(1, dtype=torch.long, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        kept = []  # every probe's graph and tensors stay alive to the end
        for probe in PROBES:
            if probe in GPU_PROBES and not cuda:
                rows.append({**base, "after": probe, "skipped": "needs CUDA", **env_info()})
                continue
            with torch.no_grad():
                if probe.startswith("eager decode"):
                    side = torch.cuda.Stream() if cuda and "side" in probe else None
                    if side is not None:
                        side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                        for _ in range(3):
                            model.decode(tok, pos, cache)
                    if side is not None:
                        torch.cuda.current_stream().wait_stream(side)
                elif probe == "empty_cache":
                    sync()
                    torch.cuda.empty_cache()
                elif probe == "torch graph, one kernel":
                    x = torch.ones(1024, device=device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        y = x * 2
                    kept += [g, x, y]
                elif probe.startswith("triton graph"):
                    h = torch.randn(1, cfg.dim, device=device, dtype=torch.bfloat16)
                    w = torch.ones(cfg.dim, device=device, dtype=torch.bfloat16)
                    with pdl_override(probe.endswith("PDL on")):
                        ops.rms_norm(h, w, 1e-5)  # compiled outside the capture
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            z = ops.rms_norm(h, w, 1e-5)
                    kept += [g, h, w, z]
                else:
                    kept.append(DecodeRunner(a.impl, model, cache, 1))
            sync()
            timed("A", runner_a, probe)
        if kept and isinstance(kept[-1], DecodeRunner):
            timed("B", kept[-1], "its own capture")
        if runner_n is not None:
            timed("N (no PDL)", runner_n, "every probe")
    if a.out:
        write_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
