"""Tensor-parallel serving (``fastdecode serve --tp N``): rank 0 runs the HTTP server, the scheduler and the
batcher; every other rank makes the same model calls on its shard, in the same order, as rank 0 tells it.

    leads, link = lead_or_follow(engine, prefill_chunk)   # every rank, at the same point (it makes a group)
    if leads: serve(engine, ..., link=link)   # rank 0 (or no TP: link None); its model calls go through the link
    # else: this rank followed rank 0's calls (``follow``) until rank 0 sent "stop"

Each model call of the batcher (a prefill pass, a decode step) is one message from rank 0, sent just before rank 0
makes the call: its inputs (token ids, positions, cache rows) as one int64 tensor broadcast on a gloo group of its
own (host memory, also when the model's group is NCCL), so that every rank enters the model's
collectives (the all-reduces, the vocabulary gather of the logits) with the same shapes and in the same order. Rank
0 alone samples, detokenises and answers; the logits the others compute are dropped. Rank 0's scheduler sends a
heartbeat each second while idle (``idle``), so that no follower sits in a broadcast until its timeout, and
``stop`` when it ends. A follower ignores SIGINT (Ctrl-C reaches every process of the terminal's group): it ends
when rank 0, which stops on it, says so.

A call that raises on every rank alike (a bad input) is reported by rank 0 as the step's error, as on one device;
the followers log it and go on. A failure on one rank only inside a collective (out of memory on one GPU) leaves
the others waiting in that collective: the server then stops answering, as any TP job does when a rank dies.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable, Optional

import torch

from fastdecode.engine.batching import LocalCalls

log = logging.getLogger("fastdecode.serve")


KINDS = ("idle", "stop", "prefill", "decode")
HEAD = 3  # [kind, rows, chunk length]


class StepLink:
    """Rank 0's side (``prefill``, ``decode``, ``idle``, ``stop``: each one broadcast to the followers), and the
    channel the followers read (``receive``). The batcher's model calls on one device are ``LocalCalls``.

    A message is one int64 tensor of a fixed length (one collective, nothing pickled): ``[kind, R, C]`` then,
    for a prefill, the R rows' starts, lengths and cache rows and the R x C tokens; for a decode step the R rows'
    tokens and positions. ``max_rows`` (the engine's slots) and ``max_tokens`` (the prefill chunk: a pass holds at
    most that many tokens, padding included) size it; every rank passes the same values (the same command line).
    A 32-row decode message took 400-444 us this way (``StepLink(32, 512)``) against 637-784 us through
    ``broadcast_object_list`` (two gloo processes on the 2-core CPU machine, session 48; not measured on a GPU host)."""

    def __init__(self, max_rows: int, max_tokens: int, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("StepLink needs torch.distributed initialised (one process per rank)")
        self.rank = dist.get_rank()
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.buf = torch.zeros(HEAD + max(3 * max_rows + max_tokens, 2 * max_rows), dtype=torch.long)
        self.sent = 0  # messages rank 0 sent
        self.local = LocalCalls()

    def _broadcast(self) -> None:
        import torch.distributed as dist

        dist.broadcast(self.buf, src=0, group=self.group)

    def send(self, kind: str, rows: int = 0, chunk: int = 0, *parts: torch.Tensor) -> None:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 sends the step plan (this is rank {self.rank})")
        body = torch.cat([p.reshape(-1).to("cpu", torch.long) for p in parts]) if parts else self.buf[:0]  # host
        if rows > self.max_rows or rows * chunk > self.max_tokens or HEAD + body.numel() > self.buf.numel():
            raise ValueError(f"a {kind} of {rows} rows x {chunk} tokens exceeds the link's {self.max_rows} rows / "
                             f"{self.max_tokens} tokens")
        self.buf[:HEAD] = torch.tensor([KINDS.index(kind), rows, chunk])
        self.buf[HEAD:HEAD + body.numel()] = body
        self._broadcast()
        self.sent += 1

    def receive(self) -> tuple:
        """The next message: ("idle",), ("stop",), ("prefill", tokens [R, C], starts, lens, slots) or
        ("decode", tokens [R], positions [R]) (CPU tensors)."""
        self._broadcast()
        kind, R, C = KINDS[int(self.buf[0])], int(self.buf[1]), int(self.buf[2])
        b = self.buf[HEAD:]
        if kind == "prefill":
            return kind, b[3 * R:3 * R + R * C].view(R, C).clone(), b[:R].tolist(), b[R:2 * R].tolist(), \
                b[2 * R:3 * R].tolist()
        if kind == "decode":
            return kind, b[:R].clone(), b[R:2 * R].clone()
        return (kind,)

    # rank 0: the batcher's model calls (engine.batching.LocalCalls' interface), each announced first
    def prefill(self, engine, tokens: torch.Tensor, starts, lens, slots) -> torch.Tensor:
        R, C = tokens.shape
        self.send("prefill", R, C, *(torch.as_tensor(v, dtype=torch.long) for v in (starts, lens, slots)), tokens)
        return self.local.prefill(engine, tokens, starts, lens, slots)

    def decode(self, engine, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.send("decode", tokens.shape[0], 0, tokens, pos)
        return self.local.decode(engine, tokens, pos)

    def idle(self) -> None:
        self.send("idle")

    def stop(self) -> None:
        self.send("stop")


def follow(engine, link: StepLink, on_message: Optional[Callable] = None) -> int:
    """A follower rank: make rank 0's model calls on this rank's shard until it sends "stop"; returns the number of
    calls made. ``on_message(msg)`` (tests) sees each message first."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops on Ctrl-C and then tells us
    calls = 0
    while True:
        msg = link.receive()
        if on_message is not None:
            on_message(msg)
        kind = msg[0]
        if kind == "stop":
            return calls
        if kind == "idle":
            continue
        try:
            with torch.no_grad():
                if kind == "prefill":
                    link.local.prefill(engine, *msg[1:])
                else:  # decode
                    link.local.decode(engine, *msg[1:])
        except Exception:  # rank 0 saw the same error and ended that step's requests
            log.error("serve: rank %d: a %s call failed", link.rank, kind, exc_info=True)
        calls += 1


def lead_or_follow(engine, prefill_chunk: int) -> tuple[bool, Optional[StepLink]]:
    """Where a command serves ``engine`` (``serve``, ``bench serve``): outside torch.distributed ``(True, None)``;
    under it, on every rank at the same point, rank 0 gets ``(True, its StepLink)`` and every other rank makes rank
    0's model calls (``follow``) until rank 0 stops, then gets ``(False, None)``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True, None
    link = StepLink(engine.max_batch, prefill_chunk)
    if link.rank == 0:
        return True, link
    follow(engine, link)
    return False, None
