"""The ops' registration (``fastdecode.ops._registry``): ``torch.library.Library`` definitions whose schema,
fake implementation and aliasing agree (``torch.library.opcheck``), and that do not import ``torch._dynamo`` when
called eagerly (``torch.library.custom_op`` did, ~1 s of start-up, and cost ~10x the host time a call)."""

import subprocess
import sys

import pytest
import torch

import fastdecode.ops as fd
from fastdecode.ops._registry import Op
from fastdecode.ops.activation import _silu_and_mul_op
from fastdecode.ops.norm import _rms_norm_op

OPS = ("rms_norm", "silu_and_mul", "quantize_fp8", "linear", "linear_fp8", "int4_linear", "int4_linear_fp8",
       "decode_attention", "rope_kv_write", "rope_decode_attention", "all_reduce", "all_reduce_add_rms_norm", "argmax")


def test_every_op_is_registered_once_with_a_schema():
    import fastdecode.ops.allreduce  # noqa: F401  (registers the all-reduce ops)
    import fastdecode.ops.attention  # noqa: F401
    import fastdecode.ops.int4  # noqa: F401

    for name in OPS:
        op = getattr(torch.ops.fastdecode, name).default
        assert op._schema.returns == [], name  # every op writes into buffers its wrapper allocated
        assert any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments), name


def test_opcheck_norm_and_silu():
    """Schema, fake implementation and aliasing agree with what the op does (torch backend, CPU; FP8 outputs are
    left out: opcheck's comparisons multiply them, which float8 tensors do not support on the CPU)."""
    x = torch.randn(3, 16)
    r = torch.randn(3, 16)
    w = torch.rand(16) + 0.5
    for op, args in (
        (_rms_norm_op, (x, r.clone(), w, torch.empty(3, 16), None, None, 1e-5, "torch")),
        (_silu_and_mul_op, (torch.randn(3, 32), torch.empty(3, 16), None, None, "torch")),
    ):
        assert isinstance(op, Op)
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


def test_eager_call_does_not_import_dynamo():
    code = ("import sys, torch, fastdecode.ops as fd; fd.rms_norm(torch.randn(2, 8), torch.ones(8), backend='torch'); "
            "fd.silu_and_mul(torch.randn(2, 8), backend='torch'); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("compile_backend", ["aot_eager"])
def test_in_place_update_survives_compile(compile_backend):
    """The mutated residual is written back under torch.compile (functionalisation of the schema's (a!) args)."""
    x, r, w = torch.randn(2, 16), torch.randn(2, 16), torch.rand(16) + 0.5

    def f(x, r):
        return fd.fused_add_rms_norm(x, r, w, 1e-6, backend="torch")

    r1, r2 = r.clone(), r.clone()
    y1 = f(x, r1)
    y2 = torch.compile(f, fullgraph=True, backend=compile_backend)(x, r2)
    assert torch.equal(r1, r2) and torch.equal(y1, y2)
