"""GGUF files: a checked reader (truncation named by tensor), lazy tensors (a shard dequantises only its own
bytes of the memory-mapped file), llama.cpp's q / k row order undone, and a GGUF file opened as a ``Checkpoint``
(llama / qwen2 architectures; Q4_0 / Q4_1 block projections as int4 weights with ``native``)."""

from __future__ import annotations

import functools
import os
import struct
from typing import Optional

import torch

from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.checkpoint.int4 import GGUFQ4Source
from fastdecode.engine.checkpoint.spec import Checkpoint, model_spec
from fastdecode.models.config import ModelConfig
from fastdecode.quant.int4 import Int4Weight

GGUF_NAMES = {
    "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
    "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias", "k_bias": "blk.{i}.attn_k.bias", "v_bias": "blk.{i}.attn_v.bias",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
}
GGUF_IGNORE = (r"^rope_freqs\.weight$",)


def read_gguf(path: str):
    """(metadata dict, reader) of a GGUF file; checks that every tensor's bytes lie inside the file.

    The metadata is parsed with ``struct`` (``_FastFields``), not with gguf-py's numpy view per value: SmolLM2's
    vocabulary (49152 tokens, their types and merges) took 4 s there (with ``contents()``), 0.2 s here (2 CPU cores)."""
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
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                              "truncated or corrupt?") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise CheckpointError(f"{path}: file is truncated: tensor {t.name!r} ends at byte {end}, file has {size}")
    meta = {}
    for key, field in reader.fields.items():  # gguf-py's header fields (GGUF.version, ...), then the key / values
        if key not in reader.values:
            try:
                meta[key] = field.contents()
            except Exception:  # unusual value types: skip, the config reader asks for what it needs
                continue
    meta.update(reader.values)
    return meta, reader


# GGUFValueType -> struct format of one value (STRING = 8 and ARRAY = 9 are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _FastFields:
    """The key / value section of a GGUF file read with ``struct`` from the mapped bytes, values as Python
    objects, as gguf-py's ``ReaderField.contents()`` gives them (int, float, bool, str, lists of them; nested
    arrays as nested lists)."""

    def __init__(self, buf, byte_order: str):
        import sys

        self.buf, self.size = buf, len(buf)
        self.bo = "<" if (byte_order == "I") == (sys.byteorder == "little") else ">"

    def unpack(self, fmt: str, offs: int):
        return struct.unpack_from(self.bo + fmt, self.buf, offs)[0]

    def string(self, offs: int) -> tuple[str, int]:
        n = self.unpack("Q", offs)
        end = offs + 8 + n
        if end > self.size:
            raise ValueError(f"a string at byte {offs} runs past the end of the file ({end} > {self.size})")
        return bytes(self.buf[offs + 8:end]).decode("utf-8"), end

    def value(self, vtype: int, offs: int):
        """(the value of type ``vtype`` at ``offs``, the offset after it)."""
        if vtype == _STRING:
            return self.string(offs)
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.unpack(fmt, offs), offs + struct.calcsize(fmt)
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {offs}")
        itype, n = self.unpack("I", offs), self.unpack("Q", offs + 4)
        offs += 12
        fmt = _SCALARS.get(itype)
        if fmt is not None:  # numbers: one numpy view, as Python values
            import numpy as np

            end = offs + n * struct.calcsize(fmt)
            if end > self.size:
                raise ValueError(f"an array at byte {offs} runs past the end of the file ({end} > {self.size})")
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt).newbyteorder(self.bo), count=n, offset=offs)
            return values.tolist(), end
        if itype == _STRING:  # the vocabulary and merges (98 k strings for SmolLM2): one tight loop
            return self.strings(n, offs)
        out = []
        for _ in range(n):
            v, offs = self.value(itype, offs)
            out.append(v)
        return out, offs

    def strings(self, n: int, offs: int) -> tuple[list[str], int]:
        """An array of ``n`` strings at ``offs`` (``string`` inlined: a third of its time per string)."""
        buf, size, length = self.buf, self.size, struct.Struct(self.bo + "Q").unpack_from
        out = []
        append = out.append
        for _ in range(n):
            (m,) = length(buf, offs)
            offs += 8
            end = offs + m
            if end > size:
                raise ValueError(f"a string at byte {offs - 8} runs past the end of the file ({end} > {size})")
            append(str(buf[offs:end], "utf-8"))
            offs = end
        return out, offs


def _checked_gguf_reader(gguf):
    """GGUFReader that reads the key / value metadata fast (``_FastFields``: every value in ``reader.values``;
    ``reader.fields`` has gguf-py's fields of the scalars and strings only, not of the arrays), hands out tensor
    data as plain numpy views of the mapping (each slice of a ``np.memmap`` runs a Python ``__array_finalize__``:
    1 M of them, 2-3 s, when gguf-py dequantises SmolLM2), and names the first tensor whose bytes run past the
    end of the file.

    (The plain reader fails on a truncated file with a numpy reshape error naming no tensor.)
    Reads the tensor-info fields' layout of gguf-py (name, n_dims, dims, type, offset); if that layout
    ever changes, the check is skipped and the generic error remains.
    """
    import numpy as np

    class _Reader(gguf.GGUFReader):
        def _build_fields(self, offs, count):
            self.values = {}
            kv = _FastFields(self.data.view(np.ndarray), self.byte_order)
            for _ in range(int(count)):
                start = offs
                key, offs = kv.string(offs)
                vtype = kv.unpack("I", offs)
                value, end = kv.value(vtype, offs + 4)
                if key in self.values or key in self.fields:
                    raise KeyError(f"duplicate metadata key {key!r} at byte {start}")
                self.values[key] = value
                if vtype != _ARRAY:  # gguf-py's own field too (GGUFReader reads general.alignment from it)
                    _, parts, idxs, types = self._get_field_parts(offs + 4, vtype)
                    self.fields[key] = gguf.ReaderField(start, key, parts, idxs, types)
                offs = end
            return offs

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
            super()._build_tensors(start_offs, fields)
            self.tensors = [t._replace(data=t.data.view(np.ndarray)) for t in self.tensors]

    return _Reader


