"""benchmarks/gpu.py, the one script for GPU runs: its report parsing and what it may write."""

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu():
    return load_script(ROOT / "benchmarks" / "gpu.py", "gpu_script")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_ok2" time="0.1"/>
<testcase classname="tests.test_b" name="test_bad[2]" time="0.2">\
<failure message="AssertionError: scale off by 3.29&#10;more">tb</failure></testcase>
<testcase classname="tests.test_c" name="test_boom" time="0.0"><error message="fixture failed">tb</error></testcase>
<testcase classname="tests.test_d" name="test_gpu" time="0.0">\
<skipped type="pytest.skip" message="needs a CUDA GPU">x</skipped></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_names_and_reasons(gpu, tmp_path):
    p = tmp_path / "j.xml"
    p.write_text(JUNIT)
    r = gpu.parse_junit(p)
    assert (r["passed"], r["failed"], r["errors"], r["skipped"]) == (2, 1, 1, 1)
    assert r["failures"][0] == {"test": "tests.test_b::test_bad[2]", "kind": "failure",
                                "message": "AssertionError: scale off by 3.29"}
    assert r["failures"][1]["kind"] == "error"
    assert r["skip_reasons"] == {"needs a CUDA GPU": 1}


@pytest.mark.parametrize("n_gpu", [1, 2])
def test_every_suite_writes_only_into_the_out_dir(gpu, tmp_path, n_gpu):
    """No step copies into src/ or writes a tuned table there: every path argument is under --out-dir."""
    for name in gpu.SUITES:
        if name == "tests":
            continue
        steps = gpu.suite_commands(name, tmp_path, n_gpu)
        if name == "tp" and n_gpu < 2:
            assert steps == []
            continue
        assert steps, name
        for label, argv, timeout in steps:
            assert "--write-config" not in argv and "cp" not in argv[:1], label
            for i, arg in enumerate(argv):
                if arg == "--out":
                    assert tmp_path in Path(argv[i + 1]).parents, (label, argv[i + 1])
            assert 0 < timeout <= 600, label


def test_hf_and_serve_suites(gpu, tmp_path):
    """``hf`` runs ``bench hf`` on 8B shapes; ``serve`` runs the embedded model and 8B random weights, one plot."""
    [(label, argv, _)] = gpu.suite_commands("hf", tmp_path, 1)
    assert argv[argv.index("bench") + 1] == "hf" and argv[argv.index("--preset") + 1] == "llama-3.1-8b", label
    steps = gpu.suite_commands("serve", tmp_path, 1)
    assert [s[0] for s in steps] == ["bench serve embedded", "bench serve 8b"]
    assert "--model" not in steps[0][1] and steps[1][1][steps[1][1].index("--model") + 1] == "llama-3.1-8b"
    for _, argv, _ in steps:
        assert argv[argv.index("--plot") + 1] == str(tmp_path / "serve.png")


def test_tests_suite_record(gpu, tmp_path, monkeypatch):
    """The tests suite runs one pytest process and records counts, failures, env and sha."""
    seen = {}

    def fake_run(self, label, argv, timeout, env):
        seen["argv"] = argv
        Path(argv[argv.index("--junitxml") + 1]).write_text(JUNIT)
        return 1, 12.3, "....\n1 failed, 2 passed, 1 skipped, 1 error in 12.30s\n"

    monkeypatch.setattr(gpu.Log, "run", fake_run)
    log = gpu.Log(tmp_path / "gpu_log.txt")
    rec = gpu.run_tests(log, tmp_path, {}, "abc123", 60)
    assert seen["argv"][1:3] == ["-m", "pytest"] and "-m" not in seen["argv"][3:]  # whole suite, no marker filter
    saved = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert saved == rec
    assert rec["summary"] == "1 failed, 2 passed, 1 skipped, 1 error in 12.30s"
    assert (rec["passed"], rec["failed"], rec["errors"], rec["git_sha"]) == (2, 1, 1, "abc123")
    for key in ("gpu", "world_size", "torch", "triton", "failures", "skip_reasons", "exit_code"):
        assert key in rec


def test_decode_formats_and_tune_sections_are_chosen(gpu, tmp_path):
    steps = gpu.suite_commands("decode", tmp_path, 2, formats=("fp8",))
    assert [label for label, _, _ in steps] == ["decode fp8"] and "peer-compile" in steps[0][1]
    assert "fastdecode-graph-no-pdl" in steps[0][1]  # the PDL ablation beside every fastdecode-graph row
    assert "fastdecode-graph-no-fused_rope" in steps[0][1]  # and RoPE + KV write in its own kernel
    [(label, argv, _)] = gpu.suite_commands("tune", tmp_path, 1, tune_dtypes=("fp8",))
    assert argv[argv.index("--dtypes") + 1:argv.index("--out")] == ["fp8"]
    assert Path(argv[argv.index("--out") + 1]) == tmp_path / "configs" / "linear_nvidia_h200.json"


def test_tune_int4_merges_into_a_copy_of_the_package_table(gpu, tmp_path):
    [(label, argv, _)] = gpu.suite_commands("tune-int4", tmp_path, 1, tune_int4_ms=[1, 2, 4, 8])
    assert argv[1:4] == ["-m", "fastdecode.bench.int4", "tune"] and "--merge" in argv
    assert argv[argv.index("--ms") + 1] == "1,2,4,8"
    assert Path(argv[argv.index("--out") + 1]) == tmp_path / "configs" / "int4_linear_nvidia_h200.json"
    assert "--ms" not in gpu.suite_commands("tune-int4", tmp_path, 1)[0][1]  # default: every M
    assert "--no-fp8" not in argv  # default: W4A8 too
    assert "--no-fp8" in gpu.suite_commands("tune-int4", tmp_path, 1, tune_int4_fp8=False)[0][1]
    assert "--small-m-dot" not in argv
    assert "--small-m-dot" in gpu.suite_commands("tune-int4", tmp_path, 1, tune_int4_small_m_dot=True)[0][1]


