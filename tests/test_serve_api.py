"""The OpenAI-compatible server (``fastdecode.serve``) in process: uvicorn on a free port in a thread, a tiny
random fp32 model with a synthetic tokenizer (token i is the word ``t<i>``), driven by the ``openai`` client
(streaming and not) and raw HTTP for the errors. Every answer is compared with ``Engine.generate`` running the
prompt alone."""

import json
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="the server tests need the serve extra: pip install 'fastdecode[serve]'")
pytest.importorskip("uvicorn", reason="the server tests need the serve extra: pip install 'fastdecode[serve]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastdecode.engine.generate import Engine  # noqa: E402
from fastdecode.engine.loader import random_model  # noqa: E402
from fastdecode.engine.sampler import SamplingParams  # noqa: E402
from fastdecode.engine.tokenizer import Tokenizer  # noqa: E402
from fastdecode.models.config import ModelConfig  # noqa: E402
from fastdecode.serve.server import start_in_thread  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, backend="torch",
                        std=0.1, seed=5, max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.synthetic(256)


@pytest.fixture(scope="module")
def server(model, tok):
    h = start_in_thread(Engine(model, tok, max_batch=4, max_seq_len=CONTEXT), model_names=("tiny", "tiny-alias"),
                        prefill_chunk=8)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alone(model, tok, prompt, n, chat=False, **sampling):
    eng = Engine(model, tok, max_batch=1, max_seq_len=CONTEXT)
    [r] = eng.generate([prompt], max_new_tokens=n, chat=chat, sampling=SamplingParams(**sampling))
    return r


def _words(n):
    return " ".join(f"t{i}" for i in torch.randint(1, 256, (n,)).tolist())


def test_models_and_health(server):
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["slots"] == 4


def test_completion_equals_generate_alone(client, model, tok):
    prompt = _words(13)  # longer than the prefill chunk (8)
    ref = alone(model, tok, prompt, 10)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 13 and out.usage.completion_tokens == 10 and out.usage.total_tokens == 23


def test_completion_streamed_equals_generate_alone(client, model, tok):
    prompt = _words(5)
    ref = alone(model, tok, prompt, 12)
    chunks = list(client.completions.create(model="tiny-alias", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices and c.choices[0].text]) == 12  # one chunk per token
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 5


def test_chat_streamed_and_not_equal_generate_alone(client, model, tok):
    msg = _words(6)
    ref = alone(model, tok, msg, 9, chat=True)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": msg}], max_tokens=9,
                                         temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": msg}],
                                                 max_tokens=9, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_and_several_prompts(client, model, tok):
    prompts = [_words(4), _words(7)]
    refs = [alone(model, tok, p, 8) for p in prompts]
    stop = refs[0].text.split(" ")[2]  # the third generated word
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, stop=[stop])
    assert [c.index for c in out.choices] == [0, 1]
    want0 = refs[0].text[:refs[0].text.find(stop)]
    assert out.choices[0].text == want0 and out.choices[0].finish_reason == "stop"
    r1 = refs[1].text
    assert out.choices[1].text == (r1[:r1.find(stop)] if stop in r1 else r1)


def test_seeded_sampling_equals_generate_alone(client, model, tok):
    prompt = _words(5)
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **kw,
                                    extra_body={"top_k": 40, "min_p": 0.01})
    assert out.choices[0].text == alone(model, tok, prompt, 10, top_k=40, min_p=0.01, **kw).text
    pen = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 1.5})
    assert pen.choices[0].text == alone(model, tok, prompt, 10, repetition_penalty=1.5).text


