"""SiLU-and-mul fused into the MLP's down projection (``silu_and_mul_linear``).

The fused GEMM computes ``silu(gate) * up`` as it loads its input and rounds it to h's dtype, the values the
SiLU-and-mul kernel stores; the weight loop and the accumulation are the GEMM's own. So on any config the fused
call equals ``linear(silu_and_mul(h))`` bit for bit, which the tests check (and both against the plain-PyTorch
reference). The int4 GEMM has no fused form: on the H200 it made the 8B int4 step 201 us slower
(benchmarks/NOTES.md, session 10). On the CPU the kernels run under the interpreter, where bf16
``tl.dot`` is wrong (docs/architecture.md): fp16 and fp32 there, bf16 and fp16 on a GPU.
"""

import pytest
import torch

import fastdecode.ops as fd
import fastdecode.ops.gemm as L
from fastdecode.ops.activation import silu_and_mul_ref
from helpers import assert_close, poison_, strided_rows

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if CUDA else (torch.float16, torch.float32)

LINEAR_CONFIGS = {
    "fma_m1": dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
    "fma_m4_split5": dict(kind="fma", BLOCK_M=4, BLOCK_N=4, BLOCK_K=32, SPLIT_K=5),
    "fma_m2_prefetch_split3": dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, PREFETCH=True),
    "dot_split1": dict(kind="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),
    "dot_split4": dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4),
}


def _h(M, K, dtype, strided=False, std=2.0):
    """[gate | up] rows (2K wide), gates over silu's whole range."""
    if strided:
        return (strided_rows(M, 2 * K, torch.float32, DEV) * std).to(dtype)
    return (torch.randn(M, 2 * K, device=DEV) * std).to(dtype)


def _dot_ok(cfg, dtype):
    return cfg["kind"] != "dot" or CUDA or dtype != torch.bfloat16


# ----------------------------------------------------------------------------- bf16 / fp16 / fp32 linear


@pytest.mark.parametrize("name", list(LINEAR_CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_every_config_equals_the_two_kernels(name, dtype):
    cfg = LINEAR_CONFIGS[name]
    N, K = 67, 200  # odd sizes: partial N tiles and a partial K block
    M = 3 if cfg["kind"] == "fma" else 19
    h = _h(M, K, dtype, strided=True)
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(dtype)
    b = torch.randn(N, device=DEV).to(dtype)
    fused = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    L.linear_with_config(h, w, b, None, 0, None, 0, fused, cfg, glu=True)
    two = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    L.linear_with_config(fd.silu_and_mul(h, backend="triton"), w, b, None, 0, None, 0, two, cfg)
    assert torch.equal(fused, two)
    if _dot_ok(cfg, dtype):
        assert_close(fused, L.linear_ref(silu_and_mul_ref(h), w, b))


@pytest.mark.parametrize("M", [1, 4, 33])
def test_linear_op_dispatch_nd_and_out(M):
    dtype = DTYPES[-1]
    N, K = 40, 96
    h = _h(2 * M, K, dtype).view(2, M, 2 * K)
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(dtype)
    out = poison_(torch.empty(2, M, N, dtype=dtype, device=DEV))
    y = fd.silu_and_mul_linear(h, w, out=out, backend="triton")
    assert y is out and y.shape == (2, M, N)
    assert torch.equal(y, fd.linear(fd.silu_and_mul(h, backend="triton"), w, backend="triton"))
    assert torch.equal(fd.silu_and_mul_linear(h, w, backend="torch"), L.linear_ref(silu_and_mul_ref(h), w))


def test_linear_errors_and_empty():
    dtype = DTYPES[-1]
    w = torch.randn(8, 16, device=DEV, dtype=dtype)
    with pytest.raises(ValueError, match=r"h must have shape \(\.\.\., 2 \* K\) = \(\.\.\., 32\)"):
        fd.silu_and_mul_linear(torch.randn(2, 16, device=DEV, dtype=dtype), w)
    with pytest.raises(ValueError, match="weight must have the dtype of h"):
        fd.silu_and_mul_linear(torch.randn(2, 32, device=DEV, dtype=dtype), w.to(torch.float16 if dtype != torch.float16
                                                                                  else torch.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        fd.silu_and_mul_linear(torch.randn(2, 32, device=DEV, dtype=dtype), w, impl="magic")
    assert fd.silu_and_mul_linear(torch.empty(0, 32, device=DEV, dtype=dtype), w, backend="triton").shape == (0, 8)


def test_opcheck_the_fused_ops():
    """Schema, fake implementation and aliasing agree (torch backend)."""
    from fastdecode.ops.glu_linear import _silu_and_mul_linear_op

    h = torch.randn(3, 64, device=DEV)
    torch.library.opcheck(_silu_and_mul_linear_op.default, (h, torch.randn(5, 32, device=DEV), None,
                                                            torch.empty(3, 5, device=DEV), "torch"),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- the model


def test_model_takes_the_fused_path_only_on_cuda():
    """On the CPU (the engine's torch path) the MLP keeps its two ops; ``fused_down`` is an ablation switch."""
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    m = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=16)
    f = m.layers[0].feed_forward
    assert f.w2.forward_glu(torch.randn(2, 2 * f.w2.in_features), "auto") is None
    m.set_kernels(fused_down=False)
    assert not f.fuse_down and m.kernels["fused_down"] is False


def test_int4_and_fp8_down_projections_keep_the_two_kernels():
    """The bf16 / fp16 skinny GEMM takes the fused input; int4 (slower fused, measured) runs SiLU-and-mul as its own
    kernel, and so does FP8 W8A8 (its activation is quantised per token over the whole row first), the path without
    the ``fp8_a16`` switch (on by default), which makes w2 W8A16 at decode, computing SiLU-and-mul in its loads."""
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model

    for quant in ("int4", "fp8"):
        m = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=16)
        quantize_model(m, quant)
        w2 = m.layers[0].feed_forward.w2
        h = torch.randn(2, 1, 2 * w2.in_features)
        if quant == "int4":
            assert getattr(w2, "forward_glu", None) is None
            continue
        assert w2.forward_glu(h, "torch").shape == (2, 1, w2.out_features)  # fp8_a16 (default): W8A16
        m.set_kernels(fp8_a16=False)
        assert w2.forward_glu(h, "torch") is None  # W8A8: SiLU-and-mul's FP8 kernel, then the GEMM
        m.set_kernels(fp8_a16=True)
        assert w2.forward_glu(torch.randn(5, 1, 2 * w2.in_features), "torch") is None  # more rows than decode's


@pytest.mark.gpu
def test_decode_mlp_fused_down_equals_unfused_gpu():
    """The MLP with the fused down projection equals the one with SiLU-and-mul apart, bit for bit."""
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig

    m = random_model(ModelConfig.from_preset("smollm2-135m").replace(n_layers=3), device="cuda",
                     dtype=torch.bfloat16, max_seq_len=64)
    x = torch.randn(4, 1, m.config.dim, device="cuda", dtype=torch.bfloat16)
    f = m.layers[1].feed_forward
    calls = []
    orig = f.w2.forward_glu
    f.w2.forward_glu = lambda h, be: calls.append(h.shape) or orig(h, be)
    y_fused = f(x, "auto")
    assert calls, "the fused path was not taken"
    f.fuse_down = False
    assert torch.equal(y_fused, f(x, "auto"))
