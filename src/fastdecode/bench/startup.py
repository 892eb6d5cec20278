"""``fastdecode bench startup``: where the start-up time of ``fastdecode generate`` goes, phase by phase.

Each run is a fresh Python process (``python -c CHILD``), so imports, CUDA initialisation and caches are what a
user's command meets: it loads the model as ``generate`` does (``engine.loader.load`` and ``Engine``, with an
``engine.timing.Timings`` threaded through them), generates the first token of one chat prompt, and writes its
phases to a JSON file; this process turns them into result rows (``bench.harness.make_row``).

Runs (``runs``): "cold" empties a temporary ``TRITON_CACHE_DIR`` first (every Triton kernel compiled), "warm"
after a cold run reuses that directory as the runs before it left it; warm runs before any cold one use the
environment's own Triton cache as it is (``warm warm``: the second one warm for sure). The OS page cache of the
checkpoint is not dropped: after the first run the file is read from memory.

Phases (seconds; those that do not apply are 0.0, e.g. Triton and graphs on a CPU), in order: ``PHASES``.
``ready_s`` is from the launch of the process to the engine being ready (model loaded, kernels compiled, graphs
captured), ``total_s`` to the first token; ``other_s`` the part of ``total_s`` no phase covers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

DEFAULT_OUT = "benchmarks/results/startup.json"
DEFAULT_PROMPT = "Why is the sky blue?"
RUNS = ("cold", "warm")

#: every phase a row reports, in the order they happen
PHASES = (
    "python_start",  # the interpreter, until the first line of the child runs (measured by the parent's clock)
    "import_torch",
    "import_fastdecode",  # fastdecode, its engine (loader, Engine)
    "import_triton",  # CUDA only
    "cuda_init",  # CUDA only: the context, the first allocation
    "checkpoint_open",  # resolve the path, parse the GGUF / safetensors headers and the config
    "model_build",  # names checked, the model built on meta
    "weights_int4",  # int4 projections read and repacked (GGUF Q4_0 / Q4_1: on the device)
    "weights_dense",  # the other tensors read (GGUF: dequantised), quantised where asked
    "weights_to_device",  # the copies to the device
    "assign",  # int4 modules swapped in, weights assigned, RoPE table
    "tokenizer",  # the wait for the tokenizer, built in a thread while the weights load (0.0: it was ready first)
    "random_init",  # presets only: random weights
    "quant_head",  # --quant-head only
    "kv_cache",
    "kernel_warmup",  # CUDA graphs: the warm-up steps before each capture (Triton compiles or cache loads)
    "graph_capture",  # CUDA graphs: the captures
    "first_token",  # generate(prompt, max_new_tokens=1): tokenise, prefill (first calls of its kernels), sample
)

# The child's first statements: the clocks start before torch is imported.
CHILD = ("import sys, time; w0 = time.time(); t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
         "from fastdecode.bench.startup import child; child(w0, t0, t1, sys.argv[1:])")


def child(w0: float, t0: float, t1: float, argv: Sequence[str]) -> None:
    """The start-up, measured: ``argv`` = [JSON config, output path]."""
    import torch

    cfg, out = json.loads(argv[0]), argv[1]
    from fastdecode.engine.generate import DEFAULT_MAX_SEQ_LEN, Engine
    from fastdecode.engine.loader import load
    from fastdecode.engine.timing import Timings

    t2 = time.perf_counter()
    timings = Timings()
    timings.phases.update(import_torch=t1 - t0, import_fastdecode=t2 - t1)
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        with timings.phase("import_triton"):
            import triton  # noqa: F401  (imported by the first Triton op otherwise: counted here instead)
        with timings.phase("cuda_init"):
            torch.cuda.init()
            if device.index is not None:
                torch.cuda.set_device(device)
            torch.zeros(1, device=device)
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None
    loaded = load(cfg.get("model"), device=device, dtype=dtype, backend=cfg.get("backend"),
                  max_seq_len=DEFAULT_MAX_SEQ_LEN, quant=cfg.get("quant"), quant_head=cfg.get("quant_head"),
                  gguf_native=False if cfg.get("dequantize") else None, progress=False, timings=timings)
    model = loaded.model
    max_seq_len = min(DEFAULT_MAX_SEQ_LEN, loaded.config.max_seq_len, model.rope_len)  # as generate's default
    eng = Engine(model, loaded.tokenizer, max_batch=cfg["max_batch"], max_seq_len=max_seq_len,
                 cuda_graph=False if cfg.get("no_cuda_graph") else None, graph_capture=cfg["graph_capture"],
                 timings=timings)
    t_ready = time.perf_counter()
    # the start-up imports no torch._dynamo (1-6 s); True means something on the way to ready brought it back
    dynamo_at_ready = "torch._dynamo" in sys.modules
    prompt = cfg["prompt"] if loaded.tokenizer is not None else [1, 2, 3, 4]
    chat = loaded.tokenizer is not None and bool(loaded.tokenizer.chat_template)
    with timings.phase("first_token"):
        [r] = eng.generate(prompt, max_new_tokens=1, chat=chat, ignore_eos=True)
    t_first = time.perf_counter()
    t = time.perf_counter()  # the same again: what of first_token was one-time (compiles, lazy set-up)
    eng.generate(prompt, max_new_tokens=1, chat=chat, ignore_eos=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    again = time.perf_counter() - t
    graphs = eng.graphs
    res = {"wall_start": w0, "phases": timings.phases, "ready_s": t_ready - t0, "total_s": t_first - t0,
           "first_token_again_s": again, "prompt_tokens": len(r.prompt_tokens),
           "model": loaded.config.name, "quant_format": getattr(model, "quant_format", None) or None,
           "dtype": str(eng.dtype).replace("torch.", ""), "device": str(device),
           "buckets": list(graphs.buckets) if graphs is not None else [],
           "captured": sorted(graphs.graphs) if graphs is not None else [],
           "capture_s": {str(b): v for b, v in graphs.capture_s.items()} if graphs is not None else {},
           "torch_threads": torch.get_num_threads(),
           "dynamo_at_ready": dynamo_at_ready}
    Path(out).write_text(json.dumps(res))


def _pythonpath() -> str:
    """This fastdecode's source directory first on the child's path (an uninstalled checkout runs too)."""
    import fastdecode

    src = str(Path(fastdecode.__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH")
    return src + (os.pathsep + rest if rest else "")


def run_child(cfg: dict, env: dict, timeout: float) -> dict:
    """One start-up in a fresh process: its result (the child's JSON, ``python_start`` and ``process_wall_s``
    added), or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="fastdecode-startup-") as d:
        out = os.path.join(d, "result.json")
        launched = time.time()
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), out], env=env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the start-up took more than {timeout:.0f} s"}
        wall = time.perf_counter() - t
        if p.returncode != 0 or not os.path.exists(out):
            tail = (p.stderr or p.stdout or "").strip().splitlines()[-12:]
            return {"error": f"exit code {p.returncode}: " + " | ".join(tail)[-1500:]}
        res = json.loads(Path(out).read_text())
    res["phases"]["python_start"] = max(0.0, res.pop("wall_start") - launched)
    res["process_wall_s"] = wall
    return res


