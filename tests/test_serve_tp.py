"""``fastdecode serve --tp 2`` on the CPU: a real server process (relaunched under torchrun, two gloo ranks), driven
over HTTP with httpx, answers as the same checkpoint generates alone at TP=1, streamed and not, with requests
interleaved in one decode batch; and the step plan's messages, rank 0 to the followers, in two gloo processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine_helpers import clear_greedy_margins, save_tiny_smollm2_vocab
from helpers import free_port, run_ranks

pytest.importorskip("fastapi", reason="the server tests need the serve extra: pip install 'fastdecode[serve]'")
pytest.importorskip("uvicorn", reason="the server tests need the serve extra: pip install 'fastdecode[serve]'")
httpx = pytest.importorskip("httpx")

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PROMPT = "Once upon a time"
START_TIMEOUT = 180  # two ranks load the model and the server comes up; a hang fails the test


def _alone(path, n):
    """The prompt's greedy text at TP=1 (``Engine.generate``, the prompt alone)."""
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import load

    loaded = load(path, dtype=torch.float32, progress=False, max_seq_len=64)
    [r] = Engine(loaded.model, loaded.tokenizer, max_batch=1, max_seq_len=64).generate([PROMPT], max_new_tokens=n)
    return r.text


def _streamed(url, body) -> tuple[str, dict]:
    text, usage = [], None
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text += [c["text"] for c in chunk["choices"]]
            usage = chunk.get("usage") or usage
    return "".join(text), usage


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two or more CUDA GPUs")),
])
def test_serve_tp2_answers_as_tp1_alone(tmp_path, device):
    for attempt in range(10):  # greedy tokens that win clearly: TP's fp32 sums move logits by ~1e-6
        d, _ = save_tiny_smollm2_vocab(tmp_path / f"tiny{attempt}", name="tiny-smol-vocab")
        if clear_greedy_margins(d, PROMPT, 10):
            break
    else:
        pytest.fail("no random model in 10 whose greedy tokens win by 1e-3")
    want = _alone(d, 10)  # fp32 on the CPU; the server in fp32 too (on GPUs: NCCL, the CUDA-graph buckets)
    assert want.strip()
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "fastdecode", "serve", "--model", d, "--device", device, "--tp", "2",
                          "--dtype", "float32",
                          "--port", str(port), "--max-seq-len", "64", "--max-batch", "4", "--prefill-chunk", "8",
                          "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert p.poll() is None, p.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the TP server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"model": "tiny-smol-vocab", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == want and out["usage"]["completion_tokens"] == 10
        text, usage = _streamed(url + "/v1/completions", body)
        assert text == want and usage["completion_tokens"] == 10
        # three at once: they share prefill passes and decode steps (rows of one batch) on both ranks
        got = [None] * 3
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _streamed(url + "/v1/completions",
                                                                                     body)[0])) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == [want] * 3
        # a bad request is answered by rank 0 alone, and the ranks go on
        bad = httpx.post(url + "/v1/completions", json={**body, "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == want
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)  # Ctrl-C in a terminal: rank 0 stops and tells the follower
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    log = p.stdout.read().decode(errors="replace")
    assert "TP=2" in log, log[-3000:]
    # Ctrl-C reaches every process of the group (the relaunching CLI, torchrun, the ranks): the CLI's exit code for
    # it (130, "interrupted"; 0 where the server ended first), never a traceback (the CPU CI once saw torchrun's
    # own SignalException, exit 1: engine.tp.torchrun_main now returns 130 for it)
    assert p.returncode in (0, 130) and "Traceback" not in log, f"exit {p.returncode} after Ctrl-C: {log[-3000:]}"


def _link_ranks(rank, world):
    """Rank 0 sends a prefill, an idle heartbeat, two decode steps and "stop"; the follower makes each model call on
    its shard (one random model, the same on both ranks, sharded)."""
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import random_model
    from fastdecode.engine.tp import apply_tp
    from fastdecode.models.config import ModelConfig
    from fastdecode.serve.tp import StepLink, follow

    cfg = ModelConfig.from_preset("tiny")
    model = apply_tp(random_model(cfg, device="cpu", dtype=torch.float32, backend="torch", max_seq_len=32))
    eng = Engine(model, None, max_batch=2, max_seq_len=32)
    link = StepLink(2, 8)
    if rank == 0:
        logits = link.prefill(eng, torch.tensor([[1, 2, 3], [4, 5, 0]]), [0, 0], [3, 2], [0, 1])
        assert logits.shape == (2, cfg.vocab_size)
        link.idle()
        for step in range(2):
            logits = link.decode(eng, torch.tensor([7, 8]), torch.tensor([3 + step, 2 + step]))
            assert logits.shape == (2, cfg.vocab_size) and torch.isfinite(logits).all()
        with pytest.raises(ValueError, match="exceeds the link's 2 rows / 8 tokens"):  # nothing sent
            link.prefill(eng, torch.zeros(1, 9, dtype=torch.long), [0], [9], [0])
        link.stop()
        assert link.sent == 5
        with pytest.raises(RuntimeError, match="only rank 0"):
            StepLink.send(type("R1", (), {"rank": 1})(), "stop")
    else:
        seen = []
        assert follow(eng, link, on_message=seen.append) == 3
        assert [m[0] for m in seen] == ["prefill", "idle", "decode", "decode", "stop"]
        tokens, starts, lens, slots = seen[0][1:]
        assert tokens.tolist() == [[1, 2, 3], [4, 5, 0]] and (starts, lens, slots) == ([0, 0], [3, 2], [0, 1])
        assert [(m[1].tolist(), m[2].tolist()) for m in seen[2:4]] == [([7, 8], [3, 2]), ([7, 8], [4, 3])]


def test_step_link_followers_make_rank0s_calls():
    run_ranks(2, _link_ranks)


def test_scheduler_sends_each_call_a_heartbeat_when_idle_and_stop():
    """Rank 0's side without a process group: a recording link in place of ``StepLink`` sees the batcher's model
    calls in order, an ``idle`` for each second without work (not for a request's wake-up), and ``stop`` at the
    end; the answer equals ``Engine.generate`` alone."""
    from fastdecode.engine.batching import LocalCalls, Request
    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import random_model
    from fastdecode.engine.sampler import SamplingParams
    from fastdecode.engine.tokenizer import Tokenizer
    from fastdecode.models.config import ModelConfig
    from fastdecode.serve.scheduler import Scheduler

    class Recording(LocalCalls):
        def __init__(self):
            self.log = []

        def prefill(self, engine, tokens, starts, lens, slots):
            self.log.append("prefill")
            return super().prefill(engine, tokens, starts, lens, slots)

        def decode(self, engine, tokens, pos):
            self.log.append("decode")
            return super().decode(engine, tokens, pos)

        def idle(self):
            self.log.append("idle")

        def stop(self):
            self.log.append("stop")

    model = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, backend="torch",
                         std=0.1, seed=3, max_seq_len=32)
    tok = Tokenizer.synthetic(256)
    prompt = torch.randint(1, 256, (5,)).tolist()
    [want] = Engine(model, tok, max_batch=1, max_seq_len=32).generate([prompt], max_new_tokens=6,
                                                                      sampling=SamplingParams(temperature=0))
    link = Recording()
    sched = Scheduler(Engine(model, tok, max_batch=2, max_seq_len=32), prefill_chunk=8, link=link).start()
    time.sleep(2.5)  # two idle seconds at least
    done, events = threading.Event(), []
    sched.submit(Request(prompt, SamplingParams(temperature=0), max_new_tokens=6,
                         on_event=lambda e: (events.append(e), e.finish_reason and done.set())))
    assert done.wait(60)
    sched.stop()
    assert events[-1].finish_reason == "length" and [t for e in events for t in e.token_ids] == want.tokens
    idle_before = link.log.index("prefill")
    assert idle_before >= 2 and set(link.log[:idle_before]) == {"idle"}
    calls = [c for c in link.log[idle_before:] if c != "idle"]
    assert calls == ["prefill"] + ["decode"] * 5 + ["stop"]  # the prefill samples the first of the 6 tokens


def test_bench_serve_tp2_on_the_cpu(tmp_path):
    """``bench serve --tp 2``: relaunched under torchrun (two gloo ranks); every rank runs the references and the
    static batches in step, rank 0 serves while rank 1 follows, and rank 0 alone writes the rows (``shape.tp`` 2).
    In fp32 every served answer equals the prompt generated alone by the same TP engine (``wrong_text`` 0)."""
    out = tmp_path / "serve.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "fastdecode", "bench", "serve", "--model", "tiny", "--device", "cpu",
                        "--tp", "2", "--dtype", "float32", "--concurrency", "1", "3", "--duration", "1",
                        "--input-len", "4", "--output-len", "6", "--max-batch", "2", "--prefill-chunk", "4",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=START_TIMEOUT)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert sorted((r["impl"], r["shape"]["concurrency"]) for r in rows) == [
        ("fastdecode-serve", 1), ("fastdecode-serve", 3), ("fastdecode-static", 1), ("fastdecode-static", 3)]
    for r in rows:
        assert r["shape"]["tp"] == 2 and r["completed"] == r["requests"] >= 1 and r["failed"] == 0, r
        assert r["impl"] == "fastdecode-static" or r["wrong_text"] == 0, r
