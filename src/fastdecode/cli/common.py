"""What every ``fastdecode`` command shares: argument types and validators, the one-line ``error:`` / ``warning:``
reports, the rank-0 rule under torchrun, the end of a tensor-parallel run, and ``run_command`` (the exit
codes of Ctrl-C and a closed stdout).

A user's mistake (a bad path, option, checkpoint) ends in one ``error: ...`` line on stderr and exit code 2
(``fail``), never a traceback; under torchrun only rank 0 prints it (every rank fails alike).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

import torch

from fastdecode.quant.formats import METHODS

#: the model dtypes a command accepts (``--dtype``)
DTYPES = ["bfloat16", "float16", "float32"]

# what a bad path, checkpoint or option raises while loading: reported as ``error: ...`` (exit 2), no traceback
USER_ERRORS = (OSError, ValueError, ImportError)

# exit codes of a command stopped from outside, as a shell reports a process killed by the signal (128 + N)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout closed by the reader (SIGPIPE), e.g. ``fastdecode generate ... | head -c 20``


# ----------------------------------------------------------------------------- argument types


def positive_int(s: str) -> int:
    """argparse ``type``: an integer >= 1 (argparse names the flag in its error)."""
    return int_at_least(s, 1)


def nonneg_int(s: str) -> int:
    """argparse ``type``: an integer >= 0."""
    return int_at_least(s, 0)


def int_at_least(s: str, lo: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be {'positive' if lo == 1 else f'>= {lo}'}, got {v}")
    return v


def finite_float(s: str) -> float:
    """argparse ``type``: a finite number."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
    return v


def temperature(s: str) -> float:
    v = finite_float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {s}")
    return v


def top_p(s: str) -> float:
    v = finite_float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 keeps every token), got {s}")
    return v


def add_quant_head_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant-head", default=None, choices=list(METHODS),
                   help="also quantise the lm head: fp8 (per-channel weights, the final norm's per-token FP8 "
                        "activation) or int4 (W4A16, RTN group 128); tied embeddings keep the dense table for "
                        "the lookup (default: the head stays in the model dtype)")


# ----------------------------------------------------------------------------- validators


def kernel_switches(s: str) -> dict:
    """``--kernels`` value: ``name=on|off`` pairs, comma-separated -> ``{name: bool}`` for ``set_kernels``."""
    from fastdecode.models.llama import KERNELS

    out = {}
    for item in s.split(","):
        name, sep, value = item.strip().partition("=")
        if name not in KERNELS:
            raise argparse.ArgumentTypeError(f"unknown kernel switch {name!r}; known: {', '.join(KERNELS)}")
        if not sep or value.lower() not in ("on", "off", "1", "0", "true", "false"):
            raise argparse.ArgumentTypeError(f"{item.strip()!r}: write {name}=on or {name}=off")
        out[name] = value.lower() in ("on", "1", "true")
    return out


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
    from fastdecode.models.llama import KERNELS, OPT_IN_KERNELS

    on = [k for k in KERNELS if k not in OPT_IN_KERNELS]
    p.add_argument("--kernels", type=kernel_switches, default=None, metavar="NAME=on|off[,...]",
                   help=f"turn kernel switches on or off (model.set_kernels), e.g. int4_a8=on (W4A8 decode with "
                        f"int8 activations) or fp8_a16=off (W8A8 decode); on by default: {', '.join(on)}; off by "
                        f"default: {', '.join(OPT_IN_KERNELS)}")


