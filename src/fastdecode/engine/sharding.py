"""Tensor-parallel sharding rules (Megatron-style), pure tensor slicing: no communication, no process group.

Per block: ``wqkv`` and ``w13`` are column-parallel, each fused part sharded on its own (q | k | v by
heads, gate | up by rows), so a rank holds ``Hq/N`` query heads, ``Hkv/N`` KV heads and ``I/N`` of the
MLP; ``wo`` and ``w2`` are row-parallel (input columns), so their outputs are partial sums, reduced by
the *next* norm together with the residual add (``RMSNorm.comm``: ``all_reduce_add_rms_norm``).
The embedding and the lm head are vocab-parallel: rank r holds rows ``[r*s, (r+1)*s)`` with
``s = ceil(V/N)`` (zero-padded on the last rank); embeddings are all-reduced, logits all-gathered.

Int4 projections (``Int4Linear``) shard the same way on their packed tensors: column-parallel takes rows,
row-parallel cuts K, which must fall on group boundaries (``shard_int4``; act-order weights cannot be
row-parallel). Quantised at load (``quant="int4"``), each rank quantises its own dense shard.

``apply_tp_structure`` applies these rules to a whole model (real or ``meta``) in place; the distributed
life cycle (process groups, the ``CommWorkspace``, loading on every rank) is ``fastdecode.engine.tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fastdecode.models.config import ModelConfig

# parameter name suffix -> how it is sharded
_COL = ("attention.wqkv.weight", "attention.wqkv.bias", "attention.wqkv.weight_scale",
        "feed_forward.w13.weight", "feed_forward.w13.weight_scale")
_ROW = ("attention.wo.weight", "feed_forward.w2.weight")
_VOCAB = ("tok_embeddings.weight", "output.weight")


ACT_ORDER_ROW_ERROR = "an act-order (g_idx) int4 weight cannot be split along K for a row-parallel layer"


@dataclass
class TPState:
    rank: int
    world: int
    vocab_start: int  # first vocabulary row held here
    vocab_rows: int  # real rows held here (the shard is vocab_shard rows, zero-padded)
    vocab_shard: int
    full_config: ModelConfig
    group: Optional[object] = None
    comm: Optional[object] = None  # fastdecode.ops.CommWorkspace

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Local logits [..., s] -> [..., V] in rank order (all-gather along the vocabulary)."""
        # the one collective of a sharded model, looked up when called (this module imports no torch.distributed)
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        torch.distributed.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def shard_rule(name: str) -> Optional[str]:
    """'col', 'row', 'vocab' or None (replicated) for a model parameter name."""
    if name.endswith(_COL):
        return "col"
    if name.endswith(_ROW):
        return "row"
    if name in _VOCAB:
        return "vocab"
    return None