def _post(server, path, body, raw=None):
    return httpx.post(server.url + path, json=body if raw is None else None, content=raw,
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("body, status, param, match", [
    ({"model": "nope", "prompt": "t1"}, 404, "model", "does not exist"),
    ({"prompt": "t1"}, 400, "model", "model must be a model name"),
    ({"model": "tiny", "prompt": "t1", "temperature": -0.5}, 400, "temperature", r"temperature must be a number"),
    ({"model": "tiny", "prompt": "t1", "top_p": 0}, 400, "top_p", r"top_p must be a number in \(0, 1\]"),
    ({"model": "tiny", "prompt": "t1", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    ({"model": "tiny", "prompt": "t1", "n": 2}, 400, "n", "n=2 is not supported"),
    ({"model": "tiny", "prompt": "t1", "logprobs": 3}, 400, "logprobs", "not supported"),
    ({"model": "tiny", "prompt": "t1", "stop": 5}, 400, "stop", "stop must be a string or a list"),
    ({"model": "tiny", "prompt": "t1", "seed": "x"}, 400, "seed", "seed must be an integer"),
    ({"model": "tiny", "prompt": []}, 400, "prompt", "prompt must be a non-empty"),
    ({"model": "tiny", "prompt": [1, 999]}, 400, "prompt", r"token id 999 is outside the vocabulary \[0, 256\)"),
    ({"model": "tiny", "prompt": "t1 " * 64}, 400, "prompt",
     "maximum context length is 64 tokens, and the prompt has 64"),
    ({"model": "tiny", "prompt": "t1 " * 60, "max_tokens": 10}, 400, "max_tokens",
     r"you requested 70 tokens \(60 in the prompt, 10 for the completion\)"),
    ({"model": "tiny", "prompt": "t1", "stream": False, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed with stream=true"),
])
def test_bad_completion_requests(server, body, status, param, match):
    import re

    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param, match", [
    ({"model": "tiny", "messages": []}, "messages", "messages must be a non-empty list"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "role in"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "only text parts"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "t1"}], "tools": [{"type": "function"}]}, "tools",
     "not supported"),
])
def test_bad_chat_requests(server, body, param, match):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


def test_not_json_unknown_path_and_method(server):
    r = _post(server, "/v1/completions", None, raw=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", None, raw=b"[1, 2]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def _wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(server.url + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False


def _slow_steps(monkeypatch, scheduler, seconds=0.05):
    """Each batching step takes ``seconds`` longer, so a 60-token request runs for about 3 s."""
    step = scheduler.batcher.step

    def slow():
        time.sleep(seconds)
        step()

    monkeypatch.setattr(scheduler.batcher, "step", slow)


def _first_data(lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("no data line")


def test_disconnect_frees_the_slot(server, monkeypatch):
    _slow_steps(monkeypatch, server.scheduler)
    body = {"model": "tiny", "prompt": _words(3), "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept open (a dropped iterator closes the connection)
        first = _first_data(lines)
        assert json.loads(first[6:])["choices"]
        assert httpx.get(server.url + "/health").json()["running"] == 1
    # the stream was closed after one chunk: the request is cancelled, its slot free (long before its 60 tokens)
    assert _wait_idle(server, timeout=1.0)
    # a non-streamed request whose client gives up
    with pytest.raises(httpx.TimeoutException):
        _post_timeout = httpx.post(server.url + "/v1/completions", timeout=0.3,  # noqa: F841
                                   json={**body, "stream": False, "max_tokens": 60})
    assert _wait_idle(server, timeout=1.0)


def test_overload_is_503_and_the_server_recovers(model, tok, monkeypatch):
    h = start_in_thread(Engine(model, tok, max_batch=1, max_seq_len=CONTEXT), model_names=("tiny",), max_waiting=0)
    _slow_steps(monkeypatch, h.scheduler)
    try:
        body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", h.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            _first_data(lines)
            busy = httpx.post(h.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "overloaded"
        assert _wait_idle(h)
        ok = httpx.post(h.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        h.stop()


def test_a_failing_step_is_a_500_not_a_hang(server, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(server.scheduler.batcher, "_decode", boom)
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": 5})
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert _wait_idle(server)
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": 2})
    assert r.status_code == 200


def test_pre_rendered_chunk_lines_are_the_chunks_json():
    """``protocol.ChunkLines`` (the streamed lines, rendered once per stream) writes what ``json.dumps`` of
    ``protocol.chunk`` writes, for awkward text too (quotes, backslashes, control characters, non-ASCII)."""
    from fastdecode.serve import protocol
    from fastdecode.serve.app import _sse

    texts = [None, "", " t5", '"quoted"\n\ttab', "ünïcødé 😀", "\\back\\", "\x00\x1f ctrl", "\u2028\u2029"]
    for kind in ("chat", "completion"):
        lines = protocol.ChunkLines(kind, 'cmpl-"id"', "mo\\del", 1700000000)
        for text in texts:
            for reason in (None, "stop", "length"):
                for i in (0, 7):
                    assert lines.line(i, text, reason) == _sse(protocol.chunk(
                        kind, 'cmpl-"id"', "mo\\del", 1700000000, i, text, reason)), (kind, text, reason, i)


def test_many_streams_at_once_get_every_token_in_order(server, model, tok):
    """Events of one step reach the event loop together (``app._Handoff``): 8 streams of 4 slots, each
    with its own prompt, every one equal to the prompt generated alone, none lost, none reordered."""
    import asyncio

    prompts = [_words(n) for n in (2, 3, 5, 7, 4, 6, 1, 8)]

    async def one(client, p):
        text = []
        body = {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [alone(model, tok, p, 12).text for p in prompts]
