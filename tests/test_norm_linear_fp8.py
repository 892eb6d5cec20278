"""The RMSNorm and the activation's FP8 quantisation inside the W8A8 GEMM (``ops.norm_linear_fp8``: X_NORM on the FP8
dot path of ``kernels.gemm``).

Against the fp32 recipe (``rms_norm_linear_fp8_ref``: per row and block of 128 columns one dynamic scale) with fresh
random inputs, poisoned outputs, odd sizes, strided rows, per-channel and per-tensor scales, bf16 and fp16, NaN rows;
on the CPU through the Triton interpreter, on the GPU (``gpu`` marks) at the Llama-3.1-8B gate_up shape under a CUDA
graph; and the sm_90 code of the loop, compiled here.
"""

import json
import re

import pytest
import torch

import fastdecode.ops.norm_linear_fp8 as F
from fastdecode.ops.gemm import linear_fp8_ref
from fastdecode.ops.norm import rms_norm_ref
from fastdecode.ops.norm_linear_fp8 import (
    QUANT_GROUP, get_norm_fp8_config, quantize_blocks_ref, rms_norm_linear_fp8, rms_norm_linear_fp8_ref,
)
from fastdecode.ops.quant import quantize_fp8_ref
from helpers import (
    assert_product_close, fp8_dequantised, fp8_weight, interpreter_on, k_loop, poison_, sm90_ptx, strided_rows,
)

gpu = pytest.mark.gpu
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn


def _weight(N, K, per_tensor=False):
    return fp8_weight(N, K, per_tensor, DEV)


def _h(M, K, dtype, strided=False):
    """A residual stream's rows (rms ~3, a few large columns as real activations have) and a norm weight ~1."""
    h = strided_rows(M, K, torch.float32, DEV) * 3 if strided else torch.randn(M, K, device=DEV) * 3
    h[:, ::37] *= 20
    return h.to(dtype), (torch.rand(K, device=DEV) + 0.5).to(dtype)


def _dequantised(h, g, eps):
    """The input the recipe multiplies: the block-quantised ``h * g`` times its scales and the row's rstd (fp32)."""
    h2 = h.reshape(-1, h.shape[-1])
    z = (h2.float() * g.float()).to(h.dtype).float() if g is not None else h2.float()
    q, s = quantize_blocks_ref(z)
    deq = (q.float().view(q.shape[0], -1) * s.repeat_interleave(QUANT_GROUP, dim=1)[:, :z.shape[1]])
    return deq * torch.rsqrt(h2.float().pow(2).mean(-1, keepdim=True) + eps)


def _close(y, ref, h, g, w, ws, eps):
    """The kernel against the recipe: compiled, the same e4m3 values (a rare one a step apart: the GPU's division
    is approximate), so the bound of the fp32 sums; under the interpreter, whose fp32 -> bf16 casts truncate and
    whose e4m3 cast drops a carry on ~2% of the values (docs/architecture.md), a bound of e4m3 steps."""
    dtype = torch.float8_e4m3fn if interpreter_on() else None
    assert_product_close(y, ref, _dequantised(h, g, eps), fp8_dequantised(w, ws), dtype=dtype)


@pytest.fixture
def config(monkeypatch):
    """Pin the op's config: ``config(**overrides)`` of the default tile (fewer warps on the CPU: faster)."""
    def pin(**kw):
        cfg = {**F.DEFAULT_CONFIG, "num_warps": 4 if CUDA else 1, **kw}
        monkeypatch.setattr(F, "get_norm_fp8_config", lambda M, N, K, device=None: {
            **cfg, "BLOCK_M": max(cfg["BLOCK_M"], 16 if M <= 16 else 32)})
    return pin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,affine,per_tensor,bias", [
    (1, 37, 256, True, False, False), (2, 70, 300, True, True, True), (3, 8, 130, False, False, False),
    (17, 21, 384, True, False, True)])
def test_norm_and_fp8_quantisation_in_the_gemm_equal_the_reference(config, dtype, M, N, K, affine, per_tensor,
                                                                    bias):
    """Odd N (partial tiles), K not a multiple of the block (a partial last block), strided h rows, more rows than
    one tile, with and without the norm weight, a bias, a poisoned output: the blockwise recipe (``_close``)."""
    config()
    h, g = _h(M, K, dtype, strided=True)
    g = g if affine else None
    w, ws = _weight(N, K, per_tensor)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    out = poison_(torch.empty(M, N, dtype=dtype, device=DEV))
    y = rms_norm_linear_fp8(h, g, w, ws, b, eps=1e-5, out=out, backend="triton")
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    _close(y, rms_norm_linear_fp8_ref(h, g, w, ws, b, eps=1e-5), h, g, w, ws, 1e-5)