class GGUFTensor:
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
        torch_dequant = _TORCH_DEQUANT.get(self.t.tensor_type.name)
        if torch_dequant is not None and data.ndim == 2:
            out = _dequantize_rows(data, *torch_dequant)
            return out[..., after].contiguous() if after != slice(None) else out
        arr = gguf.quants.dequantize(data, self.t.tensor_type)
        return torch.from_numpy(np.array(arr[..., after] if after != slice(None) else arr, dtype=np.float32))


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # fp16 d, 32 int8
    return b[..., 2:].contiguous().view(torch.int8).float() * _d(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # fp16 d, 16 bytes of nibbles; (q - 8) * d
    return _d(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # fp16 d, fp16 m, 16 bytes of nibbles; d * q + m
    return _d(b, 0) * _nibbles(b[..., 4:]).float() + _d(b, 2)


def _d(b: torch.Tensor, at: int) -> torch.Tensor:  # the fp16 at byte ``at`` of each block as float32 (rows, blocks, 1)
    from fastdecode.quant.int4 import _f16

    return _f16(b[..., at:at + 2]).float().unsqueeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # (rows, blocks, 16) bytes -> (rows, blocks, 32) values, as Q4 loads
    from fastdecode.quant.int4 import _gguf_nibbles

    return _gguf_nibbles(qs).reshape(*qs.shape[:-1], 32)


# GGUF block types dequantised in torch: (block bytes, function of (rows, blocks, block bytes) uint8)
_TORCH_DEQUANT = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}


def _dequantize_rows(data, block_bytes: int, fn) -> torch.Tensor:
    """Rows of whole blocks (uint8) as float32, in torch: gguf-py's ``dequantize`` formulas in the same order of
    float32 operations, so the same values bit for bit, on all the CPU's threads (gguf-py's numpy runs one: the
    embedded model's token embedding, Q8_0 49152 x 576, 0.29-0.55 -> 0.09-0.14 s on the 2-core CPU)."""
    import numpy as np

    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))  # a copy: the mapping is read-only
    return fn(raw.reshape(raw.shape[0], -1, block_bytes)).reshape(raw.shape[0], -1)


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE) back to HF's half-split order.

    Within each head llama.cpp orders rows (0, D/2, 1, D/2+1, ...); HF orders them (0, 1, ..., D-1).
    """
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_qkv_transform(arch: str, head_dim: int, name: str, t):
    """A llama GGUF's q / k rows (a tensor or an ``Int4Weight``; whole, or a TP shard of whole heads) back in
    HF order; anything else as it is."""
    from fastdecode.quant.int4 import take_rows

    if arch != "llama" or ".bias" in name or not (".attn_q." in name or ".attn_k." in name):
        return t  # qwen2 GGUFs keep HF order (NeoX RoPE in llama.cpp)
    rows = t.N if isinstance(t, Int4Weight) else t.shape[0]
    heads = rows // head_dim  # all of q's / k's heads, or a TP shard's (whole heads)
    if isinstance(t, Int4Weight):  # the same row permutation; groups run along K, so rows move whole
        return take_rows(t, unpermute_rope(torch.arange(t.N), heads))
    return unpermute_rope(t, heads)


def _lazy_tensor(tensors: dict, name: str) -> GGUFTensor:
    return GGUFTensor(tensors[name])  # lazy: a shard dequantises only its own bytes


def open_gguf(path: str, *, quant: Optional[str] = None, device="cpu", native: Optional[bool] = None) -> Checkpoint:
    """A GGUF file (llama / qwen2 architectures), every tensor dequantised to the model dtype, except, with
    ``native``, the Q4_0 / Q4_1 block projections, which become int4 weights as they are (group 32; Q4_0
    zero mode "sym", Q4_1 "min"). ``native`` None: when ``quant="int4"``, or ``quant`` is None on CUDA.
    Other types (F16, Q8_0, K-quants) are dequantised, and re-quantised with RTN under ``quant="int4"``."""
    import gguf  # noqa: F401  (as load_gguf did: a missing package fails here)

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
    get = functools.partial(_lazy_tensor, tensors)
    int4 = GGUFQ4Source(tensors, device) if native else None  # repacked on the device
    freq = get("rope_freqs.weight")[...] if "rope_freqs.weight" in tensors else None
    return Checkpoint("gguf", path, cfg, model_spec(cfg, GGUF_NAMES), get, set(tensors), ignore=GGUF_IGNORE,
                      qkv_transform=functools.partial(gguf_qkv_transform, arch, cfg.head_dim),
                      rope_freq_factors=freq, int4=int4, meta=meta)
