"""``--model org/name`` (issue 17): a Hub id read from the local Hugging Face cache (a fake one built here:
``models--org--name/snapshots/<commit>/`` plus ``refs/main``), never downloaded; a local path that exists wins; a
model not in the cache is an error saying how to fetch it; a name that is neither keeps the old error."""

import json
import os
import re
import shutil

import pytest
import torch

from fastdecode import cli
from fastdecode.engine.checkpoint.detect import resolve_source
from fastdecode.engine.checkpoint.hub import looks_like_repo_id
from fastdecode.engine.generate import Engine
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import load

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(hub: str, repo_id: str, files_from: str = None) -> str:
    """Lay out ``repo_id`` in the hub cache directory ``hub`` as huggingface_hub does (refs/main -> the commit,
    snapshots/<commit>/...), the snapshot holding a copy of the directory ``files_from``; returns the snapshot."""
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    if files_from is not None:
        shutil.copytree(files_from, snap)
    else:
        os.makedirs(snap)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty hub cache, named by HF_HUB_CACHE (the other variables cleared)."""
    d = str(tmp_path / "hub")
    os.makedirs(d)
    for k in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", d)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may go to the network
    return d


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from engine_helpers import save_hf_llama

    pytest.importorskip("transformers")
    return save_hf_llama(tmp_path_factory.mktemp("llama") / "m", seed=1)


def _logits(loaded, ids):
    return loaded.model.prefill(ids, KVCache(loaded.config, 1, 16, dtype=torch.float32))


def test_hub_id_loads_the_cached_snapshot(hub, tiny_llama):
    snap = put_in_cache(hub, "acme/tiny-llama", tiny_llama)
    got = load("acme/tiny-llama", dtype=torch.float32, progress=False, max_seq_len=16)
    assert got.source == snap
    ids = torch.randint(0, 300, (1, 5))
    want = load(tiny_llama, dtype=torch.float32, progress=False, max_seq_len=16)
    torch.testing.assert_close(_logits(got, ids), _logits(want, ids), atol=0, rtol=0)


def test_hub_id_under_hf_home(tmp_path, monkeypatch, tiny_llama):
    """Without HF_HUB_CACHE the cache is HF_HOME/hub (read when loading, not when huggingface_hub was imported)."""
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap = put_in_cache(str(tmp_path / "home" / "hub"), "acme/tiny-llama", tiny_llama)
    assert resolve_source("acme/tiny-llama") == ("hf", snap)


def test_local_path_wins_over_hub_id(hub, tiny_llama, tmp_path, monkeypatch):
    """A directory ./acme/tiny-llama that exists is loaded, though the cache holds a model of that id too."""
    put_in_cache(hub, "acme/tiny-llama", tiny_llama)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama, "acme/tiny-llama")
    assert resolve_source("acme/tiny-llama") == ("hf", "acme/tiny-llama")


def test_not_in_cache_says_how_to_fetch_it(hub):
    msg = (rf"model 'acme/nothing' is not a local path, and the Hugging Face cache \({re.escape(hub)}\) does not "
           r"hold it; download it first with `hf download acme/nothing` \(older huggingface_hub: `huggingface-cli "
           r"download acme/nothing`\), or set HF_HUB_CACHE / HF_HOME to the cache that holds it")
    with pytest.raises(FileNotFoundError, match=msg):
        load("acme/nothing", progress=False)
    # a repo whose refs/main names a snapshot that is not there (an interrupted download): the same
    repo = os.path.join(hub, "models--acme--nothing", "refs")
    os.makedirs(repo)
    with open(os.path.join(repo, "main"), "w") as f:
        f.write(COMMIT)
    with pytest.raises(FileNotFoundError, match=msg):
        load("acme/nothing", progress=False)


@pytest.mark.parametrize("name", ["/nonexistent/model.gguf", "no-such-model", "a/b/c", "./acme/x", "acme/x.gguf",
                                  "acme--x/y"])
def test_neither_a_path_nor_a_hub_id_keeps_the_path_error(hub, name):
    assert not looks_like_repo_id(name)
    with pytest.raises(FileNotFoundError, match=rf"model path {re.escape(repr(name))} does not exist \(a \.gguf "
                                                r"file, a HF directory, a Hugging Face Hub id org/name"):
        load(name, progress=False)


def test_gguf_repo_resolves_to_its_gguf_file(hub):
    """A GGUF repo (no config.json): its one .gguf file; several are an error naming them."""
    snap = put_in_cache(hub, "acme/tiny-GGUF")
    open(os.path.join(snap, "README.md"), "w").close()
    open(os.path.join(snap, "tiny.Q4_0.gguf"), "w").close()
    assert resolve_source("acme/tiny-GGUF") == ("gguf", os.path.join(snap, "tiny.Q4_0.gguf"))
    open(os.path.join(snap, "tiny.Q8_0.gguf"), "w").close()
    with pytest.raises(ValueError, match=r"2 \.gguf files \(tiny\.Q4_0\.gguf, tiny\.Q8_0\.gguf\) and no "
                                         r"config\.json; pass the file to use as the model path"):
        resolve_source("acme/tiny-GGUF")


def test_generate_cli_with_a_hub_id(hub, tmp_path, capsys):
    """``fastdecode generate --model org/name`` on a Qwen3-layout checkpoint (q / k norms) with a tokenizer, from
    the cache; and one ``error:`` line, exit 2, for a model that is not there."""
    from engine_helpers import save_tiny_smollm2_vocab

    path, _ = save_tiny_smollm2_vocab(tmp_path / "q", qk_norm=True, head_dim=32, name="tiny-qwen3")
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3"
    put_in_cache(hub, "acme/tiny-qwen3", path)
    argv = ["generate", "The sky is", "--raw", "--max-new-tokens", "4", "--device", "cpu"]
    assert cli.main(argv + ["--model", "acme/tiny-qwen3"]) == 0
    out, err = capsys.readouterr()
    assert "[tiny-qwen3 on cpu, float32" in err
    ref = load(path, dtype=torch.float32, progress=False)  # the same model by its path: the same greedy text
    [r] = Engine(ref.model, ref.tokenizer, max_batch=1, max_seq_len=64).generate("The sky is", max_new_tokens=4)
    assert out == r.text + "\n"
    assert cli.main(argv + ["--model", "acme/elsewhere"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: model 'acme/elsewhere' is not a local path"), err
    assert "hf download acme/elsewhere" in err[0]
