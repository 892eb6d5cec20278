"""SiLU-and-mul fused into the MLP's down projection (``silu_and_mul_linear``, ``silu_and_mul_int4_linear``).

The fused GEMM computes ``silu(gate) * up`` as it loads its input and rounds it to h's dtype, the values the
SiLU-and-mul kernel stores; the weight loop and the accumulation are the GEMM's own. So on any config the fused
call equals ``linear(silu_and_mul(h))`` / ``int4_linear(silu_and_mul(h))`` bit for bit, which the tests check
(and both against the plain-PyTorch reference). On the CPU the kernels run under the interpreter, where bf16
``tl.dot`` is wrong (docs/architecture.md): fp16 and fp32 there, bf16 and fp16 on a GPU.
"""

import pytest
import torch

import fastdecode.ops as fd
import fastdecode.ops.gemm as L
import fastdecode.ops.int4 as I
from fastdecode.ops.activation import silu_and_mul_ref
from fastdecode.quant import int4 as Q
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
INT4_CONFIGS = {
    "fma_m1": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1),
    "fma_m2_split3": dict(kind="fma", BLOCK_M=2, BLOCK_N=4, BLOCK_K=256, SPLIT_K=3),
    "fma_m4_bk512_prefetch": dict(kind="fma", BLOCK_M=4, BLOCK_N=4, BLOCK_K=512, SPLIT_K=2, PREFETCH=True),
    "dot_split2": dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, PREFETCH=True),
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


# ----------------------------------------------------------------------------- int4 (W4A16)


def _packed(fmt, N, K, g):
    """test_int4's packed weights (integers, scales, zeros or GGUF-style mins drawn there), on DEV."""
    from test_int4 import _packed as packed_cpu

    p = packed_cpu(fmt, N, K, g)
    return p if DEV == "cpu" else Q.Int4Weight(*(t.to(DEV) if torch.is_tensor(t) else t for t in (
        p.qweight, p.scales, p.zeros, p.mins, p.group_size, p.zero_mode, p.perm, p.K)))


@pytest.mark.parametrize("name,fmt", [("fma_m1", "min"), ("fma_m2_split3", "zero"), ("fma_m4_bk512_prefetch", "sym"),
                                      ("dot_split2", "min"), ("dot_split2", "zero")])
def test_int4_every_config_and_format_equals_the_two_kernels(name, fmt):
    """Every path (each format once on the FMA path; the dot path in both zero modes it treats apart)."""
    cfg = INT4_CONFIGS[name]
    N, K, g = 37, 576, 32  # SmolLM2's K with GGUF's group: 2.25 layout tiles, a partial K block
    M = 3 if cfg["kind"] == "fma" else 19
    dtype = torch.float16
    w = _packed(fmt, N, K, g)
    h = _h(M, K, dtype, strided=True, std=1.0)  # |x| ~ 0.5, as test_int4's (its weights' mins are not centred)
    b = torch.randn(N, device=DEV).half()
    fused = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    I.int4_linear_with_config(h, w, b, fused, cfg, glu=True)
    two = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    I.int4_linear_with_config(fd.silu_and_mul(h, backend="triton"), w, b, two, cfg)
    assert torch.equal(fused, two)
    assert_close(fused, I.int4_linear_ref(silu_and_mul_ref(h), w, b), ulps=2)


@pytest.mark.parametrize("M", [1, 4, 33])
def test_int4_op_dispatch_and_act_order_fallback(M):
    dtype = torch.float16
    N, K = 48, 256
    w = _packed("zero", N, K, 64)
    h = _h(M, K, dtype)
    y = fd.silu_and_mul_int4_linear(h, w, backend="triton")
    assert torch.equal(y, fd.int4_linear(fd.silu_and_mul(h, backend="triton"), w, backend="triton"))
    assert torch.equal(fd.silu_and_mul_int4_linear(h, w, backend="torch"),
                       I.int4_linear_ref(silu_and_mul_ref(h), w))
    # act-order (a column permutation of the input): SiLU-and-mul first, then the gathered GEMM
    perm = torch.randperm(K, device=DEV)
    wp = Q.Int4Weight(w.qweight, w.scales, w.zeros, w.mins, w.group_size, w.zero_mode, perm, K)
    yp = fd.silu_and_mul_int4_linear(h, wp, backend="triton")
    assert torch.equal(yp, fd.int4_linear(fd.silu_and_mul(h, backend="triton"), wp, backend="triton"))


def test_int4_errors():
    w = _packed("sym", 16, 256, 128)
    with pytest.raises(ValueError, match=r"h must have shape \(\.\.\., 2 \* K\) = \(\.\.\., 512\)"):
        fd.silu_and_mul_int4_linear(torch.randn(2, 256, device=DEV).half(), w)
    with pytest.raises(ValueError, match="packed must be a fastdecode.quant.int4.Int4Weight"):
        fd.silu_and_mul_int4_linear(torch.randn(2, 512, device=DEV).half(), torch.zeros(16, 32))
    with pytest.raises(ValueError, match="impl must be one of"):
        fd.silu_and_mul_int4_linear(torch.randn(2, 512, device=DEV).half(), w, impl="cublas")


def test_opcheck_the_fused_ops():
    """Schema, fake implementation and aliasing agree (torch backend)."""
    from fastdecode.ops.gemm import _silu_and_mul_linear_op
    from fastdecode.ops.int4 import _silu_and_mul_int4_linear_op

    h = torch.randn(3, 64, device=DEV)
    torch.library.opcheck(_silu_and_mul_linear_op.default, (h, torch.randn(5, 32, device=DEV), None,
                                                            torch.empty(3, 5, device=DEV), "torch"),
                          test_utils=("test_schema", "test_faketensor"))
    w = _packed("zero", 16, 256, 64)
    torch.library.opcheck(_silu_and_mul_int4_linear_op.default,
                          (torch.randn(2, 512, device=DEV).half(), w.qweight, w.scales, w.zeros, None, None,
                           torch.empty(2, 16, device=DEV).half(), 64, "zero", "torch"),
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


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "int4"])
def test_decode_logits_fused_down_equal_unfused_gpu(quant):
    """A whole decode step with the fused down projection equals the one with SiLU-and-mul apart, bit for bit."""
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model

    m = random_model(ModelConfig.from_preset("smollm2-135m").replace(n_layers=3), device="cuda",
                     dtype=torch.bfloat16, max_seq_len=64)
    if quant:
        quantize_model(m, quant)
    x = torch.randn(4, 1, m.config.dim, device="cuda", dtype=torch.bfloat16)
    f = m.layers[1].feed_forward
    calls = []
    orig = f.w2.forward_glu
    f.w2.forward_glu = lambda h, be: calls.append(h.shape) or orig(h, be)
    y_fused = f(x, "auto")
    assert calls, "the fused path was not taken"
    f.fuse_down = False
    assert torch.equal(y_fused, f(x, "auto"))
