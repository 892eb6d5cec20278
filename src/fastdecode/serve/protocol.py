"""The OpenAI API's request bodies checked and turned into engine requests, and its response bodies built; plain
Python (no web framework), so every rule is testable on its own.

A bad field raises ``APIError`` (HTTP status, OpenAI error type, the parameter, a message naming what was expected
and what came), which the app returns as ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
parameters and prompts longer than the context, 404 for an unknown model, 503 when the server is full.

Supported: ``model``, ``prompt`` (completions: a string, token ids, or a list of either: one choice each) or
``messages`` (chat: roles system / developer / user / assistant, text content), ``max_tokens``
(chat: ``max_completion_tokens`` too), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, and the extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``.
Parameters fastdecode does not implement (``n`` > 1, ``logprobs``, ``echo``, presence / frequency penalties,
``logit_bias``, tools, ...) are refused with 400 when set to anything but their neutral value, never ignored.
Unknown fields are ignored (clients send vendor extensions).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from fastdecode.engine.sampler import SamplingParams

#: completions without ``max_tokens`` generate this many tokens, as OpenAI's API does; chat: up to the context
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one completions request
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes

# parameters we do not implement -> their neutral values (anything else is refused)
_NEUTRAL = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
            "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
            "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
            "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
            "parallel_tool_calls": (None, False, True), "prompt_logprobs": (None, 0)}
_ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An error the client gets as OpenAI error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass
class Parsed:
    """A checked request: one prompt per choice (token ids), and what every choice shares."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    sampling: SamplingParams
    max_tokens: list[int]  # per prompt
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


# ----------------------------------------------------------------------------- field checks


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            not (lo < v if lo_open else lo <= v) or v > hi:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise invalid(name, f"{name} must be a number in {rng}, got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"{name} must be an integer {want}, got {v!r}")
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be true or false, got {v!r}")
    return v


def _is_neutral(v: Any, n: Any) -> bool:
    if n is None or isinstance(n, bool):
        return v is n
    if isinstance(n, (int, float)):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == n
    return v == n


def _unsupported(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if name in body and not any(_is_neutral(v, n) for n in neutral):
            raise APIError(400, f"{name}={v!r} is not supported by fastdecode serve", param=name,
                           code="unsupported_parameter")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"stop must be a string or a list of strings, got {v!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return [s for s in stops if s]


def sampling_params(body: dict) -> SamplingParams:
    """temperature (OpenAI's default 1; 0 is greedy), top_p, top_k (0 or -1: off), min_p, repetition_penalty, seed."""
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", -1)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    rep = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    seed = _integer(body, "seed", *SEED_RANGE)
    return SamplingParams(temperature=temperature, top_k=max(top_k or 0, 0), top_p=top_p, seed=seed, min_p=min_p,
                          repetition_penalty=rep)


def check_model(body: dict, names: tuple[str, ...]) -> None:
    """``model`` must be one of the names the server answers to: 404 ``model_not_found`` otherwise."""
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise invalid("model", f"model must be a model name (GET /v1/models lists them: {names[0]!r}), got {m!r}")
    if m not in names:
        raise APIError(404, f"The model {m!r} does not exist; this server serves {names[0]!r}", param="model",
                       code="model_not_found")


# ----------------------------------------------------------------------------- prompts


def _completion_prompts(body: dict, tokenizer, vocab_size: int) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise invalid("prompt", f"prompt must be a non-empty string, a list of token ids or a list of those, got "
                      f"{_short(p)}")
    if len(items) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            ids = tokenizer.encode(x)
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            bad = [t for t in x if not 0 <= t < vocab_size]
            if bad:
                raise invalid("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            ids = list(x)
        else:
            raise invalid("prompt", f"prompt {i} must be a string or a list of token ids, got {_short(x)}")
        if not ids:
            raise invalid("prompt", f"prompt {i} is empty (0 tokens)")
        out.append(ids)
    return out


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", f"messages must be a non-empty list of {{role, content}} objects, got {_short(msgs)}")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}] must be an object with a role in {_ROLES}, "
                          f"got {_short(m)}")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in c):
                raise invalid(f"messages[{i}].content", f"messages[{i}].content: only text parts "
                              "({\"type\": \"text\", \"text\": ...}) are supported")
            c = "".join(part["text"] for part in c)
        elif c is None and m["role"] == "assistant":
            c = ""
        elif not isinstance(c, str):
            raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text "
                          f"parts, got {_short(c)}")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    if not tokenizer.chat_template:
        raise invalid("messages", "this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(clean)
    except Exception as e:  # the template's own refusals (raise_exception) and Jinja errors
        raise invalid("messages", f"the chat template refused these messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _max_tokens(body: dict, kind: str, n_prompt: int, context: int) -> int:
    """The completion budget of a prompt of ``n_prompt`` tokens; 400 naming the numbers when it cannot fit."""
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    asked = _integer(body, name, 1)
    if n_prompt >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens, and the prompt has {n_prompt} "
                       f"tokens (at most {context - 1}, to leave room for one generated token)", param="messages"
                       if kind == "chat" else "prompt", code="context_length_exceeded")
    if asked is None:
        room = context - n_prompt
        return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if kind == "completion" else room
    if n_prompt + asked > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens; you requested "
                       f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} for the completion): lower "
                       f"{name} to at most {context - n_prompt}", param=name, code="context_length_exceeded")
    return asked


