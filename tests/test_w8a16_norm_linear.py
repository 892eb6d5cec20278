"""The RMSNorm inside the W8A16 GEMV after it and the residual add inside the W8A16 GEMV before it
(``ops.w8a16``'s ``rms_norm_linear_w8a16`` / ``add_linear_w8a16_``: the FP8 blocks of the ``norm_gemm`` decode step).

Against the fp32 recipes (``*_ref``) with fresh random inputs, poisoned outputs, odd sizes, strided rows, per-channel
and per-tensor scales, bf16 and fp16; on the CPU through the Triton interpreter (the FMA kind has no ``tl.dot``), and
on the GPU (``gpu`` marks) at the Llama-3.1-8B shapes under a CUDA graph.
"""

import re

import pytest
import torch

import fastdecode.ops.w8a16 as W
from fastdecode.ops.norm import rms_norm_ref
from fastdecode.ops.w8a16 import (
    MAX_M, add_linear_w8a16_, add_linear_w8a16_ref, linear_w8a16_ref, rms_norm_linear_w8a16,
    rms_norm_linear_w8a16_ref,
)
from helpers import assert_product_close, fp8_dequantised, fp8_weight, poison_, strided_rows

gpu = pytest.mark.gpu
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16)


def _weight(N, K, per_tensor=False):
    return fp8_weight(N, K, per_tensor, DEV)


def _h(M, K, dtype, strided=False):
    """A residual stream's rows (rms ~3) and a norm weight around 1."""
    h = strided_rows(M, K, torch.float32, DEV) * 3 if strided else torch.randn(M, K, device=DEV) * 3
    return h.to(dtype), (torch.rand(K, device=DEV) + 0.5).to(dtype)


def _normed(h, g, eps):
    """The exact input of the fused recipe: ``h * g`` rounded to h's dtype, times the row's rstd (fp32)."""
    rstd = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    a = (h.float() * g.float()).to(h.dtype) if g is not None else h
    return a.float() * rstd


def _fma(M, split=1, bn=4, bk=64):
    return dict(kind="fma", BLOCK_M=min(4, 1 << max(M - 1, 0).bit_length()), BLOCK_N=bn, BLOCK_K=bk,
                SPLIT_K=split, num_warps=2 if CUDA else 1, num_stages=1)


@pytest.fixture
def config(monkeypatch):
    """Pin the op's config (the package table or the heuristic otherwise): ``config(cfg)``."""
    def pin(cfg):
        monkeypatch.setattr(W, "get_w8a16_config", lambda M, N, K, device=None, glu=False: dict(cfg))
    return pin


# ----------------------------------------------------------------------------- rms_norm_linear_w8a16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,affine,per_tensor,bias", [
    (1, 37, 256, True, False, False), (2, 19, 300, True, True, True), (3, 8, 130, False, False, False),
    (4, 21, 192, True, False, True)])
def test_norm_in_the_w8a16_gemv_equals_the_reference(config, dtype, M, N, K, affine, per_tensor, bias):
    """The X_NORM kernel on FP8 weights: odd N (partial tiles), K not a multiple of BLOCK_K, strided h rows, with
    and without the norm weight, a bias, a poisoned output: the fused recipe within the bound of its sums."""
    config(_fma(M))
    h, g = _h(M, K, dtype, strided=True)
    g = g if affine else None
    w, ws = _weight(N, K, per_tensor)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    out = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    y = rms_norm_linear_w8a16(h, g, w, ws, b, eps=1e-5, out=out, backend="triton")
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    ref = rms_norm_linear_w8a16_ref(h, g, w, ws, b, eps=1e-5)
    assert_product_close(y, ref, _normed(h, g, 1e-5), fp8_dequantised(w, ws))
    # and the two-kernel recipe (the normed rows rounded to h's dtype, then W8A16): one more rounding of the input
    two = linear_w8a16_ref(rms_norm_ref(h, g if g is not None else torch.ones_like(h[0]), 1e-5), w, ws, b)
    assert_product_close(y, two, _normed(h, g, 1e-5), fp8_dequantised(w, ws), roundings=4)


