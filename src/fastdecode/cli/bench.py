"""``fastdecode bench ...`` and ``fastdecode tune ...``: the kernel benchmarks and tuners (GPU; one ``error:``
line on a machine without one), the decode benchmark (``bench decode``: ``fastdecode.bench.decode``, also on
the CPU), the serving benchmark (``bench serve``: ``fastdecode.bench.serve``, also on the CPU), transformers'
``generate``, plain and patched (``bench hf``: ``fastdecode.bench.hf``, also on the CPU) and the start-up of
``generate`` phase by phase (``bench startup``: ``fastdecode.bench.startup``, also on the CPU); the last two's
commands are in ``cli.bench_apps``.

    fastdecode bench norm|silu|quant|kernels (alias all)|linear|int4|allreduce|decode|serve|hf|startup
    fastdecode tune linear|int4|int4-fused   measure GEMM launch configs on this GPU, write them as data
"""

from __future__ import annotations

import argparse
import sys

import torch

from fastdecode.cli.bench_apps import add_app_parsers
from fastdecode.cli.common import DTYPES, check_dequantize, end_tp, fail, finish_tp, gguf_native, no_gpu, write_rows
from fastdecode.quant.formats import METHODS

KERNELS_OUT = "benchmarks/results/norm_activation_quant.json"
PROFILE_OUT = "benchmarks/results/profile_decode.json"


# ----------------------------------------------------------------------------- kernel benchmarks, tuners (GPU)


def cmd_bench_kernels(args) -> int:
    if no_gpu(f"bench {args.bench_command}"):
        return 2
    from fastdecode.bench import norm_activation_quant as nav

    # `kernels` (alias `all`, its name in earlier versions) runs every suite
    nav.run(args.suites or list(nav.SUITES), args.out or KERNELS_OUT, quick=args.quick, merge=not args.replace)
    return 0


def cmd_bench_linear(args) -> int:
    if no_gpu("bench linear"):
        return 2
    from fastdecode.bench import gemm as bg

    bg.run(args.out or "benchmarks/results/linear.json", quick=args.quick,
           shapes=bg.parse_shapes(args.shapes) if args.shapes else None)
    return 0


def cmd_bench_int4(args) -> int:
    if no_gpu("bench int4"):
        return 2
    from fastdecode.bench import int4 as bi

    bi.run(args.out or "benchmarks/results/int4_linear.json", quick=args.quick)
    return 0


def cmd_bench_allreduce(args) -> int:
    if no_gpu(f"bench allreduce --world {args.world}", max(args.world, 1)):
        return 2
    from fastdecode.bench import allreduce as bar

    bar.run(args.world, args.out or "benchmarks/results/allreduce.json", quick=args.quick,
            write_config=args.write_config)
    return 0


def cmd_tune(args) -> int:
    if args.what == "int4-fused":  # bad shape names or token counts: the one-line error before the GPU check
        from fastdecode.bench import int4_fused as bf

        try:
            shapes = bf.parse_shapes(args.shapes or "smollm2")
            ms = bf.parse_ms(args.ms or "1")
        except ValueError as e:
            return fail(f"tune int4-fused: {e}")
    if no_gpu(f"tune {args.what}"):
        return 2
    if args.what == "int4-fused":
        from fastdecode.ops._common import config_path

        out = args.out or config_path("int4_linear", torch.cuda.get_device_name())
        bf.tune_fused(out, shapes=shapes, ms=ms, quick=args.quick)
        return 0
    if args.what == "int4":
        from fastdecode.bench import int4 as bi

        shapes = None
        if args.shapes:
            from fastdecode.bench.gemm import parse_shapes

            shapes = parse_shapes(args.shapes)
        # merged, as `tune linear` is: the table's other shapes and sections (the fused ops') stay
        bi.tune(args.out, shapes=shapes, quick=args.quick, fp8=not args.no_fp8, merge=True)
        return 0
    from fastdecode.bench import gemm as bg

    bg.tune(args.out, shapes=bg.parse_shapes(args.shapes) if args.shapes else None, quick=args.quick,
            dtypes=tuple(args.dtypes) if args.dtypes else bg.DTYPES)
    return 0


# ----------------------------------------------------------------------------- bench decode