def _row(cfg: dict, run: str, cache: str, res: dict) -> dict:
    from fastdecode.bench.harness import make_row

    shape = {"model": res.get("model") or cfg.get("model") or "default",
             "quant": "dequantized" if cfg.get("dequantize") else cfg.get("quant"),
             "device": cfg["device"].split(":")[0], "max_batch": cfg["max_batch"],
             "graph_capture": cfg["graph_capture"]}
    if "error" in res:
        return make_row("startup", f"{run}-cache", shape, None, error=res["error"])
    ph = res["phases"]
    phases = {k: round(ph.get(k, 0.0), 4) for k in PHASES}
    phases.update({k: round(v, 4) for k, v in ph.items() if k not in phases})  # a phase PHASES does not know
    start = phases["python_start"]
    ready, total = start + res["ready_s"], start + res["total_s"]
    return make_row("startup", f"{run}-cache", shape, None, phases_s=phases, ready_s=round(ready, 4),
                    total_s=round(total, 4), other_s=round(total - sum(phases.values()), 4),
                    first_token_again_s=round(res["first_token_again_s"], 4),
                    process_wall_s=round(res["process_wall_s"], 3), triton_cache=cache,
                    buckets=res["buckets"], captured=res["captured"],
                    capture_s={b: {k: round(v, 4) for k, v in d.items()} for b, d in res["capture_s"].items()},
                    prompt_tokens=res["prompt_tokens"], quant_format=res["quant_format"], dtype=res["dtype"],
                    torch_threads=res["torch_threads"], cpu_count=os.cpu_count(),
                    dynamo_imported_at_ready=res["dynamo_at_ready"])


