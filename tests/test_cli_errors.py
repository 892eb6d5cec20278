"""Mistakes and interruptions end in one ``error: ...`` line (exit 2), never a traceback (issue 14): bad --device,
--backend, config.json, prompt bytes and sampling flags; GPU-only benchmarks on the CPU; ``| head``; Ctrl-C;
--tp failures; a KV cache larger than the model's context or the memory available (generate, bench decode,
eval-accuracy)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fastdecode import cli
from engine_helpers import save_tiny_smollm2_vocab

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model with SmolLM2's tokenizer (and chat template); max_position_embeddings 256."""
    path, _ = save_tiny_smollm2_vocab(tmp_path_factory.mktemp("tiny") / "m", name="tiny")
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model gets loaded (what the checks must refuse before loading)."""
    from fastdecode.engine import loader

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load", boom)


def _one_error(err: str, *parts: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for p in parts:
        assert p in lines[0], (p, lines[0])
    return lines[0]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([SRC, os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))


# ----------------------------------------------------------------------------- 1. --device


def test_device_cuda_without_cuda(monkeypatch, no_load, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "hi", "--device", "cuda"]) == 2
    _one_error(capsys.readouterr().err, "--device cuda", "--device cpu")


def test_device_index_past_the_gpus(monkeypatch, no_load, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.main(["generate", "hi", "--device", "cuda:7"]) == 2
    _one_error(capsys.readouterr().err, "--device cuda:7", "only 2 CUDA devices")


def test_device_not_a_device(no_load, capsys):
    assert cli.main(["chat", "--device", "gpu0"]) == 2
    _one_error(capsys.readouterr().err, "--device 'gpu0'")


# ----------------------------------------------------------------------------- 2. --backend triton


def test_backend_triton_on_cpu_without_interpreter(monkeypatch, no_load, capsys):
    from fastdecode.ops import _common

    monkeypatch.setattr(_common, "interpreter_on", lambda: False)
    monkeypatch.setattr(_common, "triton_available", lambda: True)
    assert cli.main(["generate", "hi", "--device", "cpu", "--backend", "triton"]) == 2
    _one_error(capsys.readouterr().err, "--backend triton", "--backend torch", "TRITON_INTERPRET=1")


# ----------------------------------------------------------------------------- 3, 9. config.json


@pytest.mark.parametrize("text, what", [
    ("{}", "missing key 'num_attention_heads'"),
    ("[1, 2]", "expected a JSON object ({...}), got a JSON list"),
    ('{"hidden_size": 64,\n "vocab_size": }', "not valid JSON: Expecting value at line 2:16"),
])
def test_bad_config_json(tmp_path, text, what, capsys):
    (tmp_path / "config.json").write_text(text)
    assert cli.main(["generate", "hi", "--model", str(tmp_path), "--device", "cpu"]) == 2
    _one_error(capsys.readouterr().err, f"{tmp_path / 'config.json'}: {what}")


@pytest.mark.parametrize("eps", [0, -1e-6, "NaN", "Infinity"])
def test_rms_norm_eps_must_be_finite_and_positive(tiny, tmp_path, eps, capsys):
    from fastdecode.models.config import ModelConfig

    cfg = json.loads(open(os.path.join(tiny, "config.json")).read())
    text = json.dumps({**cfg, "rms_norm_eps": 0.5}).replace("0.5", str(eps))
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json: config rms_norm_eps must be a finite number > 0"):
        ModelConfig.from_hf(str(tmp_path))
    assert cli.main(["generate", "hi", "--model", str(tmp_path), "--device", "cpu"]) == 2
    _one_error(capsys.readouterr().err, str(tmp_path / "config.json"), "rms_norm_eps")
    with pytest.raises(ValueError, match="norm_eps"):
        ModelConfig.from_preset("tiny").replace(norm_eps=math.inf)


# ----------------------------------------------------------------------------- 4. prompt bytes


def test_prompt_not_utf8(no_load, capsys):
    assert cli.main(["generate", "caf\udce9", "--device", "cpu"]) == 2  # b"caf\xe9" on argv (surrogateescape)
    _one_error(capsys.readouterr().err, "the prompt is not valid UTF-8", "byte e9 at character 3")


# ----------------------------------------------------------------------------- 5. flags, before loading


@pytest.mark.parametrize("flag, value", [
    ("--max-seq-len", "-5"), ("--max-seq-len", "0"), ("--max-new-tokens", "0"), ("--max-new-tokens", "-3"),
    ("--temperature", "-1"), ("--temperature", "inf"), ("--temperature", "nan"), ("--top-p", "0"),
    ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-k", "-1"), ("--tp", "0"),
])
def test_bad_flags_refused_by_argparse(flag, value, no_load, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--device", "cpu", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in last and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--dequantize", "--quant", "int4"], "cannot be combined with --quant int4"),
    (["serve", "--dequantize", "--quant", "fp8"], "cannot be combined with --quant fp8"),
    (["generate", "hi", "--dequantize", "--model", "llama-3.1-8b"], "--model llama-3.1-8b is not one"),
    (["bench", "decode", "--dequantize"], "--model llama-3.1-8b is not one"),
    (["bench", "decode", "--dequantize", "--model", "x.gguf", "--quant", "fp8"], "cannot be combined"),
])
def test_dequantize_only_for_gguf_without_quant(argv, says, no_load, capsys):
    """``--dequantize`` (a GGUF's int4 weights loaded dense) is refused before loading for what it cannot apply to."""
    assert cli.main(argv + ["--device", "cpu"]) == 2
    _one_error(capsys.readouterr().err, "--dequantize", says)


@pytest.mark.parametrize("value, says", [
    ("fused_attention=off", "unknown kernel switch 'fused_attention'; known: fused_norm"),
    ("int4_a8", "'int4_a8': write int4_a8=on or int4_a8=off"),
    ("fp8_a16=maybe", "'fp8_a16=maybe': write fp8_a16=on or fp8_a16=off"),
])
def test_bad_kernel_switches_refused_by_argparse(value, says, no_load, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--device", "cpu", "--kernels", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --kernels: " + says in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_kernel_switches_reach_the_model_before_the_engine(tiny, monkeypatch, capsys):
    """``--kernels`` (generate, chat, serve): applied with ``set_kernels`` after loading, before the engine is built
    (and captures its graphs): an FP8 model decodes W8A8 with ``fp8_a16=off``."""
    from fastdecode.engine import generate

    seen, orig = [], generate.Engine.__init__

    def spy(self, model, *a, **kw):
        w = model.layers[0].attention.wo
        seen.append((dict(model.kernels), w.a16_max_rows))
        orig(self, model, *a, **kw)

    monkeypatch.setattr(generate.Engine, "__init__", spy)
    for value, a16 in (("fp8_a16=off,int4_a8=on", 0), (None, 4)):
        argv = ["generate", "hi", "--model", tiny, "--device", "cpu", "--quant", "fp8", "--max-new-tokens", "2"]
        assert cli.main(argv + (["--kernels", value] if value else [])) == 0
        kernels, rows = seen.pop()
        assert rows == a16 and kernels["fp8_a16"] == (value is None) and kernels["int4_a8"] == (value is not None)
    capsys.readouterr()


# ----------------------------------------------------------------------------- 6. GPU-only commands


@pytest.mark.parametrize("argv", [["bench", "int4"], ["bench", "linear"], ["tune", "int4"], ["tune", "linear"],
                                  ["tune", "int4-fused"], ["bench", "norm"], ["bench", "allreduce"]])
def test_gpu_commands_on_cpu(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(argv) == 2
    _one_error(capsys.readouterr().err, f"`fastdecode {argv[0]} {argv[1]}", "needs ")


@pytest.mark.parametrize("args, want", [(["--shapes", "smollm2.head"], "unknown shape 'smollm2.head'"),
                                        (["--ms", "16"], "token counts from 1 to 8"),
                                        (["--ms", "one"], "invalid literal")])
def test_tune_int4_fused_bad_input_in_one_line(args, want, capsys):
    """Bad shape names and token counts end in one error line, before the GPU check (so on any machine)."""
    assert cli.main(["tune", "int4-fused", *args]) == 2
    _one_error(capsys.readouterr().err, "tune int4-fused", want)


# ----------------------------------------------------------------------------- 7. | head


def test_broken_pipe_exits_quietly(tiny):
    p = subprocess.Popen([sys.executable, "-m", "fastdecode", "generate", "Once upon a time", "--model", tiny,
                          "--raw", "--device", "cpu", "--max-new-tokens", "250"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    first = p.stdout.read(20)  # as `| head -c 20`
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert len(first) == 20
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert rc == cli.EXIT_BROKEN_PIPE == 141


# ----------------------------------------------------------------------------- 8. Ctrl-C


def test_ctrl_c_in_generate(tiny, monkeypatch, capsys):
    from fastdecode.engine.generate import Engine

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    assert cli.main(["generate", "hi", "--model", tiny, "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err


def test_ctrl_c_in_chat_stops_the_answer_and_keeps_the_history(tiny, monkeypatch, capsys):
    from fastdecode.engine.generate import Engine

    turns = iter(["first question", "second question", "third question"])

    def ask(prompt=""):
        try:
            return next(turns)
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C at the prompt: quit

    prompts, orig = [], Engine.generate

    def generate(self, prompts_, **k):
        prompts.append(self.tokenizer.decode(prompts_[0]))
        if len(prompts) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second answer
        return orig(self, prompts_, **{**k, "max_new_tokens": 3})

    monkeypatch.setattr("builtins.input", ask)
    monkeypatch.setattr(Engine, "generate", generate)
    assert cli.main(["chat", "--model", tiny, "--device", "cpu", "--max-seq-len", "256"]) == 0
    err = capsys.readouterr().err
    assert "[interrupted]" in err and "Traceback" not in err
    assert len(prompts) == 3
    assert "first question" in prompts[2] and "third question" in prompts[2]  # the history kept
    assert "second question" not in prompts[2]  # the interrupted turn dropped


def test_chat_eof_exits_cleanly(tiny, monkeypatch, capsys):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    assert cli.main(["chat", "--model", tiny, "--device", "cpu"]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- 11. memory


def test_max_seq_len_capped_at_the_models_context(tiny, monkeypatch, capsys):
    from fastdecode.engine import generate

    seen, orig = [], generate.check_kv_memory
    monkeypatch.setattr(generate, "check_kv_memory",
                        lambda cfg, b, t, *a, **kw: (seen.append(t), orig(cfg, b, t, *a, **kw))[1])
    assert cli.main(["generate", "hi", "--model", tiny, "--device", "cpu", "--max-seq-len", "4096",
                     "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert seen == [256]
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert warn == ["warning: --max-seq-len 4096 is more than the model's context (256 positions, "
                    "max_position_embeddings in its config); capped to 256"]


def test_kv_cache_larger_than_memory_is_refused_before_allocating(tiny, monkeypatch, capsys):
    from fastdecode.engine import generate, kv_cache

    def no_alloc(*a, **k):
        raise AssertionError("the KV cache was allocated")

    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 100_000)
    monkeypatch.setattr(generate, "KVCache", no_alloc)
    assert cli.main(["generate", "hi", "--model", tiny, "--device", "cpu", "--max-seq-len", "256"]) == 2
    # 2 layers x 2 x 2 KV heads x 16 x 256 positions x batch 1 x 4 bytes (float32)
    _one_error(capsys.readouterr().err, "KV cache needs 0.1 MiB (131,072 bytes)", "only 0.1 MiB (100,000 bytes)",
               "--max-seq-len")


def _no_kv_alloc(monkeypatch, available: int = 100_000) -> None:
    """Report ``available`` bytes free on every device, and fail the test if a KV cache gets allocated."""
    from fastdecode.engine import kv_cache

    def no_alloc(*a, **k):
        raise AssertionError("the KV cache was allocated")

    monkeypatch.setattr(kv_cache, "available_memory", lambda device: available)
    monkeypatch.setattr(kv_cache, "KVCache", no_alloc)  # what bench decode and eval-accuracy allocate through


def test_bench_decode_kv_cache_larger_than_memory_is_refused_before_allocating(monkeypatch, capsys):
    from fastdecode.bench import decode

    def no_peer(*a, **k):
        raise AssertionError("the peer (and its KV cache) was built")

    _no_kv_alloc(monkeypatch)
    monkeypatch.setattr(decode, "_try_build_peer", no_peer)
    assert cli.main(["bench", "decode", "--preset", "tiny", "--batch", "2", "--input-len", "1", "--output-len", "127",
                     "--impl", "torch-eager", "peer-eager", "--dtype", "float32", "--device", "cpu", "--out", ""]) == 2
    # 2 layers x 2 x 2 KV heads x 16 x 128 positions x batch 2 x 4 bytes (float32)
    _one_error(capsys.readouterr().err, "KV cache needs 0.1 MiB (131,072 bytes)", "x 128 positions x batch 2 x",
               "only 0.1 MiB (100,000 bytes)", "lower --batch, --input-len or --output-len")


def test_eval_accuracy_kv_cache_larger_than_memory_is_refused_before_allocating(tiny, monkeypatch, capsys):
    from fastdecode.engine import loader

    loads, orig = [], loader.load
    monkeypatch.setattr(loader, "load", lambda *a, **k: (loads.append(k.get("quant")), orig(*a, **k))[1])
    _no_kv_alloc(monkeypatch)
    assert cli.main(["eval-accuracy", "--model", tiny, "--device", "cpu", "--dtype", "float32", "--window", "256",
                     "--quant", "fp8", "int4"]) == 2
    # one window: 2 layers x 2 x 2 KV heads x 16 x 256 positions x batch 1 x 4 bytes (float32)
    _one_error(capsys.readouterr().err, "KV cache needs 0.1 MiB (131,072 bytes)", "x 256 positions x batch 1 x",
               "only 0.1 MiB (100,000 bytes)", "lower --window")
    assert loads == [None]  # refused after the reference loaded, before the quantised copies


def test_kv_cache_bytes_match_the_allocation():
    from fastdecode.engine.kv_cache import KVCache, available_memory, kv_cache_bytes
    from fastdecode.models.config import ModelConfig

    cfg = ModelConfig.from_preset("tiny")
    assert kv_cache_bytes(cfg, 3, 40, torch.float16) == KVCache(cfg, 3, 40, dtype=torch.float16).nbytes()
    assert available_memory("cpu") > 0


# ----------------------------------------------------------------------------- 10. --tp


def test_tp_rank_errors_end_in_one_line(tmp_path):
    """A load error on the ranks of ``--tp 2``: one ``error:`` line from rank 0, exit 2, no torchrun report."""
    missing = str(tmp_path / "missing")
    r = subprocess.run([sys.executable, "-m", "fastdecode", "generate", "hi", "--model", missing, "--device", "cpu",
                        "--tp", "2"], capture_output=True, text=True, timeout=180, env=_env())
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error(r.stderr, "loading failed on 2 of 2 ranks", "ranks 0, 1: FileNotFoundError", missing)
