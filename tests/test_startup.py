"""Start-up (issue 16): the phase breakdown of ``fastdecode bench startup`` (fresh processes, CPU and CUDA), the
``timings`` threaded through ``loader.load`` and ``Engine``, the GGUF metadata reader against gguf-py's, and lazy
CUDA-graph capture (GPU: a bucket captured on first use gives the tokens of an eager capture, in ``generate``
and in continuous batching, where buckets are captured while other sequences are decoding)."""

import json

import numpy as np
import pytest
import torch

from engine_helpers import smollm2_path
from fastdecode.engine.generate import Engine
from fastdecode.engine.loader import load, random_model
from fastdecode.engine.timing import Timings, phase
from fastdecode.models.config import ModelConfig

LOAD_PHASES = ("checkpoint_open", "model_build", "weights_int4", "weights_dense", "weights_to_device", "assign",
               "tokenizer")


def _check_row(row, device):
    from fastdecode.bench.startup import PHASES

    assert "error" not in row, row.get("error")
    ph = row["phases_s"]
    assert set(PHASES) <= set(ph), set(PHASES) - set(ph)
    assert all(v >= 0 for v in ph.values()), ph
    assert sum(ph.values()) <= row["total_s"] + 1e-3, (sum(ph.values()), row["total_s"])
    assert row["other_s"] >= -1e-3 and 0 < row["ready_s"] <= row["total_s"] <= row["process_wall_s"] + 1e-3
    for k in ("import_torch", "import_fastdecode", "checkpoint_open", "model_build", "first_token"):
        assert ph[k] > 0, k
    # "tokenizer" is the wait for it after the weights (``loader._Background``): 0.0 when it was ready first
    assert {"gpu", "torch", "git_sha"} <= set(row) and row["shape"]["device"] == device
    if device == "cpu":
        assert ph["import_triton"] == ph["cuda_init"] == ph["kernel_warmup"] == ph["graph_capture"] == 0.0
        assert row["buckets"] == [] and row["capture_s"] == {}


def test_startup_breakdown_on_the_cpu(tmp_path, capsys):
    """``fastdecode bench startup`` on the embedded model (dequantised on the CPU): one fresh process, every
    phase reported, none negative, their sum within the total; the row written to --out with the harness fields."""
    smollm2_path()
    from fastdecode.cli import main

    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--device", "cpu", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["op"] == "startup" and row["impl"] == "warm-cache" and row["triton_cache"] == "environment"
    assert row["shape"]["max_batch"] == 1 and row["shape"]["graph_capture"] == "eager"
    _check_row(row, "cpu")
    assert row["phases_s"]["weights_dense"] > 0 and row["phases_s"]["weights_int4"] == 0.0
    assert row["dynamo_imported_at_ready"] is False  # torch._dynamo costs 1-6 s of start-up; nothing imports it
    table = capsys.readouterr().out
    assert "checkpoint_open" in table and "total_s" in table


def test_startup_failure_is_a_row_with_the_error(tmp_path):
    from fastdecode.bench.startup import bench_startup

    [row] = bench_startup(str(tmp_path / "missing.gguf"), device="cpu", timeout=120)
    assert "error" in row and "missing.gguf" in row["error"] and row["median_us"] is None


def test_load_and_engine_timings_native_int4_on_the_cpu():
    """``load(..., timings=)``: the loader's phases (native GGUF Q4_1 -> int4: weights_int4 is the repacking);
    ``Engine(..., timings=)``: kv_cache (no graphs on a CPU)."""
    path = smollm2_path()
    t = Timings()
    loaded = load(path, quant="int4", progress=False, max_seq_len=256, timings=t)
    assert set(LOAD_PHASES) <= set(t.phases) and all(v >= 0 for v in t.phases.values())
    assert t.phases["weights_int4"] > 0 and loaded.model.quant_format == "int4-w4a16-gguf"
    Engine(loaded.model, loaded.tokenizer, max_seq_len=64, timings=t)
    assert t.phases["kv_cache"] >= 0 and "graph_capture" not in t.phases


