"""``fastdecode bench serve``: the OpenAI server under a concurrency sweep, against the same engine driven with one
static batch (``Engine.generate``), the server and the baseline in one process.

For each concurrency C, C clients (asyncio, httpx; in a process of their own) send streamed ``/v1/completions``
requests back to back for ``duration`` seconds (then wait for the ones in flight): ``input_len`` prompt tokens
(token ids; a few distinct prompts in turn), ``output_len`` tokens out (``ignore_eos``), greedy. Per request: time
to first token (send -> first text), the gaps between streamed chunks (inter-token latency; a chunk is one token
except where the detokeniser holds text back). Per run: completed / failed requests, generated tokens / s (wall
time from the first send to the last answer), and with ``check`` each answer compared with the prompt generated alone by
``Engine.generate`` (greedy). In fp32 any difference is an error (``wrong_text``, the exit code). In bf16 / fp16 a
row's tokens depend on which rows share its step: the GEMMs of a batch of 1 and of 8 sum in different orders and
move logits by ~1e-2, which flips near ties (random weights are full of them) and every token after; there the
run reports ``differs_from_alone`` and ``common_prefix`` (the mean fraction of the reference text a served answer
starts with), not errors. The batcher's exactness is tested in fp32 on the GPU (tests/test_serve_batching_gpu.py).

The static baseline runs ``Engine.generate`` on min(C, slots) prompts at once (after one unmeasured run): its TTFT
is the batch prefill, its ITL the decode step, its tokens / s the batch's. Rows follow the other benchmarks
(``bench.harness.make_row``: git sha, gpu, torch and triton versions), ``op = "serve"``, ``impl``
``fastdecode-serve`` / ``fastdecode-static``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import time
from typing import Callable, Optional, Sequence

import torch

from fastdecode.bench.harness import make_row

DEFAULT_OUT = "benchmarks/results/serve.json"
N_PROMPTS = 8  # distinct prompts the clients cycle through (each checked against its reference text)


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in [0, 100]); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x * 1000, 3)


def row_key(row: dict) -> tuple:
    """Rows with equal keys replace each other in a results file."""
    return row.get("op"), row.get("impl"), json.dumps(row.get("shape"), sort_keys=True), row.get("gpu")


def _metrics(ttft: list, itl: list, tokens: int, seconds: float, **extra) -> dict:
    return dict(tokens_per_s=round(tokens / seconds, 2) if seconds > 0 else None, tokens=tokens,
                duration_s=round(seconds, 3), ttft_p50_ms=_ms(percentile(ttft, 50)),
                ttft_p99_ms=_ms(percentile(ttft, 99)), itl_p50_ms=_ms(percentile(itl, 50)),
                itl_p99_ms=_ms(percentile(itl, 99)), **extra)


# ----------------------------------------------------------------------------- clients


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def _client_load(url: str, model: str, prompts: list[list[int]], refs: Optional[list[str]], concurrency: int,
                       duration: float, output_len: int, exact: bool = True) -> dict:
    import httpx

    ttft, itl, tokens = [], [], 0
    stats = dict(requests=0, completed=0, failed=0, **({"wrong_text": 0} if exact else {"differs_from_alone": 0}))
    errors: list[str] = []
    prefix: list[float] = []
    deadline = time.perf_counter() + duration
    counter = iter(range(10**9))

    async def one(client, k: int) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": prompts[k % len(prompts)], "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        last, text, used, done = None, [], 0, False
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise RuntimeError(ev["error"]["message"])
                    if ev.get("usage"):
                        used = ev["usage"]["completion_tokens"]
                    for c in ev["choices"]:
                        if c.get("text"):
                            now = time.perf_counter()
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                            text.append(c["text"])
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
        except Exception as e:  # counted, and the first few kept for the report
            stats["failed"] += 1
            if len(errors) < 5:
                errors.append(f"{type(e).__name__}: {e}")
            return
        stats["completed"] += 1
        tokens += used
        if refs is not None:
            got, ref = "".join(text), refs[k % len(prompts)]
            if got != ref:
                stats["wrong_text" if exact else "differs_from_alone"] += 1
            prefix.append(_common_prefix(got, ref) / max(len(ref), 1))

    async def worker(client) -> None:
        while time.perf_counter() < deadline:
            stats["requests"] += 1
            await one(client, next(counter))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - t
    out = _metrics(ttft, itl, tokens, seconds, **stats)
    if refs is not None and not exact:
        out["common_prefix"] = round(sum(prefix) / len(prefix), 4) if prefix else None
    if errors:
        out["errors"] = errors
    return out


def _client_run(*args) -> dict:
    """``_client_load`` in the clients' own process (``bench_serve``)."""
    return asyncio.run(_client_load(*args))


def _static(engine, prompts: list[list[int]], batch: int, output_len: int) -> dict:
    """One ``Engine.generate`` of ``batch`` prompts: TTFT, ITL (per row, from the stream callback), tokens / s."""
    ids = [prompts[i % len(prompts)] for i in range(batch)]
    last: dict[int, float] = {}
    ttft, itl = [], []

    def on_text(i: int, _text: str) -> None:
        now = time.perf_counter()
        if i in last:
            itl.append(now - last[i])
        else:
            ttft.append(now - t0)
        last[i] = now

    engine.generate(ids, max_new_tokens=output_len, ignore_eos=True)  # warm-up: the first run of each shape is slow
    t0 = time.perf_counter()
    res = engine.generate(ids, max_new_tokens=output_len, stream=on_text, ignore_eos=True)
    seconds = time.perf_counter() - t0
    return _metrics(ttft, itl, sum(len(r.tokens) for r in res), seconds, requests=batch, completed=batch, failed=0)