def check_device(spec: Optional[str]) -> torch.device:
    """The ``--device`` to run on (default: cuda when available); ValueError naming --device for a device this
    torch cannot use (no CUDA build or GPU, an index past the GPUs there are, not cpu / cuda)."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {spec!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec}: the engine runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"--device {spec}: {why} (torch {torch.__version__}); use --device cpu")
        n = torch.cuda.device_count()
        if device.index is not None and device.index >= n:
            raise ValueError(f"--device {spec}: there {'is' if n == 1 else 'are'} only {n} CUDA device"
                             f"{'' if n == 1 else 's'} (cuda:0 to cuda:{n - 1})")
    return device


def check_text(text: str, what: str) -> None:
    """ValueError when ``text`` (argv or stdin, decoded by Python with surrogateescape) holds bytes that are not
    UTF-8: they come back as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = bytes(ord(c) - 0xDC00 for c in text[e.start:e.end] if 0xDC80 <= ord(c) <= 0xDCFF)
        raise ValueError(f"{what} is not valid UTF-8 (byte{'s' if len(bad) > 1 else ''} "
                         f"{bad.hex(' ') or '?'} at character {e.start}); pass UTF-8 text") from None


# ----------------------------------------------------------------------------- reports


def rank0() -> bool:
    """Not under torchrun, or its rank 0: the process that speaks for all ranks."""
    return int(os.environ.get("RANK", "0")) == 0


def fail(e) -> int:
    """Print ``error: e`` (under torchrun on rank 0 only: every rank fails alike) and return exit code 2."""
    if rank0():
        print(f"error: {e}", file=sys.stderr)
    return 2


def warn(msg: str) -> None:
    if rank0():
        print(f"warning: {msg}", file=sys.stderr)


def no_gpu(what: str, n: int = 1) -> int:
    """0 when torch sees ``n`` CUDA GPUs; else print one ``error:`` line and return 2 (the GPU benchmarks and
    tuners would fail deep inside with a CUDA traceback)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= n:
        return 0
    need = "a CUDA GPU" if n == 1 else f"{n} CUDA GPUs"
    why = "this torch is a CPU-only build" if torch.version.cuda is None else f"torch sees {have}"
    hint = "; on the CPU, `fastdecode selfcheck` checks the kernels and `fastdecode bench decode` measures the engine"
    print(f"error: `fastdecode {what}` needs {need} ({why}){hint}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- tensor parallelism


def broadcast(obj):
    """rank 0's ``obj`` on every rank (identity without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def finish_tp() -> None:
    """The end of a command under torchrun: wait for every rank, then leave the process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_tp() -> None:
    """Leave the process group without a barrier (every rank is failing alike)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- running a command


def run_command(args) -> int:
    """``args.func(args)`` as an exit code, without a traceback for the ways a user stops a command: Ctrl-C prints
    ``interrupted`` and returns 130; a closed stdout (``| head``) ends quietly with 141, stdout pointed at
    /dev/null so that the interpreter's last flush does not complain."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if rank0():
            print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError):  # no real file descriptor (e.g. captured by pytest)
            pass
        return EXIT_BROKEN_PIPE


def check_dequantize(args) -> None:
    """``--dequantize``: GGUF files only (the embedded default is one), not with ``--quant``. ValueError."""
    if not getattr(args, "dequantize", False):
        return
    if args.quant is not None:
        raise ValueError(f"--dequantize loads dense weights; it cannot be combined with --quant {args.quant}")
    if args.model is not None and not str(args.model).lower().endswith(".gguf"):
        raise ValueError(f"--dequantize applies to GGUF files (Q4_0/Q4_1 weights); --model {args.model} is not one")


def gguf_native(args) -> Optional[bool]:
    """``loader.load``'s ``gguf_native`` for a command's ``--dequantize``: False (dense), else None (the loader's
    default)."""
    return False if getattr(args, "dequantize", False) else None


def write_rows(rows: list, out_arg: Optional[str], default_out: str, device: torch.device, **merge_kw) -> str:
    """Merge ``rows`` into ``--out`` (default ``default_out`` on CUDA, no file on a CPU; '' writes nothing) and say
    so on stderr; returns the path written, or ''."""
    from fastdecode.bench.harness import merge_rows

    out = out_arg if out_arg is not None else (default_out if device.type == "cuda" else "")
    if out:
        merged = merge_rows(rows, out, **merge_kw)
        print(f"wrote {out} ({len(rows)} rows, {len(merged)} in the file)", file=sys.stderr)
    elif out_arg is None:
        print("a CPU run writes no results file unless --out names one", file=sys.stderr)
    return out
