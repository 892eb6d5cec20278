"""A model from an opened ``Checkpoint``, step by step (``engine.loader.load`` calls them in order):

1. ``check_tensors``: every tensor the model needs is there, and nothing more (``CheckpointError`` naming one);
2. ``build_meta_model``: the model on ``meta``, its per-rank structure (``tp``) and FP8 projections swapped in;
3. ``WeightReader.read``: each tensor fetched with the checkpoint's ``get``, checked by shape, cut to rank's
   shard (reading only its bytes where the lazy tensors, and the int4 source's ``read_shard``, allow),
   transformed (q / k rows), quantised where asked (FP8 per channel, int4 RTN);
4. ``swap_int4_modules``: the meta ``Linear`` of each int4 projection replaced by a meta ``Int4Linear``;
5. ``assign_weights``: ``load_state_dict(assign=True)``, nothing allocated twice; ties, RoPE table.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.checkpoint.spec import BLOCK_LINEARS, Checkpoint, scale_name
from fastdecode.engine.sharding import apply_tp_structure, shard_int4, shard_part, shard_rule
from fastdecode.engine.timing import Timings, cuda_sync, phase
from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Transformer
from fastdecode.quant.int4 import Int4Weight

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))


def natural(s: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


def int4_label(names: list[str]) -> str:
    """'blk.0.attn_q.weight', or 'model.layers.0.self_attn.q_proj' (qweight, qzeros, scales) for several tensors."""
    if len(names) == 1:
        return repr(names[0])
    base = names[0].rsplit(".", 1)[0]
    return f"{base!r} ({', '.join(n.rsplit('.', 1)[1] for n in names)})"


def fp8_scale(t: torch.Tensor, rows: int, name: str, source: str) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: () / (1,); per channel: (N,) / (N, 1)) -> (N,) float32."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1).expand(rows).clone()
    if t.numel() == rows and (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        return t.reshape(rows)
    raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}; expected a per-tensor or "
                          f"per-channel FP8 scale (1 or {rows} values; block-wise scales are not supported)")


def progress_bar(total: int, desc: str, enabled: bool):
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


# ----------------------------------------------------------------------------- 1. names


def check_tensors(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Raise ``CheckpointError`` on a missing or unexpected tensor; returns the int4-stored block projection
    parts: dense name -> its int4 tensors in the checkpoint."""
    cfg, spec, available, int4 = ckpt.config, ckpt.spec, ckpt.available, ckpt.int4
    stored4 = {}
    if int4 is not None:
        for our, parts, _ in spec:
            if our.endswith(BLOCK_LINEARS):
                for name, _ in parts:
                    names = int4.tensors(name, available)
                    if names:
                        stored4[name] = names
    needed = set()
    for _, parts, _ in spec:
        for name, _ in parts:
            needed |= set(stored4.get(name, [name]))
    if ckpt.fp8_ckpt:  # scales that are there are used; a projection without one is quantised here
        # (FBGEMM-style checkpoints keep some layers in bf16: modules_to_not_convert)
        needed |= {scale_name(name) for our, parts, _ in spec if our.endswith(BLOCK_LINEARS)
                   for name, _ in parts} & available
    missing = sorted(needed - available, key=natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{ckpt.source}: tensor {missing[0]!r} is missing{more}; the checkpoint does not match "
                              f"the config ({cfg.n_layers} layers, tie_embeddings={cfg.tie_embeddings}, "
                              f"qkv_bias={cfg.qkv_bias}{', FP8 with weight_scale' if ckpt.fp8_ckpt else ''}"
                              f"{', ' + int4.format if int4 is not None else ''})")
    extra = sorted((n for n in available - needed if not any(re.search(p, n) for p in ckpt.ignore)), key=natural)
    if extra:
        raise CheckpointError(f"{ckpt.source}: unexpected tensor {extra[0]!r}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; "
                              "the checkpoint has more than the config describes")
    return stored4


# ----------------------------------------------------------------------------- 2. structure on meta


def build_meta_model(ckpt: Checkpoint, *, dtype, backend, rope_len: int, tp: Optional[tuple[int, int]],
                     fp8: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ckpt.config, dtype=dtype, backend=backend, rope_len=rope_len,
                            rope_freq_factors=ckpt.rope_freq_factors)
    if tp is not None:
        apply_tp_structure(model, *tp)
    if fp8:
        from fastdecode.models.quantize import quantize_model_fp8

        quantize_model_fp8(model)  # on meta: the structure only
    return model


