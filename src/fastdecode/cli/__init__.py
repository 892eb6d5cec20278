"""``fastdecode`` command line: one parser, one sub-command module per group.

    fastdecode generate PROMPT          text from the embedded default model (or --model PATH)   cli/generate.py
    fastdecode chat                     interactive chat with the model's chat template          cli/generate.py
    fastdecode serve                    OpenAI-compatible server, continuous batching             cli/serve.py
    fastdecode quantize SRC DST         write a quantised safetensors checkpoint                  cli/checkpoint.py
    fastdecode eval-accuracy            perplexity / top-1 agreement / KL of quantised formats    cli/checkpoint.py
    fastdecode info                     versions, GPUs, backends, default model                   cli/info.py
    fastdecode selfcheck                every kernel against its reference (CPU: Triton interpreter)
    fastdecode bench norm|silu|quant|kernels (alias all)|linear|int4|allreduce|decode|hf          cli/bench.py
    fastdecode bench serve|startup      the server under load; start-up phase by phase            cli/bench_apps.py
    fastdecode tune linear|int4|int4-fused  GEMM launch configs measured on this GPU, as data     cli/bench.py

Shared argument types, validators and the ``error:`` reporting: ``cli/common.py``. Each sub-parser sets
``func`` (called with the parsed args, returns an exit code); ``main`` runs it through ``run_command`` (Ctrl-C:
``interrupted``, 130; stdout closed, as by ``| head``: quiet, 141). Tensor parallelism: ``--tp N`` relaunches
the command line under torchrun (``fastdecode.engine.tp.maybe_relaunch``), which is why ``main`` keeps argv.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fastdecode.cli import bench, checkpoint, generate, info, serve
from fastdecode.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, run_command


def _cmd_selfcheck(args) -> int:
    from fastdecode import selfcheck

    return selfcheck.main(["--quick"] if args.quick else [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdecode", description="Fast LLM decoding on NVIDIA Hopper GPUs")
    p.add_argument("-v", "--verbose", action="store_true", help="log backend choices and fallbacks")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("selfcheck", help="check every kernel against its reference (CPU: interpreter)")
    s.add_argument("--quick", action="store_true", help="tiny sizes only (seconds on a CPU)")
    s.set_defaults(func=_cmd_selfcheck)

    bench.add_parsers(sub)
    generate.add_parsers(sub)
    serve.add_parser(sub)
    checkpoint.add_parsers(sub)
    info.add_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --tp relaunches (engine commands)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return run_command(args)  # Ctrl-C: "interrupted", 130; stdout closed (| head): quiet, 141


__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "build_parser", "main", "run_command"]
