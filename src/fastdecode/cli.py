"""``fastdecode`` command line.

    fastdecode generate PROMPT          text from the embedded default model (or --model PATH)
    fastdecode chat | info
    fastdecode selfcheck                every kernel against its reference (CPU: Triton interpreter)
    fastdecode bench norm|silu|quant|kernels (alias all)|linear|int4|allreduce|decode
    fastdecode tune linear              measure GEMM launch configs on this GPU, write them as data
"""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_selfcheck(args) -> int:
    from fastdecode import selfcheck

    return selfcheck.main(["--quick"] if args.quick else [])


KERNELS_OUT = "benchmarks/results/norm_activation_quant.json"


def _no_gpu(what: str, n: int = 1) -> int:
    """0 when torch sees ``n`` CUDA GPUs; else print one ``error:`` line and return 2 (the GPU benchmarks and
    tuners would fail deep inside with a CUDA traceback)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= n:
        return 0
    need = "a CUDA GPU" if n == 1 else f"{n} CUDA GPUs"
    why = "this torch is a CPU-only build" if torch.version.cuda is None else f"torch sees {have}"
    hint = "; on the CPU, `fastdecode selfcheck` checks the kernels and `fastdecode bench decode` measures the engine"
    print(f"error: `fastdecode {what}` needs {need} ({why}){hint}", file=sys.stderr)
    return 2


def _cmd_bench_kernels(args) -> int:
    if _no_gpu(f"bench {args.bench_command}"):
        return 2
    from fastdecode.bench import norm_activation_quant as nav

    # `kernels` (alias `all`, its name in earlier versions) runs every suite
    nav.run(args.suites or list(nav.SUITES), args.out or KERNELS_OUT, quick=args.quick, merge=not args.replace)
    return 0


def _cmd_bench_linear(args) -> int:
    if _no_gpu("bench linear"):
        return 2
    from fastdecode.bench import linear as bl

    bl.run(args.out or "benchmarks/results/linear.json", quick=args.quick,
           shapes=bl.parse_shapes(args.shapes) if args.shapes else None)
    return 0


def _cmd_bench_int4(args) -> int:
    if _no_gpu("bench int4"):
        return 2
    from fastdecode.bench import int4 as bi

    bi.run(args.out or "benchmarks/results/int4_linear.json", quick=args.quick)
    return 0


def _cmd_bench_allreduce(args) -> int:
    if _no_gpu(f"bench allreduce --world {args.world}", max(args.world, 1)):
        return 2
    from fastdecode.bench import allreduce as bar

    bar.run(args.world, args.out or "benchmarks/results/allreduce.json", quick=args.quick,
            write_config=args.write_config)
    return 0


def _cmd_tune(args) -> int:
    if _no_gpu(f"tune {args.what}"):
        return 2
    if args.what == "int4":
        from fastdecode.bench import int4 as bi

        shapes = None
        if args.shapes:
            from fastdecode.bench.linear import parse_shapes

            shapes = parse_shapes(args.shapes)
        bi.tune(args.out, shapes=shapes, quick=args.quick, fp8=not args.no_fp8)
        return 0
    from fastdecode.bench import linear as bl

    bl.tune(args.out, shapes=bl.parse_shapes(args.shapes) if args.shapes else None, quick=args.quick,
            dtypes=tuple(args.dtypes) if args.dtypes else bl.DTYPES)
    return 0


def _add_common(p, default_out: str) -> None:
    p.add_argument("--out", default=None, help=f"JSON result file (default {default_out})")
    p.add_argument("--quick", action="store_true", help="fewer sizes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdecode", description="Fast LLM decoding on NVIDIA Hopper GPUs")
    p.add_argument("-v", "--verbose", action="store_true", help="log backend choices and fallbacks")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("selfcheck", help="check every kernel against its reference (CPU: interpreter)")
    s.add_argument("--quick", action="store_true", help="tiny sizes only (seconds on a CPU)")
    s.set_defaults(func=_cmd_selfcheck)

    b = sub.add_parser("bench", help="benchmarks, baselines side by side (GPU)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, what in (("norm", "fused add+RMSNorm (bf16 / FP8 out)"), ("silu", "SiLU-and-mul (bf16 / FP8 out)"),
                       ("quant", "FP8 quantisation"), ("kernels", "norm + silu + quant")):
        k = bsub.add_parser(name, help=f"{what} vs PyTorch eager and torch.compile",
                            aliases=["all"] if name == "kernels" else [],
                            description=f"Benchmark {what} against PyTorch eager and torch.compile (GPU). "
                            "The rows are merged into the --out file: rows of the same op, impl and shape "
                            "are replaced, the others (e.g. of the other suites) kept; --replace overwrites.")
        _add_common(k, f"{KERNELS_OUT}; new rows are merged into it")
        k.add_argument("--replace", action="store_true",
                       help="overwrite the --out file with this run's rows instead of merging")
        k.set_defaults(func=_cmd_bench_kernels, suites=None if name == "kernels" else [name])
    lin = bsub.add_parser("linear", help="skinny BF16 / FP8 GEMMs vs cuBLAS")
    lin.add_argument("--shapes", default=None, help='e.g. "8b.o,4096x14336" (default: the Llama shapes)')
    _add_common(lin, "benchmarks/results/linear.json")
    lin.set_defaults(func=_cmd_bench_linear)
    i4 = bsub.add_parser("int4", help="int4-weight GEMMs (W4A16, W4A8) vs cuBLAS BF16")
    _add_common(i4, "benchmarks/results/int4_linear.json")
    i4.set_defaults(func=_cmd_bench_int4)
    ar = bsub.add_parser("allreduce", help="all-reduce (+ add + RMSNorm) vs NCCL, one process per GPU")
    ar.add_argument("--world", type=int, default=2, help="number of GPUs")
    ar.add_argument("--write-config", action="store_true",
                    help="store the measured one-shot / two-shot / NCCL crossovers for this GPU and world "
                         "size in configs/allreduce_<gpu>.json (what the dispatcher reads)")
    _add_common(ar, "benchmarks/results/allreduce.json")
    ar.set_defaults(func=_cmd_bench_allreduce)

    t = sub.add_parser("tune", help="measure launch configs on this GPU and write them as data")
    t.add_argument("what", choices=["linear", "int4"])
    t.add_argument("--no-fp8", action="store_true", help="int4: skip the W4A8 section")
    t.add_argument("--dtypes", nargs="+", choices=["bf16", "fp8"], default=None,
                   help="linear: the sections to tune (default both; the others in --out are kept)")
    t.add_argument("--shapes", default=None, help='e.g. "8b.o,4096x14336" (default: the Llama shapes)')
    t.add_argument("--out", default=None, help="config JSON (default: the package's configs/ folder)")
    t.add_argument("--quick", action="store_true")
    t.set_defaults(func=_cmd_tune)

    from fastdecode.engine.cli import add_bench_decode, add_subcommands

    add_bench_decode(bsub)
    add_subcommands(sub, bench=False)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --tp relaunches (engine commands)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from fastdecode.engine.cli import run_command

    return run_command(args)  # Ctrl-C: "interrupted", 130; stdout closed (| head): quiet, 141


if __name__ == "__main__":
    sys.exit(main())
