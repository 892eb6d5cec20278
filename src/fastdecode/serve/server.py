"""Running the server: the scheduler thread plus uvicorn, in the foreground (``fastdecode serve``) or in a
background thread (tests, ``fastdecode bench serve``).

    handle = start_in_thread(engine, model_names=("tiny",))    # port 0: a free one
    ... httpx / openai against handle.url ...
    handle.stop()
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

from fastdecode.engine.generate import Engine
from fastdecode.engine.kv_cache import kv_cache_bytes
from fastdecode.serve.scheduler import Scheduler

INSTALL_HINT = "pip install 'fastdecode[serve]'"


def require_serve_deps() -> None:
    """ImportError naming the missing package and how to install it (FastAPI and uvicorn are an extra)."""
    for mod in ("fastapi", "uvicorn"):
        try:
            __import__(mod)
        except ImportError:
            raise ImportError(f"fastdecode serve needs {mod}, which is not installed: {INSTALL_HINT}") from None


def slots_for_memory(cfg, max_batch: int, max_seq_len: int, dtype, kv_memory: Optional[float]) -> int:
    """KV slots (cache rows of ``max_seq_len`` positions): ``max_batch``, or fewer when ``kv_memory`` (GiB)
    holds fewer; ValueError naming ``--kv-memory`` when it holds none."""
    if kv_memory is None:
        return max_batch
    per_slot = kv_cache_bytes(cfg, 1, max_seq_len, dtype)
    n = int(kv_memory * 2**30 // per_slot)
    if n < 1:
        raise ValueError(f"--kv-memory {kv_memory:g} GiB holds no KV slot: one sequence of {max_seq_len} positions "
                         f"needs {per_slot / 2**20:.1f} MiB; raise --kv-memory or lower --max-seq-len")
    return min(n, max_batch)


def _uvicorn_server(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30))


def serve(engine: Engine, *, model_names: tuple[str, ...], host: str = "127.0.0.1", port: int = 8000,
          prefill_chunk: int = 512, max_waiting: int = 256, log_level: str = "info", ready=None,
          link=None) -> None:
    """Run until interrupted (Ctrl-C / SIGTERM, handled by uvicorn); ``ready()`` is called once it listens.
    ``link``: rank 0's ``serve.tp.StepLink`` under tensor parallelism (the other ranks run ``serve.tp.follow``)."""
    from fastdecode.serve.app import create_app

    scheduler = Scheduler(engine, prefill_chunk=prefill_chunk, max_waiting=max_waiting, link=link).start()
    try:
        server = _uvicorn_server(create_app(scheduler, model_names), host, port, log_level)
        if ready is not None:
            orig = server.startup

            async def startup(sockets=None):
                await orig(sockets=sockets)
                if server.started:
                    ready()

            server.startup = startup
        server.run()
    finally:
        scheduler.stop()


@dataclass
class ServerHandle:
    url: str  # http://host:port
    scheduler: Scheduler
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.scheduler.stop(timeout)


def start_in_thread(engine: Engine, *, model_names: tuple[str, ...], host: str = "127.0.0.1", port: int = 0,
                    prefill_chunk: int = 512, max_waiting: int = 256, log_level: str = "warning",
                    timeout: float = 30.0, link=None) -> ServerHandle:
    """The server on a background thread (port 0: a free port); returns once it accepts connections. ``link``:
    rank 0's ``serve.tp.StepLink`` under tensor parallelism (``stop()`` then ends the followers too)."""
    from fastdecode.serve.app import create_app

    require_serve_deps()
    scheduler = Scheduler(engine, prefill_chunk=prefill_chunk, max_waiting=max_waiting, link=link).start()
    server = _uvicorn_server(create_app(scheduler, model_names), host, port, log_level)
    server.install_signal_handlers = lambda: None  # not the main thread (older uvicorn calls this)
    t = threading.Thread(target=server.run, name="fastdecode-http", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            scheduler.stop()
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(f"http://{host}:{bound}", scheduler, server, t)
