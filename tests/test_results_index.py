"""Every archived GPU record is indexed: each file or folder in ``benchmarks/results/archive/`` and
``benchmarks/results/h100/`` is named in that folder's README.md (session 30 found 49 archive entries and the whole
h100 folder unlisted since session 20)."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _expand(name: str) -> list[str]:
    """Shell-style brace expansion of one name: ``a_{x,y}_{1,2}.json`` -> four names."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",") for n in _expand(name[:m.start()] + alt + name[m.end():])]


def unlisted(folder: Path) -> list[str]:
    """The entries of ``folder`` (but its README.md) that no backticked name of the README names (braces expanded,
    ``*`` as in the shell)."""
    text = (folder / "README.md").read_text()
    named = {n.rstrip("/") for quoted in re.findall(r"`([^`]+)`", text) for n in _expand(quoted)}
    return sorted(e.name for e in folder.iterdir()
                  if e.name != "README.md" and not any(fnmatchcase(e.name, n) for n in named))


def test_brace_expansion():
    assert _expand("d_{a,b}_{p,q}.json") == ["d_a_p.json", "d_a_q.json", "d_b_p.json", "d_b_q.json"]
    assert _expand("plain.json") == ["plain.json"]


def test_an_unlisted_record_is_found(tmp_path):
    (tmp_path / "README.md").write_text("| `run_{a,b}.json`, `cfg/`, `log_*.txt` | two runs | Session 1 |\n")
    for name in ("run_a.json", "run_b.json", "run_c.json", "log_1.txt"):
        (tmp_path / name).write_text("[]")
    (tmp_path / "cfg").mkdir()
    assert unlisted(tmp_path) == ["run_c.json"]


@pytest.mark.parametrize("folder", ["archive", "h100"])
def test_every_record_is_in_its_readme(folder):
    assert unlisted(RESULTS / folder) == [], f"add a row for these to benchmarks/results/{folder}/README.md"
