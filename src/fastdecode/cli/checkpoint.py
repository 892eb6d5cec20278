"""``fastdecode quantize`` (write a quantised safetensors checkpoint, ``engine.export``) and ``fastdecode
eval-accuracy`` (perplexity, top-1 agreement and KL of quantised formats, ``engine.accuracy``)."""

from __future__ import annotations

import sys
import time

import torch

from fastdecode.cli.common import DTYPES, USER_ERRORS, fail
from fastdecode.quant.formats import METHODS


def cmd_quantize(args) -> int:
    from fastdecode.engine.export import quantize_checkpoint

    t = time.perf_counter()
    try:
        fmt = quantize_checkpoint(args.src, args.dst, args.method, dtype=getattr(torch, args.dtype),
                                  overwrite=args.overwrite)
    except USER_ERRORS as e:
        return fail(e)
    print(f"[wrote {args.dst} ({fmt}) in {time.perf_counter() - t:.1f} s]", file=sys.stderr)
    return 0


def cmd_eval_accuracy(args) -> int:
    from fastdecode.engine.accuracy import eval_accuracy

    try:  # a KV cache too large for the device is a KVCacheMemoryError (a ValueError): one error line
        quants = args.quant if args.quant is not None else ([] if args.quant_head else ["fp8"])
        rows = eval_accuracy(args.model, quants, head=args.quant_head, int4_a8=args.int4_a8, fp8_a16=args.fp8_a16,
                             fp8_a16_all=args.fp8_a16_all, device=args.device,
                             dtype=getattr(torch, args.dtype) if args.dtype else None, window=args.window,
                             max_tokens=args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    except USER_ERRORS as e:
        return fail(e)
    if args.out:
        from fastdecode.bench.harness import env_info, write_rows

        for r in rows:  # the code and versions that made the row (its device is the row's own "device")
            r.update({k: v for k, v in env_info().items() if k != "gpu"})
        write_rows(rows, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def add_parsers(subparsers) -> None:
    """Add ``quantize`` and ``eval-accuracy`` to the ``fastdecode`` sub-parsers."""
    q = subparsers.add_parser("quantize", help="write a quantised safetensors checkpoint (format recorded)")
    q.add_argument("src", help="a .gguf file, a Hugging Face directory or a preset")
    q.add_argument("dst", help="output directory: must not be or overlap SRC; written into a temporary "
                               ".DST.tmp-* directory beside it, then renamed into place (a failure leaves DST as "
                               "it was; a .DST.tmp-* left by a killed run is safe to delete)")
    q.add_argument("--method", required=True, choices=list(METHODS))
    q.add_argument("--dtype", default="bfloat16", choices=DTYPES,
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
    e.add_argument("--int4-a8", action="store_true",
                   help="also evaluate each int4 format with int8 activations (the int4_a8 kernel switch: W4A8 where "
                        "the weight's groups are multiples of 128 columns)")
    e.add_argument("--fp8-a16", action="store_true",
                   help="also evaluate each fp8 format as its decode steps compute it (the fp8_a16 kernel switch, "
                        "on by default: W8A16 wqkv, wo and w2, their activations not quantised; the plain fp8 row is "
                        "W8A8, as a prefill computes it)")
    e.add_argument("--fp8-a16-all", action="store_true",
                   help="also evaluate each fp8 format with the fp8_a16_all kernel switch (every projection W8A16)")
    e.add_argument("--device", default=None)
    e.add_argument("--dtype", default=None, choices=DTYPES)
    e.add_argument("--window", type=int, default=512,
                   help="tokens per independent context window (refused when its KV cache would not fit in the "
                        "device's available memory)")
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    e.add_argument("--out", default=None, help="JSON result file")
    e.set_defaults(func=cmd_eval_accuracy)