def check_tp(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError when ``cfg`` cannot be split over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world}")
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs config {what} ({n}) divisible by {world} "
                             f"({cfg.name or 'model'}: {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, "
                             f"intermediate {cfg.intermediate_size})")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank shapes (heads and MLP width divided by ``world``; vocab_size stays the full vocabulary)."""
    check_tp(cfg, world)
    return cfg.replace(n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                       intermediate_size=cfg.intermediate_size // world, head_dim=cfg.head_dim)


def vocab_range(V: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, real rows, shard rows) of rank's vocabulary shard."""
    s = -(-V // world)
    start = min(rank * s, V)
    return start, min(V, start + s) - start, s


def shard_part(t, rule: Optional[str], rank: int, world: int, full_shape: tuple):
    """Slice one tensor (or a lazy safetensors slice) of ``full_shape`` to rank's shard; returns a tensor."""
    if rule is None or world == 1:
        return t[...] if not isinstance(t, torch.Tensor) else t
    if rule == "col":
        n = full_shape[0] // world
        return t[rank * n:(rank + 1) * n]
    if rule == "row":
        n = full_shape[1] // world
        return t[:, rank * n:(rank + 1) * n]
    if rule == "vocab":
        start, rows, s = vocab_range(full_shape[0], rank, world)
        part = t[start:start + rows]
        if rows < s:
            pad = torch.zeros((s - rows, *part.shape[1:]), dtype=part.dtype, device=part.device)
            part = torch.cat([part, pad]) if rows else pad
        return part
    raise ValueError(f"unknown shard rule {rule!r}")


def int4_row_shard(K: int, group_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's column range [k0, k1) of a row-parallel int4 weight: whole groups, or ValueError."""
    n = K // world
    if group_size != K and n % group_size:
        raise ValueError(f"int4 with tensor parallelism over {world} ranks: a row-parallel shard of K={K} has "
                         f"{n} columns, not a multiple of the group size {group_size}; use fewer ranks")
    return rank * n, (rank + 1) * n


def shard_int4(w, rule: Optional[str], rank: int, world: int):
    """An ``Int4Weight`` -> rank's shard: 'col' takes rows, 'row' cuts K (on group boundaries)."""
    from fastdecode.quant.int4 import slice_k, take_rows

    if rule is None or world == 1:
        return w
    if rule == "col":
        n = w.N // world
        return take_rows(w, slice(rank * n, (rank + 1) * n))
    if rule == "row":
        if w.perm is not None:
            raise ValueError(ACT_ORDER_ROW_ERROR)
        return slice_k(w, *int4_row_shard(w.K, w.group_size, rank, world))
    raise ValueError(f"int4 weights have no shard rule {rule!r}")


def _parts(name: str, cfg: ModelConfig) -> list[int]:
    if "wqkv" in name:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    if "w13" in name:
        return [cfg.intermediate_size] * 2
    return []


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """A full model tensor -> rank's shard (fused q|k|v and gate|up: each part sharded on its own)."""
    rule = shard_rule(name)
    sizes = _parts(name, cfg)
    if rule == "col" and sizes:
        return torch.cat([shard_part(p, "col", rank, world, tuple(p.shape)) for p in t.split(sizes, dim=0)])
    return shard_part(t, rule, rank, world, tuple(t.shape))


def apply_tp_structure(model, rank: int, world: int) -> None:
    """Shard every parameter of ``model`` (real or ``meta``) in place and fix the per-rank shapes;
    no communication (``engine.tp.attach_comm`` adds the workspace)."""
    from fastdecode.models.int4 import Int4Linear
    from fastdecode.models.llama import Fp8Linear, Linear
    from fastdecode.quant.int4 import concat_n, split_n

    if model.tp is not None:
        raise ValueError("the model is already tensor-parallel")
    cfg = model.config
    local = local_config(cfg, world)
    tied = cfg.tie_embeddings
    for name, m in list(model.named_modules()):
        if isinstance(m, Int4Linear):  # packed weights: fused parts sharded on their own, then fused again
            w, sizes, rule = m.packed, _parts(name, cfg), shard_rule(name + ".weight")
            parts = split_n(w, sizes) if rule == "col" and sizes else [w]
            new = Int4Linear.from_weight(concat_n([shard_int4(p, rule, rank, world) for p in parts]), m.bias,
                                         dtype=m.out_dtype)
            new.impl = m.impl
            parent, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, new)  # its bias is sharded with the parameters below
    int4_params = {f"{n}.{a}" for n, m in model.named_modules() if isinstance(m, Int4Linear)
                   for a in ("qweight", "scales", "zeros", "mins", "perm")}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if (tied and name == "output.weight") or name in int4_params:
            continue
        mod_name, attr = name.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        new = shard_tensor(name, p.data, cfg, rank, world)
        setattr(mod, attr, nn.Parameter(new.contiguous() if new.device.type != "meta" else new, requires_grad=False))
    for layer in model.layers:
        layer.attention.n_heads, layer.attention.n_kv_heads = local.n_heads, local.n_kv_heads
    for m in model.modules():
        if isinstance(m, (Linear, Fp8Linear)):
            m.out_features, m.in_features = m.weight.shape  # (Int4Linear: set by from_weight above)
    start, rows, s = vocab_range(cfg.vocab_size, rank, world)
    model.tok_embeddings.num_embeddings = s
    model.tie_weights()
    model.config = local
    model.tp = TPState(rank=rank, world=world, vocab_start=start, vocab_rows=rows, vocab_shard=s, full_config=cfg)
