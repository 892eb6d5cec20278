"""``benchmarks/int4_small_table.py``: the int4 table with a small-tile sweep's fastest M = 1 tiles put in (CPU;
session 32)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "src" / "fastdecode" / "configs" / "int4_linear_nvidia_h200.json"


@pytest.fixture(scope="module")
def tool():
    return load_script(ROOT / "benchmarks" / "int4_small_table.py", "int4_small_table")


def _plain_base():
    """The package's H200 table without the fused ops' sections (as it was before session 33 shipped them)."""
    from fastdecode.ops.int4 import FUSED_OPS

    base = json.loads(BASE.read_text())
    return {k: v for k, v in base.items() if k not in FUSED_OPS and k.removesuffix("_env") not in FUSED_OPS}


def _rows():
    """A sweep's rows: on qkv a tile beats the table's, on down none does; the bf16 row has no config."""
    def shape(name, n, k):
        return {"M": 1, "N": n, "K": k, "group": 32, "name": name}

    qkv, down = shape("smollm2.qkv", 960, 576), shape("smollm2.down", 576, 1536)
    fast = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 1, "PREFETCH": 2}
    slow = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 256, "SPLIT_K": 1, "SCALE_PF": True}
    own = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 16}
    return [
        {"shape": qkv, "impl": "bf16", "config": None, "median_us": 1.0, "git_sha": "abc"},
        {"shape": qkv, "impl": "table", "config": own, "median_us": 3.5, "git_sha": "abc"},
        {"shape": qkv, "impl": "fast", "config": fast, "median_us": 3.1, "git_sha": "abc"},
        {"shape": down, "impl": "table", "config": own, "median_us": 4.4, "git_sha": "abc"},
        {"shape": down, "impl": "slow", "config": slow, "median_us": 5.0, "git_sha": "abc"},
    ]


def test_the_fastest_tile_goes_into_the_fused_ops_section(tool):
    """qkv (a norm shape) takes the fastest tile (not the bf16 row, faster but no int4 tile) in the norm op's
    section; down keeps the plain entry (no tile beat the table's) and gets no entry of its own; the plain GEMV's
    section and the base itself are unchanged."""
    base = _plain_base()
    before = json.dumps(base)
    t = tool.build(_rows(), base, source="s")
    assert json.dumps(base) == before
    assert t["int4_linear"] == base["int4_linear"]
    assert t["int4_rms_norm_linear"] == {"960,576,32": {"1": {"impl": "triton", "config": _rows()[2]["config"],
                                                              "us": 3.1}}}
    assert "int4_add_linear" not in t and t["int4_small_source"] == "s"


def test_each_side_has_its_section(tool):
    """The section follows the row's side (sweeps after a7271b7: "glu" for down with SiLU-and-mul inside), and by
    name for older rows without one."""
    rows = _rows()
    for r in rows[3:]:
        r["shape"]["side"] = "glu"
    rows[4]["median_us"] = 4.0  # now a tile beats down's table tile
    t = tool.build(rows, _plain_base())
    assert t["int4_add_linear_glu"]["576,1536,32"]["1"]["config"] == rows[4]["config"]
    assert tool.side({"name": "smollm2.o"}) == "add" and tool.side({"name": "smollm2.gate_up"}) == "norm"


@pytest.mark.parametrize("only", [False, True])
def test_norm_loop_goes_on_the_norm_shapes_only(tool, only):
    """NORM_LOOP on qkv's M = 1 entry of the norm op (a norm shape), none for down; with ``norm_loop_only`` on the
    base's tile."""
    base = _plain_base()
    t = tool.build(_rows(), base, norm_loop=not only, norm_loop_only=only)
    qkv = t["int4_rms_norm_linear"]["960,576,32"]["1"]["config"]
    want = base["int4_linear"]["960,576,32"]["1"]["config"] if only else _rows()[2]["config"]
    assert qkv == {**want, "NORM_LOOP": True}
    assert "int4_add_linear" not in t and t["int4_linear"] == base["int4_linear"]


def test_the_ops_read_the_tables_sections(tool, tmp_path):
    """The table written is read by the dispatcher as built: the norm op gets the swept tile at M = 1, the plain
    GEMV keeps its tile, and at M = 2 both take the plain GEMV's entry."""
    import fastdecode.ops.int4 as I

    base = _plain_base()
    p = tmp_path / "t.json"
    p.write_text(json.dumps(tool.build(_rows(), base)))
    I.clear_config_cache()
    try:
        assert I.get_int4_config(1, 960, 576, 32, path=str(p), op="int4_rms_norm_linear")[1] == _rows()[2]["config"]
        assert I.get_int4_config(1, 960, 576, 32, path=str(p))[1] == base["int4_linear"]["960,576,32"]["1"]["config"]
        two = base["int4_linear"]["960,576,32"]["2"]["config"]
        assert I.get_int4_config(2, 960, 576, 32, path=str(p), op="int4_rms_norm_linear")[1] == two
    finally:
        I.clear_config_cache()


def test_cli_writes_a_config_dir(tmp_path):
    """The command line writes the int4 table under the GPU key given, with the base GPU's other tables beside it."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": _rows()}))
    out = tmp_path / "cfg"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "int4_small_table.py"), str(sweep), "--gpu", "gpu_x",
                    "--out-dir", str(out)], check=True, capture_output=True)
    assert {p.name for p in out.iterdir()} >= {"int4_linear_gpu_x.json", "linear_gpu_x.json"}
    t = json.loads((out / "int4_linear_gpu_x.json").read_text())
    assert t["int4_rms_norm_linear"]["960,576,32"]["1"]["us"] == 3.1
    assert "sweep at abc" in t["int4_small_source"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter smoke run; on a GPU the sweep itself runs "
                    "(gpu.py int4-small / int4-8b-options). On the device image (triton 3.6) its interpreter run "
                    "failed on every tile with 'only 0-dimensional arrays can be converted to Python scalars', as "
                    "test_int4.py, the int4 kernel's interpreter suite, is skipped there too")
@pytest.mark.parametrize("shape", ["smollm2.o", "smollm2.qkv", "smollm2.down"])
def test_sweep_checks_its_option_tiles_on_the_cpu(tmp_path, shape):
    """The sweep's smoke run (the interpreter, no timing): each tile it would time passes its check against the fp32
    reference, on the add side (o), the norm side (qkv) and down with SiLU-and-mul inside (int4_glu, as the step);
    ``--grid table`` on the CPU's heuristic tile (a split one) with PREFETCH 2 and SCALE_PF (down: one of them). A
    failed check prints FAILED and records an error row. (The small grid's tiles of 4 rows take ~50 s here; their
    options are the kernel tests' cases.)"""
    import os

    out = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    n = "1" if shape.endswith("down") else "4"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_int4_small_fma.py"), "--device", "cpu",
                        "--grid", "table", "--shapes", shape, "--max-tiles", n, "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FAILED" not in r.stdout, r.stdout
    assert json.loads(out.read_text()) in ([], {"rows": []})  # nothing timed, no error row


def test_norm_loop_rows_only_where_one_split_runs():
    """``with_norm_loop``: an ``_nl`` copy of each fma candidate that runs as one split (SPLIT_K 1, or a split count
    that K's steps reduce to 1), none of a split or a dot one."""
    sweep = load_script(ROOT / "benchmarks" / "sweep_int4_small_fma.py", "sweep_int4_small_fma")
    one = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 2}
    split = {**one, "SPLIT_K": 2}
    dot = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1}
    out = sweep.with_norm_loop([("a", one), ("b", split), ("c", dot)], 576)
    assert out == [("a", one), ("b", split), ("c", dot), ("a_nl", {**one, "NORM_LOOP": True})]
    # K = 256: one step, so SPLIT_K 2 runs as one split and gets its copy too
    assert [n for n, _ in sweep.with_norm_loop([("b", split)], 256)] == ["b", "b_nl"]


