"""``fastdecode bench decode`` results files: only measured rows are written (failed and skipped rows are
printed), and a CPU run writes a file only when ``--out`` names one (not the committed GPU results)."""

import argparse
import json
import os

import torch

from fastdecode import cli
from fastdecode.bench import decode, decode_results

RUN = ["bench", "decode", "--preset", "tiny", "--output-len", "3", "--iters", "1", "--warmup", "0",
       "--dtype", "float32", "--device", "cpu"]


def _files(d) -> list:
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def test_cpu_run_without_out_writes_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the old default, benchmarks/results/decode.json, would land here
    assert cli.main(RUN + ["--impl", "torch-eager"]) == 0
    out, err = capsys.readouterr()
    assert _files(tmp_path) == []
    assert "torch-eager" in out and "--out" in err  # the rows are reported; the note says how to save them


def test_default_out_is_the_results_file_on_cuda_only(monkeypatch):
    ns = lambda **k: argparse.Namespace(**{"out": None, "device": None, **k})  # noqa: E731
    assert decode_results.results_path(ns(device="cpu")) is None
    assert decode_results.results_path(ns(device="cuda:0")) == decode_results.DEFAULT_OUT
    assert decode_results.results_path(ns(device="cpu", out="r.json")) == "r.json"
    assert decode_results.results_path(ns(device="cuda", out="")) is None  # '' writes nothing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decode_results.results_path(ns()) == decode_results.DEFAULT_OUT
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decode_results.results_path(ns()) is None


def test_failed_and_skipped_rows_are_printed_not_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # the peer fails to build: its row carries an error; torch-graph is skipped on a CPU
    monkeypatch.setattr(decode, "_try_build_peer", lambda *a, **k: (None, "RuntimeError: no peer today"))
    out = tmp_path / "r.json"
    committed = {"op": "decode", "impl": "fastdecode-graph", "median_us": 4000.0, "tokens_per_s": 250.0,
                 "gpu": "NVIDIA H200", "shape": {"model": "llama-3.1-8b", "batch": 1}}
    out.write_text(json.dumps([committed]))
    assert cli.main(RUN + ["--impl", "torch-eager", "torch-graph", "peer-eager", "--out", str(out)]) == 0
    stdout, err = capsys.readouterr()
    assert "peer-eager: failed: RuntimeError: the peer could not be built: RuntimeError: no peer today" in err
    assert "torch-graph: skipped (needs CUDA)" in err
    assert "peer-eager" in stdout and "torch-graph" in stdout  # the table still shows them
    rows = json.loads(out.read_text())
    assert rows[0] == committed and [r["impl"] for r in rows[1:]] == ["torch-eager"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows)
    # a run with no measurement leaves the file as it was
    before = out.read_bytes()
    assert cli.main(RUN + ["--impl", "torch-graph", "peer-eager", "--out", str(out)]) == 0
    assert out.read_bytes() == before and "no measured rows: nothing written to" in capsys.readouterr().err
    assert _files(tmp_path) == ["r.json"]
