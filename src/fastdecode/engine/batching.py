"""Continuous batching over one ``Engine``: requests join and leave the running decode batch at step boundaries.

    batcher = ContinuousBatcher(engine, prefill_chunk=256)
    batcher.add(Request(prompt_ids, max_new_tokens=64, on_event=print))
    while batcher.has_work:
        batcher.step()

Slots are the rows of the engine's static KV cache (``engine.max_batch`` of them), handed out lowest first and
freed when a request finishes, fails or is cancelled. One ``step()``:

1. admit waiting requests into free slots (first come, first served);
2. prefill **one chunk** (``prefill_chunk`` tokens at most) of the oldest admitted request, into its own cache row,
   and beside it chunks of the requests admitted after it (each cut to its share), as long as the padded batch holds
   at most ``prefill_chunk`` tokens (rows x the longest chunk), in one forward pass (``models.prefill.prefill_rows``):
   a long prompt stalls the running sequences for one chunk per step, never for its whole prefill, and prompts
   that arrive together are prefilled together. A request's last chunk samples its first token;
3. one decode step for every decoding slot: the engine's decode (one CUDA graph per batch bucket on GPUs) over
   the cache rows ``[:n]``, ``n`` the bucket that covers the highest decoding slot. The other rows inside run a
   dummy token at a position whose write is harmless: 0 for a free row, and for a row still in prefill the next
   position its prefill writes (before anything reads it);
4. sample every decoding row with its own parameters and generator in one batched pass (``sampler.sample_rows``:
   the per-row parameters as columns, each row's exponentials from its own generator), detokenise incrementally
   with stop strings
   (``engine.generate._Stream``), and report each request's new text through its ``on_event``.

Single-threaded: the caller (``fastdecode.serve.scheduler``) owns the batcher and calls it from one thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from fastdecode.engine.generate import Engine, _Stream
from fastdecode.engine.sampler import SamplingParams, sample_rows
from fastdecode.models.prefill import prefill_rows

_ids = itertools.count(1)

#: finish reasons: "stop" (EOS or a stop string, as OpenAI reports both), "length" (max_new_tokens or the end of
#: the context), "abort" (cancelled: a client that went away), "error" (the step failed; ``Event.error`` says why)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Event:
    """What a request's ``on_event`` receives: after each of its tokens, and once at the end (``finish_reason``)."""

    request_id: int
    text: str  # new text (held back while it may still become a stop string)
    token_ids: list[int]  # new tokens (EOS excluded)
    finish_reason: Optional[str]  # None while running, else one of FINISH_REASONS
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far, EOS included
    error: Optional[str] = None


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    on_event: Optional[Callable[[Event], None]] = None
    id: int = field(default_factory=lambda: next(_ids))


class _Seq:
    """A request's state inside the batcher."""

    def __init__(self, req: Request, engine: Engine):
        self.req = req
        self.slot: Optional[int] = None
        self.pos = 0  # prefill: the next position to write; decode: the position of ``last``
        self.decoding = False
        self.last = 0  # the token the next decode step feeds
        self.generated = 0
        self.limit = min(req.max_new_tokens, engine.max_seq_len - len(req.prompt))
        self.stream = _Stream(engine.tokenizer, req.stop) if engine.tokenizer is not None else None
        p = req.sampling
        self.generator = None
        if not p.greedy:
            self.generator = torch.Generator(device=engine.device)
            if p.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(p.seed)
        self.seen = None  # [V] bool on the device: the tokens seen, for the repetition penalty
        if p.repetition_penalty != 1:
            self.seen = torch.zeros(engine.model.config.vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(req.prompt, dtype=torch.long)] = True
            self.seen = self.seen.to(engine.device)


