"""Write a model as a Hugging Face-layout safetensors checkpoint: ``fastdecode quantize SRC DST --method fp8|int4``.

The directory holds ``config.json`` (with ``quantization_config = {"quant_method": "fastdecode", "format": ...}``),
``model.safetensors`` (q/k/v and gate/up split back into HF names; FP8 projections as ``float8_e4m3fn`` with a
``<name>.weight_scale`` of shape (N, 1), the compressed-tensors layout; int4 projections in the int4 kernels'
own layout: ``<name>.qweight`` int32 (N, Kp / 8), ``<name>.scales`` (N, G), and ``.zeros`` / ``.mins`` / ``.perm``
where the format has them, with the packing recorded as ``quantization_config.layout``; the format also in the
file's metadata) and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``).
Loading it reads the quantised weights as they are (no re-quantisation, no repacking), and the recorded format
and layout let the loader refuse kernels that do not match.

Writing is atomic: the whole directory is written (and fsynced) into a fresh ``.DSTNAME.tmp-<pid>-XXXX``
directory beside DST, then renamed into place; a failure removes it and leaves DST as it was. An existing DST
that is not an empty directory is refused unless ``overwrite=True`` (``--overwrite``): then the old DST is
renamed aside (``.DSTNAME.old-<pid>-XXXX``), the new one renamed in, and the old one deleted. A process killed
mid-write can leave a ``.DSTNAME.tmp-*`` directory: it is safe to delete, and the next write to the same DST
deletes those of processes no longer running (and ``.DSTNAME.old-*`` ones once DST exists again).
``quantize_checkpoint`` also refuses a DST that is, or overlaps, its source, and checks DST's parent before
loading the source.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from typing import Callable, Optional

import torch

import fastdecode
from fastdecode.models.config import ModelConfig
from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Fp8Linear, Transformer


def config_to_hf(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict that ``ModelConfig.from_hf`` reads back to ``cfg``."""
    family = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    d = {
        "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(family, "LlamaForCausalLM")],
        "model_type": family,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "_name_or_path": cfg.name, "torch_dtype": "bfloat16",
    }
    if family != "llama":
        d["use_sliding_window"] = False
    rs = cfg.rope_scaling
    if rs is not None:
        d["rope_scaling"] = ({"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                              "high_freq_factor": rs.high_freq_factor,
                              "original_max_position_embeddings": rs.original_max_position_embeddings}
                             if rs.type == "llama3" else {"rope_type": "linear", "factor": rs.factor})
    return d


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our tensors under Hugging Face names (fused q|k|v and gate|up split back), FP8 scales and int4 tensors
    included."""
    if model.tp is not None:
        raise ValueError("cannot export a tensor-parallel shard; export the whole model (tp=None)")
    c = model.config
    out = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        out["lm_head.weight"] = model.output.weight

    def put(names, lin, sizes):
        if isinstance(lin, Int4Linear):  # rows split back per projection; groups run along K
            from fastdecode.quant.int4 import split_n

            for n, w in zip(names, split_n(lin.packed, sizes)):
                for k in ("qweight", "scales", "zeros", "mins", "perm"):
                    if getattr(w, k) is not None:  # the parts of a fused projection share one act-order perm
                        out[f"{n}.{k}"] = getattr(w, k).clone() if k == "perm" else getattr(w, k)
        else:
            for n, w in zip(names, lin.weight.split(sizes)):
                out[n + ".weight"] = w
        if isinstance(lin, Fp8Linear):
            for n, s in zip(names, lin.weight_scale.split(sizes)):
                out[n + ".weight_scale"] = s.reshape(-1, 1)
        if lin.bias is not None:
            for n, b in zip(names, lin.bias.split(sizes)):
                out[n + ".bias"] = b

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, f = layer.attention, layer.feed_forward
        put([p + f"self_attn.{n}_proj" for n in "qkv"], a.wqkv, [c.q_size, c.kv_size, c.kv_size])
        put([p + "self_attn.o_proj"], a.wo, [c.dim])
        put([p + "mlp.gate_proj", p + "mlp.up_proj"], f.w13, [c.intermediate_size] * 2)
        put([p + "mlp.down_proj"], f.w2, [c.dim])
        out[p + "input_layernorm.weight"] = layer.attention_norm.weight
        out[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = a.q_norm.weight, a.k_norm.weight
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def save_tokenizer(tok, dst: str) -> None:
    tok.tk.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": bool(tok.add_bos),
                   "chat_template": tok.chat_template}, f, indent=1)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.bos_id, "eos_token_id": list(tok.eos_ids)}, f, indent=1)


# ----------------------------------------------------------------------------- atomic directory writes

_STALE = re.compile(r"\.(tmp|old)-(\d+)-[A-Za-z0-9_]+")  # after ".DSTNAME": our temporary directories


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def check_src_dst(src: Optional[str], dst: str) -> None:
    """Refuse a DST that is the source, lies inside it, or contains it (resolved real paths). ``src`` None (the
    embedded model) or a name that is no path (a preset) overlaps nothing."""
    if src is None or not os.path.exists(src):
        return
    s, d = os.path.realpath(src), os.path.realpath(dst)
    if s == d:
        raise ValueError(f"DST {dst!r} is the source {src!r}; write the checkpoint to another path")
    if _inside(d, s):
        raise ValueError(f"DST {dst!r} is inside the source {src!r}; write the checkpoint outside it")
    if _inside(s, d):
        raise ValueError(f"the source {src!r} is inside DST {dst!r}; writing DST would replace it")


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def check_dst(dst: str, overwrite: bool = False) -> str:
    """``dst`` as an absolute path, after refusing one whose parent directory is missing or not writable, and an
    existing one that is not an empty directory unless ``overwrite``. Cheap: run it before a long load."""
    path = os.path.abspath(dst)
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"DST {dst!r} is a filesystem root; name a directory to write")
    if not os.path.isdir(parent):
        raise ValueError(f"the parent directory of DST {dst!r} does not exist: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write DST {dst!r}: its parent directory {parent} is not writable")
    if not overwrite and os.path.lexists(path) and not _empty_dir(path):
        raise ValueError(f"DST {dst!r} already exists and is not an empty directory; pass --overwrite "
                         "(overwrite=True) to replace it")
    return path


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _remove_stale(parent: str, name: str, path: str) -> None:
    """Delete the temporary directories an earlier write to ``path`` left when it was killed (those of processes
    no longer running); a ``.old-`` one (the previous DST, renamed aside) only once ``path`` exists again."""
    head = f".{name}"
    for entry in os.listdir(parent):
        m = _STALE.fullmatch(entry[len(head):]) if entry.startswith(head) else None
        if m is None or _alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not os.path.lexists(path):
            continue  # killed between the two renames: this is the only copy of the old DST
        _remove(os.path.join(parent, entry))


def _fsync(path: str, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:  # some filesystems / platforms cannot open a directory for fsync
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _named(e: OSError, what: str) -> OSError:
    """``e`` as an OSError of the same errno whose message starts with ``what`` (the path the user named)."""
    msg = f"{what}: {e.strerror or e}"
    return OSError(e.errno, msg) if e.errno is not None else OSError(msg)


def write_dir_atomically(dst: str, write: Callable[[str], None], *, overwrite: bool = False) -> None:
    """Run ``write(tmp)`` on a fresh temporary directory beside ``dst`` (``.DSTNAME.tmp-<pid>-XXXX``), fsync
    its files, then rename it to ``dst`` (``check_dst`` refusals first). ``overwrite``: an existing ``dst`` is
    renamed aside, the new one renamed in, the old one deleted (put back if the second rename fails). Any
    exception removes the temporary directory and leaves ``dst`` as it was; an ``OSError`` (ENOSPC, ...) is
    re-raised as one of the same errno whose message names ``dst``."""
    path = check_dst(dst, overwrite)
    parent, name = os.path.split(path)
    try:
        _remove_stale(parent, name, path)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-{os.getpid()}-")
    except OSError as e:
        raise _named(e, f"cannot write DST {dst!r}") from e
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the checkpoint from other users
        write(tmp)
        for f in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, f)):
                _fsync(os.path.join(tmp, f))
        _fsync(tmp, directory=True)
        if not os.path.lexists(path) or _empty_dir(path):
            os.rename(tmp, path)  # atomic; fails (ENOTEMPTY) if a non-empty DST appeared meanwhile
        elif not overwrite:  # appeared while we wrote
            raise ValueError(f"DST {dst!r} appeared while it was written; pass --overwrite to replace it")
        else:
            old = os.path.join(parent, f".{name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            _remove(old)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError):
            raise _named(e, f"writing DST {dst!r} failed, DST left unchanged") from e
        raise
    _fsync(parent, directory=True)


# ----------------------------------------------------------------------------- checkpoints


def _check_exportable(model: Transformer) -> None:
    if model.rope_freq_factors is not None:
        raise ValueError("this model's RoPE comes from a GGUF rope_freqs tensor, which a Hugging Face config "
                         "cannot express; export is not supported for it yet")
    if model.head_quant is not None:
        raise ValueError(f"the lm head is quantised ({model.head_quant!r}); checkpoints store it dense: "
                         "quantise the head at load instead (quant_head=, --quant-head)")


def save_checkpoint(model: Transformer, tokenizer, dst: str, fmt: Optional[str], *, overwrite: bool = False) -> None:
    """Write ``model`` (quantised as ``fmt``, or None) and its tokenizer to the directory ``dst``, atomically
    (``write_dir_atomically``): an existing ``dst`` that is not an empty directory is refused unless
    ``overwrite``, and a failure leaves ``dst`` as it was."""
    _check_exportable(model)
    write_dir_atomically(dst, lambda d: _write_checkpoint(model, tokenizer, d, fmt), overwrite=overwrite)


def _write_checkpoint(model: Transformer, tokenizer, dst: str, fmt: Optional[str]) -> None:
    """The files of the checkpoint, into the existing directory ``dst`` (not atomic: ``save_checkpoint``)."""
    from safetensors.torch import save_file

    cfg = config_to_hf(model.config)
    if fmt is not None:
        from fastdecode.models.quantize import method_of

        qc = {"quant_method": "fastdecode", "format": fmt, "fastdecode_version": fastdecode.__version__,
              "activations": "dynamic per-token FP8", "ignored": ["lm_head", "embed_tokens"]}
        if method_of(fmt) == "int4":
            from fastdecode.quant.int4 import LAYOUT

            weights = sorted({m.packed.format for m in model.modules() if isinstance(m, Int4Linear)})
            if not weights:
                raise ValueError(f"format {fmt!r} is int4 but the model has no int4 projections")
            qc.update(activations="model dtype (W4A16)", layout=LAYOUT, weights=weights)
        cfg["quantization_config"] = qc
    if tokenizer is not None and tokenizer.bos_id is not None:
        cfg["bos_token_id"] = tokenizer.bos_id
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    meta = {"format": "pt", "fastdecode_format": fmt or "none"}
    save_file(hf_state_dict(model), os.path.join(dst, "model.safetensors"), metadata=meta)
    if tokenizer is not None:
        save_tokenizer(tokenizer, dst)


def quantize_checkpoint(src: Optional[str], dst: str, method: str, *, dtype=torch.bfloat16,
                        overwrite: bool = False) -> str:
    """Load ``src`` (any loadable path), quantise with ``method``, write ``dst``; returns the format written.

    ``int4``: RTN group 128 from dense weights; int4 sources (GPTQ, AWQ, GGUF Q4_0 / Q4_1) are written as they
    are (no second quantisation). ``dst`` must not be or overlap ``src``; an existing ``dst`` that is not an
    empty directory is refused unless ``overwrite``; both checks and DST's parent directory before the load.
    The write is atomic (``save_checkpoint``)."""
    from fastdecode.engine.loader import load
    from fastdecode.models.quantize import FORMATS, QUANT_METHODS

    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}, got {method!r}")
    if method not in FORMATS:
        raise NotImplementedError(f"quantize --method {method} is not available yet")
    check_src_dst(src, dst)
    check_dst(dst, overwrite)  # before the load, which takes seconds
    loaded = load(src, device="cpu", dtype=dtype, backend="torch", quant=method, progress=False)
    # int4 sources (GPTQ, AWQ, GGUF Q4) keep their weights and name their origin in the format
    fmt = loaded.model.quant_format or FORMATS[method]
    save_checkpoint(loaded.model, loaded.tokenizer, dst, fmt, overwrite=overwrite)
    return fmt
