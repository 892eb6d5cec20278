"""The generate loop: prefill (outside any graph), then one decode step per token (a CUDA graph on GPUs).

    engine = Engine(model, tokenizer, max_batch=4, max_seq_len=2048)
    [res] = engine.generate(["The capital of France is"], max_new_tokens=32)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from fastdecode.engine.kv_cache import KVCache, check_kv_memory
from fastdecode.engine.sampler import Sampler, SamplingParams, seen_mask
from fastdecode.engine.timing import Timings, phase

Prompt = Union[str, Sequence[int]]
DEFAULT_MAX_SEQ_LEN = 4096
GRAPH_CAPTURE = ("eager", "lazy")


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS excluded)
    text: str = ""  # detokenised ``tokens``, cut before a stop string
    finish_reason: str = ""  # "eos" | "stop" | "length"


class _Stream:
    """Incremental detokenisation of one sequence; holds back text that may still become a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0

    def push(self, tid: int) -> tuple[str, bool]:
        """Add a token; returns (new text safe to show, hit a stop string)."""
        self.ids.append(tid)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return "", False
        self.text = text
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = text[:at]
                return self.flush(), True
        upto = max(self.emitted, len(text) - self.hold)
        delta, self.emitted = text[self.emitted:upto], upto
        return delta, False

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta


