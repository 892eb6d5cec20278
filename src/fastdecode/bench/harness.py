"""Benchmark harness shared by every ``fastdecode bench`` command.

Method (docs/benchmarking.md, "Kernel timings"): CUDA events after warm-up; the median of many;
launch-bound sizes are timed as CUDA-graph replays of ``calls_per_graph`` back-to-back calls (so the
~1.4 us graph launch is what a decode step pays, not the ~23 us eager launch); inputs rotate over
enough copies to exceed the L2 (60 MB on the H200), so large sizes read HBM rather than cache; bytes
and FLOPs are counted by the caller and turned into TB/s and TFLOP/s here. Every row carries the GPU
and software versions.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

L2_BYTES_DEFAULT = 60 * 2**20


@functools.cache
def env_info() -> dict:
    """GPU name and software versions recorded in every result row."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover
        triton_version = None
    sha = os.environ.get("FASTDECODE_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip() or None
        except Exception:
            sha = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    info = {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "git_sha": sha}
    if os.environ.get("FASTDECODE_CONFIG_DIR"):  # the run read tuned tables from outside the commit
        info["config_dir"] = os.environ["FASTDECODE_CONFIG_DIR"]
    if os.environ.get("FASTDECODE_PDL", "1") in ("", "0"):  # programmatic dependent launch switched off
        info["pdl"] = False
    return info



def adopt_table(table: dict, gpu_name: str, path, refusal: str) -> dict:
    """``table`` as this GPU's, for a tuning run to write into: as it is if tuned here (or without a GPU named); a
    copy named this GPU's, ``based_on`` the other, if tuned on the GPU whose tables this one reads without its own
    (``ops._common.sibling_gpu``); any other GPU's raises ValueError (``path`` and ``refusal`` name it there)."""
    from fastdecode.ops._common import sibling_gpu

    owner = table.get("gpu", gpu_name)
    if owner == gpu_name:
        return table
    if owner != sibling_gpu(gpu_name):
        raise ValueError(f"{path} was tuned on {owner!r}, not on this {gpu_name!r}: {refusal}")
    return {**table, "gpu": gpu_name, "based_on": owner}


def start_table(path: Path, gpu_name: str, num_sms: int, merge: bool, sections: Sequence[str],
                base: Optional[Path] = None) -> dict:
    """The dispatcher table a tuning run fills: the header (GPU, SM count, this run's ``env``) and ``sections``,
    empty, or with ``merge`` everything of the table already at ``path`` (where there is none, at ``base``: the
    table in use, ``ops._common.table_path``), which must have been tuned on the same GPU (``merged_into``: that
    run's env), or on the GPU whose tables this one reads without its own (``ops._common.sibling_gpu``: a copy of
    the tables in use, as ``benchmarks/gpu.py`` makes; ``based_on`` names that GPU, whose entries stay where this
    run tunes none); the run then replaces the entries it tunes, one by one."""
    src = path if path.is_file() else base
    old = json.loads(src.read_text()) if merge and src is not None and src.is_file() else {}
    table = {**adopt_table(old, gpu_name, path, "not merging"), "gpu": gpu_name, "num_sms": num_sms,
             "env": env_info()}
    if old:
        table["merged_into"] = old.get("env")
    for name in sections:
        table.setdefault(name, {})
    return table

def write_table_section(path: Path, section: str, entries: dict, base: Optional[Path] = None,
                        gpu_name: Optional[str] = None) -> dict:
    """Merge ``entries`` (``{shape key: {M: entry}}``; an entry None removes that key's M, and a key left with none
    goes) into ``section`` of the tuned table at ``path`` and write it, with ``<section>_env`` (this run's GPU and
    commit) as the section's own record. A missing file starts from
    ``base``, the table in use (``ops._common.config_path``): a table under ``FASTDECODE_CONFIG_DIR`` replaces the
    package's whole table of its family, so the copy must keep the rest. The table becomes this GPU's
    (``gpu_name``, default the run's; ``adopt_table``: a sibling's copy names this GPU, ``based_on`` the other;
    another GPU's raises ValueError). Returns the table written."""
    src = path if path.is_file() else base
    table = json.loads(src.read_text()) if src is not None and src.is_file() else {}
    info = env_info()
    gpu_name = gpu_name or (info["gpu"] if info["gpu"] != "cpu" else None)
    if table and gpu_name:
        table = adopt_table(table, gpu_name, src, f"not writing its {section} section for this GPU")
    sec = table.setdefault(section, {})
    for key, by_m in entries.items():
        kept = {**sec.get(key, {}), **by_m}
        kept = {m: e for m, e in kept.items() if e is not None}
        if kept:
            sec[key] = kept
        else:
            sec.pop(key, None)
    table[section + "_env"] = info
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", L2_BYTES_DEFAULT))
    return L2_BYTES_DEFAULT


def rotation_count(bytes_per_call: int, factor: float = 3.0, cap: int = 64) -> int:
    """How many input copies make a round of calls read ``factor`` x the L2 (at least 1)."""
    if bytes_per_call <= 0:
        return 1
    return int(max(1, min(cap, -(-int(factor * l2_bytes()) // bytes_per_call))))


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    n: int


def _stats(samples: Sequence[float]) -> Timing:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return Timing(statistics.median(s), q(0.1), q(0.9), len(s))


def time_cuda(
    calls: Sequence[Callable[[], object]],
    *,
    graph: bool,
    calls_per_graph: int = 20,
    warmup: int = 5,
    reps: int = 30,
) -> Timing:
    """Time one call, cycling through ``calls`` (one closure per rotated input set).

    graph=True: capture ``calls_per_graph`` calls (cycling the list) into one CUDA graph and time
    replays; the per-call time is replay time / calls_per_graph. graph=False: time each eager call
    of a whole rotation round and divide.

    Programmatic dependent launch is off while timing (``fastdecode.ops.pdl_override``): back-to-back calls of
    one kernel would overlap each other's launch and tail, which a baseline launched without it cannot
    (the decode benchmark measures PDL where it belongs, between the different kernels of a step).
    """
    from fastdecode.ops import pdl_override

    with pdl_override(False):
        return _time_cuda(list(calls), graph, calls_per_graph, warmup, reps)


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn`` run once on a side stream (its allocations and lazy set-up happen outside the capture), then captured
    into a CUDA graph, which is returned (not replayed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _time_cuda(calls, graph: bool, calls_per_graph: int, warmup: int, reps: int) -> Timing:
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()
    if graph:
        n = max(calls_per_graph, len(calls))

        def round_():
            for i in range(n):
                calls[i % len(calls)]()

        g = capture_graph(round_)
        g.replay()
        torch.cuda.synchronize()
        run, per = g.replay, n
    else:
        def run():
            for c in calls:
                c()
        per = len(calls)
    samples = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000.0 / per)
    if graph:
        del g
    return _stats(samples)


def geomean(xs) -> float:
    """Geometric mean of the positive values of ``xs`` (nan when there are none)."""
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


#: Fields of every result row (docs/benchmarking.md, "Kernel timings"; issue 2); ``None`` where a field does
#: not apply (a row that failed, a summary row).
ROW_FIELDS = ("op", "impl", "shape", "median_us", "tbps", "gpu", "torch", "triton", "git_sha")


def make_row(
    op: str,
    impl: str,
    shape: dict,
    t: Optional[Timing],
    *,
    bytes_moved: Optional[int] = None,
    flops: Optional[int] = None,
    error: Optional[BaseException | str] = None,
    **extra,
) -> dict:
    """The one builder of result rows: every row has ``ROW_FIELDS``.

    ``t=None``: a row without a timing (``error`` given: a run that failed; or a summary row, whose
    numbers come in ``extra``): ``median_us`` and ``tbps`` are None.
    """
    row = {"op": op, "impl": impl, "shape": shape, "median_us": None, "p10_us": None, "p90_us": None,
           "tbps": None}
    if t is not None:
        row.update(median_us=round(t.median_us, 3), p10_us=round(t.p10_us, 3), p90_us=round(t.p90_us, 3))
    if bytes_moved is not None:
        row["bytes"] = int(bytes_moved)
        if t is not None:
            row["tbps"] = round(bytes_moved / (t.median_us * 1e-6) / 1e12, 3)
    if flops is not None:
        row["flops"] = int(flops)
        row["tflops"] = round(flops / (t.median_us * 1e-6) / 1e12, 2) if t is not None else None
    if error is not None:
        row["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {str(error)[:200]}"
    row.update(extra)
    row.update(env_info())
    return row


def write_rows(rows: list[dict], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


def row_key(row: dict) -> tuple:
    """Identity of a result: (op, impl, shape)."""
    return row.get("op"), row.get("impl"), json.dumps(row.get("shape"), sort_keys=True)


def merged_rows(old: list, new: list[dict], key=row_key, keep_measured: bool = False) -> list[dict]:
    """``old`` with the rows of ``new`` in place of the old rows of the same ``key`` (so the file keeps its order),
    new keys appended. Rows of one key that repeat within ``new`` (one run timing the same thing more than once, as
    an order check does) are all kept, in their order, where the key's first old row was. ``keep_measured``: new
    rows of a key none of which has a measurement (skipped, failed: no ``median_us``) do not replace an old row
    with one."""
    if not isinstance(old, list) or not all(isinstance(r, dict) for r in old):
        raise ValueError("not a list of result rows")
    fresh: dict = {}
    for r in new:
        fresh.setdefault(key(r), []).append(r)
    out, placed = [], set()
    for r in old:
        k = key(r)
        ns = fresh.get(k)
        if ns is None:
            out.append(r)
        elif keep_measured and "median_us" in r and not any("median_us" in n for n in ns):
            out.append(r)  # the old measurement stays, the new rows of its key are dropped
            placed.add(k)
        elif k not in placed:
            out += ns
            placed.add(k)
    return out + [n for k, ns in fresh.items() if k not in placed for n in ns]


def merge_rows(rows: list[dict], path: str | os.PathLike, *, key=row_key, keep_measured: bool = False) -> list[dict]:
    """Write ``rows`` into the JSON file at ``path``, keeping its other rows (``merged_rows``; by default
    the key is (op, impl, shape)). Returns what was written."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.is_file() else []
    try:
        merged = merged_rows(old, rows, key, keep_measured)
    except ValueError:
        raise ValueError(f"{path} is not a list of result rows; cannot merge into it (write a new file)") from None
    write_rows(merged, path)
    return merged


def print_table(rows: list[dict], keys: Sequence[str] = ("op", "impl", "shape", "median_us", "tbps")) -> None:
    """A plain aligned table of some keys of the rows (stdout)."""
    cells = [[str(k) for k in keys]] + [
        [json.dumps(r.get(k), separators=(",", ":")) if isinstance(r.get(k), dict) else str(r.get(k, ""))
         for k in keys] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)), flush=True)