def test_unchanged_keeps_the_base(tool):
    """``unchanged`` (``gpu.py step-tables``' table A): the base's entries as they are, with the source note."""
    base = json.loads(BASE.read_text())
    t = tool.build(_rows(), base, norm_loop=True, source="s", unchanged=True)
    assert t == {**base, "int4_small_source": "s"}


def test_gpu_script_step_tables_alternates_the_two_dirs(tmp_path):
    """``gpu.py step-tables``: both tables built first, then the step in processes alternating A and B, each with its
    own config dir and result file; without ``--step-sweep`` the script stops at once."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_step_tables")
    steps = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_sweep="sw.json", step_rounds=2)
    labels = [label for label, _, _ in steps]
    assert labels == ["tables A", "tables B", "step A 1", "step B 2", "step A 3", "step B 4"]
    assert "--unchanged" in steps[0][1] and "--unchanged" not in steps[1][1]
    dirs = [next(x for x in cmd if x.startswith("FASTDECODE_CONFIG_DIR=")) for _, cmd, _ in steps[2:]]
    assert dirs[0] == dirs[2] != dirs[1] == dirs[3]
    assert [cmd[-1] for _, cmd, _ in steps[2:]] == [str(tmp_path / f"decode_embedded_tables_{i}.json")
                                                    for i in range(1, 5)]
    with pytest.raises(SystemExit):
        gpu.main(["step-tables", "--out-dir", str(tmp_path)])


def test_gpu_script_step_tables_on_a_config_dir(tmp_path):
    """``--step-config-dir``: table B is that directory as it is (nothing built for it); table A is the base, built
    without a sweep."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_step_tables_dir")
    tuned = tmp_path / "tuned"
    steps = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_config_dir=str(tuned), step_rounds=1)
    assert [label for label, _, _ in steps] == ["tables A", "step A 1", "step B 2"]
    assert "--unchanged" in steps[0][1] and not any(a.endswith(".json") for a in steps[0][1][:3])
    assert f"FASTDECODE_CONFIG_DIR={tuned}" in steps[2][1]
    out = tmp_path / "A"
    argv = steps[0][1][1:]
    argv[argv.index("--out-dir") + 1] = str(out)
    subprocess.run([sys.executable, *argv], check=True, capture_output=True)
    assert json.loads((out / "int4_linear_gpu_x.json").read_text())["int4_small_source"].endswith("nothing changed")
    r = subprocess.run([sys.executable, steps[0][1][1], "--gpu", "g", "--out-dir", str(out)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "unless --unchanged" in r.stderr


def test_gpu_script_tune_int4_fused_writes_into_the_out_dirs_table(tmp_path):
    """``tune-int4-fused``: the fused ops' tuner on SmolLM2's shapes at M = 1 by default (quick list), into the table
    copy under --out-dir; ``--tune-shapes`` and ``--tune-int4-ms`` pass through."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_tune_fused")
    [(_, argv, timeout)] = gpu.suite_commands("tune-int4-fused", tmp_path, 1, gpu="gpu_x")
    assert argv[1:4] == ["-m", "fastdecode.bench.int4_fused", "--quick"]
    assert argv[argv.index("--shapes") + 1] == "smollm2" and argv[argv.index("--ms") + 1] == "1"
    assert argv[-1] == str(tmp_path / "configs" / "int4_linear_gpu_x.json") and timeout <= 600
    [(_, argv, _)] = gpu.suite_commands("tune-int4-fused", tmp_path, 1, tune_shapes="8b.o", tune_int4_ms=[1, 2])
    assert argv[argv.index("--shapes") + 1] == "8b.o" and argv[argv.index("--ms") + 1] == "1,2"


def test_step_tables_table_a_is_the_package_table_of_this_gpu(tmp_path):
    """Table A (``--unchanged``) starts from the package's int4 table of the GPU where there is one (the H100's since
    session 39), not the H200's: before, an H100's step-tables compared a tuned copy of its own table against the
    H200's. Its linear table, which the H100 does not have, is the H200's (the sibling rule), as the ops read it."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_step_tables_base")
    key = "nvidia_h100_80gb_hbm3"
    [(_, argv, _), *_] = gpu.suite_commands("step-tables", tmp_path, 1, gpu=key, step_config_dir="d", step_rounds=1)
    own = ROOT / "src" / "fastdecode" / "configs" / f"int4_linear_{key}.json"
    assert argv[argv.index("--base") + 1] == str(own)
    argv[argv.index("--out-dir") + 1] = str(tmp_path / "A")
    subprocess.run(argv, check=True, capture_output=True)
    made = json.loads((tmp_path / "A" / f"int4_linear_{key}.json").read_text())
    assert {k: v for k, v in made.items() if k != "int4_small_source"} == json.loads(own.read_text())
    assert (tmp_path / "A" / f"linear_{key}.json").read_text() == (own.parent / "linear_nvidia_h200.json").read_text()
    [(_, argv, _), *_] = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_config_dir="d", step_rounds=1)
    assert "--base" not in argv  # no table of its own: the script's default, the H200's


