"""The OpenAI-compatible HTTP API (FastAPI / Starlette) in front of a running ``Scheduler``.

    app = create_app(scheduler, model_names=("SmolLM2-135M-Instruct",))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streamed as server-sent events with
``"stream": true``, ending in ``data: [DONE]``, or answered whole), ``GET /v1/models``, ``GET /health``.
Every error is OpenAI error JSON (``protocol.APIError``): 400 bad parameters or a prompt past the context, 404
unknown model or path, 503 server full; a request that fails inside the engine gets 500 (streamed: an ``error``
event, then the stream ends). A handler waits for its events at most ``POLL_S`` at a time, checking in between
that its client is still there and the scheduler still running: a client that disconnects has its requests
cancelled (their slots freed at the next step), and no connection waits on a dead scheduler.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' annotations (the request type, imported
# inside create_app) at definition time
import asyncio
import json
import threading
import weakref
from collections import deque
from typing import Optional

from fastdecode.engine.batching import Event, Request
from fastdecode.serve import protocol
from fastdecode.serve.protocol import APIError
from fastdecode.serve.scheduler import Overloaded, Scheduler

POLL_S = 0.25


class _Handoff:
    """Events from the scheduler thread to one event loop, coalesced: the first event after a delivery schedules one
    ``call_soon_threadsafe`` (a write to the loop's wake-up pipe); the events that follow before it runs ride
    along. A decode step of 32 streams thus wakes the loop once instead of 32 times."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    def put(self, inbox: "_Inbox", item) -> None:  # the scheduler thread; raises once the loop is closed
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._pending.append((inbox, item))
            if len(self._pending) > 1:
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody will deliver these (the batcher aborts the request)
            with self._lock:
                self._pending.clear()
            raise

    def _deliver(self) -> None:  # the loop
        with self._lock:
            batch, self._pending = self._pending, []
        for inbox, item in batch:
            inbox._arrive(item)


_HANDOFFS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Handoff]" = weakref.WeakKeyDictionary()


def _handoff(loop: asyncio.AbstractEventLoop) -> _Handoff:
    h = _HANDOFFS.get(loop)
    if h is None:
        h = _HANDOFFS[loop] = _Handoff(loop)
    return h


