"""What the int4 benchmark scripts share (``benchmarks/diag_int4_gemv.py``, ``sweep_int4_a8.py``,
``sweep_int4_packed.py``): their baselines, a checked timing loop over configs, the per-shape flush, ``--shapes``
parsing and the ``--table`` writer. The operands and the reference check are ``bench.int4``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from fastdecode.bench.harness import make_row, time_cuda, write_rows
from fastdecode.bench.int4 import _ok, _Operands


def baseline_rows(op: str, ops: _Operands, M: int, shape: dict) -> list[dict]:
    """The benchmarks' two baselines at M, as rows of ``op``: ``cublas_bf16`` (``torch.mm`` on the dequantised
    weight) and ``tinygemm`` (``_weight_int4pack_mm``; a shape it refuses gives a row with the error); each with
    its ``err_rel`` against the fp32 reference (``bench.int4._ok``), as the configs' rows have."""
    acc: dict = {}
    _ok(ops, M, "cublas", errors=acc)
    rows = [make_row(op, "cublas_bf16", shape, time_cuda(ops.calls(M, "cublas"), graph=True),
                     bytes_moved=ops.bytes_bf16(M), **acc)]
    try:
        _ok(ops, M, "tinygemm", errors=acc)
        rows.append(make_row(op, "tinygemm", shape, time_cuda(ops.calls(M, "tinygemm"), graph=True),
                             bytes_moved=ops.bytes_int4(M), **acc))
    except Exception as e:  # noqa: BLE001  (a shape tinygemm refuses: the row says why)
        rows.append(make_row(op, "tinygemm", shape, None, error=e))
    return rows


def checked_row(op: str, ops: _Operands, M: int, shape: dict, name: str, impl: str, config: Optional[dict]) -> dict:
    """``impl`` (``_Operands.calls``) checked against the reference (``err_rel``; an ``error`` key where it misses),
    then timed: its row, with ``config`` (for "dispatch", the table's choice it runs)."""
    acc: dict = {}
    err = _ok(ops, M, impl, config, errors=acc)
    t = time_cuda(ops.calls(M, impl, config), graph=True)
    return make_row(op, name, shape, t, bytes_moved=ops.bytes_int4(M), config=config, **acc,
                    **({"error": err} if err else {}))


def dispatch_row(op: str, ops: _Operands, M: int, shape: dict, name: str = "dispatch") -> dict:
    """``int4_linear`` as the engine calls it (the tuned table's choice, named in the row), checked and timed."""
    from fastdecode.ops.int4 import get_int4_config

    _, config = get_int4_config(M, ops.N, ops.K, ops.group, torch.device("cuda"))
    return checked_row(op, ops, M, shape, name, "dispatch", config)


def timed_configs(op: str, ops: _Operands, M: int, shape: dict, named: Sequence[tuple[str, dict]],
                  rows: list[dict]) -> Optional[dict]:
    """Each (name, config) checked and timed (``checked_row``), appended to ``rows`` (one that cannot launch: a row
    with the error); returns the fastest correct row, or None."""
    best = None
    for name, c in named:
        try:
            r = checked_row(op, ops, M, shape, name, "triton", c)
        except Exception as e:  # noqa: BLE001  (out of resources: the row says so)
            rows.append(make_row(op, name, shape, None, config=c, error=e))
            continue
        rows.append(r)
        if "error" not in r and (best is None or r["median_us"] < best["median_us"]):
            best = r
    return best


def flush_rows(rows: list[dict], zero_mode: str, out_path: Optional[Path]) -> None:
    """After a shape (its operands deleted by the caller): free the cache, name the weights' zero mode in every
    row, write the rows so far."""
    torch.cuda.empty_cache()
    for r in rows:
        r.setdefault("zero_mode", zero_mode)
    if out_path:
        write_rows(rows, out_path)


def write_best_configs(path: Path, section: str, rows: list[dict], summary_op: str, us_key: str,
                       keep=lambda r: bool(r.get("best_config"))) -> dict:
    """The sweep scripts' ``--table``: each ``summary_op`` row that ``keep`` accepts gives its (shape, M) entry
    ``{"impl": "triton", "config": best_config, "us": row[us_key]}`` in ``section`` of the int4_linear table at
    ``path`` (``harness.write_table_section``: merged into what the file holds, else into the table in use)."""
    from fastdecode.bench.harness import write_table_section
    from fastdecode.ops._common import table_path
    from fastdecode.ops.int4 import table_key

    entries: dict = {}
    for r in rows:
        if r["op"] == summary_op and keep(r):
            sh = r["shape"]
            entries.setdefault(table_key(sh["N"], sh["K"], sh["group"]), {})[str(sh["M"])] = {
                "impl": "triton", "config": r["best_config"], "us": r[us_key]}
    base = table_path("int4_linear", torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    table = write_table_section(path, section, entries, base)
    print(f"wrote {path}: {sum(len(v) for v in entries.values())} entries into {section}")
    return table


def pick_shapes(parser, text: str, known: dict) -> list[str]:
    """The sweep scripts' ``--shapes``: comma-separated names of ``known``; an unknown one is the parser's error."""
    shapes = [s for s in text.split(",") if s]
    bad = [s for s in shapes if s not in known]
    if bad:
        parser.error(f"unknown shape {bad[0]!r}; known: {', '.join(known)}")
    return shapes
