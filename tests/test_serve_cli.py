"""``fastdecode serve`` and ``fastdecode bench serve`` from the command line: the load check (16 clients for a few
seconds: no request lost, every text right), the options, the missing extra, and the embedded model through the
``openai`` client."""

import builtins
import json
import os
import subprocess
import sys

import pytest
import torch

from fastdecode.cli import main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _needs_serve():
    pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'fastdecode[serve]'")
    pytest.importorskip("uvicorn", reason="needs the serve extra: pip install 'fastdecode[serve]'")
    pytest.importorskip("httpx")


def test_bench_serve_16_clients_lose_nothing_and_get_the_right_text(tmp_path, capsys):
    """The short version of the 64-clients-for-60-s check: every request completes, every greedy text equals the
    prompt generated alone, and the rows land in --out with the benchmark fields."""
    _needs_serve()
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--model", "tiny", "--device", "cpu", "--concurrency", "16", "--duration", "3",
                 "--input-len", "12", "--output-len", "12", "--max-batch", "8", "--prefill-chunk", "8",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    served = [r for r in rows if r["impl"] == "fastdecode-serve"]
    static = [r for r in rows if r["impl"] == "fastdecode-static"]
    assert len(served) == 1 and len(static) == 1
    r = served[0]
    assert r["requests"] >= 16 and r["completed"] == r["requests"] and r["failed"] == 0 and r["wrong_text"] == 0
    assert r["tokens"] == 12 * r["completed"]
    for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "git_sha", "gpu", "torch"):
        assert key in r
    assert r["ttft_p50_ms"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0
    assert r["shape"]["concurrency"] == 16 and static[0]["shape"]["batch"] == 8


def test_serve_without_the_extra_says_how_to_install(monkeypatch, capsys):
    real = builtins.__import__

    def no_fastapi(name, *a, **k):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    assert main(["serve", "--model", "tiny"]) == 2
    assert "pip install 'fastdecode[serve]'" in capsys.readouterr().err


def test_importing_fastdecode_needs_no_web_stack():
    code = ("import sys, fastdecode, fastdecode.cli, fastdecode.serve.server, fastdecode.serve.protocol, "
            "fastdecode.engine.batching; bad = [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]; "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("argv, match", [
    (["--port", "70000"], "must be in [0, 65535]"),
    (["--max-batch", "0"], "must be positive"),
    (["--kv-memory", "-1"], "must be a positive number of GiB"),
    (["--prefill-chunk", "x"], "expected an integer"),
])
def test_serve_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve"] + argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_serve_sizes_slots_from_kv_memory(monkeypatch, capsys):
    """--kv-memory sets the slots (fewer than --max-batch when it holds fewer); too little is one error line."""
    _needs_serve()
    from fastdecode.engine.kv_cache import kv_cache_bytes
    from fastdecode.models.config import ModelConfig
    from fastdecode.serve import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda eng, **kw: seen.update(eng=eng, **kw))
    per_slot = kv_cache_bytes(ModelConfig.from_preset("tiny"), 1, 128, torch.float32)
    gib = 3.5 * per_slot / 2**30
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--max-seq-len", "128", "--kv-memory", str(gib),
                 "--max-batch", "8", "--port", "0"]) == 0
    assert seen["eng"].max_batch == 3 and seen["eng"].max_seq_len == 128
    assert seen["model_names"][0] == "tiny" and seen["eng"].tokenizer is not None  # synthetic for a preset
    assert "synthetic" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--max-seq-len", "128",
                 "--kv-memory", str(0.5 * per_slot / 2**30)]) == 2
    assert "holds no KV slot" in capsys.readouterr().err


def test_embedded_model_through_the_openai_client():
    """SmolLM2-135M-Instruct served on the CPU: chat (streamed and not) answers what Engine.generate answers."""
    _needs_serve()
    openai = pytest.importorskip("openai")
    from engine_helpers import smollm2_path

    path = smollm2_path()
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import load
    from fastdecode.serve.server import start_in_thread

    m = load(path, device="cpu", max_seq_len=512, progress=False)
    eng = Engine(m.model, m.tokenizer, max_batch=2, max_seq_len=512)
    q = "What is the capital of France?"
    [ref] = eng.generate([q], max_new_tokens=24, chat=True)
    h = start_in_thread(eng, model_names=("SmolLM2-135M-Instruct",))
    try:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": q}]
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=24,
                                             temperature=0)
        assert out.choices[0].message.content == ref.text and "Paris" in ref.text
        assert out.usage.prompt_tokens == len(ref.prompt_tokens)
        streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=24,
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ref.text
    finally:
        h.stop()
