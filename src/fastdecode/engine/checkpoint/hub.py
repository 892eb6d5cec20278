"""A Hugging Face Hub id (``org/name``) resolved to its snapshot in the local Hugging Face cache, never downloaded.

``load("Qwen/Qwen3-0.6B")`` reads ``<cache>/models--Qwen--Qwen3-0.6B/snapshots/<commit of refs/main>/`` through
``huggingface_hub.snapshot_download(repo_id, local_files_only=True)``; the cache is ``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read when called, so a changed environment counts). A model
that is not there is an error that says how to fetch it (``hf download org/name``). ``detect.resolve_source``
asks here only for a name that is not an existing local path and has the shape of a repo id.
"""

from __future__ import annotations

import os
import re
from typing import Optional

# what the Hub accepts as "namespace/name": letters, digits, "-", "_", "." (huggingface_hub validate_repo_id)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def looks_like_repo_id(name) -> bool:
    """True for ``org/name`` (one slash, Hub characters, no ``--`` / ``..``, not a ``.gguf`` file name)."""
    return (isinstance(name, str) and _REPO_ID.fullmatch(name) is not None and "--" not in name
            and ".." not in name and not name.endswith((".git", ".gguf")))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache directory, with huggingface_hub's precedence of environment variables."""
    env = os.environ
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not hub:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                  "huggingface")
        hub = os.path.join(home, "hub")
    return os.path.expanduser(os.path.expandvars(hub))


def not_cached_message(repo_id: str, cache: str, why: Optional[str] = None) -> str:
    return (f"model {repo_id!r} is not a local path, and the Hugging Face cache ({cache}) does not hold it"
            f"{f' ({why})' if why else ''}; download it first with `hf download {repo_id}` (older "
            f"huggingface_hub: `huggingface-cli download {repo_id}`), or set HF_HUB_CACHE / HF_HOME to the cache "
            "that holds it")


def cached_snapshot(repo_id: str) -> str:
    """The local snapshot of ``repo_id`` (its ``main`` revision): a directory, or its one ``.gguf`` file when the
    repo has no ``config.json`` (a GGUF repo). FileNotFoundError saying how to fetch it when it is not cached."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise ImportError(f"model {repo_id!r} is not a local path; reading a Hub id from the Hugging Face cache "
                          "needs huggingface_hub (pip install huggingface_hub)") from None
    cache = hub_cache_dir()
    try:
        path = snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except HFValidationError as e:
        raise ValueError(f"model {repo_id!r} is not a local path nor a valid Hugging Face repo id: {e}") from None
    except OSError as e:  # LocalEntryNotFoundError; its IncompleteSnapshotError (an interrupted download) names
        # the missing files
        why = None if type(e) is LocalEntryNotFoundError else f"{type(e).__name__}: {e}"
        raise FileNotFoundError(not_cached_message(repo_id, cache, why)) from None
    return _model_file(repo_id, path)


def _model_file(repo_id: str, snapshot: str) -> str:
    """A snapshot directory with config.json as is; without one, its single .gguf file (GGUF repos)."""
    if os.path.exists(os.path.join(snapshot, "config.json")):
        return snapshot
    ggufs = sorted(f for f in os.listdir(snapshot) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"model {repo_id!r}: the cached snapshot {snapshot} has {len(ggufs)} .gguf files "
                         f"({', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''}) and no config.json; pass "
                         "the file to use as the model path")
    raise FileNotFoundError(f"model {repo_id!r}: the cached snapshot {snapshot} has neither a config.json nor a "
                            f".gguf file; download the model's files (`hf download {repo_id}`)")