# ----------------------------------------------------------------------------- 3. weights


@dataclass
class Weights:
    state: dict = field(default_factory=dict)  # model tensor name -> tensor (on the device)
    packed: dict = field(default_factory=dict)  # block projection name -> Int4Weight (on the device)
    formats: set = field(default_factory=set)  # the int4 formats of ``packed``


class WeightReader:
    """Reads every tensor of ``ckpt.spec``: rank's shard of it (``tp``), checked, in the model's form.

    ``quant="fp8"``: block projections quantised here as they are read (or, ``ckpt.fp8_ckpt``, taken with their
    stored scales); ``quant="int4"``: the dense ones quantised here (RTN); ``stored4``: the parts stored as int4
    (``check_tensors``), loaded as they are.
    """

    def __init__(self, ckpt: Checkpoint, stored4: dict, *, device, dtype, quant: Optional[str],
                 tp: Optional[tuple[int, int]]):
        self.ckpt, self.stored4, self.device, self.dtype, self.quant = ckpt, stored4, device, dtype, quant
        self.source, self.get, self.available, self.int4 = ckpt.source, ckpt.get, ckpt.available, ckpt.int4
        self.fp8_ckpt = ckpt.fp8_ckpt
        self.fp8 = ckpt.fp8_ckpt or quant == "fp8"
        self.rank, self.world = tp or (0, 1)

    def read(self, progress: bool, timings: Optional[Timings] = None) -> Weights:
        """Every tensor; ``timings`` (``engine.timing``) gets ``weights_int4`` (int4 projections read and repacked:
        GGUF Q4 on the device), ``weights_dense`` (the others read, dequantised, quantised) and
        ``weights_to_device`` (the copies to the device afterwards). Per tensor they time the host (no
        synchronisation, as an untimed load runs); the device work they queued is drained once at the end, in
        ``weights_to_device``."""
        out = Weights()
        spec = self.ckpt.spec
        with progress_bar(len(spec), f"loading {os.path.basename(self.source.rstrip('/'))}", progress) as prog:
            for our, parts, how in spec:
                transform = self.ckpt.qkv_transform if how == "qkv" else None
                if our.endswith(BLOCK_LINEARS) and (self.quant == "int4"
                                                    or any(n in self.stored4 for n, _ in parts)):
                    with phase(timings, "weights_int4", sync=False):
                        w, t, fmt = self.int4_projection(our, parts, transform)
                    with phase(timings, "weights_to_device", sync=False):
                        if w is not None:
                            out.packed[our], out.formats = w.to(self.device), out.formats | {fmt}
                        else:
                            out.state[our] = t.to(device=self.device, dtype=self.dtype)
                else:
                    with phase(timings, "weights_dense", sync=False):
                        ts, as_stored = self.dense(our, parts, transform)
                    with phase(timings, "weights_to_device", sync=False):
                        for name, t in ts.items():
                            out.state[name] = t.to(self.device) if as_stored else t.to(device=self.device,
                                                                                        dtype=self.dtype)
                if prog is not None:
                    prog.advance(prog.task_ids[0])
        with phase(timings, "weights_to_device", sync=False):  # what the phases above queued on the device
            cuda_sync()
        return out

    def fetch(self, name, shape, our, transform=None):
        source, rank, world = self.source, self.rank, self.world
        try:
            t = self.get(name)
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
        if t.dtype in FP8_DTYPES and not (self.fp8_ckpt and our.endswith(BLOCK_LINEARS)
                                          and scale_name(name) in self.available):
            # a cast to the model dtype would drop the scale: values off by it, silently
            raise CheckpointError(f"{source}: tensor {name!r} is stored as {t.dtype} without a scale "
                                  f"({scale_name(name)!r} is missing); an FP8 weight cannot be loaded without "
                                  "its dequantisation scale")
        return t

    def fetch4(self, name, shape, our, transform=None) -> Int4Weight:
        source, rank, world, int4 = self.source, self.rank, self.world, self.int4
        label = int4_label(self.stored4[name])
        rule, shape, w = shard_rule(our), tuple(shape), None
        want = shape
        try:
            if world > 1 and rule in ("col", "row"):
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

    def int4_projection(self, our, parts, transform) -> tuple[Optional[Int4Weight], Optional[torch.Tensor], str]:
        """(packed weight, None, format) or (None, dense tensor, "") for one (fused) block projection."""
        from fastdecode.quant.int4 import concat_n, dequantize_int4

        stored4, source = self.stored4, self.source
        names = [name for name, _ in parts]
        if all(name in stored4 for name in names):
            ws = [self.fetch4(name, shape, our, transform) for name, shape in parts]
            try:
                return concat_n(ws, [int4_label(stored4[n]) for n in names]), None, self.int4.format
            except ValueError as e:
                if not self.int4.dequantise_unfusable:
                    raise CheckpointError(f"{source}: {our}: {e}") from e
        else:
            ws = [self.fetch4(name, shape, our, transform) if name in stored4 else None for name, shape in parts]
        # dense (some parts are, or the int4 parts do not fuse): dequantised, then RTN if int4 is asked for
        ts = [dequantize_int4(w, torch.float32).cpu() if w is not None else self.fetch(name, shape, our, transform)
              for w, (name, shape) in zip(ws, parts)]  # (a source may repack on the device: cat on the CPU)
        t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
        if self.quant != "int4":
            return None, t, ""
        from fastdecode.models.quantize import INT4_FORMAT, quantize_weight_int4

        try:
            w = quantize_weight_int4(t.to(device=self.device, dtype=self.dtype))  # as quantize_model_int4 does
        except ValueError as e:
            raise CheckpointError(f"{source}: cannot quantise {our} to int4: {e}") from e
        return w, None, INT4_FORMAT

    def dense(self, our, parts, transform) -> tuple[dict, bool]:
        """({name: tensor}, as_stored) of one model tensor (fused parts concatenated): an FP8 block projection with
        its scale (as_stored: their dtypes kept), else the tensor (to be cast to the model dtype)."""
        source, device, dtype = self.source, self.device, self.dtype
        quantised = self.fp8 and our.endswith(BLOCK_LINEARS)
        ts, scales = [], []
        for name, shape in parts:
            t = self.fetch(name, shape, our, transform)
            sname = scale_name(name)
            if quantised and sname in self.available:  # stored FP8 + scale: used as they are
                if t.dtype != torch.float8_e4m3fn:
                    raise CheckpointError(f"{source}: tensor {name!r} is {t.dtype}, but the checkpoint has "
                                          f"{sname!r}: expected float8_e4m3fn")
                st = self.get(sname)
                st = st[...] if not isinstance(st, torch.Tensor) else st
                if st.numel() > 1 and shard_rule(our) == "col":  # per-channel scales follow the rows
                    st = shard_part(st, "col", self.rank, self.world, tuple(st.shape))
                t, st = t.to(device), fp8_scale(st, t.shape[0], sname, source).to(device)
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
            return {our: t, scale_name(our): torch.cat(scales)}, True
        return {our: t}, False


# ----------------------------------------------------------------------------- 4. int4 modules, 5. assignment


def swap_int4_modules(model: Transformer, weights: Weights, dtype) -> None:
    """The meta Linear of each packed projection -> a meta Int4Linear of its weight's format; its packed
    tensors join ``weights.state``."""
    for our, w in weights.packed.items():
        path = our[: -len(".weight")]
        parent, attr = path.rsplit(".", 1)
        lin = model.get_submodule(path)
        setattr(model.get_submodule(parent), attr, Int4Linear.from_weight(w, lin.bias, device="meta", dtype=dtype))
        for k in ("qweight", "scales", "zeros", "mins", "perm"):
            if getattr(w, k) is not None:
                weights.state[f"{path}.{k}"] = getattr(w, k)


def assign_weights(model: Transformer, weights: Weights, *, rope_len: int, device) -> None:
    """Every tensor assigned (``strict``: the state covers the model exactly), ties, the RoPE table, and the
    int4 format of a model with packed projections."""
    state = weights.state
    if model.config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.setup_rope(rope_len, device)
    if weights.packed:
        model.quant_format = "+".join(sorted(weights.formats))  # every one int4-w4a16-*: quant "int4"
        model.set_kernels()  # the int4_gemm switch on the new modules
