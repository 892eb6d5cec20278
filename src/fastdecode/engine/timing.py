"""Wall time of the start-up phases (``fastdecode bench startup``): an optional ``Timings`` that ``loader.load`` and
``Engine`` take as ``timings=``; without one, ``phase`` is a no-op (no clock read, no synchronisation).

    t = Timings()
    loaded = load(path, device="cuda", timings=t)
    eng = Engine(loaded.model, loaded.tokenizer, timings=t)
    t.phases   # {"checkpoint_open": 0.21, "model_build": 0.05, "weights_int4": 0.4, ..., "graph_capture": 0.03}

On CUDA each phase synchronises the device before and after (once CUDA is initialised: a phase never initialises
it), so a phase's time includes the GPU work it queued; ``sync=False`` times the host only (the loader's per-tensor
phases: a synchronisation per tensor would time a start-up that ``generate``, untimed, does not have; the loader
drains the queued work once, in ``weights_to_device``). A phase entered twice adds up.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch


def cuda_sync() -> None:
    """Synchronise the current CUDA device once CUDA is initialised (never initialises it). Nothing here asks
    ``torch.cuda.is_available()``: it asks the driver for the device count every call (0.13 ms on the H100 machine's
    host; 748 calls, 0.19 s of a timed start-up in session 36's profile). ``torch.cuda.synchronize()`` without a
    device asks it to find the current one (torch 2.11, seen in session 37's GPU suite); with the index it does not."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(torch.cuda.current_device())


class Timings:
    """Seconds per named phase, in the order first entered."""

    def __init__(self):
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, sync: bool = True):
        if sync:
            cuda_sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                cuda_sync()
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0


def phase(timings: Optional[Timings], name: str, sync: bool = True):
    """``timings.phase(name, sync)``, or a no-op context when ``timings`` is None."""
    return timings.phase(name, sync) if timings is not None else contextlib.nullcontext()
