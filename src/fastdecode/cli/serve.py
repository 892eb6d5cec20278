"""``fastdecode serve``: the OpenAI-compatible server (``fastdecode.serve``) on the embedded default model or
``--model``; needs the ``serve`` extra (FastAPI, uvicorn).

    fastdecode serve                                   # SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1
    fastdecode serve --model llama-3.1-8b --quant fp8 --max-batch 64 --kv-memory 20
    fastdecode serve --model path/to/model --tp 2    # rank 0 serves, rank 1 makes its model calls (serve.tp)
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from fastdecode.cli.common import USER_ERRORS, end_tp, fail, finite_float, int_at_least, positive_int, warn
from fastdecode.cli.generate import _add_model_args, start_engine


def _port(s: str) -> int:
    v = int_at_least(s, 0)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {v}")
    return v


def _gib(s: str) -> float:
    v = finite_float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {s}")
    return v


def model_names(args, config_name: str) -> tuple[str, ...]:
    """The names the server answers to: ``--served-model-name`` first (else the file or directory name of the
    model, without ``.gguf`` and a GGUF type suffix such as ``.Q4_1``: ``SmolLM2-135M-Instruct`` for the
    embedded model), then the ``--model`` argument and the checkpoint's own name."""
    path = args.model
    if path is None:
        from fastdecode.engine.checkpoint.detect import default_model_path

        try:
            path = default_model_path()
        except FileNotFoundError:
            path = None
    stem = None
    if path:
        stem = re.sub(r"\.gguf$", "", os.path.basename(os.path.normpath(path)), flags=re.I)
        stem = re.sub(r"\.(I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.I)
    names = [args.served_model_name, stem, args.model, config_name]
    return tuple(dict.fromkeys(n for n in names if n)) or ("fastdecode",)


def cmd_serve(args) -> int:
    from fastdecode.serve.server import require_serve_deps, serve, slots_for_memory
    from fastdecode.serve.tp import lead_or_follow

    try:
        require_serve_deps()
    except USER_ERRORS as e:
        return fail(e)
    eng = start_engine(args, max_batch=lambda cfg, T, dtype: slots_for_memory(cfg, args.max_batch, T, dtype,
                                                                              args.kv_memory),
                       need_tokenizer=False)  # --tp N: the same command under torchrun
    if isinstance(eng, int):
        return eng
    leads, link = lead_or_follow(eng, args.prefill_chunk)  # under --tp rank 0 serves, the others follow (serve.tp)
    if not leads:
        end_tp()  # rank 0's "stop" was the last message: no barrier (on Ctrl-C torchrun may end rank 0 first)
        return 0
    if eng.tokenizer is None:
        from fastdecode.engine.tokenizer import Tokenizer

        warn(f"{args.model} has no tokenizer: serving with a synthetic one (token i is the word 't<i>'); pass "
             "--tokenizer PATH for real text")
        eng.tokenizer = Tokenizer.synthetic(eng.model.config.vocab_size)
    names = model_names(args, eng.model.config.name)
    url = f"http://{args.host}:{args.port}/v1"
    tp = f", TP={eng.model.tp.world}" if eng.model.tp is not None else ""
    print(f"[serving {names[0]!r}{tp}: {eng.max_batch} KV slots of {eng.max_seq_len} positions, prefill chunk "
          f"{args.prefill_chunk}, up to {args.max_waiting} waiting; OpenAI API at {url}]", file=sys.stderr, flush=True)
    serve(eng, model_names=names, host=args.host, port=args.port, prefill_chunk=args.prefill_chunk,
          max_waiting=args.max_waiting, log_level=args.log_level, link=link)
    end_tp()
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own options (shared with ``bench serve``)."""
    p.add_argument("--max-batch", type=positive_int, default=32,
                   help="KV slots: requests decoded together (one CUDA graph per batch bucket up to it)")
    p.add_argument("--kv-memory", type=_gib, default=None,
                   help="GiB for the KV cache: fewer slots than --max-batch when it holds fewer (default: "
                        "--max-batch slots, refused when they do not fit in the device's free memory)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512,
                   help="prompt tokens prefilled per step: a new request stalls the running ones for at most "
                        "one chunk")
    p.add_argument("--max-waiting", type=lambda v: int_at_least(v, 0), default=256,
                   help="requests queued for a slot beyond the running ones; more are answered 503")


def add_parser(subparsers) -> None:
    """Add ``serve`` to the ``fastdecode`` sub-parsers."""
    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching (needs fastdecode[serve])",
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, streaming or "
        "not; /v1/models; /health) with continuous batching: requests join and leave the running decode batch "
        "at step boundaries, prompts are prefilled in chunks between decode steps. Sampling per request: "
        "temperature, top_p, top_k, min_p, repetition_penalty, seed, max_tokens, stop. Needs FastAPI and "
        "uvicorn: pip install 'fastdecode[serve]'.")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the checkpoint's name; --model works too)")
    add_serve_arguments(s)
    s.add_argument("--graph-capture", default="eager", choices=["eager", "lazy"],
                   help="eager: capture the decode graph of every batch bucket up to --max-batch at start-up (the "
                        "memory is taken then); lazy: capture each bucket on the first step that needs it (a faster "
                        "start; the first batch of a new size waits for its capture)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    s.set_defaults(func=cmd_serve)
