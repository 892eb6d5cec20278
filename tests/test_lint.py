"""ruff over src/, tests/ and benchmarks/ (pyproject.toml's [tool.ruff]: 120 columns, E/F/W), as part of the suite."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is in the [test] extra (pip install -e '.[test]'); "
                    "not installed here (e.g. the offline GPU image)")
    # --no-cache: nothing written into the checkout (it may be read-only); the check takes well under a second
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    rc = r.returncode
    assert rc == 0, f"`ruff check src tests benchmarks` failed (exit {rc}):\n{r.stdout}{r.stderr}"
