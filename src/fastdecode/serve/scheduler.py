"""The scheduler thread: it alone owns the engine and its ``ContinuousBatcher``, and runs the batching loop;
other threads (the HTTP server's event loop) only ``submit`` and ``cancel``, through a locked inbox.

    sched = Scheduler(engine, prefill_chunk=512, max_waiting=256).start()
    sched.submit(Request(ids, on_event=...))     # Overloaded when the waiting queue is full (HTTP 503)
    sched.cancel(request_id)                     # a client that went away: its slot is freed at the next step
    sched.stop()

Each loop iteration takes the inbox, then runs one ``batcher.step()`` (admit, one prefill chunk, one decode
step). A step that raises ends every running and waiting request with ``finish_reason="error"`` (the message in
the event), and the loop goes on with the next requests. ``on_event`` is called on this thread: it must only hand
the event over (``loop.call_soon_threadsafe``), never block.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from typing import Optional

import torch

from fastdecode.engine.batching import ContinuousBatcher, Event, Request
from fastdecode.engine.generate import Engine

log = logging.getLogger("fastdecode.serve")


class Overloaded(RuntimeError):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class Scheduler:
    def __init__(self, engine: Engine, *, prefill_chunk: int = 512, max_waiting: int = 256, link=None):
        """``link``: under tensor parallelism, rank 0's ``fastdecode.serve.tp.StepLink`` (the batcher's model
        calls go through it; a heartbeat each idle second; "stop" when the loop ends)."""
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.engine, self.link = engine, link
        self.batcher = ContinuousBatcher(engine, prefill_chunk=prefill_chunk, calls=link)
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._cancels: deque[int] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None  # why the loop itself died (never a request's error)
        self.completed = 0

    # ------------------------------------------------------------------ any thread

    @property
    def slots(self) -> int:
        return self.engine.max_batch

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def waiting(self) -> int:
        """Requests not yet holding a slot (approximate: read without the scheduler's cooperation)."""
        return len(self._inbox) + len(self.batcher.waiting)

    def check(self, req: Request) -> None:
        """ValueError when ``req`` can never run (prompt past the context, bad ids, ...); reads only."""
        self.batcher.check(req)

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises ``ValueError`` (bad request), ``Overloaded`` (queue full: every slot busy and
        ``max_waiting`` requests waiting) or RuntimeError (the scheduler is not running)."""
        self.check(req)
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the scheduler is not running{': ' + self.error if self.error else ''}")
            queued = len(self._inbox) + len(self.batcher.waiting) + self.batcher.running
            if queued >= self.slots + self.max_waiting:
                raise Overloaded(f"the server is at capacity ({self.slots} running requests and "
                                 f"{self.max_waiting} waiting); retry later")
            self._inbox.append(req)
        self._wake.set()

    def cancel(self, request_id: int) -> None:
        """Stop a request at the next step boundary (idempotent; unknown ids are ignored)."""
        with self._lock:
            self._cancels.append(request_id)
        self._wake.set()

    def start(self) -> "Scheduler":
        if self.alive:
            raise RuntimeError("the scheduler is already running")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fastdecode-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running end with ``finish_reason="abort"``."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the scheduler thread

    def _run(self) -> None:
        try:
            if self.engine.device.type == "cuda":  # a new thread starts on GPU 0 (a TP rank's engine may be on 1)
                torch.cuda.set_device(self.engine.device)
            while not self._stopping:
                self._wake.clear()
                self._take_inbox()
                if not self.batcher.has_work:
                    if not self._wake.wait(timeout=1.0) and self.link is not None:  # a second with nothing to do:
                        self.link.idle()  # the followers wait in a broadcast; keep it short of its timeout
                    continue
                try:
                    self.batcher.step()
                except Exception as e:  # a failed step ends its requests, not the server
                    log.error("serve: a step failed; ending its requests\n%s", traceback.format_exc())
                    self.batcher.fail_all(f"{type(e).__name__}: {e}")
            with self._lock:
                pending = list(self._inbox)
                self._inbox.clear()
            for r in pending:
                self.batcher.add(r)
            for seq in list(self.batcher.waiting) + [s for s in self.batcher.slots if s is not None]:
                self.batcher.cancel(seq.req.id)
            if self.link is not None:
                self.link.stop()
        except BaseException as e:  # never leave clients waiting on a dead loop without a reason
            self.error = f"{type(e).__name__}: {e}"
            log.error("serve: the scheduler loop died\n%s", traceback.format_exc())
            try:
                self.batcher.fail_all(self.error)
                if self.link is not None:  # died outside a model call: the followers can still be told
                    self.link.stop()
            except Exception:
                pass
            raise

    def _take_inbox(self) -> None:
        with self._lock:
            new, cancels = list(self._inbox), list(self._cancels)
            self._inbox.clear()
            self._cancels.clear()
        for r in new:
            try:
                self.batcher.add(r)
            except ValueError as e:  # checked in submit already; kept for safety
                if r.on_event is not None:
                    r.on_event(Event(r.id, "", [], "error", len(r.prompt), 0, str(e)))
        for rid in cancels:
            self.batcher.cancel(rid)