def parse(kind: str, body: Any, *, tokenizer, vocab_size: int, context: int, model_names: tuple[str, ...]) -> Parsed:
    """Check a completions (``kind="completion"``) or chat (``"chat"``) request body; raises ``APIError``."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body, model_names)
    _unsupported(body)
    sampling = sampling_params(body)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise invalid("stream_options", f"stream_options must be {{\"include_usage\": true|false}}, got {opts!r}")
    if opts is not None and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    prompts = (_completion_prompts(body, tokenizer, vocab_size) if kind == "completion"
               else [_chat_prompt(body, tokenizer)])
    return Parsed(kind, prompts, sampling, [_max_tokens(body, kind, len(p), context) for p in prompts],
                  stop=_stop(body), stream=stream, include_usage=bool(opts and opts.get("include_usage")),
                  ignore_eos=_flag(body, "ignore_eos"))


# ----------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, created: int, texts: list[str], reasons: list[str],
             prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole (non-streamed) answer: one choice per prompt."""
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chunk(kind: str, rid: str, model: str, created: int, index: int, text: Optional[str],
          finish_reason: Optional[str] = None, role: bool = False) -> dict:
    """One streamed event. Chat: ``delta`` holds the role (first chunk) and / or new content."""
    if kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        c = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": _chunk_object(kind), "created": created, "model": model, "choices": [c]}


def _chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat" else "text_completion"


# a str as compact JSON, as ``json.dumps(s, ensure_ascii=False)`` writes it (C-accelerated)
_json_str = json.encoder.encode_basestring  # json imports its encoder module


class ChunkLines:
    """The server-sent-event lines of one stream's chunks, ``"data: " + json(chunk(...))``, compact, with the
    fields that do not change (id, object, created, model) rendered once: a token's line then costs one string
    escape instead of a dict and a ``json.dumps`` (the event loop writes one per token per stream)."""

    def __init__(self, kind: str, rid: str, model: str, created: int):
        self.kind = kind
        head = json.dumps({"id": rid, "object": _chunk_object(kind), "created": created, "model": model},
                          separators=(",", ":"), ensure_ascii=False)
        self._head = "data: " + head[:-1] + ',"choices":[{"index":'

    def line(self, index: int, text: Optional[str], finish_reason: Optional[str] = None) -> str:
        fr = "null" if finish_reason is None else _json_str(finish_reason)
        if self.kind == "chat":
            body = '"delta":{}' if text is None else '"delta":{"content":' + _json_str(text) + "}"
        else:
            body = '"text":' + _json_str(text or "")
        return f'{self._head}{int(index)},{body},"logprobs":null,"finish_reason":{fr}}}]}}\n\n'


def usage_chunk(kind: str, rid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last streamed event with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": _chunk_object(kind), "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def models_list(names: tuple[str, ...], created: int) -> dict:
    return {"object": "list", "data": [{"id": names[0], "object": "model", "created": created,
                                        "owned_by": "fastdecode"}]}


def now() -> int:
    return int(time.time())
