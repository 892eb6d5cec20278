"""Safetensors files: which file holds each tensor, headers checked for truncation, lazy slices."""

from __future__ import annotations

import json
import os

from fastdecode.engine.checkpoint.errors import CheckpointError


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
        check_safetensors_size(full)  # first: safe_open's own error on a truncated file names no tensor
        try:
            with safe_open(full, framework="pt") as f:
                for k in f.keys():
                    out[k] = full
        except Exception as e:
            raise CheckpointError(f"{full}: cannot read the safetensors header ({e}); truncated or corrupt?") from e
    return out


class SafetensorsReader:
    """Open files once; ``get`` returns a lazy slice (``[a:b]`` reads only those bytes)."""

    def __init__(self):
        self.handles = {}

    def get(self, files: dict[str, str], name: str):
        from safetensors import safe_open

        fname = files[name]
        if fname not in self.handles:
            check_safetensors_size(fname)
            try:
                self.handles[fname] = safe_open(fname, framework="pt")
            except Exception as e:
                raise CheckpointError(f"{fname}: cannot open ({e}); truncated or corrupt?") from e
        h = self.handles[fname]
        if name not in h.keys():
            raise CheckpointError(f"tensor {name!r} is listed for {os.path.basename(fname)} but that file lacks it")
        return h.get_slice(name)


def check_safetensors_size(fname: str) -> None:
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
