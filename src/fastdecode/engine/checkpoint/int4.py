"""How a checkpoint stores int4 block projections: one reader per source (GPTQ, AWQ, ``fastdecode quantize``,
GGUF Q4_0 / Q4_1), each reading a whole weight or only a tensor-parallel shard's bytes."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fastdecode.engine.sharding import ACT_ORDER_ROW_ERROR, int4_row_shard
from fastdecode.quant.int4 import Int4Weight, packed_cols


class Int4Source:
    """The int4 block projections of one checkpoint.

    ``tensors(name, available)``: the stored tensors of the projection whose dense name is ``name``
    (e.g. ``...q_proj.weight``), first the one to name in errors; None when that projection is stored dense.
    ``read(name, (N, K))``: the whole weight as an ``Int4Weight`` (sharding happens afterwards).
    ``read_shard(name, (N, K), rule, rank, world)``: only rank's shard ("col": rows, "row": columns), reading
    only its bytes, as ``engine.sharding.shard_int4`` would cut it from the whole weight (the same bits), after
    checking the stored tensors against (N, K); None where it cannot cut those bytes (then: ``read``, and
    ``shard_int4``).
    ``dequantise_unfusable``: parts of one fused projection that cannot be concatenated (different formats)
    are dequantised (GGUF files mix types) rather than refused.
    """

    format: str  # recorded as model.quant_format
    dequantise_unfusable: bool = False

    def tensors(self, name: str, available: set) -> Optional[list[str]]:
        raise NotImplementedError

    def read(self, name: str, shape: tuple) -> Int4Weight:
        raise NotImplementedError

    def read_shard(self, name: str, shape: tuple, rule: str, rank: int, world: int) -> Optional[Int4Weight]:
        return None


# ----------------------------------------------------------------------------- HF safetensors: GPTQ, AWQ, fastdecode


class _HFInt4Source(Int4Source):
    """Int4 projections of a safetensors checkpoint: ``get(name)`` reads a whole tensor of ``available``;
    ``lazy(name)``, a safetensors slice of it (for reading only a TP shard; None: shards are cut after ``read``)."""

    required: tuple = ()
    optional: tuple = ()

    def __init__(self, fmt: str, qc: dict, get: Callable, available: set[str], lazy: Optional[Callable] = None):
        from fastdecode.models.quantize import INT4_FAMILY

        self.fmt, self.get, self.available, self.lazy = fmt, get, available, lazy
        group = qc.get("group_size")
        self.group = None if group in (None, -1) else int(group)
        self.zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
        self.sym = None if qc.get("sym") is None else bool(qc["sym"])
        self.format = fmt if fmt.startswith(INT4_FAMILY) else f"{INT4_FAMILY}-{fmt}"

    def tensors(self, name, available):
        base = name[: -len(".weight")]
        if f"{base}.qweight" not in available:
            return None  # stored dense (modules_to_not_convert)
        return ([f"{base}.qweight"] + [f"{base}.{k}" for k in self.required]
                + [f"{base}.{k}" for k in self.optional if f"{base}.{k}" in available])

    def _opt(self, base, k):
        return self.get(f"{base}.{k}") if f"{base}.{k}" in self.available else None

    def read_shard(self, name, shape, rule, rank, world) -> Optional[Int4Weight]:
        """Rank's rows (col) or columns (row) through safetensors slices; None to read it whole instead: an N
        range off whole int32 words of 8 nibbles, unknown GPTQ symmetry (decided on all zeros), fp32 scales
        (their fp16 / bf16 rounding is decided on the whole tensor), a K range off whole 256-column tiles of the
        kernel layout."""
        if self.lazy is None:
            return None
        base = name[: -len(".weight")]
        sl = {k: self.lazy(f"{base}.{k}") for k in ("qweight", *self.required, *self.optional)
              if f"{base}.{k}" in self.available}
        shapes = {k: tuple(v.get_shape()) for k, v in sl.items()}
        if sl["scales"].get_dtype() not in ("F16", "BF16") or (self.fmt == "gptq" and self.sym is None):
            return None
        return self._read_shard(base, sl, shapes, *shape, rule, rank, world)

    def _read_shard(self, base, sl, shapes, N, K, rule, rank, world) -> Optional[Int4Weight]:
        raise NotImplementedError


class _GPTQAWQSource(_HFInt4Source):
    required = ("qzeros", "scales")

    def _read_shard(self, base, sl, shapes, N, K, rule, rank, world):
        from fastdecode.quant.int4 import from_awq, from_gptq

        fmt, group = self.fmt, self.group
        want = (K // 8, N) if fmt == "gptq" else (K, N // 8)
        if shapes["qweight"] != want or len(shapes["scales"]) != 2 or shapes["scales"][1] != N:
            raise ValueError(f"{base}.qweight / scales have shapes {shapes['qweight']} / {shapes['scales']}; "
                             f"expected {want} / (G, {N}) for a weight of shape {(N, K)}")
        G = shapes["scales"][0]
        if shapes["qzeros"] != (G, -(-N // 8)):
            raise ValueError(f"{base}.qzeros has shape {shapes['qzeros']}, expected {(G, -(-N // 8))}")
        gs = group or (K // G if G and K % G == 0 else K)
        g_idx = self.get(f"{base}.g_idx") if "g_idx" in sl else None  # (K,): small, read whole
        if rule == "col":
            n = N // world
            a, b = rank * n, (rank + 1) * n
            if a % 8 or b % 8:
                return None
            if fmt == "gptq":
                return from_gptq(sl["qweight"][:, a:b], sl["qzeros"][:, a // 8:b // 8], sl["scales"][:, a:b],
                                 g_idx, group_size=group, zero_offset=self.zero_offset, symmetric=self.sym)
            return from_awq(sl["qweight"][:, a // 8:b // 8], sl["qzeros"][:, a // 8:b // 8], sl["scales"][:, a:b],
                            group_size=group)
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // gs):
            raise ValueError(ACT_ORDER_ROW_ERROR)
        k0, k1 = int4_row_shard(K, K if G == 1 else gs, rank, world)
        g0, g1 = (0, 1) if G == 1 else (k0 // gs, k1 // gs)
        qw = sl["qweight"][k0 // 8:k1 // 8] if fmt == "gptq" else sl["qweight"][k0:k1]
        conv = from_gptq if fmt == "gptq" else from_awq
        kw = {"zero_offset": self.zero_offset, "symmetric": self.sym} if fmt == "gptq" else {}
        return conv(qw, sl["qzeros"][g0:g1], sl["scales"][g0:g1], group_size=None if G == 1 else gs, **kw)


class GPTQSource(_GPTQAWQSource):
    """GPTQ: ``qweight`` (K/8, N), ``qzeros``, ``scales`` (G, N), ``g_idx``."""

    optional = ("g_idx",)

    def read(self, name, shape):
        from fastdecode.quant.int4 import from_gptq

        base = name[: -len(".weight")]
        return from_gptq(self.get(f"{base}.qweight"), self.get(f"{base}.qzeros"), self.get(f"{base}.scales"),
                         self._opt(base, "g_idx"), group_size=self.group, zero_offset=self.zero_offset,
                         symmetric=self.sym)


class AWQSource(_GPTQAWQSource):
    """AWQ (GEMM): ``qweight`` (K, N/8), ``qzeros``, ``scales``."""

    def read(self, name, shape):
        from fastdecode.quant.int4 import from_awq

        base = name[: -len(".weight")]
        return from_awq(self.get(f"{base}.qweight"), self.get(f"{base}.qzeros"), self.get(f"{base}.scales"),
                        group_size=self.group)


def fastdecode_weight(base, N, K, qweight, scales, zeros, mins, perm) -> Int4Weight:
    """The tensors of a ``fastdecode quantize --method int4`` projection, checked, as an ``Int4Weight``."""
    from fastdecode.quant.int4 import LAYOUT, SCALE_DTYPES

    kw = packed_cols(K)
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


class FastdecodeInt4Source(_HFInt4Source):
    """``fastdecode quantize --method int4``: ``qweight`` in the kernel layout, ``scales`` (N, G), ``zeros`` |
    ``mins``, ``perm``."""

    required = ("scales",)
    optional = ("zeros", "mins", "perm")

    def read(self, name, shape):
        base = name[: -len(".weight")]
        return fastdecode_weight(base, *shape, self.get(f"{base}.qweight"), self.get(f"{base}.scales"),
                                 self._opt(base, "zeros"), self._opt(base, "mins"), self._opt(base, "perm"))

    def _read_shard(self, base, sl, shapes, N, K, rule, rank, world):
        kw_full = packed_cols(K)
        if shapes["qweight"] != (N, kw_full) or len(shapes["scales"]) != 2 or shapes["scales"][0] != N:
            raise ValueError(f"{base}.qweight / scales have shapes {shapes['qweight']} / {shapes['scales']}; "
                             f"expected {(N, kw_full)} / ({N}, G) (the kernel layout for K={K})")
        perm = self.get(f"{base}.perm") if "perm" in sl else None
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


def hf_int4_source(fmt: str, qc: dict, get: Callable, available: set[str],
                   lazy: Optional[Callable] = None) -> _HFInt4Source:
    """The reader of a HF checkpoint's int4 format (``checkpoint_format``: "gptq", "awq" or ``int4-w4a16-*``)
    with its ``quantization_config`` ``qc``."""
    from fastdecode.models.quantize import INT4_FAMILY

    if fmt.startswith(INT4_FAMILY):
        return FastdecodeInt4Source(fmt, qc, get, available, lazy)
    return {"gptq": GPTQSource, "awq": AWQSource}[fmt](fmt, qc, get, available, lazy)


# ----------------------------------------------------------------------------- GGUF Q4_0 / Q4_1


class GGUFQ4Source(Int4Source):
    """GGUF Q4_0 / Q4_1 tensors (``tensors``: name -> gguf ReaderTensor) as int4 weights, as they are
    (group 32; Q4_0 zero mode "sym", Q4_1 "min"); other types are stored dense for this purpose.

    The raw blocks go to ``device`` first and are repacked there (the same integer ops, so the same bits): on a
    GPU the repacking then takes milliseconds instead of seconds of CPU time (SmolLM2-135M: 2-7 s on 2 cores)."""

    dequantise_unfusable = True

    def __init__(self, tensors: dict, device="cpu"):
        import gguf

        from fastdecode.models.quantize import INT4_FAMILY
        from fastdecode.quant.int4 import from_gguf_q4_0, from_gguf_q4_1

        self.format = f"{INT4_FAMILY}-gguf"
        self.gguf_tensors, self.device = tensors, torch.device(device)
        self.q4 = {gguf.GGMLQuantizationType.Q4_0: from_gguf_q4_0, gguf.GGMLQuantizationType.Q4_1: from_gguf_q4_1}

    def tensors(self, name, available):
        return [name] if self.gguf_tensors[name].tensor_type in self.q4 else None

    def _weight(self, t, raw, shape):
        """Raw Q4_0 / Q4_1 blocks of ``t`` (all of them, or a shard's) -> an ``Int4Weight`` of ``shape``."""
        import numpy as np

        raw = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))  # a copy: the mapping is read-only
        return self.q4[t.tensor_type](raw.to(self.device), shape)

    def read(self, name, shape):
        t = self.gguf_tensors[name]
        K, N = (int(v) for v in t.shape)  # GGUF lists dims innermost first
        return self._weight(t, t.data, (N, K))

    def read_shard(self, name, shape, rule, rank, world):
        """Rows (col) or a K range on whole 32-value blocks (row) of the raw blocks, read from the mapped file."""
        import gguf

        t = self.gguf_tensors[name]
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
        return self._weight(t, raw, shard)
