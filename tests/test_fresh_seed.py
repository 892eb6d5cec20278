"""conftest.py draws a fresh seed for every test; a failure's report must name it, and the named seed must draw the
same inputs again (the CI's random draws are not reproducible otherwise)."""

import os
import re
import subprocess
import sys
from pathlib import Path

FAILING = '''
import torch

def test_draws_then_fails():
    print("draw", repr(torch.rand(3).tolist()))
    assert False
'''


def _run(tmp_path, seed=None):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FASTDECODE_TEST_SEED", None)
    env.pop("FASTDECODE_TEST_TIMES", None)
    if seed is not None:
        env["FASTDECODE_TEST_SEED"] = str(seed)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "test_failing.py"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout
    draw = re.search(r"^draw (.*)$", out, re.M)
    named = re.search(r"rerun with FASTDECODE_TEST_SEED=(\d+)", out)
    assert draw and named and "1 failed" in out, out
    return draw.group(1), int(named.group(1))


def test_a_failure_names_its_seed_and_the_seed_draws_the_same_inputs(tmp_path):
    (tmp_path / "test_failing.py").write_text(FAILING)
    draw, seed = _run(tmp_path)
    other_draw, other_seed = _run(tmp_path)
    assert (other_draw, other_seed) != (draw, seed)  # fresh: two runs draw apart (2**-32 to collide)
    again, named = _run(tmp_path, seed)
    assert (again, named) == (draw, seed)