@pytest.mark.parametrize("M,K", [(1, 256), (3, 200)])
def test_inputs_exact_in_e4m3_give_the_blockwise_product_exactly(config, M, K):
    """Rows whose ``h * g`` is exact in bf16 and whose blocks each hold ``448 * 2^j``: every scale is a power of two
    and every quantised value exact, on the GPU and under the interpreter alike, so only the fp32 sums' order may
    differ from the recipe."""
    config()
    e4m3 = torch.randn(M, K, device=DEV).mul(40).clamp(-440, 440).to(FP8).float()
    for b0 in range(0, K, QUANT_GROUP):
        e4m3[:, b0] = 448.0 * (-1) ** (b0 // QUANT_GROUP)
    j = torch.randint(-6, 3, (M, (K + QUANT_GROUP - 1) // QUANT_GROUP), device=DEV).float()
    g = (2.0 ** torch.randint(-1, 2, (K,), device=DEV).float()).bfloat16()
    h = (e4m3 * 2.0 ** j.repeat_interleave(QUANT_GROUP, dim=1)[:, :K] / g.float()).bfloat16()
    assert torch.equal((h.float() * g.float()).bfloat16().float(), h.float() * g.float())
    w, ws = _weight(19, K)
    y = rms_norm_linear_fp8(h, g, w, ws, eps=1e-6, backend="triton")
    assert_product_close(y, rms_norm_linear_fp8_ref(h, g, w, ws, eps=1e-6), _dequantised(h, g, 1e-6),
                         fp8_dequantised(w, ws), roundings=1)


def test_blockwise_quantisation_is_no_worse_than_one_scale_a_row():
    """Against the unquantised product of the normed rows, the blockwise recipe errs no more than the two-kernel
    path (the norm kernel's FP8 output, one scale a row, then W8A8) on rows with a few large columns."""
    M, N, K = 4, 64, 1024
    h, g = _h(M, K, torch.bfloat16)
    w, ws = _weight(N, K)
    exact = rms_norm_ref(h, g, 1e-6).float() @ fp8_dequantised(w, ws).t()
    y = rms_norm_linear_fp8_ref(h, g, w, ws, eps=1e-6).float()
    xq, xs = quantize_fp8_ref(rms_norm_ref(h, g, 1e-6), per_token=True)
    two = linear_fp8_ref(xq, xs, w, ws).float()
    err_block, err_row = (y - exact).norm() / exact.norm(), (two - exact).norm() / exact.norm()
    assert err_block < 0.05 and err_block <= err_row * 1.05, (err_block, err_row)


def test_a_nan_row_gives_nan_and_leaves_the_others(config):
    config()
    h, g = _h(3, 256, torch.bfloat16)
    h[1, 200] = float("nan")
    w, ws = _weight(16, 256)
    y = rms_norm_linear_fp8(h, g, w, ws, backend="triton")
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    _close(y[[0, 2]], rms_norm_linear_fp8_ref(h[[0, 2]], g, w, ws), h[[0, 2]], g, w, ws, 1e-6)


def test_quantize_blocks_ref_scales_and_clamps():
    z = torch.zeros(2, 300)
    z[0, 5], z[0, 140], z[1, 299] = 896.0, -3.0, 1e-9
    q, s = quantize_blocks_ref(z)
    assert q.shape == (2, 300) and s.shape == (2, 3)
    assert s[0, 0] == 2.0 and q[0, 5].float() == 448 and s[0, 1] == 3.0 / 448 and q[0, 140].float() == -448
    assert s[1, 2] == F.FP8_MIN_SCALE and s[1, 0] == F.FP8_MIN_SCALE  # an all-zero block: the floor, values 0
    assert (q[1, :256].float() == 0).all()


def test_leading_dims_empty_rows_and_torch_backend(config):
    config()
    h, g = _h(2, 160, torch.bfloat16)
    w, ws = _weight(24, 160)
    h3 = h.view(2, 1, 160)
    y = rms_norm_linear_fp8(h3, g, w, ws, backend="triton")
    assert y.shape == (2, 1, 24)
    torch.testing.assert_close(rms_norm_linear_fp8(h3, g, w, ws, backend="torch"),
                               rms_norm_linear_fp8_ref(h3, g, w, ws), atol=0, rtol=0)
    assert rms_norm_linear_fp8(h[:0], g, w, ws, backend="triton").shape == (0, 24)


def test_refusals_name_the_argument():
    h, g = _h(1, 64, torch.bfloat16)
    w, ws = _weight(8, 64)
    with pytest.raises(ValueError, match="h must have dtype"):
        rms_norm_linear_fp8(h.float(), g, w, ws)
    with pytest.raises(ValueError, match="norm_weight must have dtype"):
        rms_norm_linear_fp8(h, g.half(), w, ws)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(64,\)"):
        rms_norm_linear_fp8(h, g[:32], w, ws)
    with pytest.raises(ValueError, match="weight_fp8 must have dtype"):
        rms_norm_linear_fp8(h, g, w.bfloat16(), ws)
    with pytest.raises(ValueError, match="mismatched K"):
        rms_norm_linear_fp8(h, g, _weight(8, 96)[0], ws)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_linear_fp8(h, g, w, ws, eps=-1.0)


@pytest.fixture
def fresh_lookups():
    """The op's cached config lookups forgotten before and after (a test that patches the table's answer must not
    leave its configs cached for later tests)."""
    F._config.cache_clear()
    yield
    F._config.cache_clear()


def test_config_takes_the_tables_fp8_tile_with_one_split_and_the_quant_group(monkeypatch, fresh_lookups):
    tuned = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 3, "num_warps": 8,
             "num_stages": 3, "DOT_FP8": True}
    monkeypatch.setattr(F, "get_linear_config", lambda M, N, K, dtype, device=None: ("triton", dict(tuned)))
    cfg = get_norm_fp8_config(40, 4096, 4096)
    assert cfg == {**F.DEFAULT_CONFIG, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    assert cfg["BLOCK_K"] == QUANT_GROUP and cfg["SPLIT_K"] == 1
    monkeypatch.setattr(F, "get_linear_config", lambda M, N, K, dtype, device=None: ("cublas", None))
    assert get_norm_fp8_config(1, 4096, 4096) == F.DEFAULT_CONFIG


def test_the_launcher_refuses_a_norm_it_cannot_compute():
    from fastdecode.kernels.gemm import launch_skinny_linear

    h, g = _h(1, 256, torch.bfloat16)
    w, ws = _weight(8, 256)
    out = torch.empty(1, 8, dtype=torch.bfloat16, device=DEV)
    for cfg in ({**F.DEFAULT_CONFIG, "DOT_FP8": False}, {**F.DEFAULT_CONFIG, "SPLIT_K": 2}):
        with pytest.raises(ValueError, match="RMSNorm in the GEMV"):
            launch_skinny_linear(h, w, None, None, 0, ws, 2, out, None, None, cfg, norm_weight=g, eps=1e-6)


def test_opcheck():
    """The fake implementation agrees with the op (torch backend). Not ``test_schema``: torch's CPU kernels cannot
    multiply the float8_e4m3fn weight it compares (as ``test_w8a16_norm_linear``'s opcheck says)."""
    h, g = _h(2, 128, torch.bfloat16)
    w, ws = _weight(16, 128)
    out = torch.empty(2, 16, dtype=torch.bfloat16, device=DEV)
    torch.library.opcheck(F._rms_norm_linear_fp8_op.default, (h, g, w, ws, None, out, 1e-6, "torch"),
                          test_utils=("test_faketensor",))


_PTX = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.gemm import _skinny_linear_kernel

a = json.loads(sys.argv[1])
sig = {"x_ptr": "*bf16" if a["norm"] else "*fp8e4nv", "w_ptr": "*fp8e4nv", "bias_ptr": "*bf16",
       "xs_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
       "nw_ptr": "*bf16", "eps": "fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
       "stride_om": "i32", "stride_part": "i32", "split_k": "i32"}
consts = dict(HAS_BIAS=False, X_SCALE_MODE=0, W_SCALE_MODE=2, USE_DOT=True, DOT_FP8=True, EVEN_K=True, USE_PDL=True,
              PREFETCH=False, W_EVICT=True, X_GLU=False, X_NORM=a["norm"], NORM_VEC=8, NORM_AFFINE=True,
              NORM_ROWS=a.get("rows", 1), ACCUMULATE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=False,
              L2_SLAB=0, PF_LANES=128)
sig.update({k: "constexpr" for k in consts})
aligned = {"x_ptr", "w_ptr", "bias_ptr", "xs_ptr", "ws_ptr", "out_ptr", "part_ptr", "lock_ptr", "nw_ptr", "N", "K",
           "stride_xm", "stride_wn", "stride_om"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
cc = triton.compile(ASTSource(_skinny_linear_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4, "num_stages": 5})
sys.stdout.write(cc.asm["ptx"])
"""


def test_sm90_loop_quantises_in_registers_and_keeps_fp8_mmas():
    """Compiled ahead of time for sm_90 (the 8B gate_up tile with the norm): the K loop still issues its FP8 MMAs
    (``wgmma ... e4m3.e4m3``), converts h to e4m3 in registers (``cvt ... e4m3x2``), spills nothing; and the plain
    W8A8 loop (X_NORM off, an FP8 x) has no conversion."""
    body = k_loop(sm90_ptx(_PTX, json.dumps({"norm": True})))
    ptx_plain = sm90_ptx(_PTX, json.dumps({"norm": False}))
    assert len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", body)) == QUANT_GROUP // 32
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", body)
    assert "ld.local" not in body and "st.local" not in body
    assert not re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", k_loop(ptx_plain))


@gpu
def test_gate_up_shape_under_a_cuda_graph():
    """The 8B gate_up shape at one token with the package's config, captured and replayed: the reference within the
    bound of its sums, and the replay equal to the eager call."""
    if not CUDA or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an FP8 GPU (sm_89+)")
    h, g = _h(1, 4096, torch.bfloat16)
    w, ws = _weight(28672, 4096)
    eager = rms_norm_linear_fp8(h, g, w, ws, eps=1e-5)
    _close(eager, rms_norm_linear_fp8_ref(h, g, w, ws, eps=1e-5), h, g, w, ws, 1e-5)
    out = poison_(torch.empty_like(eager))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm_linear_fp8(h, g, w, ws, eps=1e-5, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_norm_gemm_switch_puts_w13s_norm_into_its_w8a8_gemm(monkeypatch):
    """``fp8_norm_gemm`` (opt-in) on an FP8 model's ``norm_gemm`` step: w13's norm runs inside its W8A8 GEMM (one
    ``rms_norm_linear_fp8`` a layer, no norm kernel before it; the norm weights stay in the norms), and the logits
    and caches stay within FP8 activation roundings of the step without the switch (one scale a row there, one a
    128-column block here: ``test_w8a16_norm_linear``'s bound for a W8A8 w13). Off again, the op is not called."""
    import fastdecode.models.norm_gemm as NG
    import fastdecode.models.rmsnorm as RN
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model_fp8

    cfg = ModelConfig.from_preset("tiny").replace(n_layers=2)
    m = quantize_model_fp8(random_model(cfg, device=DEV, dtype=torch.bfloat16, backend="triton", max_seq_len=64,
                                        std=0.08, seed=int(torch.randint(0, 2**31, ()))))
    for layer in m.layers:
        layer.ffn_norm.weight.copy_(1 + 0.3 * torch.randn(layer.ffn_norm.weight.shape, device=DEV))
    calls, norms = [], []
    real = NG.rms_norm_linear_fp8
    monkeypatch.setattr(NG, "rms_norm_linear_fp8", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    real_norm = RN.rms_norm_fp8
    monkeypatch.setattr(RN, "rms_norm_fp8", lambda *a, **kw: (norms.append(1), real_norm(*a, **kw))[1])
    toks = torch.randint(0, cfg.vocab_size, (2, 6), device=DEV)
    caches = [KVCache(cfg, 2, 16, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    m.backend = "ref"
    for c in caches:
        m.prefill(toks[:, :4], c)
    m.backend = "triton"
    pos = torch.tensor([4, 2], device=DEV)
    assert NG.applies(m, 2)
    ref = m.decode(toks[:, 4], pos, caches[1])
    assert not calls and len(norms) == cfg.n_layers  # without the switch: w13's FP8 norm kernel
    norms.clear()
    m.set_kernels(fp8_norm_gemm=True)
    on = m.decode(toks[:, 4], pos, caches[0])
    assert len(calls) == cfg.n_layers and not norms
    rel = ((on.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
    assert rel < 0.2, rel
    assert torch.equal(caches[0].k[0], caches[1].k[0])  # layer 0's attention runs before any w13
    m.set_kernels(fp8_norm_gemm=False)
    calls.clear()
    m.decode(toks[:, 5], pos + 1, caches[0])
    assert not calls