class _Inbox:
    """The events of one HTTP request's engine requests, handed from the scheduler thread to the event loop
    (``_Handoff``), kept in a deque: taking one that is there costs no task and no wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items = loop, deque()
        self._handoff = _handoff(loop)
        self._waiter: Optional[asyncio.Future] = None
        self._checked = loop.time()  # when the client's connection was last checked
        self.closed = False

    def callback(self, index: int):
        def on_event(ev: Event) -> None:  # on the scheduler thread; raises once the loop is closed (-> abort)
            self._handoff.put(self, (index, ev))
        return on_event

    def _arrive(self, item) -> None:  # the loop
        if self.closed:
            return
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, request, scheduler: Scheduler) -> Optional[tuple[int, Event]]:
        """The next (choice index, event); None when the client has disconnected (checked every ``POLL_S``, also
        while events keep coming)."""
        while True:
            now = self.loop.time()
            if now >= self._checked + POLL_S:
                self._checked = now
                if await request.is_disconnected():
                    self.close()
                    return None
                if not scheduler.alive and not self.items:
                    self.close()
                    raise APIError(500, f"the scheduler stopped ({scheduler.error or 'shut down'})", "server_error")
            if self.items:
                return self.items.popleft()
            self._waiter = self.loop.create_future()
            timer = self.loop.call_later(POLL_S, _set_done, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None

    def close(self) -> None:
        self.closed = True
        self.items.clear()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def create_app(scheduler: Scheduler, model_names: tuple[str, ...]):
    """A FastAPI app serving ``scheduler``'s engine under ``model_names`` (the first is listed by /v1/models)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    engine = scheduler.engine
    tok, vocab, context = engine.tokenizer, engine.model.config.vocab_size, engine.max_seq_len
    if tok is None:
        raise ValueError("the engine has no tokenizer; serve needs one (Tokenizer.synthetic for random weights)")
    names = tuple(dict.fromkeys(model_names))
    created = protocol.now()
    app = FastAPI(title="fastdecode", description="OpenAI-compatible API on the fastdecode engine")
    app.state.scheduler = scheduler

    class EventStream(StreamingResponse):
        """Server-sent events; ``on_close`` runs however the response ends (done, client gone, send failed)."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(_, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise APIError(503, f"the scheduler is not running ({scheduler.error or 'stopped'})", "server_error")
        return {"status": "ok", "slots": scheduler.slots, "running": scheduler.batcher.running,
                "waiting": scheduler.waiting()}

    @app.get("/v1/models")
    async def models():
        return protocol.models_list(names, created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in names:
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {names[0]!r}",
                           param="model", code="model_not_found")
        return protocol.models_list(names, created)["data"][0]

    async def handle(kind: str, request: HTTPRequest):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None
        parsed = await run_in_threadpool(protocol.parse, kind, body, tokenizer=tok, vocab_size=vocab,
                                         context=context, model_names=names)
        inbox = _Inbox(asyncio.get_running_loop())
        reqs = [Request(ids, sampling=parsed.sampling, max_new_tokens=m, stop=parsed.stop,
                        ignore_eos=parsed.ignore_eos, on_event=inbox.callback(i))
                for i, (ids, m) in enumerate(zip(parsed.prompts, parsed.max_tokens))]
        done: set[int] = set()

        def cancel_all():
            inbox.close()
            for r in reqs:
                if r.id not in done:
                    scheduler.cancel(r.id)
                    done.add(r.id)

        try:
            for r in reqs:
                scheduler.submit(r)
        except Overloaded as e:
            cancel_all()
            raise APIError(503, str(e), "server_error", code="overloaded") from None
        except ValueError as e:
            cancel_all()
            raise protocol.invalid("messages" if kind == "chat" else "prompt", str(e)) from None
        except RuntimeError as e:
            cancel_all()
            raise APIError(503, str(e), "server_error") from None
        rid, model_name = protocol.new_id(kind), body["model"]
        n_prompt = sum(len(p) for p in parsed.prompts)
        if parsed.stream:
            return EventStream(_stream(kind, request, inbox, reqs, done, rid, model_name, created_at=protocol.now(),
                                       n_prompt=n_prompt, include_usage=parsed.include_usage), cancel_all)
        try:
            texts, reasons, completion = [""] * len(reqs), [None] * len(reqs), [0] * len(reqs)
            while len(done) < len(reqs):
                item = await inbox.next(request, scheduler)
                if item is None:  # the client is gone: nobody reads an answer
                    return Response(status_code=499)
                i, ev = item
                texts[i] += ev.text
                completion[i] = ev.completion_tokens
                if ev.finish_reason:
                    done.add(reqs[i].id)
                    _raise_failed(ev)
                    reasons[i] = ev.finish_reason
        finally:
            cancel_all()
        return protocol.response(kind, rid, model_name, protocol.now(), texts, reasons, n_prompt, sum(completion))

    async def _stream(kind, request, inbox, reqs, done, rid, model_name, created_at, n_prompt, include_usage):
        completion = [0] * len(reqs)
        sse = protocol.ChunkLines(kind, rid, model_name, created_at)  # = _sse(protocol.chunk(...)), pre-rendered
        if kind == "chat":
            yield _sse(protocol.chunk(kind, rid, model_name, created_at, 0, "", role=True))
        try:
            while len(done) < len(reqs):
                item = await inbox.next(request, scheduler)
                if item is None:
                    return
                i, ev = item
                completion[i] = ev.completion_tokens
                if ev.finish_reason:
                    done.add(reqs[i].id)
                    _raise_failed(ev)
                if ev.text or (ev.finish_reason and kind == "completion"):
                    yield sse.line(i, ev.text, ev.finish_reason if kind == "completion" else None)
                if ev.finish_reason and kind == "chat":
                    yield sse.line(i, None, ev.finish_reason)
        except APIError as e:  # headers are sent: the error travels as an event, then the stream ends
            yield _sse(e.body())
            return
        if include_usage:
            yield _sse(protocol.usage_chunk(kind, rid, model_name, created_at, n_prompt, sum(completion)))
        yield "data: [DONE]\n\n"

    def _raise_failed(ev: Event) -> None:
        if ev.finish_reason == "error":
            raise APIError(500, f"generation failed: {ev.error}", "server_error")
        if ev.finish_reason == "abort":
            raise APIError(503, "the request was cancelled (the server is shutting down)", "server_error")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle("chat", request)

    return app