def test_split_config_runs_the_norm_kernel_first(config):
    """A config the X_NORM prologue cannot take (split K): the norm kernel, then the W8A16 GEMV: the two-kernel
    recipe within the bound of its sums."""
    config(_fma(2, split=3, bk=32))
    h, g = _h(2, 200, torch.bfloat16)
    w, ws = _weight(24, 200)
    y = rms_norm_linear_w8a16(h, g, w, ws, eps=1e-6, backend="triton")
    two = linear_w8a16_ref(rms_norm_ref(h, g, 1e-6), w, ws)
    assert_product_close(y, two, _normed(h, g, 1e-6), fp8_dequantised(w, ws))


def test_norm_op_leading_dims_empty_and_torch_backend():
    h, g = _h(2, 96, torch.bfloat16)
    w, ws = _weight(16, 96)
    h3 = h.view(2, 1, 96)
    y = rms_norm_linear_w8a16(h3, g, w, ws, eps=1e-6, backend="triton")
    assert y.shape == (2, 1, 16)
    torch.testing.assert_close(rms_norm_linear_w8a16(h3, g, w, ws, eps=1e-6, backend="torch"),
                               rms_norm_linear_w8a16_ref(h3, g, w, ws, eps=1e-6), atol=0, rtol=0)
    assert rms_norm_linear_w8a16(h[:0], g, w, ws, backend="triton").shape == (0, 16)


def test_norm_op_refusals_name_the_argument():
    h, g = _h(1, 64, torch.bfloat16)
    w, ws = _weight(8, 64)
    with pytest.raises(ValueError, match=f"at most {MAX_M} token rows"):
        rms_norm_linear_w8a16(torch.randn(MAX_M + 1, 64, device=DEV).bfloat16(), g, w, ws)
    with pytest.raises(ValueError, match="h must have dtype"):
        rms_norm_linear_w8a16(h.float(), g, w, ws)
    with pytest.raises(ValueError, match="norm_weight must have dtype"):
        rms_norm_linear_w8a16(h, g.half(), w, ws)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(64,\)"):
        rms_norm_linear_w8a16(h, g[:32], w, ws)
    with pytest.raises(ValueError, match="weight_fp8 must have dtype"):
        rms_norm_linear_w8a16(h, g, w.bfloat16(), ws)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_linear_w8a16(h, g, w, ws, eps=-1.0)


# ----------------------------------------------------------------------------- add_linear_w8a16_


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg,M", [(_fma(1), 1), (_fma(3, split=3, bk=32), 3), (_fma(2, bn=8), 2)])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_residual_add_in_the_w8a16_epilogue(config, dtype, cfg, M, glu, per_tensor):
    """residual += x @ (Wq * s).T in place, with and without split K and SiLU-and-mul in the loads: the fp32 sum
    rounded once (the reference), within the bound of the sums (the residual ~4 counts in the ulp)."""
    config(cfg)
    N, K = 45, 200
    x = (strided_rows(M, 2 * K if glu else K, torch.float32, DEV) * 2).to(dtype)
    w, ws = _weight(N, K, per_tensor)
    b = torch.randn(N, device=DEV).to(dtype)
    r0 = (torch.randn(M, N, device=DEV) * 4).to(dtype)
    r = r0.clone()
    assert add_linear_w8a16_(r, x, w, ws, b, glu=glu, backend="triton") is r
    from fastdecode.ops.activation import silu_and_mul_ref

    a = silu_and_mul_ref(x) if glu else x
    assert_product_close(r, add_linear_w8a16_ref(r0, x, w, ws, b, glu=glu), a, fp8_dequantised(w, ws))


def test_add_op_torch_backend_and_refusals_leave_the_residual_alone():
    x = torch.randn(2, 1, 64, device=DEV).bfloat16()
    w, ws = _weight(8, 64)
    r0 = torch.randn(2, 1, 8, device=DEV).bfloat16()
    r = r0.clone()
    add_linear_w8a16_(r, x, w, ws, backend="torch")
    assert torch.equal(r, add_linear_w8a16_ref(r0, x, w, ws))
    keep = r.clone()
    with pytest.raises(ValueError, match=r"residual must have shape \(2, 1, 8\)"):
        add_linear_w8a16_(r[:1], x, w, ws)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        add_linear_w8a16_(torch.randn(8, 1, 2, device=DEV).bfloat16().permute(2, 1, 0), x, w, ws)
    with pytest.raises(ValueError, match=r"2 \* K"):
        add_linear_w8a16_(r, x, w, ws, glu=True)
    with pytest.raises(ValueError, match="residual must have dtype"):
        add_linear_w8a16_(r.half(), x, w, ws)
    with pytest.raises(ValueError, match=f"at most {MAX_M} token rows"):
        add_linear_w8a16_(torch.zeros(5, 8, device=DEV).bfloat16(), torch.randn(5, 64, device=DEV).bfloat16(), w, ws)
    assert torch.equal(r, keep)


