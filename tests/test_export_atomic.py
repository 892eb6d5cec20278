"""``fastdecode quantize`` / ``save_checkpoint`` write atomically and refuse what would destroy data: DST equal to
or overlapping SRC, an existing non-empty DST without ``--overwrite``, a missing or unwritable parent (before the
load); a failure or a kill mid-write leaves DST as it was and no temporary directory behind (after a rerun)."""

import errno
import os
import signal
import subprocess
import sys

import pytest
import torch

from fastdecode import cli
from fastdecode.engine import export
from fastdecode.engine.loader import load, random_model
from fastdecode.models.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q = ["--method", "fp8", "--dtype", "float32"]


def _src(tmp_path, name="src") -> str:
    """A tiny dense checkpoint (no tokenizer): a quantize source that loads in well under a second."""
    m = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=32, seed=1)
    d = str(tmp_path / name)
    export.save_checkpoint(m, None, d, None)
    return d


def _snapshot(d) -> dict:
    """Every file under ``d`` (relative path -> bytes)."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = fh.read()
    return out


def _temps(parent) -> list:
    return sorted(e for e in os.listdir(parent) if ".tmp-" in e or ".old-" in e)


def _fake_sharded(d) -> None:
    """An old DST: a sharded checkpoint's files (index json included) that a fresh export does not write."""
    os.makedirs(d)
    for name, text in [("config.json", '{"old": true}'), ("model.safetensors.index.json", '{"weight_map": {}}'),
                       ("model-00001-of-00002.safetensors", "old shard 1"),
                       ("model-00002-of-00002.safetensors", "old shard 2")]:
        with open(os.path.join(d, name), "w") as f:
            f.write(text)


@pytest.fixture
def no_load(monkeypatch):
    """Refusals must come before the (slow) load of SRC."""
    import fastdecode.engine.loader as loader

    def fail(*a, **k):
        raise AssertionError("the source was loaded before the refusal")

    monkeypatch.setattr(loader, "load", fail)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_dst_equal_to_or_overlapping_src_is_refused(tmp_path, capsys, no_load):
    src = _src(tmp_path)
    before = _snapshot(src)
    for dst, what in [(src, "is the source"), (src + "/.", "is the source"),
                      (os.path.join(src, "q"), "is inside the source"),
                      (str(tmp_path), "is inside DST")]:
        assert cli.main(["quantize", src, dst, *Q, "--overwrite"]) == 2
        err = _one_error_line(capsys)
        assert what in err and repr(dst) in err
        assert _snapshot(src) == before and _temps(tmp_path) == [] and _temps(src) == []
    link = tmp_path / "alias"
    link.symlink_to(src)  # resolved real paths: a symlink to SRC is SRC
    assert cli.main(["quantize", src, str(link), *Q]) == 2 and "is the source" in _one_error_line(capsys)
    # a file source (a .gguf): DST == SRC refused before anything reads it
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    assert cli.main(["quantize", str(gguf), str(gguf), *Q, "--overwrite"]) == 2
    assert "is the source" in _one_error_line(capsys) and gguf.read_bytes() == b"GGUF not really"
    assert _snapshot(src) == before


def test_existing_dst_refused_without_overwrite_and_replaced_with_it(tmp_path, capsys):
    src = _src(tmp_path)
    dst = str(tmp_path / "q")
    _fake_sharded(dst)
    before = _snapshot(dst)
    assert cli.main(["quantize", src, dst, *Q]) == 2
    err = _one_error_line(capsys)
    assert repr(dst) in err and "--overwrite" in err and _snapshot(dst) == before
    # the library call refuses the same way
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        export.quantize_checkpoint(src, dst, "fp8", dtype=torch.float32)
    assert _snapshot(dst) == before

    assert cli.main(["quantize", src, dst, *Q, "--overwrite"]) == 0
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]  # no stale index json or shards
    assert load(dst, dtype=torch.float32, progress=False, max_seq_len=32).model.quant == "fp8"
    assert _temps(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(dst).st_mode & 0o777 == 0o777 & ~umask  # a plain directory, not mkdtemp's private 0700
    # an existing empty directory is written without --overwrite
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["quantize", src, str(empty), *Q]) == 0 and (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("existing", [False, True])
def test_failure_mid_write_leaves_dst_untouched_and_no_temp_dir(tmp_path, capsys, monkeypatch, existing):
    import safetensors.torch

    src = _src(tmp_path)
    dst = str(tmp_path / "q")
    if existing:
        _fake_sharded(dst)
    before = _snapshot(dst) if existing else None

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    assert cli.main(["quantize", src, dst, *Q, "--overwrite"]) == 2
    err = _one_error_line(capsys)
    assert repr(dst) in err and "No space left on device" in err and "unchanged" in err
    assert (_snapshot(dst) == before) if existing else not os.path.lexists(dst)
    assert _temps(tmp_path) == []
    # the public writer: the same errno, DST named, nothing left
    m = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=32)
    with pytest.raises(OSError, match="No space left on device") as e:
        export.save_checkpoint(m, None, dst, None, overwrite=True)
    assert e.value.errno == errno.ENOSPC and repr(dst) in str(e.value)
    assert (_snapshot(dst) == before) if existing else not os.path.lexists(dst)
    assert _temps(tmp_path) == []


