"""Host time per call (issues 16, 17): what the launchers and the model build must not pay for.

* ``triton.cdiv`` / ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in triton 3.6 (~8 us a call from
  Python on the H200 host, ~10 calls per GEMM launch): host code uses ``fastdecode.kernels.host`` instead.
* Building the model on meta and calling an op eagerly import neither ``torch._dynamo`` (1-6 s of start-up)
  nor, for the torch backend, triton.
"""

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

import fastdecode
from fastdecode.kernels.host import cdiv, next_pow2

SRC = Path(fastdecode.__file__).resolve().parent
SLOW_HOST_CALLS = {"cdiv", "next_power_of_2"}


def test_integer_helpers_match_math():
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 64, 128, 256):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)
        assert next_pow2(a) == (1 if a <= 1 else 2 ** math.ceil(math.log2(a))), a
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1 and next_pow2(2**40 + 1) == 2**41
    assert isinstance(cdiv(7.0, 2), int) and isinstance(next_pow2(5), int)


def _slow_calls(path: Path, root: Path = SRC) -> list[str]:
    """``triton.cdiv(...)`` / ``triton.next_power_of_2(...)`` calls in a source file (inside jitted code the
    kernels use ``tl.cdiv``, which this does not match)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SLOW_HOST_CALLS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton"):
            found.append(f"{path.relative_to(root)}:{node.lineno}: triton.{node.func.attr}")
    return found


def test_no_launcher_calls_triton_constexpr_helpers():
    found = [hit for p in sorted(SRC.rglob("*.py")) for hit in _slow_calls(p)]
    assert not found, "use fastdecode.kernels.host.cdiv / next_pow2 on the host:\n" + "\n".join(found)


def test_the_scan_finds_a_slow_call(tmp_path):
    """The scan above is not vacuous: it finds the pattern it forbids."""
    p = tmp_path / "launcher.py"
    p.write_text("import triton\n\ndef grid(n):\n    return (triton.cdiv(n, 128), triton.next_power_of_2(n))\n")
    assert [h.split(": ")[1] for h in _slow_calls(p, tmp_path)] == ["triton.cdiv", "triton.next_power_of_2"]


@pytest.mark.parametrize("code, absent", [
    # the model as the loader builds it (on meta), then assigned: no Dynamo
    ("from fastdecode.models.config import ModelConfig; from fastdecode.models.llama import Transformer\n"
     "with torch.device('meta'):\n"
     "    m = Transformer(ModelConfig.from_preset('tiny'), dtype=torch.bfloat16, rope_len=16)\n"
     "assert m.tok_embeddings.weight.is_meta and not m.tok_embeddings.weight.requires_grad",
     ("torch._dynamo",)),
    # importing every op module and running the torch backend: no Dynamo, no triton
    ("import fastdecode.ops as fd, fastdecode.ops.attention, fastdecode.ops.gemm, fastdecode.ops.int4\n"
     "fd.rms_norm(torch.randn(2, 8), torch.ones(8), backend='torch')",
     ("torch._dynamo", "triton")),
], ids=["meta-build", "ops-torch-backend"])
def test_fresh_process_imports_nothing_slow(code, absent):
    probe = f"\nbad = [m for m in {absent!r} if m in sys.modules]\nprint('LOADED', bad)"
    out = subprocess.run([sys.executable, "-c", "import sys, torch\n" + code + probe], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "LOADED []", out.stdout