class Engine:
    """A model, its tokenizer and a static KV cache for up to ``max_batch`` sequences of ``max_seq_len`` tokens.

    ``max_seq_len`` defaults to the model's context capped at 4096. ``cuda_graph``: replay the decode step
    as a CUDA graph per batch-size bucket (default: on for CUDA). ``graph_capture``: "eager" captures every
    bucket up to ``max_batch`` here (``max_batch=1``: one graph), "lazy" each bucket on the first step that
    needs it (``engine.cuda_graph``: a step boundary; its memory is then taken while serving, not up front).
    ``timings``: an ``engine.timing.Timings`` that gets ``kv_cache``, ``kernel_warmup`` and ``graph_capture``.
    """

    def __init__(self, model, tokenizer=None, *, max_batch: int = 1, max_seq_len: Optional[int] = None,
                 cuda_graph: Optional[bool] = None, batch_buckets: Optional[Sequence[int]] = None,
                 graph_capture: str = "eager", timings: Optional[Timings] = None):
        if graph_capture not in GRAPH_CAPTURE:
            raise ValueError(f"graph_capture must be one of {GRAPH_CAPTURE}, got {graph_capture!r}")
        self.model, self.tokenizer = model, tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # default context: the model's, capped at 4096 (a 128K-token cache of Llama-3.1-8B would be 16 GiB)
        max_seq_len = max_seq_len or min(model.config.max_seq_len, model.rope_len, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len > model.rope_len:
            raise ValueError(f"max_seq_len ({max_seq_len}) exceeds the model's RoPE table ({model.rope_len}); "
                             "load the model with a larger max_seq_len")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        with phase(timings, "kv_cache"):
            # before allocating; under TP every rank agrees (one short of memory stops all)
            check_kv_memory(model.config, max_batch, max_seq_len, self.dtype, self.device,
                            group=getattr(getattr(model, "tp", None), "group", None))
            self.cache = KVCache(model.config, max_batch, max_seq_len, dtype=self.dtype, device=self.device)
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        self.graphs = None
        if cuda_graph:
            from fastdecode.engine.cuda_graph import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, self.cache, buckets=batch_buckets, lazy=graph_capture == "lazy")
            if graph_capture == "eager":
                self.graphs.capture(timings=timings)

    # ------------------------------------------------------------------ steps

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Fill cache rows [:B] with the prompts (right-padded); returns logits [B, V] at each last token
        (with CUDA graphs and one-token prompts: a view of the graph's output, valid until the next step)."""
        B = len(prompts)
        lens = [len(p) for p in prompts]
        S = max(lens)
        tokens = torch.zeros((B, S), dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        tokens = tokens.to(self.device)
        if S == 1 and self.graphs is not None:
            # one token per prompt is a decode step at position 0: the captured graph replays it (an eager
            # prefill launches every kernel from Python: 45 ms against a 3 ms replay for 8B int4 on the H200)
            return self.decode(tokens[:, 0], torch.zeros(B, dtype=torch.long, device=self.device))
        last = torch.tensor(lens, dtype=torch.long, device=self.device) - 1
        return self.model.prefill(tokens, self.cache, last_idx=last)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens, input_pos: [B] int64 on the device -> logits [B, V] fp32."""
        if self.graphs is not None:
            return self.graphs.run(tokens, input_pos)
        return self.model.decode(tokens, input_pos, self.cache)

    def decode_rows(self, n: int) -> int:
        """How many cache rows a decode step covering rows [:n] runs: the smallest graph bucket >= n
        (CUDA graphs; a caller passing fewer rows gets padding rows that write position 0 of rows [n, bucket)),
        else n."""
        return self.graphs.bucket_for(n) if self.graphs is not None else n

    # ------------------------------------------------------------------ API

    def encode_prompts(self, prompts: Sequence[Prompt], chat: bool = False) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; this model has none (pass token ids)")
                if chat:
                    text = self.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                else:
                    ids = self.tokenizer.encode(p)
            else:
                ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty (0 tokens)")
            out.append(ids)
        return out

    def check_capacity(self, prompts: list[list[int]]) -> None:
        if len(prompts) > self.max_batch:
            raise ValueError(f"batch of {len(prompts)} prompts exceeds the engine's capacity "
                             f"(max_batch={self.max_batch})")
        for i, p in enumerate(prompts):
            if len(p) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {self.max_seq_len} "
                                 f"(prompt + generated tokens), so at most {self.max_seq_len - 1} prompt tokens")
        V = self.model.config.vocab_size
        bad = [t for p in prompts for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")

    @torch.no_grad()
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
                 stream: Optional[Callable[[int, str], None]] = None, chat: bool = False,
                 ignore_eos: bool = False) -> list[GenerationResult]:
        """Generate for a batch of prompts (text or token ids), each with its own length.

        Stops a sequence at EOS, at a stop string (cut from the text) or after ``max_new_tokens`` /
        the end of the context. ``stream(i, text)`` receives each sequence's new text as it comes.
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        ids = self.encode_prompts(prompts, chat=chat)
        self.check_capacity(ids)
        B = len(ids)
        results = [GenerationResult(prompt_tokens=p) for p in ids]
        streams = [_Stream(self.tokenizer, stop) if self.tokenizer is not None else None for _ in ids]
        eos = set() if ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        sampler = Sampler(sampling, self.device)

        # the tokens each row has seen, for the repetition penalty: [B, V] bool on the device
        seen = seen_mask(ids, self.model.config.vocab_size, self.device) if sampling.repetition_penalty != 1 else None
        logits = self.prefill(ids)
        nxt = sampler(logits, seen)  # [B]
        pos = torch.tensor([len(p) for p in ids], dtype=torch.long, device=self.device)
        limit = [min(max_new_tokens, self.max_seq_len - len(p)) for p in ids]
        active = [True] * B
        cuda = self.device.type == "cuda"
        if cuda:  # tokens go to the host through pinned memory while the GPU runs the next step
            host_buf = torch.empty(B, dtype=torch.long, pin_memory=True)
            copied = torch.cuda.Event()
        for step in range(max_new_tokens):
            if cuda:
                host_buf.copy_(nxt, non_blocking=True)
                copied.record()
            following = None
            if step + 1 < max(limit):
                # finished rows keep running (static shapes); clamp so they never index past the cache
                logits = self.decode(nxt, torch.clamp(pos, max=self.max_seq_len - 1))
                if seen is not None:
                    seen.scatter_(1, nxt[:, None], True)
                following = sampler(logits, seen)
                pos += 1
            if cuda:
                copied.synchronize()
                host = host_buf.tolist()
            else:
                host = nxt.tolist()
            for b in range(B):
                if not active[b]:
                    continue
                t, r = host[b], results[b]
                if t in eos:
                    r.finish_reason, active[b] = "eos", False
                else:
                    r.tokens.append(t)
                    if streams[b] is not None:
                        delta, hit = streams[b].push(t)
                        if delta and stream:
                            stream(b, delta)
                        if hit:
                            r.finish_reason, active[b] = "stop", False
                if active[b] and len(r.tokens) >= limit[b]:
                    r.finish_reason, active[b] = "length", False
                if not active[b] and streams[b] is not None and stream:
                    rest = streams[b].flush()
                    if rest:
                        stream(b, rest)
            if not any(active) or following is None:
                break
            nxt = following
        for b, r in enumerate(results):
            r.text = streams[b].text if streams[b] is not None else ""
        return results