def test_failed_swap_puts_the_old_dst_back(tmp_path, monkeypatch):
    src = _src(tmp_path)
    dst = str(tmp_path / "q")
    _fake_sharded(dst)
    before = _snapshot(dst)
    rename = os.rename

    def flaky(a, b):
        if ".tmp-" in os.path.basename(str(a)):  # renaming the new directory in
            raise OSError(errno.EIO, "Input/output error")
        rename(a, b)

    monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        export.quantize_checkpoint(src, dst, "fp8", dtype=torch.float32, overwrite=True)
    assert _snapshot(dst) == before and _temps(tmp_path) == []


def test_missing_or_unwritable_parent_refused_before_the_load(tmp_path, capsys, no_load, monkeypatch):
    dst = str(tmp_path / "nope" / "q")
    assert cli.main(["quantize", "tiny", dst, *Q]) == 2
    err = _one_error_line(capsys)
    assert "parent directory" in err and "does not exist" in err and repr(dst) in err
    # unwritable: os.access is what decides (a root user passes a chmod 0500 directory, so it is faked here)
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(ro) else real_access(p, mode, **k))
    assert cli.main(["quantize", "tiny", str(ro / "q"), *Q]) == 2
    err = _one_error_line(capsys)
    assert "is not writable" in err and str(ro) in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a chmod 0500 directory; the os.access-faked test covers the check")
def test_chmod_readonly_parent_refused_before_the_load(tmp_path, capsys, no_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert cli.main(["quantize", "tiny", str(ro / "q"), *Q]) == 2
        assert "is not writable" in _one_error_line(capsys)
    finally:
        ro.chmod(0o700)


_KILLED_DRIVER = """
import os, signal, sys
import safetensors.torch

def killed(*a, **k):  # the process dies in the middle of writing (config.json already in the temp directory)
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = killed
from fastdecode.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("existing", [False, True])
def test_sigkill_mid_write_then_rerun_cleans_up(tmp_path, capsys, existing):
    src = _src(tmp_path)
    dst = str(tmp_path / "q")
    if existing:
        _fake_sharded(dst)
    before = _snapshot(dst) if existing else None
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _KILLED_DRIVER, "quantize", src, dst, *Q, "--overwrite"],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (_snapshot(dst) == before) if existing else not os.path.lexists(dst)
    stale = _temps(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".q.tmp-")
    assert os.path.isfile(tmp_path / stale[0] / "config.json")  # it was killed mid-write
    # a second run succeeds and removes the dead run's temporary directory
    assert cli.main(["quantize", src, dst, *Q, "--overwrite"]) == 0
    assert _temps(tmp_path) == [] and sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    assert load(dst, dtype=torch.float32, progress=False, max_seq_len=32).model.quant == "fp8"


def test_stale_cleanup_is_limited_to_dead_writers_of_this_dst(tmp_path):
    src = _src(tmp_path)
    dead = 2 ** 22 + 12345  # above Linux's largest pid_max: no such process
    keep = [f".q.tmp-{os.getpid()}-abc123",  # a live writer (this process)
            f".q.old-{dead}-abc123",  # killed between the renames, DST missing: the only copy of the old DST
            f".qq.tmp-{dead}-abc123", f".q.tmp-5.tmp-{dead}-abc123", ".q.tmp-x-abc123", "q.tmp-1-abc"]
    gone = [f".q.tmp-{dead}-abc123", f".q.tmp-{dead}-zz_9"]
    for name in keep + gone:
        os.makedirs(tmp_path / name / "sub")
    export.quantize_checkpoint(src, str(tmp_path / "q"), "fp8", dtype=torch.float32)
    entries = set(os.listdir(tmp_path))
    assert set(keep) <= entries and not set(gone) & entries
    # once DST exists, an old DST left aside by a dead writer is garbage
    export.quantize_checkpoint(src, str(tmp_path / "q"), "fp8", dtype=torch.float32, overwrite=True)
    assert f".q.old-{dead}-abc123" not in os.listdir(tmp_path)


def test_save_checkpoint_is_atomic_and_refuses_existing(tmp_path):
    m = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=32)
    d = tmp_path / "ck"
    export.save_checkpoint(m, None, str(d), None)  # positional signature unchanged
    before = _snapshot(d)
    with pytest.raises(ValueError, match="already exists"):
        export.save_checkpoint(m, None, str(d), None)
    assert _snapshot(d) == before
    export.save_checkpoint(m, None, str(d) + "/", None, overwrite=True)  # a trailing slash names the same DST
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"] and _temps(tmp_path) == []