def test_timings_add_up_and_none_is_free():
    t = Timings()
    for _ in range(2):
        with phase(t, "a"):
            pass
    with phase(None, "b"):
        pass
    assert list(t.phases) == ["a"] and t.phases["a"] >= 0
    with pytest.raises(ValueError), t.phase("c"):
        raise ValueError("recorded anyway")
    assert "c" in t.phases


def test_host_only_phases_and_a_cheap_sync(monkeypatch):
    """``sync=False`` (the loader's per-tensor phases) times the host and never synchronises; a synchronising phase
    does before and after; ``cuda_sync`` asks only whether CUDA is initialised (``torch.cuda.is_available`` asks the
    driver every call: 0.19 s of a timed start-up in session 36)."""
    import fastdecode.engine.timing as T

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.init()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("asked")))
    T.cuda_sync()  # CPU: not initialised; GPU: synchronises the current device by index; nothing asked either way
    if not gpu:  # the initialised path on a CPU machine: the current device's index, no driver query
        seen = []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
        T.cuda_sync()
        assert seen == [0]
    calls = []
    monkeypatch.setattr(T, "cuda_sync", lambda: calls.append(1))
    t = Timings()
    with phase(t, "host", sync=False):
        pass
    assert calls == [] and t.phases["host"] >= 0
    with phase(t, "synced"):
        pass
    assert len(calls) == 2


def test_background_returns_or_raises_in_the_caller():
    """``loader._Background`` (the tokenizer built while the weights load): its value, or its exception raised by
    ``result()`` in the calling thread, after the work ran in another thread."""
    import threading

    from fastdecode.engine.loader import _Background

    seen = []

    def work(x):
        seen.append(threading.current_thread().name)
        if x < 0:
            raise KeyError("negative")
        return x * 2

    assert _Background(work, 21).result() == 42
    with pytest.raises(KeyError, match="negative"):
        _Background(work, -1).result()
    assert seen == ["fastdecode-work"] * 2 and threading.current_thread().name not in seen


def test_triton_key_prewarm_thread():
    """``loader._prewarm_triton``: on CUDA with a Triton backend, a thread computes Triton's cache key (cached per
    process) while the weights load; none on a CPU or with the torch backend."""
    from fastdecode.engine.loader import _prewarm_triton

    assert _prewarm_triton(torch.device("cpu"), "auto") is None
    assert _prewarm_triton(torch.device("cuda"), "torch") is None
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

    th = _prewarm_triton(torch.device("cuda"), "auto")
    assert th is not None and th.daemon
    th.join(timeout=120)
    assert not th.is_alive() and triton_key.cache_info().currsize == 1