# ----------------------------------------------------------------------------- the benchmark


def bench_serve(model: Optional[str], *, concurrency: Sequence[int], duration: float = 10.0, input_len: int = 128,
                output_len: int = 128, max_batch: int = 32, prefill_chunk: int = 512, device=None,
                dtype: Optional[torch.dtype] = None, quant: Optional[str] = None, static: bool = True,
                check: bool = True, log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """Rows of the sweep (see the module docstring). ``model``: a preset (random weights, a synthetic tokenizer),
    a checkpoint path or None (the embedded model).

    Under torch.distributed (``bench serve --tp N``: torchrun) every rank loads its shard and runs the references
    and the static batches in step; then rank 0 serves (its model calls announced through ``serve.tp.StepLink``)
    while the others follow, and rank 0 alone returns rows (``shape.tp``: N); the others return none."""
    import torch.distributed as dist

    from fastdecode.engine.generate import Engine
    from fastdecode.engine.loader import load
    from fastdecode.engine.tokenizer import Tokenizer
    from fastdecode.engine.tp import load_tp
    from fastdecode.serve.server import start_in_thread
    from fastdecode.serve.tp import lead_or_follow

    for name, v in (("input_len", input_len), ("output_len", output_len), ("max_batch", max_batch)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"concurrency must be a list of integers >= 1, got {list(concurrency)}")
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    T = input_len + output_len
    world = dist.get_world_size() if dist.is_initialized() else 1
    loaded = (load_tp if world > 1 else load)(model, device=device, dtype=dtype, quant=quant, max_seq_len=max(T, 16),
                                              progress=False)
    tok = loaded.tokenizer or Tokenizer.synthetic(loaded.config.vocab_size)
    engine = Engine(loaded.model, tok, max_batch=max_batch, max_seq_len=T)
    V = min(loaded.config.vocab_size, tok.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (input_len,), generator=gen).tolist() for _ in range(N_PROMPTS)]
    refs = None
    if check:  # each prompt alone, greedy: what every server answer must equal
        refs = [engine.generate([p], max_new_tokens=output_len, ignore_eos=True)[0].text for p in prompts]
    shape = dict(model=loaded.config.name if model is None else model, dtype=str(engine.dtype).replace("torch.", ""),
                 quant=quant or "none", input_len=input_len, output_len=output_len, max_batch=engine.max_batch,
                 prefill_chunk=prefill_chunk, device=device.type, **({"tp": world} if world > 1 else {}))
    rows = []
    if static:
        for c in concurrency:
            b = min(c, engine.max_batch)
            m = _static(engine, prompts, b, output_len)
            rows.append(make_row("serve", "fastdecode-static", {**shape, "concurrency": c, "batch": b}, None, **m))
            log(f"static   C={c:<4} {m['tokens_per_s']} tok/s, TTFT p50 {m['ttft_p50_ms']} ms, "
                f"ITL p50 {m['itl_p50_ms']} ms")
    exact = engine.dtype == torch.float32  # see the module docstring
    leads, link = lead_or_follow(engine, prefill_chunk)  # under TP rank 0 serves, the others follow until it stops
    if not leads:
        return []
    handle = start_in_thread(engine, model_names=("bench",), prefill_chunk=prefill_chunk,
                             max_waiting=max(concurrency) + 16, link=link)
    # the clients in a process of their own, as a server's clients are: in this one their HTTP parsing shared the
    # server's interpreter lock (32 streams of the tiny model on a 2-core CPU: 4.6k tok/s served with the clients
    # in process, 7.8-8.3k from another process, same server)
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        # warm-up, not reported: on the CPU the first decode step of each batch size and length is slow
        pool.submit(_client_run, handle.url, "bench", prompts, None, max(concurrency), min(duration, 1.0),
                    output_len).result()
        for c in concurrency:
            m = pool.submit(_client_run, handle.url, "bench", prompts, refs, c, duration, output_len, exact).result()
            rows.append(make_row("serve", "fastdecode-serve", {**shape, "concurrency": c, "clients": "process"}, None,
                                 **m))
            log(f"serve    C={c:<4} {m['tokens_per_s']} tok/s, TTFT p50 {m['ttft_p50_ms']} ms p99 {m['ttft_p99_ms']} "
                f"ms, ITL p50 {m['itl_p50_ms']} ms p99 {m['itl_p99_ms']} ms; {m['completed']}/{m['requests']} "
                f"completed, {m['failed']} failed, " + (f"{m.get('wrong_text', 0)} wrong" if exact else
                f"{m.get('differs_from_alone', 0)} differ from alone (common prefix {m.get('common_prefix')})"))
    finally:
        pool.shutdown(cancel_futures=True)
        handle.stop()
    return rows


def plot_rows(rows: list[dict], path: str) -> None:
    """Tokens / s, TTFT p50 and ITL p50 against concurrency, served and static (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for impl, style in (("fastdecode-serve", "o-"), ("fastdecode-static", "s--")):
        sub = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["shape"]["concurrency"])
        if not sub:
            continue
        xs = [r["shape"]["concurrency"] for r in sub]
        for ax, key, label in zip(axes, ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms"),
                                  ("tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)")):
            ax.plot(xs, [r.get(key) or float("nan") for r in sub], style, label=impl.replace("fastdecode-", ""))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
    axes[0].legend()
    s = rows[0]["shape"] if rows else {}
    fig.suptitle(f"serve {s.get('model', '')} in {s.get('input_len', '')} out {s.get('output_len', '')} "
                 f"({rows[0]['gpu'] if rows else ''})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