def test_tune_shapes_and_groups_reach_both_tuners(gpu, tmp_path, monkeypatch):
    """``--tune-shapes`` goes to both tuners, ``--tune-int4-groups`` to the int4 one, which parses them."""
    shapes = "960x576,49152x576"
    [(_, lin, _)] = gpu.suite_commands("tune", tmp_path, 1, tune_shapes=shapes)
    [(_, i4, _)] = gpu.suite_commands("tune-int4", tmp_path, 1, tune_shapes=shapes, tune_int4_groups="32")
    assert lin[lin.index("--shapes") + 1] == shapes and i4[i4.index("--shapes") + 1] == shapes
    assert i4[i4.index("--groups") + 1] == "32" and "--shapes" not in gpu.suite_commands("tune", tmp_path, 1)[0][1]
    from fastdecode.bench import int4 as bi

    seen = {}
    monkeypatch.setattr(bi, "tune", lambda out, **kw: seen.update(kw, out=out))
    assert bi.main(i4[i4.index("tune"):]) == 0
    assert seen["shapes"] == {"960x576": (960, 576), "49152x576": (49152, 576)} and seen["groups"] == (32,)
    assert seen["merge"] is True and seen["out"] == str(tmp_path / "configs" / "int4_linear_nvidia_h200.json")
    assert seen["kinds"] == ("fma", "mma", "dot")  # default: every kind
    [(_, i4k, _)] = gpu.suite_commands("tune-int4", tmp_path, 1, tune_int4_kinds="mma")
    assert bi.main(i4k[i4k.index("tune"):]) == 0 and seen["kinds"] == ("mma",)


def test_decode_with_a_quantised_head(gpu, tmp_path):
    """The -head formats: the same decode with ``--quant-head`` of the format, the peer beside it (its head in the
    same format; int4 with and without the opt-in int8 activations, FP8 with and without W8A16)."""
    [(label, argv, _)] = gpu.suite_commands("decode", tmp_path, 1, formats=("int4-head",))
    assert label == "decode int4 head"
    assert argv[argv.index("--quant") + 1] == "int4" and argv[argv.index("--quant-head") + 1] == "int4"
    assert argv[argv.index("--impl") + 1:] == ["peer-compile", "fastdecode-graph", "fastdecode-graph-with-int4_a8"]
    [(label, argv, _)] = gpu.suite_commands("decode", tmp_path, 1, formats=("fp8-head",))
    assert label == "decode fp8 head" and argv[argv.index("--quant-head") + 1] == "fp8"
    assert argv[argv.index("--impl") + 1:] == ["peer-compile", "fastdecode-graph", "fastdecode-graph-no-fp8_a16"]
    [(_, argv, _)] = gpu.suite_commands("decode", tmp_path, 1, formats=("int4",))
    assert "fastdecode-graph-with-int4_a8" in argv and "peer-compile" in argv
    [(_, argv, _)] = gpu.suite_commands("decode", tmp_path, 1, formats=("int4",),
                                        decode_impls=("peer-compile", "fastdecode-graph-with-int4_a8"))
    assert argv[argv.index("--impl") + 1:] == ["peer-compile", "fastdecode-graph-with-int4_a8"]
    (label, argv, _), (label2, argv2, _), (label3, argv3, _) = gpu.suite_commands("int4-a8", tmp_path, 1)
    assert label3 == "decode int4 head a8 tuned" and argv3[argv3.index("--quant-head") + 1] == "int4"
    assert label == "sweep int4 a8" and argv[1].endswith("sweep_int4_a8.py")
    # the sweep's best configs into a copy of the int4 table, then the 8B int4 step reading that table
    table = argv[argv.index("--table") + 1]
    assert table == str(tmp_path / "configs" / "int4_linear_nvidia_h200.json")
    assert label2 == "decode int4 a8 tuned" and argv2[:2] == ["env", f"FASTDECODE_CONFIG_DIR={tmp_path / 'configs'}"]
    assert argv2[argv2.index("--impl") + 1:] == ["fastdecode-graph", "fastdecode-graph-with-int4_a8"]


def test_w8a16_suite_sweeps_into_a_table_copy_then_times_the_fp8_step_on_it(gpu, tmp_path):
    (label, argv, _), (label2, argv2, _) = gpu.suite_commands("w8a16", tmp_path, 1)
    assert label == "sweep w8a16" and argv[1].endswith("sweep_w8a16.py")
    assert argv[argv.index("--table") + 1] == str(tmp_path / "configs" / "linear_nvidia_h200.json")
    assert set(argv[argv.index("--shapes") + 1].split(",")) == {"8b_o", "8b_down", "8b_qkv", "8b_gate_up"}
    assert argv2[:2] == ["env", f"FASTDECODE_CONFIG_DIR={tmp_path / 'configs'}"]
    assert argv2[argv2.index("--impl") + 1:] == ["fastdecode-graph", "fastdecode-graph-no-norm_gemm",
                                                  "fastdecode-graph-no-fp8_a16", "fastdecode-graph-with-fp8_a16_all"]
    [(label, argv, _)] = gpu.suite_commands("int8-producers", tmp_path, 1)
    assert argv[1].endswith("diag_int8_producers.py")
    import runpy  # the sweep's shape names exist

    shapes = runpy.run_path(argv[1].replace("diag_int8_producers", "sweep_w8a16"))["SHAPES"]
    assert {"8b_o", "8b_down", "8b_qkv", "8b_gate_up"} <= set(shapes)


