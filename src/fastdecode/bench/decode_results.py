"""The decode benchmark's rows after the run (``fastdecode.bench.decode``): the speedup over the peer, the
results file (which rows it holds and how a run merges into it) and the plot.

``--out`` merges the measured rows into the file (``merge_rows``): a run replaces the rows of the same
measurement (``row_key``) and keeps the others, so a partial run does not wipe committed results. Rows without
a measurement (failed: ``error``; skipped; no ``tokens_per_s``) are printed but never written. Without ``--out``
a CUDA run writes ``benchmarks/results/decode.json`` (``DEFAULT_OUT``); a CPU run writes no file.
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_OUT = "benchmarks/results/decode.json"


def add_speedup_vs_peer(rows: list[dict]) -> None:
    """In place: ``speedup_vs_peer`` (tokens/s over the measured ``peer-compile`` row's) on every measured
    ``fastdecode-*`` row; nothing without a measured peer. Rows of one batch size (one ``bench_decode`` call)."""
    peer = next((r for r in rows if r.get("impl") == "peer-compile" and r.get("tokens_per_s")), None)
    if peer is None:
        return
    for r in rows:
        if r.get("impl", "").startswith("fastdecode") and r.get("tokens_per_s"):
            r["speedup_vs_peer"] = round(r["tokens_per_s"] / peer["tokens_per_s"], 3)


def row_key(row: dict) -> tuple:
    """What one decode row measures: rows with equal keys replace each other in a results file.
    (Older rows have no quant / tp in their shape: none and 1.) The tables' directory (``config_dir``, from
    ``FASTDECODE_CONFIG_DIR``; none for the package's) is part of it: in session 38 the step on a sweep's table copy
    was replaced by the step on the package's tables, run later into the same file."""
    s = row.get("shape", {})
    return (row.get("op"), s.get("model"), row.get("impl"), s.get("dtype"), s.get("quant") or "none",
            s.get("tp") or 1, s.get("batch"), s.get("input_len"), s.get("output_len"), row.get("gpu"),
            row.get("config_dir"))


def merge_rows(old: list, new: list[dict]) -> list[dict]:
    """``old`` with each row of ``new`` in place of the old row of the same ``row_key`` (new keys appended),
    except that a row without a measurement (skipped, failed) does not replace one with."""
    from fastdecode.bench.harness import merged_rows

    return merged_rows(old, new, key=row_key, keep_measured=True)


def is_measured(row: dict) -> bool:
    """A row a results file may hold: it has a measurement (``tokens_per_s``) and no ``error``."""
    return "error" not in row and bool(row.get("tokens_per_s"))


def results_path(args) -> Optional[str]:
    """Where ``fastdecode bench decode`` writes: ``--out`` when given ('' is no file); otherwise ``DEFAULT_OUT``
    on CUDA and nothing on a CPU (a CPU run must not land in the committed GPU results)."""
    if args.out is not None:
        return args.out or None
    dev = getattr(args, "device", None)
    cuda = torch.device(dev).type == "cuda" if dev else torch.cuda.is_available()
    return DEFAULT_OUT if cuda else None


def plot_rows(rows: list[dict], path: str) -> None:
    """Bar chart of tokens/s per implementation (and the weight-bytes roofline), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["impl"] for r in ok]
    vals = [r["tokens_per_s"] for r in ok]
    ax.barh(names, vals, color=["#999" if not n.startswith("fastdecode") else "#d62" for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center")
    roof = next((r.get("roofline_tokens_per_s") for r in ok if r.get("roofline_tokens_per_s")), None)
    if roof:
        ax.axvline(roof, ls="--", color="k", lw=1)
        ax.text(roof, -0.45, "weight-bytes roofline ", va="bottom", ha="right", fontsize=8)
    s = ok[0]["shape"] if ok else {}
    ax.set_xlabel("tokens/s")
    ax.set_title(f"decode {s.get('model', '')} batch {s.get('batch', '')} "
                 f"in {s.get('input_len', '')} out {s.get('output_len', '')} ({ok[0]['gpu'] if ok else ''})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["DEFAULT_OUT", "add_speedup_vs_peer", "is_measured", "merge_rows", "plot_rows", "results_path",
           "row_key"]
