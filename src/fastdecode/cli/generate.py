"""``fastdecode generate`` and ``fastdecode chat``: load a model (``--model``, default the embedded
SmolLM2-135M-Instruct), build an ``Engine`` and stream its tokens.

Tensor parallelism: ``torchrun --nproc-per-node N -m fastdecode generate ...`` runs one rank per process
(only rank 0 prints); ``--tp N`` relaunches the same command line under torchrun
(``fastdecode.engine.tp.maybe_relaunch``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from fastdecode.cli.common import (DTYPES, USER_ERRORS, add_kernels_arg, add_quant_head_arg, broadcast,
                                   check_dequantize, check_device, check_text, end_tp, fail, finish_tp, gguf_native,
                                   nonneg_int, positive_int, temperature, top_p, warn)
from fastdecode.quant.formats import METHODS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face directory, or a Hub id org/name already in the local Hugging "
                        "Face cache (HF_HUB_CACHE / HF_HOME; never downloaded) (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights and activations (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="context (KV cache) length (default: the model's context, at most 4096; more than the "
                        "model's context is capped to it with a warning; refused when the KV cache would not fit "
                        "in the device's available memory)")
    p.add_argument("--backend", default=None, choices=["auto", "triton", "torch"],
                   help="op backend (default: torch on CPU, auto on GPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="launch the decode step eagerly")
    add_kernels_arg(p)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json, a HF directory holding one, or a .gguf whose vocabulary to use "
                        "(default: the model's own; needed for a GGUF without a vocabulary)")
    _add_quant_tp_args(p)


def _add_quant_tp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default=None, choices=list(METHODS),
                   help="fp8: per-channel FP8 weights, W8A8 with per-token activations (decode steps run wqkv, wo "
                        "and w2 W8A16: the fp8_a16 switch); int4: W4A16 (group-wise int4 weights, RTN group 128; "
                        "int4_a8=on: int8 activations at decode); quantised at load unless the checkpoint already "
                        "is (FP8, GPTQ, AWQ, GGUF Q4_0/Q4_1); default: as stored (GGUF Q4_0/Q4_1 run as int4 on "
                        "CUDA)")
    p.add_argument("--dequantize", action="store_true",
                   help="a GGUF's Q4_0/Q4_1 weights dequantised to --dtype at load (as on the CPU), not run as int4: "
                        "more memory, and faster where the decode step is bound by kernel launches rather than "
                        "weight bytes (the embedded 135M model); GGUF only, not with --quant")
    add_quant_head_arg(p)
    p.add_argument("--tp", type=positive_int, default=None,
                   help="tensor parallelism over N GPUs (relaunches under torchrun; or run under torchrun yourself)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _dtype(args, device: torch.device) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
    check_dequantize(args)


def _engine(args, max_batch=1, need_tokenizer: bool = True):
    """Load the model and its tokenizer (``--tokenizer`` overrides the checkpoint's); raises one of
    ``USER_ERRORS`` with a message for the user (a model without a tokenizer too, unless not ``need_tokenizer``:
    the engine then has none). ``max_batch``: an int, or ``f(config, max_seq_len, dtype) -> int``."""
    from fastdecode.engine.generate import DEFAULT_MAX_SEQ_LEN, Engine
    from fastdecode.engine.loader import load
    from fastdecode.engine.tokenizer import Tokenizer
    from fastdecode.engine.tp import under_torchrun

    # the RoPE table: what was asked for (capped to the model's context below), else the default context
    kw = dict(backend=args.backend, max_seq_len=args.max_seq_len or DEFAULT_MAX_SEQ_LEN, quant=args.quant,
              quant_head=getattr(args, "quant_head", None),
              gguf_native=gguf_native(args))
    t = time.perf_counter()
    if under_torchrun():
        from fastdecode.engine.tp import init_distributed, load_tp

        _, _, device = init_distributed(args.device)
        dtype = _dtype(args, device)
        loaded = load_tp(args.model, device=device, dtype=dtype, progress=False, **kw)
    else:
        device = check_device(args.device)
        dtype = _dtype(args, device)
        loaded = load(args.model, device=device, dtype=dtype, progress=sys.stderr.isatty(), **kw)
    if getattr(args, "kernels", None):
        loaded.model.set_kernels(**args.kernels)  # before the engine captures its graphs
    tok = loaded.tokenizer
    if args.tokenizer:
        tok = Tokenizer.from_path(args.tokenizer)
        if tok.vocab_size > loaded.config.vocab_size:  # its ids would index past the embedding
            raise ValueError(f"--tokenizer {args.tokenizer}: {tok.vocab_size} tokens, but the model's vocabulary "
                             f"has {loaded.config.vocab_size}")
    if tok is None and need_tokenizer:
        why = loaded.tokenizer_error or f"{loaded.source} has no tokenizer"
        raise ValueError(f"{why}; generate and chat need one: pass --tokenizer PATH (a tokenizer.json, a HF "
                         "directory or a .gguf with a vocabulary)")
    context = loaded.config.max_seq_len  # max_position_embeddings / GGUF context_length
    if args.max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, context)
    elif args.max_seq_len > context:
        warn(f"--max-seq-len {args.max_seq_len} is more than the model's context ({context} positions, "
              f"max_position_embeddings in its config); capped to {context}")
        max_seq_len = context
    else:
        max_seq_len = args.max_seq_len
    if callable(max_batch):  # serve: the KV slots that fit its memory setting
        max_batch = max_batch(loaded.config, min(max_seq_len, loaded.model.rope_len), dtype)
    eng = Engine(loaded.model, tok, max_batch=max_batch,
                 max_seq_len=min(max_seq_len, loaded.model.rope_len),  # KVCacheMemoryError if it does not fit
                 cuda_graph=False if args.no_cuda_graph else None,
                 graph_capture=getattr(args, "graph_capture", "eager"))  # serve --graph-capture
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


def _sampling(args):
    from fastdecode.engine.sampler import SamplingParams
    from fastdecode.engine.tp import under_torchrun

    seed = args.seed
    if seed is None and args.temperature > 0 and under_torchrun():  # every rank must draw the same tokens
        seed = broadcast(int(torch.randint(0, 2**31 - 1, ()).item()))
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)  # ValueError


def _stats(n_tokens: int, seconds: float) -> str:
    return f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tokens/s]"


def start_engine(args, **engine_kw):
    """The engine of a command that loads one (generate, chat, serve; ``engine_kw`` as ``_engine``'s), or the exit
    code when the command ends here: a --tp relaunch under torchrun returned, or a user error (bad path, option,
    checkpoint) was printed."""
    from fastdecode.engine.tp import TPLoadError, maybe_relaunch

    try:
        _check_args(args)
        code = maybe_relaunch(args.tp, getattr(args, "argv", None))
        if code is not None:
            return code
        return _engine(args, **engine_kw)
    except (*USER_ERRORS, TPLoadError) as e:
        end_tp()
        return fail(e)


def _start(args):
    """(engine, sampling) for generate / chat, or the exit code when the command ends here (``start_engine``)."""
    eng = start_engine(args)
    if isinstance(eng, int):
        return eng
    try:
        return eng, _sampling(args)
    except USER_ERRORS as e:
        end_tp()
        return fail(e)


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
        end_tp()
        return fail(e)
    dt = time.perf_counter() - t
    out.write("\n")
    if main:
        print(_stats(len(r.tokens), dt) + f" [{r.finish_reason}]", file=sys.stderr)
    finish_tp()
    return 0


def cmd_chat(args) -> int:
    started = _start(args)
    if isinstance(started, int):
        return started
    eng, sampling = started
    tok = eng.tokenizer
    if not tok.chat_template:
        return fail("this model has no chat template; use `generate --raw`")
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
        user = broadcast(user)  # under TP every rank runs the same turn
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
    finish_tp()
    return 0


def add_parsers(subparsers) -> None:
    """Add ``generate`` and ``chat`` to the ``fastdecode`` sub-parsers."""
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
