"""``fastdecode bench serve`` (``fastdecode.bench.serve``: the OpenAI server under a concurrency sweep beside one
static batch) and ``fastdecode bench startup`` (``fastdecode.bench.startup``: the start-up of ``generate`` phase by
phase, in fresh processes); both run on the CPU too. Registered under ``bench`` by ``cli.bench``."""

from __future__ import annotations

import argparse
import sys

import torch

from fastdecode.cli.common import DTYPES, check_dequantize, end_tp, fail, write_rows
from fastdecode.quant.formats import METHODS


# ----------------------------------------------------------------------------- bench serve


def cmd_bench_serve(args) -> int:
    """``fastdecode bench serve``: the concurrency sweep (``fastdecode.bench.serve``), the table on stdout, the rows
    merged into the results file (default ``benchmarks/results/serve.json`` on CUDA, none on a CPU), the plot."""
    from fastdecode.bench.harness import print_table
    from fastdecode.bench.serve import DEFAULT_OUT, bench_serve, plot_rows, row_key
    from fastdecode.cli.common import USER_ERRORS, check_device
    from fastdecode.engine.tp import init_distributed, maybe_relaunch, under_torchrun
    from fastdecode.serve.server import require_serve_deps

    try:
        require_serve_deps()
        device = check_device(args.device)
    except USER_ERRORS as e:
        return fail(e)
    code = maybe_relaunch(args.tp, getattr(args, "argv", None))  # --tp N: the same command under torchrun
    if code is not None:
        return code
    main = True
    try:
        if under_torchrun():  # every rank loads its shard; rank 0 serves and reports (bench.serve)
            rank, _, device = init_distributed(args.device)
            main = rank == 0
        rows = bench_serve(args.model, concurrency=args.concurrency, duration=args.duration,
                           input_len=args.input_len, output_len=args.output_len, max_batch=args.max_batch,
                           prefill_chunk=args.prefill_chunk, device=device,
                           dtype=getattr(torch, args.dtype) if args.dtype else None, quant=args.quant,
                           static=not args.no_static, check=not args.no_check,
                           log=(lambda m: print(m, file=sys.stderr, flush=True)) if main else (lambda m: None))
    except USER_ERRORS as e:
        end_tp()
        return fail(e) if main else 2
    end_tp()  # rank 0's "stop" was the followers' last message: no barrier
    if not main:
        return 0
    print_table(rows, ("impl", "shape", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                       "completed", "failed", "wrong_text", "differs_from_alone", "common_prefix"))
    out = write_rows(rows, args.out, DEFAULT_OUT, device, key=row_key)
    if args.plot is not None:
        path = args.plot or (out.rsplit(".", 1)[0] + ".png" if out else "serve.png")
        plot_rows(rows, path)
        print(f"wrote {path}", file=sys.stderr)
    bad = sum(r.get("failed", 0) + r.get("wrong_text", 0) for r in rows)
    if bad:
        print(f"error: {bad} requests failed or answered wrong text", file=sys.stderr)
        return 1
    return 0


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a preset (random weights, synthetic tokenizer: llama-3.1-8b, smollm2-135m, tiny), a "
                        "checkpoint path, or nothing for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64],
                   help="concurrent clients (one run each)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds each run sends requests")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=32, help="the server's KV slots")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--quant", default=None, choices=list(METHODS))
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallelism over N GPUs (relaunches under torchrun; rank 0 serves, as serve --tp)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--no-static", action="store_true", help="skip the static-batch baseline")
    p.add_argument("--no-check", action="store_true",
                   help="do not compare each answer with the prompt generated alone (greedy)")
    p.add_argument("--out", default=None,
                   help="JSON result file (default: benchmarks/results/serve.json on CUDA, no file on a CPU); rows of "
                        "the same impl, shape and GPU are replaced, the others kept; '' writes nothing")
    p.add_argument("--plot", default=None, nargs="?", const="", help="write a PNG (default: next to --out)")


# ----------------------------------------------------------------------------- bench startup


