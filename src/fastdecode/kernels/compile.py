"""Compile many variants of a kernel at once, before they are launched one by one.

A tuner (and its tests) launches dozens of configs of one kernel; each is a Triton compile of ~0.9 s on
the H200's host, one after another. ``precompile`` runs the launches as warmups inside Triton's
``AsyncCompileMode``: the compiles go to a thread pool (Triton releases the GIL in its MLIR passes and
ptxas is a subprocess; on 2 CPU cores, 6 int4 configs compiled for sm_90 took 4.8 s one by one and 3.1 s
on 2 threads) and land in the JIT's cache, so the launches that follow find them compiled.

Nothing here changes what runs: a config that fails to compile is left for its real launch to report.
Under the Triton interpreter, or a Triton without ``AsyncCompileMode``, it does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Optional

log = logging.getLogger("fastdecode")


def precompile(warm: Callable[[dict], None], configs: Iterable[dict], workers: Optional[int] = None) -> int:
    """Queue ``warm(cfg)`` (a launch with ``warmup=True``) for every config and wait for the compiles.

    Returns the number of configs queued (0 when it did nothing)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return 0
    try:
        import triton

        mode_cls = getattr(triton, "AsyncCompileMode", None)
    except ImportError:
        return 0
    if mode_cls is None:
        return 0
    import concurrent.futures as cf

    configs = list(configs)
    workers = workers or max(1, min(16, os.cpu_count() or 1, len(configs)))
    queued = 0
    try:
        with cf.ThreadPoolExecutor(workers) as ex, mode_cls(ex, ignore_errors=True):
            for cfg in configs:
                try:
                    warm(cfg)
                    queued += 1
                except Exception:  # its real launch reports it
                    pass
    except Exception as e:  # no harm: every launch still compiles what is missing
        log.info(f"fastdecode: parallel precompile stopped ({type(e).__name__}: {e}); compiling on demand")
    return queued
