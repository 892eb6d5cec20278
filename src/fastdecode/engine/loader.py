"""Build a model (and its tokenizer) from a checkpoint: HF safetensors directory, GGUF file, or a preset.

``load`` reads like gpt-fast's ``_load_model``: resolve the source (``engine.checkpoint.detect``), open it
(``checkpoint.hf`` / ``checkpoint.gguf_io``), build the model on ``meta`` (rank's shard structure,
``engine.sharding``; FP8 modules swapped in), read the weights, swap in the int4 modules, assign
(``checkpoint.assemble``), so nothing is allocated twice. ``quant="fp8"`` quantises each block projection
as it is read (per-channel FP8); FP8 checkpoints that carry ``weight_scale`` tensors (compressed-tensors /
FBGEMM layout, or written by ``fastdecode quantize``) load as they are. ``quant="int4"`` quantises each
block projection as it is read (W4A16, RTN, group 128); int4 checkpoints load as they are, without
re-quantisation (``checkpoint.int4``): GPTQ and AWQ (HF ``quantization_config``), ``fastdecode quantize
--method int4`` (the kernel layout itself), and GGUF Q4_0 / Q4_1 tensors (natively, when int4 is asked for,
or by default on a CUDA device; on the CPU the default dequantises them). Fused projections (q | k | v,
gate | up) concatenate their parts' int4 weights along N. ``tp=(rank, world)`` reads only the rank's shard
(safetensors slices, GPTQ / AWQ / fastdecode int4 tensors included; GGUF byte ranges of the memory-mapped
file: rows, or K ranges on whole blocks; see ``fastdecode.engine.sharding``). Every tensor the model needs
is checked by name and shape; a missing, truncated, extra or mis-shaped tensor, or an FP8 tensor without
its scale, raises ``CheckpointError`` naming it, never a silently wrong model.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from fastdecode.engine.checkpoint.assemble import (WeightReader, assign_weights, build_meta_model, check_tensors,
                                                   swap_int4_modules)
from fastdecode.engine.checkpoint.detect import resolve_source
from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.checkpoint.gguf_io import open_gguf
from fastdecode.engine.checkpoint.hf import open_hf
from fastdecode.engine.checkpoint.spec import Checkpoint
from fastdecode.engine.sharding import apply_tp_structure
from fastdecode.engine.timing import Timings, phase
from fastdecode.engine.tokenizer import Tokenizer
from fastdecode.models.config import ModelConfig
from fastdecode.models.llama import Transformer

__all__ = ["CheckpointError", "Loaded", "load", "random_model"]


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Optional[object]  # fastdecode.engine.tokenizer.Tokenizer, None for random-weight presets
    config: ModelConfig
    source: str
    tokenizer_error: Optional[str] = None  # why ``tokenizer`` is None for a checkpoint (e.g. a GGUF without vocabulary)


def load(path: Optional[str] = None, *, device="cpu", dtype: Optional[torch.dtype] = None,
         backend: Optional[str] = None, max_seq_len: Optional[int] = None, progress: bool = True,
         quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None,
         gguf_native: Optional[bool] = None, quant_head: Optional[str] = None,
         timings: Optional[Timings] = None) -> Loaded:
    """Load ``path``: a ``.gguf`` file, a HF directory (config.json + safetensors), a preset name
    (random weights, no tokenizer) or None for the embedded default model.

    ``dtype``: default bfloat16 on GPUs, float32 on the CPU. ``max_seq_len`` sizes the RoPE table (default:
    the model's context). ``backend``: the model's op backend; default "torch" on the CPU, "auto" elsewhere.
    ``quant``: None (as stored), "fp8" (W8A8, quantised at load unless the checkpoint already is) or "int4"
    (W4A16: RTN group 128 at load, unless the checkpoint is int4 already: GPTQ, AWQ, ``fastdecode quantize``).
    ``tp``: (rank, world): build and read only that rank's shard (no communication; see ``engine.tp.load_tp``).
    ``gguf_native``: GGUF Q4_0 / Q4_1 tensors as int4 weights (True), dequantised (False; then
    ``quant="int4"`` re-quantises them with RTN), or None: native when ``quant="int4"``, or when
    ``quant`` is None and ``device`` is CUDA.
    ``quant_head``: None (the lm head as stored), "fp8" or "int4": the head quantised after loading
    (``models.quantize.quantize_head``; under ``tp``, this rank's rows).
    ``timings``: a ``engine.timing.Timings`` that gets the phases (``checkpoint_open``, ``model_build``,
    ``weights_int4`` (int4 weights read and repacked), ``weights_dense`` (the others read, dequantised,
    quantised), ``weights_to_device``, ``assign``, ``tokenizer`` (the wait for it: it is built in a thread while the
    weights load), ``quant_head``; a preset: ``random_init``).
    """
    from fastdecode.models.quantize import QUANT_METHODS, check_head

    if quant is not None and quant not in QUANT_METHODS:
        raise ValueError(f"quant must be one of {QUANT_METHODS} or None, got {quant!r}")
    check_head(quant_head, "quant_head")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if backend is None:
        backend = "torch" if device.type == "cpu" else "auto"
    prewarm = _prewarm_triton(device, backend)
    with phase(timings, "checkpoint_open"):
        kind, source = resolve_source(path)  # a preset's config, or the path of a HF directory / GGUF file
        if kind != "preset":
            ckpt = open_hf(source, quant=quant) if kind == "hf" else open_gguf(source, quant=quant, device=device,
                                                                                native=gguf_native)
    if kind == "preset":
        with phase(timings, "random_init"):
            loaded = _load_preset(source, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len,
                                  quant=quant, tp=tp)
    else:
        tokenizer = _Background(_tokenizer, ckpt)  # built while the weights load: their copies free the GIL
        model = _load_model(ckpt, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len,
                            progress=progress, quant=quant, tp=tp, timings=timings)
        with phase(timings, "tokenizer"):  # what is left of it
            tok, tok_error = tokenizer.result()
        loaded = Loaded(model, tok, ckpt.config, source, tok_error)
    if quant_head is not None:
        from fastdecode.models.quantize import quantize_head

        with phase(timings, "quant_head"):
            quantize_head(loaded.model, quant_head)
    if prewarm is not None:
        prewarm.join()
    return loaded


class _Background(threading.Thread):
    """``fn(*args)`` in a daemon thread from now; ``result()`` joins it and returns its value or raises its
    exception in the caller."""

    def __init__(self, fn, *args):
        super().__init__(name=f"fastdecode-{fn.__name__.strip('_').replace('_', '-')}", daemon=True)
        self._fn, self._args, self._out, self._err = fn, args, None, None
        self.start()

    def run(self):
        try:
            self._out = self._fn(*self._args)
        except BaseException as e:  # re-raised by result(), in the loading thread
            self._err = e

    def result(self):
        self.join()
        if self._err is not None:
            raise self._err
        return self._out


def _prewarm_triton(device: torch.device, backend: str) -> Optional[threading.Thread]:
    """A thread that computes Triton's cache key of its own installation while the weights load
    (``triton.runtime.cache.triton_key``, cached per process: it hashes Triton's sources and its library, 0.37 s of
    the warm start-up's first kernel call on the H100 machine's host, session 36's profile); hashing and reading
    release the GIL. CUDA with a Triton backend only; a failure is left to that first kernel call."""
    if device.type != "cuda" or backend == "torch":
        return None
    try:
        from triton.runtime.cache import triton_key
    except Exception:  # another Triton layout: its first kernel call computes what it needs
        return None

    def _triton_key():
        try:
            triton_key()
        except Exception:
            pass

    return _Background(_triton_key)


def _load_model(ckpt: Checkpoint, *, device, dtype, backend, max_seq_len, progress, quant, tp,
                timings: Optional[Timings] = None) -> Transformer:
    """The model of an opened checkpoint: names checked, built on meta (rank's shard, FP8 modules), weights
    read (rank's shard; quantised where asked), int4 modules swapped in, weights assigned."""
    with phase(timings, "model_build"):
        stored4 = check_tensors(ckpt)
        rope_len = max_seq_len or ckpt.config.max_seq_len
        model = build_meta_model(ckpt, dtype=dtype, backend=backend, rope_len=rope_len, tp=tp,
                                 fp8=ckpt.fp8_ckpt or quant == "fp8")
    weights = WeightReader(ckpt, stored4, device=device, dtype=dtype, quant=quant, tp=tp).read(progress, timings)
    with phase(timings, "assign"):
        swap_int4_modules(model, weights, dtype)
        assign_weights(model, weights, rope_len=rope_len, device=device)
    return model


def _tokenizer(ckpt: Checkpoint) -> tuple[Optional[Tokenizer], Optional[str]]:
    """(tokenizer, None) or (None, why there is none): a HF directory's tokenizer.json, a GGUF's vocabulary."""
    path = ckpt.source
    if ckpt.kind == "hf":
        has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
        return (Tokenizer.from_hf_dir(path), None) if has_tok else (None, f"{path} has no tokenizer.json")
    try:  # a GGUF without a usable vocabulary still runs (bench decode); generate asks for --tokenizer
        return Tokenizer.from_gguf_metadata(ckpt.meta), None
    except (ValueError, KeyError, IndexError) as e:
        return None, f"{path}: no usable tokenizer ({type(e).__name__}: {e})"


def _load_preset(cfg: ModelConfig, *, device, dtype, backend, max_seq_len, quant, tp) -> Loaded:
    model = random_model(cfg, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, tp=tp)
    if quant is not None:
        from fastdecode.models.quantize import quantize_model

        quantize_model(model, quant)  # under TP each rank quantises its own shard
    return Loaded(model, None, cfg, f"preset:{cfg.name}")


def random_model(cfg: ModelConfig, *, device, dtype=torch.bfloat16, backend="auto", max_seq_len=None,
                 std: float = 0.02, seed: int = 0, tp: Optional[tuple[int, int]] = None) -> Transformer:
    """A model with N(0, std) weights (norm weights 1) created directly on ``device`` (no CPU copy of 16 GB).

    ``tp=(rank, world)``: only that rank's shard, with its own random values (for benchmarks)."""
    device = torch.device(device)
    rope_len = max_seq_len or min(cfg.max_seq_len, 8192)
    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, backend=backend, rope_len=rope_len)
    if tp is not None:
        apply_tp_structure(model, *tp)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, std, generator=gen)
    model.tie_weights()
    model.setup_rope(rope_len, device)
    return model
