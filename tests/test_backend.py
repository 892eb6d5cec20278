"""The backend switch, fallback logging, and torch.compile / custom-op integration on the CPU; the CLI's
``selfcheck`` and the plumbing of the kernel benchmarks (rows, baselines, merging) without a GPU."""

import logging

import pytest
import torch

import fastdecode as fd
from fastdecode.ops import _common
from helpers import assert_close, interpreter_on


def test_explicit_torch_backend_runs_reference(monkeypatch):
    x = torch.randn(3, 64)
    w = torch.randn(64)
    assert torch.equal(fd.rms_norm(x, w, backend="torch"), fd.rms_norm_ref(x, w))


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("FASTDECODE_BACKEND", "torch")
    assert _common.resolve_backend(None, torch.device("cpu"), "op") == "torch"
    monkeypatch.setenv("FASTDECODE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        _common.resolve_backend(None, torch.device("cpu"), "op")


def test_auto_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(_common, "interpreter_on", lambda: False)
    monkeypatch.delenv("FASTDECODE_BACKEND", raising=False)
    _common._logged_once.clear()
    with caplog.at_level(logging.INFO, logger="fastdecode"):
        for _ in range(3):
            assert _common.resolve_backend("auto", torch.device("cpu"), "rms_norm") == "torch"
    lines = [r for r in caplog.records if "rms_norm uses the torch backend" in r.getMessage()]
    assert len(lines) == 1


def test_explicit_triton_that_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(_common, "interpreter_on", lambda: False)
    with pytest.raises(RuntimeError, match="backend='triton' was requested but tensors are on the CPU"):
        _common.resolve_backend("triton", torch.device("cpu"), "rms_norm")


def test_pdl_switch(monkeypatch):
    """Programmatic dependent launch: on by default, FASTDECODE_PDL=0 or set_pdl(False) turns it off,
    set_pdl(None) restores the default; never for CPU tensors (the GPU side: tests/test_engine_gpu.py)."""
    monkeypatch.setattr(_common._PDL, "value", None)
    for env, on in ((None, True), ("1", True), ("0", False), ("", False)):
        if env is None:
            monkeypatch.delenv("FASTDECODE_PDL", raising=False)
        else:
            monkeypatch.setenv("FASTDECODE_PDL", env)
        assert _common.pdl_switch() is on
        _common.set_pdl(not on)
        assert _common.pdl_switch() is (not on)
        _common.set_pdl(None)
        assert _common.pdl_switch() is on
    _common.set_pdl(True)
    assert not _common.pdl_enabled(torch.empty(1))  # a CPU tensor
    _common.set_pdl(None)


def test_pdl_override_restores_the_setting(monkeypatch):
    monkeypatch.setattr(_common._PDL, "value", True)
    with _common.pdl_override(False):
        assert not _common.pdl_switch()
    assert _common._PDL.value is True
    with pytest.raises(RuntimeError):
        with _common.pdl_override(False):
            raise RuntimeError("inside")
    assert _common._PDL.value is True


def test_log_once_inside_a_fullgraph_compile(monkeypatch, caplog):
    """The auto backend's one-line fallback log (log_once) must not break torch.compile(fullgraph=True): Dynamo
    cannot enter its lock, so it stays silent while tracing and logs on the next eager call."""
    monkeypatch.setattr(_common, "_logged_once", set())

    def f(x):
        _common.log_once("fastdecode: a fallback, once")
        return x + 1

    y = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(y, torch.full((2,), 2.0))
    with caplog.at_level(logging.INFO, logger="fastdecode"):
        f(torch.ones(2))
        f(torch.ones(2))
    assert [r.getMessage() for r in caplog.records].count("fastdecode: a fallback, once") == 1


def test_ops_are_registered_custom_ops():
    for name in ("rms_norm", "silu_and_mul", "quantize_fp8"):
        assert hasattr(torch.ops.fastdecode, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    """fullgraph=True: the ops trace as single custom-op calls, no graph break (aot_eager: no C++).

    CPU tensors; Triton runs on them under the interpreter only (the GPU suite compiles with
    Inductor on CUDA tensors in test_gpu_integration.py).
    """
    if backend == "triton" and not interpreter_on():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (GPU machine: see test_gpu_integration)")
    x = torch.randn(4, 96, dtype=torch.float16)
    r = torch.randn(4, 96, dtype=torch.float16)
    w = torch.randn(96, dtype=torch.float16)
    gu = torch.randn(4, 192, dtype=torch.float16)

    def f(x, r, w, gu):
        y = fd.fused_add_rms_norm(x, r, w, 1e-6, backend=backend)
        q, s = fd.rms_norm_fp8(y, w, backend=backend)
        a = fd.silu_and_mul(gu, backend=backend)
        qa, sa = fd.quantize_fp8(a, per_token=True, backend=backend)
        return y, q, s, a, qa, sa

    r_eager = r.clone()
    expected = f(x, r_eager, w, gu)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    r_comp = r.clone()
    got = compiled(x, r_comp, w, gu)
    assert torch.equal(r_comp, r_eager), "the in-place residual update was lost under compile"
    for a, b in zip(got, expected):
        assert_close(a.float(), b.float(), dtype=torch.float32)


# ----------------------------------------------------------------------------- selfcheck


SELFCHECK_LINES = (
    "rms_norm", "rms_norm_fp8 dynamic", "rms_norm_fp8 static", "fused_add_rms_norm",
    "fused_add_rms_norm_fp8 dyn", "fused_add_rms_norm_fp8 stat", "silu_and_mul", "silu_and_mul_fp8 dynamic",
    "silu_and_mul_fp8 static", "quantize_fp8 per-token", "quantize_fp8 per-tensor", "quantize_fp8 static",
    "linear", "rms_norm_linear", "add_linear_", "linear_fp8", "int4_linear",
)
# one size each in --quick: decode attention and its prologue; the all-reduce across two gloo ranks
SELFCHECK_ONCE = ("decode_attention", "rope_kv_write", "rope_decode_attention")
SELFCHECK_ALLREDUCE = ("all_reduce", "all_reduce_add_rms_norm", "all_reduce_add_rms_norm_fp8")


def test_cli_selfcheck_covers_every_kernel(capsys, monkeypatch):
    from fastdecode import cli

    monkeypatch.delenv("FASTDECODE_BACKEND", raising=False)
    assert cli.main(["selfcheck", "--quick"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("  ") and not line.startswith("  skip")]
    assert all(line.startswith("  ok  ") for line in lines), lines
    names = [line[8:36].strip() for line in lines]  # "  ok    " then a 28-character name column
    # the all-reduce: two gloo ranks on a CPU; every path (one-shot, two-shot, NCCL) on 2+ GPUs; none on one GPU
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    paths = ["gloo"] if n_gpu == 0 else (["one_shot", "two_shot", "nccl"] if n_gpu >= 2 else [])
    if n_gpu == 1:
        assert "  skip  all-reduce: needs two or more GPUs" in text
    # every check: the row kernels and GEMMs at each of two sizes, attention once, the all-reduce at two sizes
    assert sorted(names) == sorted(SELFCHECK_LINES * 2 + SELFCHECK_ONCE + SELFCHECK_ALLREDUCE * 2 * len(paths)), names
    world = 2 if n_gpu == 0 else n_gpu
    fused_ar = 2 * 2 * len(paths) if world == 2 else 0  # the fused all-reduces' residuals are exact at 2 ranks
    assert sum("residual exact" in line for line in lines) == 6 + fused_ar  # + 3 fused norms x 2 sizes
    for p in paths:
        assert sum(f"{p:<8} world={world}" in line for line in lines) == 6, p
    assert "caches exact" in text
    assert "all kernels match their references" in text
    import os

    assert "FASTDECODE_BACKEND" not in os.environ, "selfcheck leaked its backend choice"


def test_selfcheck_reports_a_wrong_kernel(capsys, monkeypatch):
    from fastdecode import selfcheck

    monkeypatch.setattr(fd, "silu_and_mul", lambda x: fd.silu_and_mul_ref(x) * 1.1)
    # the all-reduce checks (rank processes: ~10 s on 2 GPUs) have their own test above
    monkeypatch.setattr(selfcheck, "_allreduce_checks", lambda dev, quick: iter(()))
    assert selfcheck.main(["--quick"]) == 1
    text = capsys.readouterr().out
    assert [line.split()[1] for line in text.splitlines() if line.startswith("  FAIL")] == ["silu_and_mul"] * 2
    assert "2 checks FAILED" in text


def test_selfcheck_explains_lost_carries_in_plain_words(monkeypatch):
    """Under the interpreter a value one power of two low (its FP8 cast's lost carry) is accepted, and the line
    says what happened, not a bare "(+N interpreter lost carries)"."""
    from fastdecode import selfcheck
    from fastdecode.ops import _common

    monkeypatch.setattr(_common, "interpreter_on", lambda: True)
    q_ref = torch.tensor([128.0, 1.0, -2.0]).to(torch.float8_e4m3fn)
    q = torch.tensor([64.0, 1.0, -2.0]).to(torch.float8_e4m3fn)  # 2 x 64 = 128: the carry the cast dropped
    s = torch.ones(1)
    ok, detail = selfcheck._fp8_close(q, q_ref, s, s)
    assert ok and detail.startswith("0 of 3 values off by > 1 e4m3 step (1 more are half the reference: ")
    assert "drops the carry when a value rounds up to the next power of two; accepted" in detail
    monkeypatch.setattr(_common, "interpreter_on", lambda: False)  # compiled kernels: the same value fails
    assert selfcheck._fp8_close(q, q_ref, s, s) == (False, "1 of 3 values off by > 1 e4m3 step, scale rel err 0.0e+00")


# ----------------------------------------------------------------------------- kernel benchmarks


def test_cli_bench_kernels_alias_and_merge_flag(monkeypatch, tmp_path):
    from fastdecode import cli
    from fastdecode.bench import norm_activation_quant as nav

    calls = []
    monkeypatch.setattr(nav, "run", lambda which, out, quick=False, merge=True: calls.append((which, out, merge)))
    # the plumbing, on any machine (the guard: test_cli_errors)
    monkeypatch.setattr(cli.bench, "no_gpu", lambda *a, **k: 0)
    out = str(tmp_path / "r.json")
    assert cli.main(["bench", "all", "--out", out]) == 0  # the old name of `kernels`
    assert cli.main(["bench", "kernels", "--out", out, "--replace"]) == 0
    assert cli.main(["bench", "norm"]) == 0
    assert cli.main(["bench", "argmax", "--out", out]) == 0
    every = ["norm", "silu", "quant", "argmax"]
    assert calls == [(every, out, True), (every, out, False),
                     (["norm"], "benchmarks/results/norm_activation_quant.json", True), (["argmax"], out, True)]


def test_merge_rows_replaces_same_op_impl_shape(tmp_path):
    import json

    from fastdecode.bench.harness import merge_rows, write_rows

    path = tmp_path / "r.json"
    a = {"op": "add_rms_norm", "impl": "fastdecode", "shape": {"M": 1, "H": 8}, "median_us": 1.0}
    b = {"op": "silu_and_mul", "impl": "fastdecode", "shape": {"M": 1, "I": 8}, "median_us": 2.0}
    write_rows([a, b], path)
    a2 = {**a, "shape": {"H": 8, "M": 1}, "median_us": 0.5}  # same shape, other key order
    c = {**a, "shape": {"M": 2, "H": 8}}
    merge_rows([a2, c], path)
    assert json.loads(path.read_text()) == [a2, b, c]
    # one run timing the same row three times (an order check): all three kept, in place of the old row
    a3 = [{**a2, "median_us": v} for v in (0.4, 0.6, 0.61)]
    merge_rows(a3, path)
    assert json.loads(path.read_text()) == [*a3, b, c]
    merge_rows([a2], path)  # a later run of it once: the three give way to its row
    assert json.loads(path.read_text()) == [a2, b, c]
    merge_rows([b], tmp_path / "new.json")  # no file yet: just the rows
    assert json.loads((tmp_path / "new.json").read_text()) == [b]
    path.write_text('{"not": "rows"}')
    with pytest.raises(ValueError, match="not a list of result rows"):
        merge_rows([a], path)


def test_bench_suites_rows_and_fp8_baselines_on_cpu():
    """Every suite's rows, built on the CPU with a fake timer and no compilation: every FP8 variant has
    our kernel, PyTorch eager and torch.compile; every row (an error row too) has the required fields."""
    from fastdecode.bench import norm_activation_quant as nav
    from fastdecode.bench.harness import ROW_FIELDS, Timing

    n = {"timed": 0}

    def timer(calls):
        n["timed"] += 1
        if n["timed"] == 2:  # the second row fails, as a baseline that does not compile would
            raise RuntimeError("capture failed")
        calls[0]()
        return Timing(2.0, 1.0, 3.0, 1)

    runner = nav.Runner(device="cpu", timer=timer, compile=lambda f: f)
    rows = []
    nav.bench_add_rms_norm(rows, Hs=(64,), Ms=(2,), dtype=torch.float16, runner=runner)
    nav.bench_silu_and_mul(rows, Is=(32,), Ms=(2,), dtype=torch.float16, runner=runner)
    nav.bench_quantize_fp8(rows, Hs=(64,), Ms=(2,), dtype=torch.float16, runner=runner)
    nav.bench_argmax(rows, Vs=(3000,), Ms=(2,), runner=runner)
    for r in rows:
        assert set(ROW_FIELDS) <= set(r), r
    err = rows[1]
    assert err["impl"] == "torch_eager" and err["error"] == "RuntimeError: capture failed"
    assert err["median_us"] is None and err["tbps"] is None and err["bytes"] > 0
    ok = [r for r in rows if "error" not in r]
    assert len(ok) == len(rows) - 1
    assert all(r["median_us"] == 2.0 and r["tbps"] == round(r["bytes"] / 2e-6 / 1e12, 3) for r in ok)
    impls = {}
    for r in rows:
        impls.setdefault(r["op"], set()).add(r["impl"])
    variants = {"add_rms_norm_fp8": ("dynamic", "static"), "silu_and_mul_fp8": ("dynamic", "static"),
                "quantize_fp8": ("per_token", "per_tensor", "static")}
    for op, modes in variants.items():
        assert impls[op] == {f"{who}_{m}" for m in modes for who in ("fastdecode", "torch_eager", "torch_compile")}
    for op in ("add_rms_norm", "silu_and_mul", "argmax"):
        assert impls[op] == {"fastdecode", "torch_eager", "torch_compile"}


def test_fp8_baselines_compute_what_the_kernels_compute():
    """The eager / compiled baselines do the same work as our kernels: checked against the references."""
    from fastdecode.bench import norm_activation_quant as nav
    from helpers import assert_fp8_close

    x, r, w = torch.randn(5, 96), torch.randn(5, 96), 1 + 0.1 * torch.randn(96)
    gu = 3 * torch.randn(5, 192)
    s = torch.tensor([0.01])
    for scale in (None, s):
        r1 = r.clone()
        q, qs = nav.add_rms_fp8_manual(x, r1, w, scale)
        q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w, scale=scale)
        assert torch.equal(r1, r_ref)
        assert_fp8_close(q, q_ref, qs, s_ref)
        q, qs = nav.silu_mul_fp8(gu, scale)
        assert_fp8_close(q, *fd.silu_and_mul_fp8_ref(gu, scale)[:1], qs, fd.silu_and_mul_fp8_ref(gu, scale)[1])
    for base, kw in ((nav.quant_per_token, {"per_token": True}), (nav.quant_per_tensor, {}),
                     (lambda t: nav.quant_static(t, s), {"scale": s})):
        q, qs = base(x)
        q_ref, s_ref = fd.quantize_fp8_ref(x, **kw)
        assert_fp8_close(q, q_ref, qs.reshape(s_ref.shape), s_ref)


def test_config_dir_override_reads_your_table_and_falls_back_per_family(monkeypatch, tmp_path):
    """FASTDECODE_CONFIG_DIR: a table there replaces the package's for its family only."""
    from fastdecode.bench.harness import env_info

    mine = tmp_path / "linear_nvidia_h200.json"
    mine.write_text("{}")
    monkeypatch.setenv("FASTDECODE_CONFIG_DIR", str(tmp_path))
    assert _common.config_path("linear", "NVIDIA H200") == mine
    assert _common.config_path("int4_linear", "NVIDIA H200") == _common.CONFIG_DIR / "int4_linear_nvidia_h200.json"
    env_info.cache_clear()
    try:
        assert env_info()["config_dir"] == str(tmp_path)  # rows say the tables came from elsewhere
    finally:
        env_info.cache_clear()
    monkeypatch.delenv("FASTDECODE_CONFIG_DIR")
    assert _common.config_path("linear", "NVIDIA H200") == _common.CONFIG_DIR / "linear_nvidia_h200.json"


def test_the_order_effect_diagnosis_on_cpu(tmp_path):
    """``benchmarks/diag_order_effect.py`` (session 47), a CPU smoke run of torch-eager on the tiny preset. Runners:
    A, then B captured beside it, timed in turn (A B A B ...), then C after both are gone. Probes: A alone twice, then
    A after each probe; the probes that need CUDA (the graph captures, ``empty_cache``) are rows marked skipped."""
    import json
    from pathlib import Path

    from helpers import load_script

    diag = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "diag_order_effect.py",
                       "diag_order_effect")
    common = ["--preset", "tiny", "--quant", "none", "--impl", "torch-eager", "--device", "cpu", "--iters", "2",
              "--output-len", "3"]
    out = tmp_path / "runners.json"
    assert diag.main(common + ["--mode", "runners", "--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["runner"], r["turn"]) for r in rows] == [("A", 1), ("B", 2), ("A", 3), ("B", 4), ("A", 5), ("C", 6),
                                                        ("C", 7)]
    assert all(r["median_us"] > 0 and r["min_us"] <= r["median_us"] <= r["max_us"] for r in rows)
    out = tmp_path / "probes.json"
    assert diag.main(common + ["--mode", "probes", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    timed = [r["after"] for r in rows if "median_us" in r]
    assert timed == ["", "nothing", "eager decode x3", "eager decode x3, side stream"]
    assert [r["after"] for r in rows if r.get("skipped") == "needs CUDA" and "after" in r] == list(diag.GPU_PROBES)
    assert [r["runner"] for r in rows if r.get("skipped") and "after" not in r] == ["N (no PDL)"]