def _gguf_with_every_value_type(path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "<|im_end|>"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty_arr", [])
    w.add_tensor("x.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_metadata_reader_equals_gguf_py(tmp_path):
    """``read_gguf``'s own metadata parser gives what gguf-py's ``contents()`` does, value for value and type for
    type, and the same tensors (as plain numpy views of the mapping)."""
    gguf = pytest.importorskip("gguf")
    from fastdecode.engine.checkpoint.gguf_io import read_gguf

    path = tmp_path / "kv.gguf"
    _gguf_with_every_value_type(path)
    paths = [str(path)]
    try:
        paths.append(smollm2_path())
    except pytest.skip.Exception:
        pass
    for p in paths:
        meta, reader = read_gguf(p)
        ref = gguf.GGUFReader(p)
        want = {k: f.contents() for k, f in ref.fields.items()}
        assert list(meta) == list(want)
        for k, v in want.items():
            assert meta[k] == v and type(meta[k]) is type(v), k
            if isinstance(v, list) and v:
                assert [type(x) for x in meta[k]] == [type(x) for x in v], k
        assert [t.name for t in reader.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(reader.tensors, ref.tensors):
            assert type(a.data) is np.ndarray and np.array_equal(a.data, b.data) and a.tensor_type == b.tensor_type


def test_gguf_metadata_reader_truncated_string_array(tmp_path):
    """A file cut inside an array of strings (the vocabulary's case) is refused by name, not read past its end."""
    gguf = pytest.importorskip("gguf")
    from fastdecode.engine.checkpoint.errors import CheckpointError
    from fastdecode.engine.checkpoint.gguf_io import read_gguf

    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["alpha", "", "gamma" * 20])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = path.read_bytes()
    assert read_gguf(str(path))[0]["t.strs"] == ["alpha", "", "gamma" * 20]
    path.write_bytes(data[:data.index(b"gamma") + 10])
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        read_gguf(str(path))


def test_engine_graph_capture_argument():
    model = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, backend="torch",
                         max_seq_len=64)
    with pytest.raises(ValueError, match="graph_capture"):
        Engine(model, max_seq_len=32, graph_capture="sometimes")
    eng = Engine(model, max_seq_len=32, graph_capture="lazy")  # no graphs on a CPU: nothing to capture
    assert eng.graphs is None and eng.decode_rows(3) == 3
    [r] = eng.generate([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)
    assert len(r.tokens) == 4


def test_cli_options():
    from fastdecode.cli import build_parser

    a = build_parser().parse_args(["serve", "--graph-capture", "lazy"])
    assert a.graph_capture == "lazy"
    assert build_parser().parse_args(["serve"]).graph_capture == "eager"
    a = build_parser().parse_args(["bench", "startup", "--runs", "cold", "warm", "--max-batch", "32", "--out", ""])
    assert a.runs == ["cold", "warm"] and a.max_batch == 32 and a.out == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "startup", "--runs", "tepid"])


def test_gpu_script_startup_suite(tmp_path):
    """benchmarks/gpu.py's ``startup`` suite: bench startup on the embedded model (cold then warm Triton cache), then
    32 KV slots eager and lazy, every row into <out-dir>/startup.json, each step within 240 s."""
    from pathlib import Path

    from fastdecode.cli import build_parser

    from helpers import load_script

    gpu = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py", "gpu_script_startup")
    assert "startup" in gpu.SUITES
    steps = gpu.suite_commands("startup", tmp_path, 1)
    assert [s[0] for s in steps] == ["bench startup", "bench startup serve eager", "bench startup serve lazy",
                                     "bench startup dequantized"]
    for label, argv, timeout in steps:
        assert argv[argv.index("bench") + 1] == "startup" and "--model" not in argv, label
        assert argv[argv.index("--out") + 1] == str(tmp_path / "startup.json") and 0 < timeout <= 240, label
        a = build_parser().parse_args(argv[3:])
        assert a.timeout * len(a.runs or ["warm"]) < timeout, label  # a hung run fails inside the step's limit
    assert steps[0][1][steps[0][1].index("--runs") + 1:][:2] == ["cold", "warm"]
    assert "lazy" in steps[2][1] and "32" in steps[1][1]
    assert ["--dequantize" in argv for _, argv, _ in steps] == [False, False, False, True]


# ----------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def smollm2_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return load(smollm2_path(), device="cuda", progress=False, max_seq_len=512)  # native int4 on CUDA


@pytest.mark.gpu
def test_startup_breakdown_on_the_gpu(tmp_path):
    """A warm run on CUDA: Triton imported, CUDA initialised, kernels warmed up and bucket 1 captured, timed."""
    smollm2_path()
    from fastdecode.bench.startup import bench_startup

    [row] = bench_startup(device="cuda", runs=["warm"], timeout=300)
    _check_row(row, "cuda")
    ph = row["phases_s"]
    assert ph["cuda_init"] > 0 and ph["kernel_warmup"] > 0 and ph["graph_capture"] > 0 and ph["weights_int4"] > 0
    assert row["buckets"] == [1] and row["captured"] == [1] and set(row["capture_s"]) == {"1"}


