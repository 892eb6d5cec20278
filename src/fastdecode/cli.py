"""``fastdecode`` command line: selfcheck, bench, tune, and the engine's generate / chat / info."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_selfcheck(args) -> int:
    from fastdecode import selfcheck

    return selfcheck.main([])


def _cmd_bench(args) -> int:
    from fastdecode.bench import norm_activation_quant as nav

    suites = {"norm": ["norm"], "silu": ["silu"], "quant": ["quant"], "all": ["norm", "silu", "quant"]}
    if args.what in suites:
        out = args.out or "benchmarks/results/norm_activation_quant.json"
        nav.run(suites[args.what], out, quick=args.quick)
        if args.what == "all":
            _bench_linear(args)
        return 0
    if args.what == "linear":
        return _bench_linear(args)
    if args.what == "allreduce":
        from fastdecode.bench import allreduce as bar

        bar.run(args.world, args.out or "benchmarks/results/allreduce.json", quick=args.quick)
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def _bench_linear(args) -> int:
    try:
        from fastdecode.bench import linear as bl
    except ImportError:
        print("linear benchmark not available in this build", file=sys.stderr)
        return 1
    out = args.out if args.what == "linear" and args.out else "benchmarks/results/linear.json"
    bl.run(out, quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdecode", description="Fast LLM decoding on NVIDIA Hopper GPUs")
    p.add_argument("-v", "--verbose", action="store_true", help="log backend choices and fallbacks")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("selfcheck", help="check every kernel against its reference (CPU: interpreter)")
    s.set_defaults(func=_cmd_selfcheck)

    b = sub.add_parser("bench", help="benchmark kernels against PyTorch eager / torch.compile / cuBLAS")
    b.add_argument("what", choices=["norm", "silu", "quant", "linear", "allreduce", "all"])
    b.add_argument("--world", type=int, default=2, help="GPUs for the all-reduce benchmark")
    b.add_argument("--out", default=None, help="JSON result file")
    b.add_argument("--quick", action="store_true", help="fewer sizes")
    b.set_defaults(func=_cmd_bench)

    try:  # the engine adds generate / chat / info / bench decode
        from fastdecode.engine.cli import add_subcommands
    except ImportError:
        add_subcommands = None
    if add_subcommands is not None:
        add_subcommands(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