class LocalCalls:
    """The batcher's model calls, made in this process, on host tensors (token ids, positions) that they move to the
    engine's device. Under tensor parallelism rank 0's batcher takes ``fastdecode.serve.tp.StepLink`` instead, which
    announces each call to the other ranks first (the host tensors as they are: no copy back from the GPU)."""

    def prefill(self, engine: Engine, tokens: torch.Tensor, starts, lens, slots) -> torch.Tensor:
        return prefill_rows(engine.model, tokens.to(engine.device), starts, lens, slots, engine.cache)

    def decode(self, engine: Engine, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return engine.decode(tokens.to(engine.device), pos.to(engine.device))


class ContinuousBatcher:
    """Runs many requests through one ``Engine`` (its KV-cache rows are the slots). See the module docstring.
    ``calls``: who makes the model calls (``LocalCalls`` by default)."""

    def __init__(self, engine: Engine, prefill_chunk: int = 512, calls=None):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.engine, self.prefill_chunk = engine, prefill_chunk
        self.calls = calls if calls is not None else LocalCalls()
        self.slots: list[Optional[_Seq]] = [None] * engine.max_batch
        self.waiting: deque[_Seq] = deque()
        self.prefilling: deque[_Seq] = deque()  # admitted (hold a slot), prompt not fully in the cache yet
        tok = engine.tokenizer
        self.eos = set(tok.eos_ids) if tok is not None else set()
        self.steps = 0  # decode steps run

    # ------------------------------------------------------------------ requests

    def check(self, req: Request) -> None:
        """ValueError naming what is wrong with ``req`` (what ``add`` refuses)."""
        T, V = self.engine.max_seq_len, self.engine.model.config.vocab_size
        if not req.prompt:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(req.prompt) >= T:
            raise ValueError(f"the prompt has {len(req.prompt)} tokens; the context holds {T} (prompt + generated "
                             f"tokens), so at most {T - 1} prompt tokens")
        bad = [t for t in req.prompt if not (isinstance(t, int) and 0 <= t < V)]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {V})")
        if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if req.stop and self.engine.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if not isinstance(req.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(req.sampling).__name__}")

    def add(self, req: Request) -> None:
        """Queue ``req`` (checked first: ValueError); it joins the batch at a coming step."""
        self.check(req)
        self.waiting.append(_Seq(req, self.engine))

    def cancel(self, request_id: int) -> bool:
        """Stop a request (its ``on_event`` gets ``finish_reason="abort"``) and free its slot; False if unknown."""
        for seq in list(self.waiting) + [s for s in self.slots if s is not None]:
            if seq.req.id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def fail_all(self, message: str) -> None:
        """End every request with ``finish_reason="error"`` (after a step raised) and free every slot."""
        for seq in list(self.waiting) + [s for s in self.slots if s is not None]:
            self._finish(seq, "error", error=message)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def running(self) -> int:
        """Requests holding a slot (in prefill or decoding)."""
        return sum(s is not None for s in self.slots)

    @property
    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self) -> None:
        """Admit, prefill one chunk (of one or more requests), decode one token for every decoding request (see the
        module docstring)."""
        self._admit()
        if self.prefilling:
            self._prefill()
        self._decode()

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            seq.slot = self.slots.index(None)  # lowest free: keeps the decode batch (rows [:n]) small
            self.slots[seq.slot] = seq
            self.prefilling.append(seq)

    def prefill_plan(self) -> list[tuple["_Seq", int]]:
        """This step's prefill: (request, chunk length) for the oldest admitted request (a chunk of at most
        ``prefill_chunk`` tokens), then the next ones in admission order, each chunk cut to its share of the
        budget, while rows x the longest chunk stays within ``prefill_chunk`` tokens."""
        plan, longest = [], 0
        for seq in self.prefilling:
            rest = len(seq.req.prompt) - seq.pos
            c = min(rest, self.prefill_chunk // (len(plan) + 1))
            if plan and (c < 1 or (len(plan) + 1) * max(longest, c) > self.prefill_chunk):
                break
            plan.append((seq, c))
            longest = max(longest, c)
        return plan

    def _prefill(self) -> None:
        plan = self.prefill_plan()
        longest = max(c for _, c in plan)
        rows = [seq.req.prompt[seq.pos:seq.pos + c] + [0] * (longest - c) for seq, c in plan]
        tokens = torch.tensor(rows, dtype=torch.long)  # on the host: the calls move it (LocalCalls)
        logits = self.calls.prefill(self.engine, tokens, [seq.pos for seq, _ in plan], [c for _, c in plan],
                                    [seq.slot for seq, _ in plan])  # [rows, V]
        done = []
        for i, (seq, c) in enumerate(plan):
            seq.pos += c
            if seq.pos == len(seq.req.prompt):
                done.append(i)
        if not done:
            return
        seqs = [plan[i][0] for i in done]
        for seq in seqs:
            self.prefilling.remove(seq)
            seq.decoding = True  # seq.pos: where the first generated token goes
        for seq, tok in zip(seqs, self._sample(seqs, logits[done]).tolist()):
            self._accept(seq, tok)

    def _decode(self) -> None:
        rows = [s for s in self.slots if s is not None and s.decoding]
        if not rows:
            return
        n = self.engine.decode_rows(max(s.slot for s in rows) + 1)
        T = self.engine.max_seq_len
        tokens, pos = [0] * n, [0] * n
        for s in range(n):
            seq = self.slots[s]
            if seq is None:
                continue
            if seq.decoding:
                tokens[s], pos[s] = seq.last, seq.pos
            else:  # in prefill: its next chunk writes this position before reading it
                pos[s] = min(seq.pos, T - 1)
        logits = self.calls.decode(self.engine, torch.tensor(tokens, dtype=torch.long),
                                   torch.tensor(pos, dtype=torch.long))  # host tensors (LocalCalls)
        self.steps += 1
        picked = self._sample(rows, logits[[s.slot for s in rows]]).tolist()
        for seq, tok in zip(rows, picked):
            seq.pos += 1
            self._accept(seq, tok)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        """One token per sequence (logits [len(seqs), V]), each row with its own parameters and generator, in one
        batched pass (``sampler.sample_rows``: a seeded row gets the tokens it would get alone)."""
        seen = None
        if any(s.seen is not None for s in seqs):
            seen = torch.zeros(len(seqs), logits.shape[-1], dtype=torch.bool, device=logits.device)
            for i, s in enumerate(seqs):
                if s.seen is not None:
                    seen[i] = s.seen
        return sample_rows(logits, [s.req.sampling for s in seqs], [s.generator for s in seqs], seen)

    # ------------------------------------------------------------------ results

    def _accept(self, seq: _Seq, tok: int) -> None:
        seq.generated += 1
        seq.last = tok
        if seq.seen is not None:
            seq.seen[tok] = True
        if tok in self.eos and not seq.req.ignore_eos:
            self._finish(seq, "stop")
            return
        text, reason = "", None
        if seq.stream is not None:
            text, hit = seq.stream.push(tok)
            if hit:
                reason = "stop"
        if reason is None and seq.generated >= seq.limit:
            reason = "length"
        if reason is None:
            self._emit(seq, text, [tok], None)
        else:
            self._finish(seq, reason, text=text, token_ids=[tok])

    def _finish(self, seq: _Seq, reason: str, text: str = "", token_ids=(), error: Optional[str] = None) -> None:
        """Free ``seq``'s slot (or take it off the queues) and send its last event."""
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq.stream is not None and reason in ("stop", "length"):
            text += seq.stream.flush()
        self._emit(seq, text, list(token_ids), reason, error)

    def _emit(self, seq: _Seq, text: str, token_ids: list[int], reason: Optional[str],
              error: Optional[str] = None) -> None:
        if seq.req.on_event is None:
            return
        ev = Event(seq.req.id, text, token_ids, reason, len(seq.req.prompt), seq.generated, error)
        try:
            seq.req.on_event(ev)
        except Exception:  # the receiver is gone (e.g. its event loop closed): stop the request, free the slot
            if reason is None:
                self._finish(seq, "abort")