def cmd_bench_startup(args) -> int:
    """``fastdecode bench startup``: the start-up of ``generate`` phase by phase, each run in a fresh process
    (``fastdecode.bench.startup``); the table on stdout, the rows merged into ``--out`` (default
    ``benchmarks/results/startup.json`` on CUDA, none on a CPU). Exit code 1 when a run failed."""
    from fastdecode.bench.startup import DEFAULT_OUT, bench_startup, print_phases
    from fastdecode.cli.common import USER_ERRORS, check_device

    try:
        device = check_device(args.device)
        check_dequantize(args)
        rows = bench_startup(args.model, quant=args.quant, quant_head=args.quant_head, dequantize=args.dequantize,
                             device=device, dtype=args.dtype, backend=args.backend, runs=args.runs,
                             max_batch=args.max_batch, graph_capture=args.graph_capture,
                             cuda_graph=not args.no_cuda_graph, prompt=args.prompt, timeout=args.timeout,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    except USER_ERRORS as e:
        return fail(e)
    print_phases(rows)
    write_rows(rows, args.out, DEFAULT_OUT, device)
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"error: {r['impl']}: {r['error']}", file=sys.stderr)
    return 1 if errors else 0


def add_startup_bench_arguments(p: argparse.ArgumentParser) -> None:
    from fastdecode.bench.startup import DEFAULT_PROMPT, RUNS

    p.add_argument("--model", default=None,
                   help="a .gguf file, a HF directory, a preset (random weights) or nothing for the embedded "
                        "SmolLM2-135M-Instruct (GGUF Q4_1: native int4 on CUDA)")
    p.add_argument("--quant", default=None, choices=list(METHODS), help="as generate --quant (default: as stored)")
    p.add_argument("--quant-head", default=None, choices=list(METHODS))
    p.add_argument("--dequantize", action="store_true", help="as generate --dequantize (a GGUF's int4 weights dense)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--backend", default=None, choices=["auto", "triton", "torch"])
    p.add_argument("--runs", nargs="+", default=None, choices=list(RUNS),
                   help="fresh processes in turn: cold (an empty temporary Triton cache), warm (that cache as the "
                        "runs before left it; alone: the environment's own) (default: cold warm on CUDA, warm on "
                        "a CPU)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="the engine's KV slots: one CUDA graph per batch bucket up to it (generate: 1; serve: 32)")
    p.add_argument("--graph-capture", default="eager", choices=["eager", "lazy"],
                   help="eager: every bucket at start-up; lazy: each on first use (the first token's decode "
                        "bucket only)")
    p.add_argument("--no-cuda-graph", action="store_true", help="an eager engine (no graphs)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat prompt of the first token")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--out", default=None,
                   help="JSON result file (default: benchmarks/results/startup.json on CUDA, no file on a CPU); "
                        "rows of the same impl (cold-cache / warm-cache) and shape are replaced, the others kept; "
                        "'' writes nothing")


def add_app_parsers(bsub) -> None:
    """Add ``serve`` and ``startup`` to ``bench``'s sub-parsers."""
    sv = bsub.add_parser("serve", help="the OpenAI server under a concurrency sweep vs one static batch (CPU too)",
                         description="Throughput (tok/s), time to first token and inter-token latency (p50 / p99) "
                         "of `fastdecode serve` (in process) for each --concurrency, beside the same engine "
                         "driven with one static batch; every answer checked against the prompt generated alone. "
                         "Exit code 1 when a request failed or, in fp32, answered wrong text. Needs fastdecode[serve].")
    add_serve_bench_arguments(sv)
    sv.set_defaults(func=cmd_bench_serve)
    st = bsub.add_parser("startup", help="start-up time of generate, phase by phase, in fresh processes (CPU too)",
                         description="Load the model as `fastdecode generate` does and generate one token, in a fresh "
                         "process per run, timing each phase: imports, CUDA init, checkpoint parsing, int4 "
                         "repacking, copies to the device, kernel warm-up (Triton compiles), CUDA graph capture "
                         "per batch bucket, the first token. Exit code 1 when a run failed.")
    add_startup_bench_arguments(st)
    st.set_defaults(func=cmd_bench_startup)