def cmd_bench_decode(args) -> int:
    """``fastdecode bench decode``: every ``--batch`` in turn, the table on stdout, the measured rows merged into
    the results file (``bench.decode_results``), the plot. ``--tp N`` relaunches under torchrun (rank 0 reports).
    A KV cache larger than the device's available memory ends in one ``error:`` line (exit 2)."""
    import torch.distributed as dist

    from fastdecode.bench.decode import ABLATIONS, IMPLS, bench_decode
    from fastdecode.bench.decode_results import is_measured, plot_rows, results_path, row_key
    from fastdecode.bench.harness import merge_rows, print_table
    from fastdecode.engine.kv_cache import KVCacheMemoryError
    from fastdecode.engine.tp import init_distributed, maybe_relaunch, under_torchrun

    try:
        check_dequantize(args)
    except ValueError as e:
        return fail(e)
    code = maybe_relaunch(args.tp, getattr(args, "argv", None))  # --tp N outside torchrun: the same command under it
    if code is not None:
        return code
    if under_torchrun():
        init_distributed(getattr(args, "device", None))
    main = not dist.is_initialized() or dist.get_rank() == 0
    if getattr(args, "profile", False):
        return _profile_decode(args, main)
    impl = args.impl or list(IMPLS)
    impls = impl + ([a for a in ABLATIONS if a not in impl] if getattr(args, "ablate", False) else [])
    rows = []
    try:
        for b in args.batch:
            rows += bench_decode(args.model, batch=b, input_len=args.input_len, output_len=args.output_len,
                                 iters=args.iters, warmup=args.warmup, impls=impls, device=args.device,
                                 dtype=getattr(torch, args.dtype), layers=args.layers,
                                 quant=getattr(args, "quant", None), quant_head=getattr(args, "quant_head", None),
                                 gguf_native=gguf_native(args),
                                 log=(lambda m: print(m, file=sys.stderr, flush=True)) if main else (lambda m: None))
    except KVCacheMemoryError as e:  # checked before the KV cache is allocated: not a CUDA out-of-memory traceback
        end_tp()
        return fail(e)
    finish_tp()
    if not main:
        return 0
    print_table(rows, ("impl", "shape", "median_us", "tokens_per_s", "tbps", "roofline_tokens_per_s"))
    out = results_path(args)
    measured = [r for r in rows if is_measured(r)]
    if out and measured:
        merged = merge_rows(measured, out, key=row_key, keep_measured=True)
        print(f"wrote {out} ({len(measured)} measured rows of {len(rows)}, {len(merged)} in the file)",
              file=sys.stderr)
    elif out:
        print(f"no measured rows: nothing written to {out}", file=sys.stderr)
    elif args.out is None:
        print("a CPU run writes no results file unless --out names one", file=sys.stderr)
    if args.plot is not None:
        path = args.plot or (out.rsplit(".", 1)[0] + ".png" if out else "decode.png")
        for b in args.batch:
            sub = [r for r in rows if r["shape"]["batch"] == b]
            plot_rows(sub, path if len(args.batch) == 1 else path.replace(".png", f".b{b}.png"))
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _profile_decode(args, main: bool) -> int:
    """``bench decode --profile``: the family table of each ``--impl`` (default fastdecode-graph-no-pdl), merged
    into ``--out`` (default benchmarks/results/profile_decode.json)."""
    from fastdecode.bench.profile import profile_decode

    if len(args.batch) != 1:
        return fail(ValueError(f"--profile takes one --batch, got {args.batch}"))
    for flag, given in (("--ablate", args.ablate), ("--plot", args.plot is not None)):
        if given:  # they shape the timed run, which --profile replaces
            return fail(ValueError(f"--profile does not time generate: {flag} does not apply "
                                   "(name the rows with --impl)"))
    try:
        recs = profile_decode(args.model, impls=args.impl or ["fastdecode-graph-no-pdl"], batch=args.batch[0],
                              input_len=args.input_len, output_len=args.output_len, steps=args.profile_steps,
                              device=args.device, dtype=getattr(torch, args.dtype), layers=args.layers,
                              quant=args.quant, quant_head=args.quant_head,
                              gguf_native=gguf_native(args),
                              log=print if main else (lambda m: None))
    except (ValueError, RuntimeError) as e:
        end_tp()
        return fail(e)
    finish_tp()
    if main:
        write_rows(recs, args.out, PROFILE_OUT, torch.device("cuda"))
    return 0


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``fastdecode bench decode``."""
    from fastdecode.bench.decode import ABLATIONS, EXTRA_IMPLS, IMPLS, check_impl

    def impl_type(name: str) -> str:
        try:
            return check_impl(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--preset", "--model", dest="model", default="llama-3.1-8b",
                   help="a preset (random weights: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, smollm2-135m, "
                        "tiny) or a checkpoint path")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (several: one run each)")
    p.add_argument("--input-len", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impl", nargs="+", default=None, type=impl_type, metavar="IMPL",
                   help=f"rows to run (default: {' '.join(IMPLS)}; with --profile: fastdecode-graph-no-pdl); also "
                        f"{' '.join(EXTRA_IMPLS + ABLATIONS)}, and fastdecode-graph-with-<a>+<b> for several opt-in "
                        "switches")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing generate: one table per --impl of where the decode step's time goes, "
                        "kernel time and bytes per family (qkv, o, gate_up, down, head, attention, norms, "
                        "activation, sampling, gaps) against the copy-rate floor (CUDA; fastdecode.bench.profile), "
                        "merged into --out (default benchmarks/results/profile_decode.json)")
    p.add_argument("--profile-steps", type=int, default=20, help="decode steps recorded by --profile")
    p.add_argument("--ablate", action="store_true",
                   help="add fastdecode-graph with each kernel switched off in turn, and fastdecode-eager")
    p.add_argument("--quant", default=None, choices=list(METHODS),
                   help="quantise the model: fp8 (W8A8) or int4 (W4A16, RTN group 128)")
    p.add_argument("--quant-head", default=None, choices=list(METHODS),
                   help="quantise the lm head too: fp8 (W8A8) or int4 (W4A16, RTN group 128)")
    p.add_argument("--dequantize", action="store_true",
                   help="a GGUF's Q4_0/Q4_1 weights loaded dense in --dtype, not as int4 (as generate --dequantize); "
                        "the rows' quant reads dequantized")
    p.add_argument("--tp", type=int, default=None, help="tensor parallelism over N GPUs (relaunches under torchrun)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (big presets)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None,
                   help="JSON result file (default: benchmarks/results/decode.json on CUDA, no file on a CPU); "
                        "measured rows are merged into an existing one: a row with the same model, impl "
                        "(ablations included), dtype, quant, tp, batch, input/output length and GPU is replaced, "
                        "the others are kept; skipped or failed rows are printed, never written; '' writes "
                        "nothing")
    p.add_argument("--plot", default=None, nargs="?", const="", help="write a PNG (default: next to --out)")


# ----------------------------------------------------------------------------- bench hf


def cmd_bench_hf(args) -> int:
    """``fastdecode bench hf``: transformers' ``generate`` plain and patched (``fastdecode.bench.hf``), the table on
    stdout, the rows merged into ``--out`` (default ``benchmarks/results/hf.json`` on CUDA, none on a CPU)."""
    from fastdecode.bench.harness import print_table
    from fastdecode.cli.common import USER_ERRORS, check_device

    try:
        import transformers  # noqa: F401  (optional: the test extra)
    except ImportError:
        return fail("bench hf needs transformers (pip install 'transformers>=5,<6')")
    from fastdecode.bench.hf import DEFAULT_OUT, bench_hf

    try:
        device = check_device(args.device)
        rows = bench_hf(args.preset, layers=args.layers, device=device, dtype=getattr(torch, args.dtype),
                        batch=args.batch, input_len=args.input_len, output_len=args.output_len, iters=args.iters,
                        warmup=args.warmup, variants=args.variants, compile_backend=args.compile_backend,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    except USER_ERRORS as e:
        return fail(e)
    print_table(rows, ("impl", "ms_per_step", "tokens_per_s", "speedup_vs_plain", "tbps", "tokens_match_plain"))
    write_rows(rows, args.out, DEFAULT_OUT, device)
    return 1 if any("error" in r for r in rows) else 0


def add_hf_bench_arguments(p: argparse.ArgumentParser) -> None:
    from fastdecode.bench.hf import EXTRA_VARIANTS, VARIANTS

    p.add_argument("--preset", default="llama-3.1-8b",
                   help="the shapes of a preset, random weights (llama-3.1-8b, tiny, ...)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS,
                   metavar="VARIANT", help=f"default: {' '.join(VARIANTS)}; also: {' '.join(EXTRA_VARIANTS)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default=None, help="default: cuda when available (cpu: for testing, with a tiny preset)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the -compile variants (aot_eager: no C++ build on a CPU)")
    p.add_argument("--out", default=None,
                   help="JSON result file (default: benchmarks/results/hf.json on CUDA, no file on a CPU); rows of "
                        "the same op, impl and shape are replaced, the others kept; '' writes nothing")


# ----------------------------------------------------------------------------- wiring


def _add_common(p, default_out: str) -> None:
    p.add_argument("--out", default=None, help=f"JSON result file (default {default_out})")
    p.add_argument("--quick", action="store_true", help="fewer sizes")


def add_parsers(subparsers) -> None:
    """Add ``bench`` (with its sub-commands, ``decode`` included) and ``tune`` to the ``fastdecode`` sub-parsers."""
    b = subparsers.add_parser("bench", help="benchmarks, baselines side by side (GPU)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, what in (("norm", "fused add+RMSNorm (bf16 / FP8 out)"), ("silu", "SiLU-and-mul (bf16 / FP8 out)"),
                       ("quant", "FP8 quantisation"), ("argmax", "greedy argmax over a vocabulary"),
                       ("kernels", "norm + silu + quant + argmax")):
        k = bsub.add_parser(name, help=f"{what} vs PyTorch eager and torch.compile",
                            aliases=["all"] if name == "kernels" else [],
                            description=f"Benchmark {what} against PyTorch eager and torch.compile (GPU). "
                            "The rows are merged into the --out file: rows of the same op, impl and shape "
                            "are replaced, the others (e.g. of the other suites) kept; --replace overwrites.")
        _add_common(k, f"{KERNELS_OUT}; new rows are merged into it")
        k.add_argument("--replace", action="store_true",
                       help="overwrite the --out file with this run's rows instead of merging")
        k.set_defaults(func=cmd_bench_kernels, suites=None if name == "kernels" else [name])
    lin = bsub.add_parser("linear", help="skinny BF16 / FP8 GEMMs vs cuBLAS")
    lin.add_argument("--shapes", default=None, help='e.g. "8b.o,4096x14336" (default: the Llama shapes)')
    _add_common(lin, "benchmarks/results/linear.json")
    lin.set_defaults(func=cmd_bench_linear)
    i4 = bsub.add_parser("int4", help="int4-weight GEMMs (W4A16, W4A8) vs cuBLAS BF16")
    _add_common(i4, "benchmarks/results/int4_linear.json")
    i4.set_defaults(func=cmd_bench_int4)
    ar = bsub.add_parser("allreduce", help="all-reduce (+ add + RMSNorm) vs NCCL, one process per GPU")
    ar.add_argument("--world", type=int, default=2, help="number of GPUs")
    ar.add_argument("--write-config", action="store_true",
                    help="store the measured one-shot / two-shot / NCCL crossovers for this GPU and world "
                         "size in configs/allreduce_<gpu>.json (what the dispatcher reads)")
    _add_common(ar, "benchmarks/results/allreduce.json")
    ar.set_defaults(func=cmd_bench_allreduce)
    d = bsub.add_parser("decode", help="decode latency / tokens/s ablation (random-weight presets)")
    add_decode_arguments(d)
    d.set_defaults(func=cmd_bench_decode)
    hf = bsub.add_parser("hf", help="transformers generate, plain and patched by fastdecode (CPU too)",
                         description="HF generate on a random-weight Llama of a preset's shapes: plain, plain + "
                         "torch.compile (static cache), patched by fastdecode.integrations.transformers.apply, "
                         "patched + compile, patched with FP8 / int4 linears; tokens/s and ms/step, the plain row "
                         "as the baseline. Exit code 1 when a variant failed.")
    add_hf_bench_arguments(hf)
    hf.set_defaults(func=cmd_bench_hf)
    add_app_parsers(bsub)  # serve, startup (cli.bench_apps)
    t = subparsers.add_parser("tune", help="measure launch configs on this GPU and write them as data")
    t.add_argument("what", choices=["linear", "int4", "int4-fused"],
                   help="int4-fused: the fused int4 ops' own table sections (the norm, the residual add, SiLU-and-mul "
                        "inside the GEMV, as the decode step runs them) in this GPU's int4 table")
    t.add_argument("--no-fp8", action="store_true", help="int4: skip the W4A8 section")
    t.add_argument("--dtypes", nargs="+", choices=["bf16", "fp8"], default=None,
                   help="linear: the sections to tune (default both; the others in --out are kept)")
    t.add_argument("--shapes", default=None, help='e.g. "8b.o,4096x14336" (default: the Llama shapes); int4-fused: '
                   'names such as "smollm2.qkv" or the groups "smollm2" (default) and "8b"')
    t.add_argument("--ms", default=None, help="int4-fused: comma-separated token counts up to 8 (default 1)")
    t.add_argument("--out", default=None, help="config JSON (default: the package's configs/ folder)")
    t.add_argument("--quick", action="store_true")
    t.set_defaults(func=cmd_tune)