def test_opcheck_both_ops():
    """The fake implementations agree with the ops (torch backend). Not ``test_schema``: its check that inputs are
    not mutated multiplies them, which torch's CPU kernels do not implement for float8_e4m3fn; the mutated
    arguments are the ones the definitions name (``out``, ``residual``), as ``ops.norm_linear``'s opcheck checks."""
    h = torch.randn(3, 32, device=DEV).bfloat16()
    w, ws = _weight(5, 32)
    torch.library.opcheck(W._rms_norm_linear_w8a16_op.default,
                          (h, torch.rand(32, device=DEV).bfloat16(), w, ws, None,
                           torch.empty(3, 5, device=DEV).bfloat16(), 1e-6, "torch"),
                          test_utils=("test_faketensor",))
    torch.library.opcheck(W._add_linear_w8a16_op.default,
                          (torch.randn(3, 5, device=DEV).bfloat16(), h, w, ws, None, False, "torch"),
                          test_utils=("test_faketensor",))


# ----------------------------------------------------------------------------- GPU and sm_90


@gpu
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N,K,glu", [(6144, 4096, False), (4096, 4096, False), (4096, 14336, True),
                                     (28672, 4096, False)])
def test_gpu_llama8b_shapes_under_a_graph(M, N, K, glu):
    """The 8B qkv / gate_up (norm inside) and wo / w2 (residual add, SiLU-and-mul for w2) on the package's configs,
    against the references, then replayed in a CUDA graph: the same bits."""
    w, ws = _weight(N, K)
    gate_up = N == 28672 or N == 6144
    if gate_up:
        h, g = _h(M, K, torch.bfloat16)
        y = rms_norm_linear_w8a16(h, g, w, ws, eps=1e-5)
        assert_product_close(y, rms_norm_linear_w8a16_ref(h, g, w, ws, eps=1e-5), _normed(h, g, 1e-5),
                             fp8_dequantised(w, ws))
        out = torch.empty_like(y)

        def call():
            rms_norm_linear_w8a16(h, g, w, ws, eps=1e-5, out=out)
    else:
        from fastdecode.ops.activation import silu_and_mul_ref

        x = torch.randn(M, 2 * K if glu else K, device=DEV).bfloat16()
        r0 = (torch.randn(M, N, device=DEV) * 4).bfloat16()
        y = add_linear_w8a16_(r0.clone(), x, w, ws, glu=glu)
        assert_product_close(y, add_linear_w8a16_ref(r0, x, w, ws, glu=glu),
                             silu_and_mul_ref(x) if glu else x, fp8_dequantised(w, ws))
        out = r0.clone()

        def call():
            out.copy_(r0)
            add_linear_w8a16_(out, x, w, ws, glu=glu)
    call()  # compiled before the capture
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        call()
    out.zero_()
    g_.replay()
    torch.testing.assert_close(out, y, atol=0, rtol=0)


def _fused_ptx_kw(norm):
    return dict(X_GLU=not norm, X_NORM=norm, NORM_AFFINE=norm, ACCUMULATE=not norm, BLOCK_K=1024, SPLIT=False)


@pytest.fixture(scope="module")
def ptx_ahead():
    """Both fused compiles at once (``helpers.sm90_ptx_ahead``)."""
    from helpers import sm90_ptx_ahead, w8a16_job

    sm90_ptx_ahead([w8a16_job(**_fused_ptx_kw(norm)) for norm in (True, False)])


@pytest.mark.parametrize("which", ["norm", "add_glu"])
def test_sm90_compiles_the_norm_and_the_residual_add_on_fp8_weights(ptx_ahead, which):
    """No GPU needed: the FMA kind with FP8 weights and the norm in its loads (or SiLU-and-mul in its loads and the
    residual add in its epilogue) compiles for sm_90; the weight bytes keep the paired e4m3 conversion, and the
    norm's rsqrt comes after the K loop, once."""
    from helpers import k_loop, w8a16_ptx

    norm = which == "norm"
    ptx = w8a16_ptx(**_fused_ptx_kw(norm))
    body = k_loop(ptx)
    assert "cvt.rn.f16x2.e4m3x2" in body
    assert "rsqrt" not in body
    if which == "norm":
        assert re.search(r"rsqrt\.approx", ptx)