def test_a_base_with_fused_sections_keeps_what_the_sweep_did_not_beat(tool):
    """The shipped H200 table has the fused ops' own sections (session 33): ``norm_loop_only`` puts NORM_LOOP on the
    norm op's own tile (not the plain GEMV's), and a shape whose own tile no swept tile beat keeps its entry."""
    base = json.loads(BASE.read_text())
    norm = base["int4_rms_norm_linear"]["960,576,32"]["1"]["config"]
    assert norm != base["int4_linear"]["960,576,32"]["1"]["config"]
    t = tool.build(_rows(), base, norm_loop_only=True)
    assert t["int4_rms_norm_linear"]["960,576,32"]["1"]["config"] == {**norm, "NORM_LOOP": True}
    assert t["int4_add_linear_glu"] == base["int4_add_linear_glu"]


def test_gpu_script_step_tables_on_the_8b_int4_step(tmp_path):
    """``--step-model 8b-int4``: the same alternation on the 8B int4 step (random weights quantised at load), each
    process with its own result file and a longer limit."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_step_tables_8b")
    steps = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_config_dir="d", step_rounds=1,
                               step_model="8b-int4")
    for i, (_, cmd, limit) in enumerate(steps[1:], 1):
        assert cmd[cmd.index("--preset") + 1] == "llama-3.1-8b" and cmd[cmd.index("--quant") + 1] == "int4"
        assert "--model" not in cmd and cmd[-1] == str(tmp_path / f"decode_8b_int4_tables_{i}.json") and limit > 120
        assert cmd[cmd.index("--impl") + 1:cmd.index("--out")] == ["fastdecode-graph"]
    # --decode-impls: every step process runs those rows (each table with and without a switch)
    steps = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_config_dir="d", step_rounds=1,
                               step_model="8b-int4", decode_impls=("fastdecode-graph", "fastdecode-graph-no-int4_glu"))
    for _, cmd, _ in steps[1:]:
        assert cmd[cmd.index("--impl") + 1:cmd.index("--out")] == ["fastdecode-graph", "fastdecode-graph-no-int4_glu"]


def test_gpu_script_step_tables_on_the_8b_fp8_step(tmp_path):
    """``--step-model 8b-fp8``: the 8B FP8 step (random weights quantised at load) alternating between table A (the
    package's linear table: A's directory holds only the int4 table) and a directory with a linear table of its own."""
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_step_tables_8b_fp8")
    steps = gpu.suite_commands("step-tables", tmp_path, 1, gpu="gpu_x", step_config_dir="d", step_rounds=2,
                               step_model="8b-fp8")
    assert [label for label, _, _ in steps] == ["tables A", "step A 1", "step B 2", "step A 3", "step B 4"]
    for i, (_, cmd, limit) in enumerate(steps[1:], 1):
        assert cmd[cmd.index("--preset") + 1] == "llama-3.1-8b" and cmd[cmd.index("--quant") + 1] == "fp8"
        assert cmd[-1] == str(tmp_path / f"decode_8b_fp8_tables_{i}.json") and limit > 120
        env = cmd[1]
        assert env.startswith("FASTDECODE_CONFIG_DIR=") and env.endswith("/A" if i % 2 else "=d")
    with pytest.raises(SystemExit):  # the choice is checked
        gpu.main(["step-tables", "--step-model", "8b-bf16", "--step-config-dir", "d"])