def test_l2_prefetch_suite_runs_its_diagnosis_on_the_archived_w8a16_table(gpu, tmp_path):
    [(label, argv, timeout)] = gpu.suite_commands("l2-prefetch", tmp_path, 1)
    assert label == "diag l2 prefetch" and argv[1].endswith("diag_l2_prefetch.py") and timeout < 600
    assert argv[argv.index("--out") + 1] == str(tmp_path / "diag_l2_prefetch.json")
    table = argv[argv.index("--w8a16-table") + 1]
    import json
    from pathlib import Path

    assert "w8a16" in json.loads(Path(table).read_text())  # the archived table has the section it is run for
    import runpy

    diag = runpy.run_path(argv[1])
    assert diag["_impl"]("int4_a8", "8") == "fastdecode-graph-with-int4_a8+l2_prefetch"
    assert diag["_impl"]("fp8", "off") == "fastdecode-graph"
    assert diag["_impl"]("fp8", "all", "64") == "fastdecode-graph-with-l2_prefetch+weight_prefetch"
    assert argv[argv.index("--slab-kb") + 1:argv.index("--w8a16-table")] == ["64", "all"]
    from fastdecode.bench.decode import check_impl

    for f in ("fp8", "int4", "int4_a8"):  # rows bench decode knows
        for lim in ("off", "all"):
            for kb in (None, "64"):
                check_impl(diag["_impl"](f, lim, kb))
    assert set(argv[argv.index("--formats") + 1:argv.index("--limits")]) <= set(diag["QUANT"])


def test_profile_switches_profiles_each_opt_in_switch_beside_the_default_step(gpu, tmp_path):
    steps = gpu.suite_commands("profile-switches", tmp_path, 1, formats=("fp8", "int4"))
    assert [label for label, _, _ in steps] == [
        "profile fp8 no-norm_gemm no-fp8_a16 with-fp8_a16_all with-l2_prefetch",
        "profile int4 with-int4_a8 with-l2_prefetch"]
    for (_, argv, _), q, switches in zip(steps, ("fp8", "int4"), (("no-norm_gemm", "no-fp8_a16", "with-fp8_a16_all",
                                                                   "with-l2_prefetch"),
                                                                  ("with-int4_a8", "with-l2_prefetch"))):
        assert argv[:2] == ["env", "FASTDECODE_PDL=0"] and "--profile" in argv
        assert argv[argv.index("--quant") + 1] == q
        assert argv[argv.index("--impl") + 1:argv.index("--out")] == ["fastdecode-graph"] + [
            f"fastdecode-graph-{k}" for k in switches]
    assert gpu.suite_commands("profile-switches", tmp_path, 1, formats=("bf16",)) == []