# ----------------------------------------------------------------------------- the model's norm_gemm step


def _rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("a16_all", [False, True])
def test_fp8_model_decode_takes_its_norms_into_the_w8a16_gemvs(monkeypatch, a16_all):
    """An FP8 model with ``fp8_a16`` (default) takes the ``norm_gemm`` step up to 4 rows: the attention norm inside
    wqkv's W8A16 GEMV, the residual adds inside wo's and w2's (SiLU-and-mul in w2's loads), w13 W8A8 after its FP8
    norm (or, with ``fp8_a16_all``, W8A16 with the norm inside). Every kernel of that step is called and no
    separate add + norm runs; the logits and caches are within bf16 roundings of the unfused W8A16 step (no FP8
    activation rounding differs: the same rows reach w13's FP8 norm up to bf16 roundings, which can flip one FP8
    step, hence a relative bound). The norm weights stay in the norms (never folded into FP8 weights). Beyond 4
    rows, with ``fp8_a16`` off or on the torch backend the unfused path runs."""
    import copy

    import fastdecode.models.norm_gemm as NG
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model_fp8

    cfg = ModelConfig.from_preset("tiny").replace(n_layers=2)
    m = quantize_model_fp8(random_model(cfg, device=DEV, dtype=torch.bfloat16, backend="triton", max_seq_len=64,
                                        std=0.08, seed=int(torch.randint(0, 2**31, ()))))
    for layer in m.layers:
        for n in (layer.attention_norm, layer.ffn_norm):
            n.weight.copy_(1 + 0.3 * torch.randn(n.weight.shape, device=DEV))
    m.set_kernels(fp8_a16_all=a16_all)
    assert NG.applies(m, 1) and NG.applies(m, 4) and not NG.applies(m, 5)
    off = copy.deepcopy(m)
    off.set_kernels(norm_gemm=False)
    calls = {"norm": 0, "add": 0}
    for name, key in (("rms_norm_linear_w8a16", "norm"), ("add_linear_w8a16_", "add")):
        real = getattr(NG, name)
        monkeypatch.setattr(NG, name, lambda *a, _r=real, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1),
                                                                          _r(*a, **kw))[1])
    import fastdecode.models.rmsnorm as RN

    norms = []  # the unfused step's add + norm kernels, counted while m decodes
    for name in ("fused_add_rms_norm", "fused_add_rms_norm_fp8"):
        real = getattr(RN, name)
        monkeypatch.setattr(RN, name, lambda *a, _r=real, _n=name, **kw: (norms.append(_n), _r(*a, **kw))[1])
    toks = torch.randint(0, cfg.vocab_size, (2, 7), device=DEV)
    caches = [KVCache(cfg, 2, 16, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    off.backend = m.backend = "ref"
    for c, model in zip(caches, (m, off)):  # one recipe for both caches' prompt rows
        model.prefill(toks[:, :4], c)
    off.backend = m.backend = "triton"
    # fp8_a16_all: bf16 roundings apart only (no FP8 activation); a W8A8 w13: its FP8 norm may round a value one
    # FP8 step apart (tests/test_engine_fp8.py says why no whole-step bound is tighter; the ops are held to their
    # references above)
    bound = 0.04 if a16_all else 0.2
    for t in range(4, 6):
        pos = torch.tensor([t, t - 2], device=DEV)
        ref = off.decode(toks[:, t], pos, caches[1])
        norms.clear()
        on = m.decode(toks[:, t], pos, caches[0])
        assert not norms, norms
        assert _rel_rms(on, ref) < bound, _rel_rms(on, ref)
        assert _rel_rms(caches[0].k[:, :2, :, :t + 1], caches[1].k[:, :2, :, :t + 1]) < bound
    per_step = cfg.n_layers * 2
    assert calls == {"norm": 2 * (per_step if a16_all else per_step // 2), "add": 2 * per_step}
    assert not any(torch.equal(n.weight, torch.ones_like(n.weight)) for layer in m.layers
                   for n in (layer.attention_norm, layer.ffn_norm))
    m.set_kernels(fp8_a16=False, fp8_a16_all=False)
    assert not NG.applies(m, 1)
    m.set_kernels(fp8_a16=True)
    m.backend = "torch"
    assert not NG.applies(m, 1)