def bench_startup(model: Optional[str] = None, *, quant: Optional[str] = None, quant_head: Optional[str] = None,
                  dequantize: bool = False, device=None, dtype: Optional[str] = None, backend: Optional[str] = None,
                  runs: Optional[Sequence[str]] = None, max_batch: int = 1, graph_capture: str = "eager",
                  cuda_graph: bool = True, prompt: str = DEFAULT_PROMPT, timeout: float = 600.0,
                  log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """One result row per run (``runs``, default cold then warm on CUDA, one warm run on a CPU). ``dequantize``: a
    GGUF's int4 weights loaded dense (``generate --dequantize``; the rows' quant reads ``dequantized``)."""
    import torch

    device = str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    runs = list(runs) if runs else (list(RUNS) if cuda else ["warm"])
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise ValueError(f"runs must be among {RUNS}, got {bad[0]!r}")
    cfg = {"model": model, "quant": quant, "quant_head": quant_head, "dequantize": dequantize, "device": device,
           "dtype": dtype,
           "backend": backend, "max_batch": max_batch, "graph_capture": graph_capture, "prompt": prompt,
           "no_cuda_graph": not cuda_graph}
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastdecode-triton-") as tdir:
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        cache = "environment"
        for run in runs:
            if run == "cold":  # this run and the ones after it: the temporary cache
                shutil.rmtree(tdir)
                os.makedirs(tdir)
                env["TRITON_CACHE_DIR"], cache = tdir, "empty"
            elif cache != "environment":
                cache = "reused"
            log(f"startup: {run} run ({cache} Triton cache) on {device} ...")
            res = run_child(cfg, env, timeout)
            rows.append(_row(cfg, run, cache, res))
            log(f"startup: {run}: " + (f"error: {res['error']}" if "error" in res else
                                       f"ready {rows[-1]['ready_s']:.2f} s, first token {rows[-1]['total_s']:.2f} s"))
    return rows


def print_phases(rows: list[dict]) -> None:
    """The phases of each row side by side (stdout): one line per phase, one column per run."""
    ok = [r for r in rows if "phases_s" in r]
    if not ok:
        return
    names = list(dict.fromkeys(k for r in ok for k in r["phases_s"]))
    lines = [["phase (s)"] + [r["impl"] for r in ok]]
    lines += [[k] + [f"{r['phases_s'].get(k, 0.0):.3f}" for r in ok] for k in names]
    for k in ("other_s", "ready_s", "total_s", "first_token_again_s", "process_wall_s"):
        lines.append([k] + [f"{r[k]:.3f}" for r in ok])
    for r in ok:
        if r["capture_s"]:
            per = ", ".join(f"b={b}: {d['warmup']:.3f} + {d['capture']:.3f}" for b, d in r["capture_s"].items())
            lines.append([f"[{r['impl']}] buckets {r['buckets']}, captured (warm-up + capture s): {per}"])
    widths = [max(len(c[i]) for c in lines if len(c) > 1 and i < len(c)) for i in range(len(lines[0]))]
    for c in lines:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)) if len(c) > 1 else c[0], flush=True)