def test_a8_sweep_times_a_config_and_names_its_prefetch(monkeypatch):
    """``sweep_int4_a8._time_config``: a correct config's row (named with ``pf2`` under PREFETCH 2) is returned for
    the ranking; a config off the reference or one that fails to run gets its row but is not ranked."""
    import sys
    from types import SimpleNamespace

    saved = list(sys.path)
    S = load_script(ROOT / "benchmarks" / "sweep_int4_a8.py", "sweep_int4_a8")
    sys.path[:] = saved
    us = {1: 5.0, 2: 4.5}
    monkeypatch.setattr(S, "time_cuda", lambda calls, graph: SimpleNamespace(
        median_us=us[calls["PREFETCH"]], p10_us=1.0, p90_us=1.0, samples=30))

    class A8:
        def check(self, c):
            if c.get("BLOCK_N") == 0:
                raise RuntimeError("out of resources")
            return "max err 1.0" if c["SPLIT_K"] == 3 else None

        def gemv_calls(self, c):
            return c

    shape = {"name": "8b.o", "M": 1, "N": 4096, "K": 4096, "group": 128}
    rows = []
    cfg = {"BLOCK_M": 1, "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4}
    (r1,) = S._time_config(A8(), dict(cfg, PREFETCH=1), shape, 1000, rows)
    (r2,) = S._time_config(A8(), dict(cfg, PREFETCH=2), shape, 1000, rows)
    assert (r1["impl"], r2["impl"]) == ("a8 gemv bn64 w4 sk2", "a8 gemv bn64 w4 sk2 pf2")
    assert r2["median_us"] == 4.5 and r2["config"]["PREFETCH"] == 2
    assert S._time_config(A8(), dict(cfg, SPLIT_K=3, PREFETCH=1), shape, 1000, rows) == []
    assert S._time_config(A8(), dict(cfg, BLOCK_N=0, PREFETCH=1), shape, 1000, rows) == []
    assert len(rows) == 4 and "error" in rows[2] and "error" in rows[3]


def test_a8_sweep_table_section_is_what_the_dispatcher_reads(tmp_path, monkeypatch):
    """``sweep_int4_a8.py --table``: each (shape, M)'s best config into the int4 table's ``int4_linear_a8`` section,
    the rest of the table kept; ``ops.int4_a8.get_a8_config`` then returns it on that GPU, and the heuristic above
    the largest tuned M and for shapes the table lacks."""
    import json
    import sys

    from fastdecode.ops import _tuned
    from fastdecode.ops import int4_a8 as A

    saved = list(sys.path)
    S = load_script(ROOT / "benchmarks" / "sweep_int4_a8.py", "sweep_int4_a8")
    sys.path[:] = saved  # the script puts src / and benchmarks / first

    path = tmp_path / "int4_linear_nvidia_h200.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "int4_linear": {"1,2,128": {}}}))
    best = {"BLOCK_M": 1, "BLOCK_N": 128, "SPLIT_K": 8, "num_warps": 8}
    rows = [{"op": "int4_a8_summary", "shape": {"name": "8b.o", "M": 1, "N": 4096, "K": 4096, "group": 128},
             "best_config": best, "a8_gemv_best_us": 5.1},
            {"op": "int4_a8", "shape": {"name": "8b.o", "M": 1, "N": 4096, "K": 4096, "group": 128}}]
    table = S.write_table(path, rows)
    assert json.loads(path.read_text()) == table and table["int4_linear"] == {"1,2,128": {}}
    assert table["int4_linear_a8"] == {"4096,4096,128": {"1": {"impl": "triton", "config": best, "us": 5.1}}}
    monkeypatch.setenv("FASTDECODE_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(_tuned, "device_info", lambda device: ("NVIDIA H200", 132))
    monkeypatch.setattr(A, "device_info", lambda device: ("NVIDIA H200", 132))
    _tuned.clear_config_cache()
    try:
        assert A.get_a8_config(1, 4096, 4096) == best
        # above the largest tuned M, and shapes the table lacks: the heuristic (ops._tuned's rule)
        assert A.get_a8_config(2, 4096, 4096) == A.heuristic_config(2, 4096, 4096, 132)
        assert A.get_a8_config(1, 6144, 4096) == A.heuristic_config(1, 6144, 4096, 132)
    finally:
        _tuned.clear_config_cache()


def test_decode_small_runs_the_embedded_model_and_its_bf16_shapes(gpu, tmp_path):
    steps = gpu.suite_commands("decode-small", tmp_path, 1)
    assert [label for label, _, _ in steps] == ["decode embedded", "decode smollm2 bf16", "decode embedded dequantized"]
    assert steps[0][1][steps[0][1].index("--model") + 1].endswith(".gguf")
    assert "fastdecode-graph-no-int4_glu" in steps[0][1]  # the switch's ablation (on by default, session 31)
    assert steps[1][1][steps[1][1].index("--preset") + 1] == "smollm2-135m" and "peer-compile" in steps[1][1]
    assert "--dequantize" in steps[2][1] and "--dequantize" not in steps[0][1]


def test_small_dense_alternates_int4_and_dequantized_one_row_a_process(gpu, tmp_path):
    """``small-dense``: the embedded step as int4 and dequantised, each with and without ``attn_wo``, alternating,
    one process a row (each the first PDL graph of its process: ``engine.cuda_graph.pdl_graphs_captured``), then a
    warm start-up of the two formats."""
    steps = gpu.suite_commands("small-dense", tmp_path, 1)
    ways = ["int4", "dequantized", "int4 attn_wo", "dequantized attn_wo"]
    assert [label for label, _, _ in steps] == ([f"decode embedded {w} {i}" for i in (1, 2) for w in ways]
                                                + ["startup int4", "startup dequantized"])
    for label, argv, _ in steps:
        assert ("--dequantize" in argv) == label.startswith(("decode embedded dequantized", "startup dequantized"))
        assert argv[argv.index("--model") + 1].endswith(".gguf") if "decode" in argv else "startup" in argv
        if "decode" in argv:
            impl = argv[argv.index("--impl") + 1]
            assert impl == ("fastdecode-graph-with-attn_wo" if "attn_wo" in label else "fastdecode-graph")


def test_profile_small_profiles_the_bf16_shapes_and_the_embedded_gguf(gpu, tmp_path):
    steps = gpu.suite_commands("profile-small", tmp_path, 1)
    assert [label for label, _, _ in steps] == ["profile smollm2", "profile embedded"]
    assert steps[0][1][steps[0][1].index("--preset") + 1] == "smollm2-135m"
    assert steps[1][1][steps[1][1].index("--model") + 1].endswith(".gguf")
    outs = [argv[argv.index("--out") + 1] for _, argv, _ in steps]
    assert all("--profile" in argv for _, argv, _ in steps) and len(set(outs)) == 2  # one file each


def test_int4_tune_merge_keeps_the_entries_it_does_not_tune(tmp_path):
    """The tuners' table start (``bench.harness.start_table``; the int4 and GEMM tuners both use it)."""
    import functools

    from fastdecode.bench.harness import start_table

    start_table = functools.partial(start_table, sections=("int4_linear", "int4_linear_fp8"))
    path = tmp_path / "t.json"
    old = {"gpu": "NVIDIA H200", "env": {"git_sha": "old"}, "int4_linear": {"4096,4096,128": {"16": {"impl": "x"}}},
           "int4_linear_fp8": {}}
    path.write_text(json.dumps(old))
    t = start_table(path, "NVIDIA H200", 132, merge=True)
    assert t["int4_linear"] == old["int4_linear"] and t["merged_into"] == {"git_sha": "old"}
    assert start_table(path, "NVIDIA H200", 132, merge=False)["int4_linear"] == {}
    with pytest.raises(ValueError, match="tuned on 'NVIDIA H200', not on this 'NVIDIA A100'"):
        start_table(path, "NVIDIA A100", 108, merge=True)
    # an H100 reads the H200's tables without its own (ops._common.table_path): a copy of them is a start, named
    h100 = start_table(path, "NVIDIA H100 80GB HBM3", 132, merge=True)
    assert h100["int4_linear"] == old["int4_linear"] and h100["based_on"] == "NVIDIA H200"
    assert h100["gpu"] == "NVIDIA H100 80GB HBM3" and "based_on" not in t
    # a new file starts from ``base`` (the table in use, ops._common.table_path) when merging, and empty when not
    new = tmp_path / "new.json"
    fresh = start_table(new, "NVIDIA H100 80GB HBM3", 132, merge=True, base=path)
    assert fresh["int4_linear"] == old["int4_linear"] and fresh["based_on"] == "NVIDIA H200"
    assert start_table(new, "NVIDIA H100 80GB HBM3", 132, merge=False, base=path)["int4_linear"] == {}
    assert start_table(new, "NVIDIA H200", 132, merge=True, base=tmp_path / "none.json")["int4_linear"] == {}


def test_wheels_installs_only_the_serve_packages_that_do_not_import(tmp_path):
    """``gpu.py --wheels DIR`` (session 39: the device image has no fastapi, so ``serve`` failed and the server tests
    skip): pip from DIR, no index, only what is missing; nothing when all import."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_script")
    have = {"httpx"}
    cmd = gpu.wheel_install(tmp_path, find_spec=lambda name: object() if name in have else None)
    assert cmd[1:7] == ["-m", "pip", "install", "-q", "--no-index", "--find-links"]
    assert cmd[7] == str(tmp_path) and cmd[8:] == ["fastapi", "uvicorn", "openai"]
    assert gpu.wheel_install(tmp_path, find_spec=lambda name: object()) is None


def test_a_sweeps_table_copy_names_the_gpu_it_was_written_on(tmp_path):
    """``bench.harness.write_table_section`` (the sweeps' ``--table``, the fused tuner): a copy of a sibling's table
    becomes this GPU's as ``start_table``'s does (``gpu`` this one, ``based_on`` the other). Session 39 found the
    H100's int4 table, written by ``sweep_int4_packed.py --table`` from the H200's, still named the H200 at its top."""
    from fastdecode.bench.harness import write_table_section

    base = tmp_path / "h200.json"
    base.write_text(json.dumps({"gpu": "NVIDIA H200", "int4_linear": {"4096,4096,128": {"16": {"impl": "x"}}}}))
    path = tmp_path / "configs" / "int4_linear_nvidia_h100_80gb_hbm3.json"
    entry = {"1": {"impl": "triton", "config": {"kind": "fma"}}}
    t = write_table_section(path, "int4_linear", {"4096,4096,128": entry}, base, gpu_name="NVIDIA H100 80GB HBM3")
    assert t["gpu"] == "NVIDIA H100 80GB HBM3" and t["based_on"] == "NVIDIA H200"
    assert t["int4_linear"]["4096,4096,128"] == {"16": {"impl": "x"}, **entry} and json.loads(path.read_text()) == t
    again = write_table_section(path, "int4_linear", {}, base, gpu_name="NVIDIA H100 80GB HBM3")  # its own now
    assert again["gpu"] == "NVIDIA H100 80GB HBM3" and again["based_on"] == "NVIDIA H200"
    with pytest.raises(ValueError, match="not on this 'NVIDIA A100'"):
        write_table_section(tmp_path / "a100.json", "int4_linear", {}, base, gpu_name="NVIDIA A100")
    assert "based_on" not in write_table_section(tmp_path / "h200_copy.json", "int4_linear", {}, base,
                                                 gpu_name="NVIDIA H200")


def test_cli_tune_int4_merges_into_the_table(monkeypatch):
    """``fastdecode tune int4`` updates the table, as ``tune linear`` does: the shapes and sections it does not tune
    (SmolLM2's entries, the fused ops' sections) stay."""
    from fastdecode import cli
    from fastdecode.bench import int4 as bi
    from fastdecode.cli import bench as cb

    seen = {}
    monkeypatch.setattr(cb, "no_gpu", lambda what: 0)
    monkeypatch.setattr(bi, "tune", lambda out, **kw: seen.update(kw, out=out))
    assert cli.main(["tune", "int4", "--shapes", "8b.o", "--quick"]) == 0
    assert seen["merge"] is True and seen["quick"] is True and seen["out"] is None


def test_int4_tuner_dot_tiles_below_m8_only_when_asked():
    """The 16-row dot tiles below M = 8 lost end to end on the H200 (benchmarks/NOTES.md, session 6): opt-in."""
    from fastdecode.bench.int4 import candidates

    for M in (1, 2, 4):
        assert {c["kind"] for c in candidates(M, 4096, 4096)} == {"fma", "mma"}  # mma: the swapped tiles
        dots = [c for c in candidates(M, 4096, 4096, small_m_dot=True) if c["kind"] == "dot"]
        assert dots and {c["BLOCK_M"] for c in dots} == {16} and max(c["SPLIT_K"] for c in dots) == 16
    assert {c["kind"] for c in candidates(8, 4096, 4096)} == {"fma", "mma", "dot"}


def test_a_killed_run_still_names_what_failed_and_where_it_was(gpu, tmp_path, monkeypatch):
    """The JUnit report comes only at the end: a run killed at its limit is read from pytest -v's lines."""
    text = ("tests/test_a.py::test_ok PASSED [ 10%]\ntests/test_b.py::test_bad[2] FAILED [ 20%]\n"
            "tests/test_c.py::test_ok2 PASSED [ 30%]\ntests/test_c.py::test_slow \n"
            "[gpu.py] tests: killed after 570 s\n")
    monkeypatch.setattr(gpu.Log, "run", lambda self, label, argv, timeout, env: (124, 570.0, text))
    rec = gpu.run_tests(gpu.Log(tmp_path / "gpu_log.txt"), tmp_path, {}, "abc123", 570)
    assert rec["exit_code"] == 124 and rec["finished_before_kill"] == 3
    assert [f["test"] for f in rec["failures"]] == ["<pytest>", "tests/test_b.py::test_bad[2]"]
    assert rec["running_when_killed"] == "tests/test_c.py::test_slow"


def test_per_test_times_and_failure_text(gpu, tmp_path):
    """The conftest's timing lines give the slowest tests, seconds per file and the failure text; a line
    cut by a kill is ignored."""
    p = tmp_path / "t.jsonl"
    rows = [{"test": "tests/test_a.py::test_ok", "when": w, "outcome": "passed", "s": s}
            for w, s in (("setup", 1.0), ("call", 2.5), ("teardown", 0.5))]
    rows.append({"test": "tests/test_b.py::test_bad[2]", "when": "call", "outcome": "failed", "s": 7.0,
                 "message": "E   AssertionError: scale off"})
    p.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"test": "tests/test_c.py::te')
    r = gpu.read_times(p)
    assert r["slowest"] == [["tests/test_b.py::test_bad[2]", 7.0], ["tests/test_a.py::test_ok", 4.0]]
    assert r["file_seconds"] == {"tests/test_b.py": 7.0, "tests/test_a.py": 4.0}
    assert r["failure_text"] == {"tests/test_b.py::test_bad[2]": "E   AssertionError: scale off"}
    assert gpu._junit_name("tests/test_b.py::test_bad[2]") == gpu._junit_name("tests.test_b::test_bad[2]")
    assert gpu.read_times(tmp_path / "missing.jsonl")["tests_timed"] == 0


def test_conftest_writes_timing_lines(tmp_path):
    """Run a throwaway test file under this conftest with FASTDECODE_TEST_TIMES set: a line per phase,
    the failure's text on the failed one."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_t.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n")
    times = tmp_path / "times.jsonl"
    env = dict(os.environ, FASTDECODE_TEST_TIMES=str(times))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout
    rows = [json.loads(ln) for ln in times.read_text().splitlines()]
    assert len(rows) == 6 and {r_["when"] for r_ in rows} == {"setup", "call", "teardown"}
    [bad] = [r_ for r_ in rows if r_["outcome"] == "failed"]
    assert bad["test"].endswith("test_t.py::test_bad") and "assert 1 == 2" in bad["message"]


def test_warm_tests_runs_test_files_that_exist(gpu, tmp_path):
    """``warm-tests`` (the kernels of the compile-heaviest test files into the Triton cache before ``tests``) runs
    pytest on files of tests/ that exist, within a call."""
    [(label, argv, timeout)] = gpu.suite_commands("warm-tests", tmp_path, 1)
    files = [Path(a) for a in argv if a.endswith(".py")]
    assert len(files) == len(gpu.WARM_TEST_FILES) and all(f.is_file() and f.parent.name == "tests" for f in files)
    assert argv[1:3] == ["-m", "pytest"] and timeout <= 300


def test_split_test_files_keeps_the_order_and_balances_the_recorded_time(gpu):
    """``tests --part k/n`` slices: contiguous, in pytest's order, every file once (the process-state guard at
    the end of each slice), about equal recorded seconds, an unrecorded file at the median."""
    files = [f"tests/test_{c}.py" for c in "abcdefgh"] + [gpu.PROCESS_STATE_FILE]
    secs = {"tests/test_a.py": 10, "tests/test_b.py": 10, "tests/test_c.py": 40, "tests/test_d.py": 10,
            "tests/test_e.py": 10, "tests/test_f.py": 10, "tests/test_g.py": 10}  # h: the median, 10
    parts = gpu.split_test_files(files, secs, 2)
    assert [p[-1] for p in parts] == [gpu.PROCESS_STATE_FILE] * 2
    assert sum((p[:-1] for p in parts), []) == files[:-1]  # contiguous, nothing lost or repeated
    assert [sum(secs.get(f, 10) for f in p[:-1]) for p in parts] == [60, 50]
    three = gpu.split_test_files(files, {}, 3)  # no record: equal weights
    assert [len(p) - 1 for p in three] == [3, 2, 3] and sum((p[:-1] for p in three), []) == files[:-1]
    assert all(len(p) > 1 for p in gpu.split_test_files(files, {"tests/test_a.py": 1000}, 4))  # no empty slice
    with pytest.raises(ValueError):
        gpu.split_test_files(files[:2], secs, 3)
    real = gpu.split_test_files(gpu.test_files(), gpu.recorded_file_seconds(), 2)
    assert sorted(set(sum(real, []))) == gpu.test_files()


def test_recorded_file_seconds_take_each_files_newest_measurement(gpu, tmp_path):
    """The split's seconds: per file the newest record's (the whole-suite record or an archived part), never the
    file a killed part was running; a broken record is passed over."""
    def write(name, date, secs, running=None):
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        p.write_text(json.dumps({"date": date, "file_seconds": secs, "running_when_killed": running}))

    write("gpu_tests.json", "2026-12-01T00:00:00",
          {"tests/test_a.py": 10, "tests/test_b.py": 20, "tests/test_c.py": 30})
    write("archive/gpu_tests_part1of3_x_h100.json", "2026-12-07T00:00:00", {"tests/test_a.py": 50})
    write("archive/gpu_tests_part3of3_x_h100.json", "2026-12-07T01:00:00",
          {"tests/test_b.py": 5, "tests/test_c.py": 1.5}, running="tests/test_c.py::test_slow[1]")
    write("archive/gpu_tests_part2of3_old_h100.json", "2026-11-01T00:00:00",
          {"tests/test_a.py": 99, "tests/test_d.py": 7})
    (tmp_path / "archive" / "gpu_tests_part1of2_broken.json").write_text("{")
    assert gpu.recorded_file_seconds(tmp_path / "gpu_tests.json") == {
        "tests/test_a.py": 50, "tests/test_b.py": 5, "tests/test_c.py": 30, "tests/test_d.py": 7}
    assert gpu.recorded_file_seconds(tmp_path / "none.json", "nothing*") == {}
    whole = json.loads((gpu.RESULTS / "gpu_tests.json").read_text())["file_seconds"]
    assert set(gpu.recorded_file_seconds()) >= set(whole)  # the committed records: nothing of the whole one lost


def test_the_parts_of_the_suite_combine_into_one_record(gpu, tmp_path, monkeypatch):
    """Each ``--part`` is one pytest process over its slice; the last writes ``gpu_tests.json`` from all the part
    records of its commit and split (summed counts, every part kept), and not before every part has run."""
    runs = []

    def fake_run(self, label, argv, timeout, env):
        runs.append((label, [a for a in argv if a.endswith(".py")]))
        k = len(runs)
        Path(argv[argv.index("--junitxml") + 1]).write_text(JUNIT)
        return (1 if k == 1 else 0), 10.0 * k, f"....\nsummary {k}\n"

    monkeypatch.setattr(gpu.Log, "run", fake_run)
    log, parts = gpu.Log(tmp_path / "gpu_log.txt"), tmp_path / "parts"
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    out1.mkdir(), out2.mkdir()
    r1 = gpu.run_tests(log, out1, {}, "abc123", 60, part=(1, 2), parts_dir=parts)
    assert not (out1 / "gpu_tests.json").exists() and r1["combined"] == "part 2/2 not run yet"
    assert json.loads((out1 / "gpu_tests_part1of2.json").read_text())["part"] == "1/2"
    # a part 2 record of another commit is not combined
    stale = dict(json.loads((parts / "gpu_tests_part1of2.json").read_text()), git_sha="old", part="2/2")
    (parts / "gpu_tests_part2of2.json").write_text(json.dumps(stale))
    r2 = gpu.run_tests(log, out2, {}, "abc123", 60, part=(2, 2), parts_dir=parts)
    assert r2["combined"] == "all 2 parts combined into gpu_tests.json"
    whole = json.loads((out2 / "gpu_tests.json").read_text())
    assert [f for _, fs in runs for f in fs if not f.endswith(gpu.PROCESS_STATE_FILE.split("/")[1])] == \
        [str(gpu.ROOT / f) for f in gpu.test_files() if f != gpu.PROCESS_STATE_FILE]
    assert (whole["passed"], whole["failed"], whole["errors"], whole["skipped"]) == (4, 2, 2, 2)
    assert whole["exit_code"] == 1 and whole["duration_s"] == 30.0 and whole["git_sha"] == "abc123"
    assert "wall_s" not in whole  # one call each: no common wall time
    assert [p["part"] for p in whole["parts"]] == ["1/2", "2/2"] and len(whole["failures"]) == 4
    assert whole["summary"] == "part 1/2: summary 1 | part 2/2: summary 2"


def test_run_many_runs_the_jobs_at_once_under_one_deadline(gpu, tmp_path):
    """``Log.run_many``: the jobs start together (two 1.5 s sleeps end within ~2 s, not 3), each gets its exit code,
    output and end time, and a job past the deadline is killed with its children (rc 124)."""
    import time

    log = gpu.Log(tmp_path / "gpu_log.txt")
    nap = [sys.executable, "-c", "import time; time.sleep(1.5); print('woke')"]
    child = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(30)']); print('started', c.pid, flush=True); time.sleep(30)")
    t0 = time.time()
    runs = log.run_many([("a", nap, dict(os.environ)), ("b", nap, dict(os.environ)),
                         ("bad", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ)),
                         ("stuck", [sys.executable, "-c", child], dict(os.environ))], timeout=4)
    assert time.time() - t0 < 8
    (rc_a, dt_a, text_a), (rc_b, dt_b, _), (rc_bad, _, _), (rc_stuck, dt_stuck, text_stuck) = runs
    assert (rc_a, rc_b, rc_bad, rc_stuck) == (0, 0, 3, 124)
    assert "woke" in text_a and dt_a < 3.5 and dt_b < 3.5 and dt_stuck == 4
    assert "started" in text_stuck and "killed after 4 s" in text_stuck
    pid = int(text_stuck.split("started")[1].split()[0])  # the stuck job's child: killed with it (gone or a zombie)
    for _ in range(50):
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stuck job's child {pid} is still running")
    logged = (tmp_path / "gpu_log.txt").read_text()
    assert logged.count("with 3 more at once") == 4 and "===== stuck: rc=124" in logged


def test_parts_at_once_write_the_records_of_the_parts(gpu, tmp_path, monkeypatch):
    """``--parts-at-once n``: every part's slice in one ``run_many``, each told its share of the cores; the part
    records as ``--part k/n`` writes them (``at_once`` n) and ``gpu_tests.json`` combined from them."""
    seen = {}

    def fake_many(self, jobs, timeout):
        seen["jobs"] = jobs
        out = []
        for k, (label, argv, env) in enumerate(jobs, 1):
            Path(argv[argv.index("--junitxml") + 1]).write_text(JUNIT)
            Path(env["FASTDECODE_TEST_TIMES"]).write_text(json.dumps({"test": f"t{k}", "when": "call",
                                                                      "outcome": "passed", "s": 1.0}) + "\n")
            out.append((124 if k == 2 else 0, 5.0 * k, f"....\nsummary {k}\n"))
        return out

    monkeypatch.setattr(gpu.Log, "run_many", fake_many)
    out, parts = tmp_path / "o", tmp_path / "parts"
    out.mkdir()
    recs = gpu.run_parts_at_once(gpu.Log(tmp_path / "gpu_log.txt"), out, {}, "abc123", 500, 3, parts)
    jobs = seen["jobs"]
    assert [label for label, _, _ in jobs] == ["tests part 1/3", "tests part 2/3", "tests part 3/3"]
    assert {env["FASTDECODE_TEST_THREADS"] for _, _, env in jobs} == {str(max(1, (os.cpu_count() or 1) // 3))}
    files = [a for _, argv, _ in jobs for a in argv if a.endswith(".py")]
    assert [f for f in files if not f.endswith(gpu.PROCESS_STATE_FILE.split("/")[1])] == \
        [str(gpu.ROOT / f) for f in gpu.test_files() if f != gpu.PROCESS_STATE_FILE]
    assert [r["part"] for r in recs] == ["1/3", "2/3", "3/3"] and all(r["at_once"] == 3 for r in recs)
    assert recs[-1]["combined"] == "all 3 parts combined into gpu_tests.json"
    whole = json.loads((out / "gpu_tests.json").read_text())
    assert "--parts-at-once 3" in whole["command"] and whole["exit_code"] == 124
    assert whole["duration_s"] == 30.0 and whole["wall_s"] == 15.0  # the processes' sum, the longest one
    assert json.loads((parts / "gpu_tests_part2of3.json").read_text())["exit_code"] == 124
    # at most 8 files come back from the device: the timing lines of the parts in one archive
    assert sorted(f.name for f in out.iterdir()) == ["gpu_test_times_3_at_once.tar.gz", "gpu_tests.json",
                                                     "gpu_tests_part1of3.json", "gpu_tests_part2of3.json",
                                                     "gpu_tests_part3of3.json"]
    import tarfile

    with tarfile.open(out / "gpu_test_times_3_at_once.tar.gz") as tar:
        assert sorted(tar.getnames()) == [f"gpu_test_times_part{k}of3.jsonl" for k in (1, 2, 3)]
    assert [r["tests_timed"] for r in recs] == [1, 1, 1]  # each record read its timing lines before they were packed


def test_part_arguments_are_checked(gpu, capsys):
    for bad in (["--parts-at-once", "1"], ["--parts-at-once", "2", "--part", "1/2"],
                ["--parts-at-once", "2", "--workers", "2"]):
        with pytest.raises(SystemExit):
            gpu.main(["tests", *bad])
        assert "--parts-at-once wants N >= 2" in capsys.readouterr().err
    for bad in ("3/2", "0/2", "x", "1/2/3"):
        with pytest.raises(SystemExit):
            gpu.main(["tests", "--part", bad])
        assert "--part wants K/N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["tests", "--part", "1/2", "--workers", "2"])


def test_batch_rule_suite_times_the_embedded_step_at_three_batches(gpu, tmp_path):
    [(label, argv, timeout)] = gpu.suite_commands("batch-rule", tmp_path, 1)
    assert argv[1].endswith("diag_norm_gemm_batch_rule.py") and timeout <= 300
    assert argv[argv.index("--batch") + 1:argv.index("--out")] == ["1", "4", "8"]
    assert argv[argv.index("--model") + 1] == gpu._embedded_gguf()
    assert argv[argv.index("--out") + 1] == str(tmp_path / "diag_norm_gemm_batch_rule.json")


def test_tests_suite_refuses_a_gpu_machine_without_the_embedded_model(gpu, tmp_path, monkeypatch, capsys):
    """On a GPU, ``tests`` does not start where the embedded GGUF does not load (its tests would skip inside a run
    that says 0 failed: session 36's part 1); ``--allow-no-model`` runs anyway. On a CPU it is not asked."""
    import os
    import sys

    import torch

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "gguf.py").write_text("raise ImportError('no gguf in this environment')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT / "src")]))
    assert "no gguf in this environment" in gpu.embedded_model_missing(env)

    ran = []
    monkeypatch.setattr(gpu, "run_tests", lambda *a, **k: ran.append(k) or {
        "failed": 0, "errors": 0, "summary": "ok", "duration_s": 0.0, "failures": [], "exit_code": 0})
    monkeypatch.setattr(gpu, "embedded_model_missing", lambda env: "ModuleNotFoundError: No module named 'gguf'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(sys, "argv", ["gpu.py"])
    assert gpu.main(["tests", "--out-dir", str(tmp_path / "o1"), "--git-sha", "abc"]) == 2
    assert "does not load here (ModuleNotFoundError" in capsys.readouterr().err and not ran
    assert gpu.main(["tests", "--out-dir", str(tmp_path / "o2"), "--git-sha", "abc", "--allow-no-model"]) == 0
    assert len(ran) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine: not asked
    assert gpu.main(["tests", "--out-dir", str(tmp_path / "o3"), "--git-sha", "abc"]) == 0
    assert len(ran) == 2


def test_startup_bytecode_suite_times_the_warm_start_before_and_after_compileall(gpu, tmp_path):
    """``startup-bytecode`` (session 37 did it by hand, and lost the first run to a wrong flag): two warm runs, then
    ``compileall`` over ``src`` and the installed packages that start-up imports from source, then two more."""
    steps = gpu.suite_commands("startup-bytecode", tmp_path, 1)
    assert [s[0] for s in steps] == ["bench startup warm", "compileall", "bench startup warm, compiled"]
    for (_, argv, _), name in zip(steps[::2], ("startup_warm.json", "startup_warm_compiled.json")):
        assert argv[argv.index("bench") + 1] == "startup" and argv[argv.index("--runs") + 1:][:2] == ["warm", "warm"]
        assert argv[argv.index("--out") + 1] == str(tmp_path / name)
    argv = steps[1][1]
    assert argv[1:3] == ["-m", "compileall"] and argv[argv.index("0") + 1] == str(gpu.ROOT / "src")
    dirs = argv[argv.index("0") + 2:]
    import triton  # noqa: F401  (installed with the test extra: its folder is among them)

    assert any(d.rstrip("/").endswith("triton") for d in dirs), dirs
    assert "startup-bytecode" in gpu.SUITES