@pytest.mark.gpu
def test_gguf_int4_repacked_on_the_device_equals_the_cpu_repacking(smollm2_cuda):
    """GGUF Q4_1 blocks repacked on the GPU: the same bits as repacked on the CPU and copied."""
    cpu = load(smollm2_path(), device="cpu", dtype=torch.bfloat16, quant="int4", progress=False, max_seq_len=512)
    got, want = smollm2_cuda.model.state_dict(), cpu.model.state_dict()
    assert set(got) == set(want)
    packed = [k for k in got if k.endswith(".qweight")]
    assert len(packed) == 4 * smollm2_cuda.config.n_layers  # wqkv, wo, w13, w2
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].cpu(), v), k


def _greedy(eng, prompts, n=24):
    return [r.tokens for r in eng.generate(prompts, max_new_tokens=n, ignore_eos=True)]


@pytest.mark.gpu
def test_lazy_capture_gives_the_tokens_of_eager_capture(smollm2_cuda):
    """Engine(graph_capture="lazy") captures nothing up front, then each bucket on the step that first needs it
    (bucket 1 for one prompt, 4 for three), with the greedy tokens of the eagerly captured engine."""
    m, tok = smollm2_cuda.model, smollm2_cuda.tokenizer
    eager = Engine(m, tok, max_batch=4, max_seq_len=256)
    lazy = Engine(m, tok, max_batch=4, max_seq_len=256, graph_capture="lazy")
    assert sorted(eager.graphs.graphs) == eager.graphs.buckets == [1, 2, 4] and lazy.graphs.graphs == {}
    one = ["The capital of France is"]
    three = ["Why is the sky blue?", "1, 2, 3,", "Once upon a time"]
    assert _greedy(lazy, one) == _greedy(eager, one)
    assert sorted(lazy.graphs.graphs) == [1]
    assert _greedy(lazy, three) == _greedy(eager, three)
    assert sorted(lazy.graphs.graphs) == [1, 4] and set(lazy.graphs.capture_s) == {1, 4}
    assert _greedy(lazy, three) == _greedy(eager, three)  # replays of the captured graphs
    assert _greedy(lazy, [[1]]) == _greedy(eager, [[1]])  # a one-token prompt: the graph replays its prefill


def _batched(eng, tok, prompts, join_at, n=20):
    """Greedy tokens of each prompt through a ContinuousBatcher over ``eng``, prompt i joining at step join_at[i]."""
    from fastdecode.engine.batching import ContinuousBatcher, Request
    from test_serve_batching import _run

    reqs = [Request(tok.encode(p), max_new_tokens=n, ignore_eos=True) for p in prompts]
    out = _run(ContinuousBatcher(eng, prefill_chunk=8), reqs, join_at=join_at)
    return [out[r.id][0] for r in reqs]


@pytest.mark.gpu
def test_lazy_capture_while_other_sequences_decode(smollm2_cuda):
    """Continuous batching on a lazy engine: buckets 2 and 4 are captured at the steps where a request first
    joins the decoding rows, while earlier ones are mid-answer (the warm-up steps run that very step, so the
    cache rows of the running sequences get what the replay writes): every request gets the tokens of the same
    schedule on an eagerly captured engine."""
    m, tok = smollm2_cuda.model, smollm2_cuda.tokenizer
    prompts = ["Tell me about the sea.", "What is 2 + 2?", "Name three colours.", "Write a haiku about rain."]
    join_at = [0, 3, 6, 6]
    want = _batched(Engine(m, tok, max_batch=4, max_seq_len=256), tok, prompts, join_at)
    eng = Engine(m, tok, max_batch=4, max_seq_len=256, graph_capture="lazy")
    got = _batched(eng, tok, prompts, join_at)
    assert sorted(eng.graphs.graphs) == [1, 2, 4]
    assert got == want and all(len(t) == 20 for t in got)
