"""Tokenizer: Hugging Face ``tokenizer.json`` (via ``tokenizers``) or rebuilt from a GGUF vocabulary.

GGUF files carry no tokenizer.json: the vocabulary, merges, token types and special ids live in the
metadata under llama.cpp's names (``tokenizer.ggml.*``), with ``tokenizer.ggml.pre`` naming how text
is split before BPE. We rebuild an equivalent ``tokenizers.Tokenizer`` from those.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre`` (the regexes these vocabularies were trained with).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """Text <-> token ids, special tokens, stop ids and the chat template."""

    def __init__(self, tk, *, bos_id: Optional[int], eos_ids: Sequence[int], add_bos: bool,
                 chat_template: Optional[str] = None, bos_token: str = "", eos_token: str = ""):
        self.tk = tk
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF); tokenizer.json post-processors do it themselves
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` adds BOS as the model expects (off for chat-templated text)."""
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{role, content}]) with the model's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json / GGUF tokenizer.chat_template)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token,
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_path(cls, path: str) -> "Tokenizer":
        """From a HF directory, a ``tokenizer.json`` file (its directory's configs read too) or a GGUF file's
        vocabulary (``generate --tokenizer PATH``)."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"tokenizer path {path!r} does not exist (a tokenizer.json, a directory "
                                    "holding one, or a .gguf file)")
        if path.endswith(".gguf"):
            from fastdecode.engine.checkpoint.gguf_io import read_gguf

            return cls.from_gguf_metadata(read_gguf(path)[0])
        if path.endswith(".json"):
            return cls.from_hf_dir(os.path.dirname(os.path.abspath(path)), tokenizer_json=path)
        raise ValueError(f"tokenizer path {path!r}: expected a tokenizer.json, a directory holding one, or a .gguf")

    @classmethod
    def from_hf_dir(cls, path: str, tokenizer_json: Optional[str] = None) -> "Tokenizer":
        """From a directory holding ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``);
        ``tokenizer_json``: that file under another name."""
        from tokenizers import Tokenizer as _Tk

        tj = tokenizer_json or os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tk = _Tk.from_file(tj)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))

        def tok_str(v):
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        bos_token, eos_token = tok_str(cfg.get("bos_token")), tok_str(cfg.get("eos_token"))
        bos_id = tk.token_to_id(bos_token) if bos_token else None
        if bos_id is None:
            bos_id = mcfg.get("bos_token_id")
        eos = gen.get("eos_token_id", mcfg.get("eos_token_id"))
        eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        if eos_token and tk.token_to_id(eos_token) is not None:
            eos_ids.append(tk.token_to_id(eos_token))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{name, template}]: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        # tokenizer.json's post-processor adds BOS where the model wants it; add it ourselves only
        # when the config asks for it and the post-processor does not
        probe = tk.encode("a", add_special_tokens=True).ids
        add_bos = bool(cfg.get("add_bos_token", False)) and bos_id is not None and probe[:1] != [bos_id]
        return cls(tk, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, chat_template=template,
                   bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """From GGUF ``tokenizer.ggml.*`` metadata: byte-level BPE (``gpt2``) or SentencePiece BPE (``llama``)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = list(meta.get("tokenizer.ggml.tokens") or ())
        if not tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens (no vocabulary); generate and chat take "
                             "one from --tokenizer PATH (a tokenizer.json, a HF directory or another .gguf)")
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "gpt2":
            tk = _byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or ()), meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            tk = _sentencepiece_bpe(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)),
                                    types, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
        _add_special_tokens(tk, tokens, types)
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos_id)] if eos_id is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.append(int(eot))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        return cls(tk, bos_id=None if bos_id is None else int(bos_id), eos_ids=eos_ids, add_bos=add_bos,
                   chat_template=meta.get("tokenizer.chat_template"),
                   bos_token=tokens[int(bos_id)] if bos_id is not None else "",
                   eos_token=tokens[int(eos_id)] if eos_id is not None else "")

    @classmethod
    def synthetic(cls, vocab_size: int, eos_id: Optional[int] = None) -> "Tokenizer":
        """A stand-in for models without a vocabulary (random-weight presets, served or benchmarked): token ``i``
        is the word ``t<i>``; text splits on whitespace (an unknown word is ``t0``) and decodes to the words
        joined by spaces. ``eos_id``: its EOS (default none: generation runs to its length). Its chat template
        joins the messages' contents."""
        from tokenizers import Tokenizer as TkTokenizer, models, pre_tokenizers

        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        tk = TkTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return cls(tk, bos_id=None, eos_ids=[] if eos_id is None else [eos_id], add_bos=False,
                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _byte_level_bpe(tokens, merges, pre):
    from tokenizers import Regex, Tokenizer as _Tk, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    ignore_merges = pre in ("llama3", "llama-v3", "llama-bpe")  # Llama 3 looks whole words up first
    tk = _Tk(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    split = _SPLITS.get(pre)
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":  # GPT-2 split with every digit on its own (llama.cpp's "smollm" pre-tokenizer)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "gpt2", "default" and unknown names: the GPT-2 split
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(tokens, scores, types, add_space_prefix: bool):
    """Llama 2-style SentencePiece BPE: merges implied by the scores, bytes as <0xNN> tokens."""
    from tokenizers import Tokenizer as _Tk, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    merges = []
    for t in tokens:
        if len(t) < 2 or types[vocab[t]] in (_CONTROL, 6):  # 6: byte tokens
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                merges.append((score[t], vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tk = _Tk(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                        fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def _add_special_tokens(tk, tokens, types):
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)
