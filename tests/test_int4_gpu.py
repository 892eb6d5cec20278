"""Int4-weight linear on a real GPU: bf16, real Llama sizes, odd M, every group size and zero mode,
both kernel paths and every tuner candidate on one shape, the dequant + cuBLAS path, W4A8 on the
FP8 tensor cores, split-K determinism, CUDA-graph capture and torch.compile(fullgraph=True).

The tests marked ``gpu`` skip without CUDA (conftest.py); the CPU interpreter suite is test_int4.py.
The unmarked tests at the end run everywhere: the tuner's shared-memory filter and its skip of a
config that cannot launch.
"""

import dataclasses
import itertools
import logging
from functools import partial

import pytest
import torch

import fastdecode.kernels.int4 as KI
import fastdecode.kernels.int4_dequant as KD
import fastdecode.kernels.int4_mma as KM
import fastdecode.ops.int4 as I
from fastdecode.bench import int4 as B
from fastdecode.bench.int4 import candidates
from fastdecode.kernels.compile import precompile
from fastdecode.quant import quantize_activation_fp8
from fastdecode.quant import int4 as Q
from helpers import precompile_calls

gpu = pytest.mark.gpu
DEV = "cuda"
H200_SMEM = 232448  # shared_memory_per_block_optin of the H200
SHAPES = [(6144, 4096), (4096, 14336), (28672, 4096), (200, 4160)]  # (N, K); the last is odd (K = 16.25 tiles)


def _packed(N, K, g, fmt="sym", dtype=torch.bfloat16):
    w = torch.randn(N, K, device=DEV) / K**0.5
    if fmt == "min":  # GGUF Q4_1 style: mins
        G = K // g
        q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=DEV)
        s = (torch.rand(N, G, device=DEV) * 0.02 / K**0.25).to(dtype)
        m = (-7.5 * s.float()).to(dtype)
        return Q.prepack(q, s, group_size=g, mins=m)
    return Q.quantize_int4(w, g, symmetric=fmt == "sym", scale_dtype=dtype)


def _close(y, ref):
    # one bf16 rounding of the output; the error of fp32 sums over K is far below that
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * max(ref.float().abs().max().item(), 1e-3))


REAL_MS = [1, 3, 16, 33, 64, 257]


@gpu
@pytest.mark.parametrize("impl", [None, "triton"])
@pytest.mark.parametrize("M", REAL_MS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_int4_linear_bf16_real_sizes(N, K, M, impl, compiled):
    w = _packed(N, K, 128 if K % 128 == 0 else K)
    x = torch.randn(M, K, device=DEV).bfloat16()
    b = torch.randn(N, device=DEV).bfloat16()
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = I.int4_linear(x, w, b, out=out, impl=impl)
    _close(y, I.int4_linear_ref(x, w, b))


def _warm(x, w, x_scale=None) -> None:
    """Compile only: the kernel the dispatcher (int4_linear / int4_linear_fp8) would launch for x and w."""
    op = "int4_linear" if x_scale is None else "int4_linear_fp8"
    _, cfg = I.get_int4_config(x.shape[0], w.N, x.shape[1], w.group_size, x.device, op=op)
    out = torch.empty(x.shape[0], w.N, device=x.device, dtype=torch.bfloat16 if x_scale is not None else x.dtype)
    I.int4_linear_with_config(x, w, None, out, cfg, None if x_scale is None else x_scale.reshape(-1), warmup=True)


@pytest.fixture(scope="module")
def compiled():
    """The kernels the tests below launch (the dispatcher's at every group size and mode, W4A8, the real sizes,
    the embedded model's shapes, the dequant path, both conversions of the dot path), compiled first in parallel
    threads (kernels.compile.precompile; each is ~0.9 s one after another on the H200's host): the tests' calls
    made once with every launch turned into a compile (helpers.precompile_calls). The tests then launch and
    check every one of them as before. (The tuner test compiles its candidates itself, also in parallel.)"""
    if not torch.cuda.is_available():
        return
    calls = []
    for g, fmt in itertools.product(GROUP_MODE_GS, GROUP_MODE_FMTS):
        w = _packed(1024, 4096, g, fmt, torch.float16 if fmt == "zero" else torch.bfloat16)
        for M in GROUP_MODE_MS:
            for dt in (torch.bfloat16,) + ((torch.float16,) if M in (1, 48) else ()):
                calls.append(partial(_warm, torch.empty(M, 4096, device=DEV, dtype=dt), w))
    if torch.cuda.get_device_capability() >= (8, 9):
        for fmt, g in W4A8_FMTS:
            w = _packed(2048, 4096, g, fmt)
            for M in W4A8_MS:
                xq = torch.zeros(M, 4096, device=DEV).to(torch.float8_e4m3fn)
                calls += [partial(_warm, xq, w, torch.ones(M, 1, device=DEV)),
                          partial(_warm, xq, w, torch.ones(1, device=DEV))]

    def dispatch(M, w, bias=None, impl=None):  # int4_linear as the tests call it
        I.int4_linear(torch.empty(M, w.K, device=DEV, dtype=torch.bfloat16), w, bias, impl=impl)

    for N, K in SHAPES:
        w, b = _packed(N, K, 128 if K % 128 == 0 else K), torch.empty(N, device=DEV, dtype=torch.bfloat16)
        calls += [partial(dispatch, M, w, b, impl) for M, impl in itertools.product(REAL_MS, (None, "triton"))]
    for N, K in EMBEDDED_SHAPES:
        w = _packed(N, K, 32, "min")
        calls += [partial(dispatch, M, w, None, impl) for M in EMBEDDED_MS
                  for impl in (None, "triton") + (("dequant",) if M > 16 else ())]
    w = _packed(4096, 4096, 128, "zero")
    calls += [partial(dispatch, M, w, None, "dequant") for M in DEQUANT_MS]

    def dot(fmt, g, x_dtype, w_dtype, cfg):  # test_dot_fast_conversion_equals_portable's launches, and the next
        M, K = 48, 4224 if g == 96 else 4096
        x, out = torch.empty(M, K, device=DEV, dtype=x_dtype), torch.empty(M, 1024, device=DEV, dtype=x_dtype)
        I.int4_linear_with_config(x, _packed(1024, K, g, fmt, w_dtype), None, out, cfg)

    for (fmt, g), x_dtype in itertools.product(DOT_FAST_FMTS, DOT_X_DTYPES):
        calls += [partial(dot, fmt, g, x_dtype, x_dtype, DOT_CFG),
                  partial(dot, fmt, g, x_dtype, x_dtype, {**DOT_CFG, "fast_cvt": False})]
    calls.append(partial(dot, "min", 32, torch.bfloat16, torch.float16, DOT_CFG))  # fp16 scales, bf16 x

    def mma(fmt, g, N, K, M, x_dtype, cfg):  # test_mma_kind_every_group_mode_and_dtype's launches (with a bias)
        x, out = torch.empty(M, K, device=DEV, dtype=x_dtype), torch.empty(M, N, device=DEV, dtype=x_dtype)
        b = torch.empty(N, device=DEV, dtype=x_dtype)
        I.int4_linear_with_config(x, _packed(N, K, g, fmt, x_dtype), b, out, cfg)

    for fmt_g_n_k, (x_dtype, ms, cfgs) in itertools.product(MMA_FMTS, MMA_CASES):
        for M, cfg in itertools.product((ms[0], ms[-1]), cfgs):  # the first and last M: BLOCK_M 16 and 64
            calls.append(partial(mma, *fmt_g_n_k, M, x_dtype, _mma_cfg(M, *cfg)))
    precompile_calls(calls, [(KI, "_int4_linear_kernel"), (KD, "_int4_dequant_kernel"), (KM, "_int4_mma_kernel")])


GROUP_MODE_FMTS, GROUP_MODE_GS, GROUP_MODE_MS = ["sym", "zero", "min"], [32, 64, 128, 4096], [1, 5, 48, 300]
W4A8_FMTS, W4A8_MS = [("sym", 128), ("zero", 32), ("min", 64)], [1, 7, 64, 512]


@gpu
@pytest.mark.parametrize("fmt", GROUP_MODE_FMTS)
@pytest.mark.parametrize("g", GROUP_MODE_GS)
@pytest.mark.parametrize("M", GROUP_MODE_MS)
def test_int4_linear_every_group_and_mode(M, g, fmt, compiled):
    N, K = 1024, 4096
    w = _packed(N, K, g, fmt, torch.float16 if fmt == "zero" else torch.bfloat16)
    x = torch.randn(M, K, device=DEV).bfloat16()
    _close(I.int4_linear(x, w, impl="triton"), I.int4_linear_ref(x, w))
    if M in (1, 48):  # fp16 activations on the fma and dot paths (each dtype is a compile of its own)
        xh = x.half()
        _close(I.int4_linear(xh, w, impl="triton"), I.int4_linear_ref(xh, w))


EMBEDDED_SHAPES, EMBEDDED_MS = [(192, 576), (576, 576), (3072, 576), (576, 1536)], [1, 7, 128]


@gpu
@pytest.mark.parametrize("M", EMBEDDED_MS)
@pytest.mark.parametrize("N,K", EMBEDDED_SHAPES)
def test_embedded_model_shapes_q4_1(N, K, M, compiled):
    """The embedded SmolLM2's projections as its GGUF loads them (Q4_1: group 32, mins; K = 576 is 2.25
    layout tiles), at decode and prefill sizes, every path the dispatcher may take."""
    w = _packed(N, K, 32, "min")
    x = torch.randn(M, K, device=DEV).bfloat16()
    ref = I.int4_linear_ref(x, w)
    for impl in (None, "triton") + (("dequant",) if M > 16 else ()):
        _close(I.int4_linear(x, w, impl=impl), ref)


DEQUANT_MS = [256, 1024]


@gpu
@pytest.mark.parametrize("M", DEQUANT_MS)
def test_dequant_cublas_path(M, compiled):
    w = _packed(4096, 4096, 128, "zero")
    x = torch.randn(M, 4096, device=DEV).bfloat16()
    _close(I.int4_linear(x, w, impl="dequant"), I.int4_linear_ref(x, w))


@gpu
@pytest.mark.parametrize("M", [1, 4, 16, 64, 256])
def test_every_tuner_candidate(M, caplog):
    """Every config the tuner may try either runs and is right, or is skipped with one log line naming
    it and the reason (Triton's OutOfResources), as ``fastdecode tune int4`` does; the shared-memory
    estimate keeps every config that cannot launch out of what the tuner proposes on this GPU, and at
    least one config runs per M. (Regression: M=64 / 256 crashed with ``out of resource: shared
    memory, Required: 245760, Hardware limit: 232448`` on the H200, from 64 x 128 x 256 at 4 stages.)"""
    N, K = 1024, 4096
    w = _packed(N, K, 128)
    x = torch.randn(M, K, device=DEV).bfloat16()
    ref = I.int4_linear_ref(x, w)
    proposed = candidates(M, N, K, smem_limit=I.smem_limit(torch.device(DEV)))
    launched, skipped = [], []
    every = candidates(M, N, K)  # unfiltered: the launch-time safety net sees what the estimate drops
    # Every tile at SPLIT_K = 1; split-K (the other code path; the split count is a runtime value) on the
    # smallest N tile at the fewest stages of each kind and BLOCK_M. Each config is a compile (~0.9 s on
    # the H200's host): the split variants of every tile cost the suite ~75 s for no new code.
    bn0, st0 = min(c["BLOCK_N"] for c in every), min(c.get("num_stages", 1) for c in every)
    picked = [c for c in every if c["SPLIT_K"] == 1 or (c["SPLIT_K"] == 4 and c["BLOCK_N"] == bn0
                                                        and c.get("num_stages", 1) == st0)]
    # their compiles in parallel threads first, as the tuner does (kernels.compile.precompile)
    precompile(lambda c: I.int4_linear_with_config(x, w, None, torch.empty_like(ref, dtype=torch.bfloat16), c,
                                               warmup=True), picked)
    for cfg in picked:
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastdecode"):
            ran = B.try_config(lambda c: I.int4_linear_with_config(x, w, None, out, c), cfg, f"M={M}")
        if ran:
            _close(out, ref)
            launched.append(cfg)
        else:
            msgs = [r.getMessage() for r in caplog.records]
            assert len(msgs) == 1 and str(cfg) in msgs[0] and "out of resource" in msgs[0], msgs
            skipped.append(cfg)
    assert launched, f"no candidate launched at M={M}"
    wrong = [c for c in skipped if c in proposed]
    assert not wrong, f"the shared-memory estimate proposed configs that cannot launch: {wrong}"


@gpu
def test_precompile_fills_the_jit_cache_before_the_launches():
    """kernels.compile.precompile: warmup launches under Triton's AsyncCompileMode compile in threads and
    leave the kernels in the JIT's cache (the launches after it compile nothing); the results are right."""
    from fastdecode.kernels.int4 import _int4_linear_kernel

    def cached():
        return sum(len(c[0]) for c in _int4_linear_kernel.device_caches.values())

    N, K, M = 512, 1024, 2
    w = _packed(N, K, 64, "zero")
    x = torch.randn(M, K, device=DEV).bfloat16()
    # num_warps 2 and these tiles: configs no other test compiles
    cfgs = [dict(kind="fma", BLOCK_M=2, BLOCK_N=bn, BLOCK_K=256, SPLIT_K=1, num_warps=2, num_stages=1,
                 PREFETCH=pf) for bn in (8, 16) for pf in (False, True)]
    before = cached()
    out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    assert precompile(lambda c: I.int4_linear_with_config(x, w, None, out, c, warmup=True), cfgs) == len(cfgs)
    assert cached() == before + len(cfgs)
    for c in cfgs:
        y = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        I.int4_linear_with_config(x, w, None, y, c)
        _close(y, I.int4_linear_ref(x, w))
    assert cached() == before + len(cfgs)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8")
@pytest.mark.parametrize("fmt,g", W4A8_FMTS)
@pytest.mark.parametrize("M", W4A8_MS)
def test_w4a8(M, fmt, g, compiled):
    N, K = 2048, 4096
    w = _packed(N, K, g, fmt)
    xq, xs = quantize_activation_fp8(torch.randn(M, K, device=DEV))
    ref = I.int4_linear_fp8_ref(xq, xs, w)
    _close(I.int4_linear_fp8(xq, xs, w), ref)
    xq2, xs2 = quantize_activation_fp8(torch.randn(M, K, device=DEV), 0.02)  # per-tensor
    _close(I.int4_linear_fp8(xq2, xs2, w), I.int4_linear_fp8_ref(xq2, xs2, w))


@gpu
def test_act_order_gptq_on_gpu():
    N, K, g = 512, 4096, 128
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = (torch.rand(N, K // g) * 0.01).half()
    z = torch.randint(0, 16, (N, K // g), dtype=torch.uint8)
    perm = torch.randperm(K)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // g
    w = Q.prepack(q, s, group_size=g, zeros=z, g_idx=g_idx).to(DEV)
    x = torch.randn(9, K, device=DEV).half()
    _close(I.int4_linear(x, w), I.int4_linear_ref(x, w))


@gpu
def test_fp32_reference_path_captures_in_a_cuda_graph():
    """fp32 activations on CUDA run int4_linear_ref (the engine's fp32 model on a GPU); it used to copy a
    host tensor of nibble shifts to the device on every call, which a CUDA-graph capture refuses
    (test_engine_gpu::test_default_model_on_gpu_matches_cpu_greedy failed there on the H200)."""
    from fastdecode.models.llama import Int4Linear

    w = _packed(192, 576, 32, "min")  # the embedded SmolLM2's k/v projection, Q4_1 style
    lin = Int4Linear.from_weight(w, dtype=torch.float32)
    x = torch.randn(1, 576, device=DEV)
    out = lin(x, backend="triton")  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lin(x, backend="triton")
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, I.int4_linear_ref(x, w))


@gpu
def test_split_k_deterministic_graph_capture_and_compile():
    N, K = 4096, 4096
    w = _packed(N, K, 128)
    x = torch.randn(1, K, device=DEV).bfloat16()
    cfg = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 8, "num_warps": 4, "num_stages": 1}
    outs = []
    for _ in range(3):
        out = torch.empty(1, N, device=DEV, dtype=torch.bfloat16)
        I.int4_linear_with_config(x, w, None, out, cfg)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # graph capture: allocate once (warm-up), capture, replay with fresh inputs
    out = torch.empty(1, N, device=DEV, dtype=torch.bfloat16)
    I.int4_linear(x, w, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        I.int4_linear(x, w, out=out)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    _close(out, I.int4_linear_ref(x, w))
    f = torch.compile(lambda a: I.int4_linear(a, w), fullgraph=True)
    _close(f(x), I.int4_linear_ref(x, w))


DOT_FAST_FMTS = [("sym", 128), ("zero", 32), ("min", 64), ("sym", 4096), ("zero", 96)]
DOT_X_DTYPES = [torch.bfloat16, torch.float16]
DOT_CFG = dict(kind="dot", BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3)


@gpu
@pytest.mark.parametrize("x_dtype", DOT_X_DTYPES)
@pytest.mark.parametrize("fmt,g", DOT_FAST_FMTS)
def test_dot_fast_conversion_equals_portable(fmt, g, x_dtype, compiled):
    """The packed-pair PTX conversion (fast_cvt) against the bitcast form the interpreter runs: the same
    dequantised operand up to the rounding of the scale to x.dtype, so results agree to the output rounding."""
    N, K, M = 1024, 4224 if g == 96 else 4096, 48  # 4224 = 44 groups of 96
    w = _packed(N, K, g, fmt, x_dtype)  # scales of x's dtype: the fast conversion's condition
    x = torch.randn(M, K, device=DEV).to(x_dtype)
    cfg = DOT_CFG
    fast = torch.full((M, N), float("nan"), device=DEV, dtype=x_dtype)
    slow = torch.full((M, N), float("nan"), device=DEV, dtype=x_dtype)
    I.int4_linear_with_config(x, w, None, fast, cfg)
    I.int4_linear_with_config(x, w, None, slow, {**cfg, "fast_cvt": False})
    _close(fast, slow)
    _close(fast, I.int4_linear_ref(x, w))


# (fmt, group, N, K): every zero mode, groups of one to eight shifts and one per row, an odd N (200 rows: a
# partial 64- / 128-row tile) and an odd K (4160: 16.25 layout tiles, 65 groups of 64)
MMA_FMTS = [("sym", 128, 1024, 4096), ("zero", 32, 1024, 4096), ("zero", 64, 200, 4160), ("min", 64, 1024, 4096),
            ("sym", 4096, 512, 4096), ("zero", 128, 4096, 14336)]
# (BLOCK_N, num_warps, SPLIT_K, num_stages[, extra keys]); the last: one shift converted at a time and the padding
# tokens masked (CVT1, MASK_X: what the tuner proposes), on mma.sync (2 warps)
MMA_CFGS = [(64, 4, 1, 2), (128, 4, 4, 3), (256, 8, 16, 2), (32, 2, 2, 3, {"CVT1": True, "MASK_X": True})]
# (x dtype, token counts, configs): every config in bf16; fp16 changes only the conversion's constants (two
# configs). Each (mode, dtype, BLOCK_M, config) is a compile of its own (~0.9 s on the H200's host).
MMA_CASES = [(torch.bfloat16, [1, 16, 40], MMA_CFGS), (torch.float16, [1, 40], MMA_CFGS[1:2] + MMA_CFGS[3:])]


def _mma_cfg(M, bn, nw, sk, st, extra=None):
    return {"kind": "mma", "BLOCK_M": 16 if M <= 16 else 64, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk,
            "num_warps": nw, "num_stages": st, **(extra or {})}


@gpu
@pytest.mark.parametrize("fmt,g,N,K", MMA_FMTS)
def test_mma_kind_every_group_mode_and_dtype(fmt, g, N, K, compiled):
    """The mma kind (kernels.int4_mma: the weight as the tensor cores' register operand, its nibbles converted
    by inline PTX two words at a time) against the reference: every zero mode and group tiling, bf16 and
    fp16, 1-40 tokens (BLOCK_M 16 and 64), split-K, partial row tiles and a partial last layout tile. A wrong
    pairing of the two words' halves (k, k + 1) or of the shifts would move every output."""
    for x_dtype, ms, cfgs in MMA_CASES:
        w = _packed(N, K, g, fmt, x_dtype)  # scales of x's dtype: what "min" needs (mma_supported)
        b = torch.randn(N, device=DEV).to(x_dtype)
        for M, cfg in itertools.product(ms, cfgs):
            x = torch.randn(M, K, device=DEV).to(x_dtype)
            out = torch.full((M, N), float("nan"), device=DEV, dtype=x_dtype)
            I.int4_linear_with_config(x, w, b, out, _mma_cfg(M, *cfg))
            _close(out, I.int4_linear_ref(x, w, b))


@gpu
def test_mma_kind_asm_equals_portable_and_replays_in_a_graph():
    """The inline-PTX conversion against the fp32 form the interpreter runs (same values: both compute the
    exact ``q - zero``, so the outputs agree to the MMA's summation order); under CUDA-graph replay with PDL
    (the L2 prefetch of the first weight tiles before the wait) and fresh inputs; split-K deterministic."""
    N, K, M = 4096, 4096, 3
    w = _packed(N, K, 128, "zero")
    x = torch.randn(M, K, device=DEV).bfloat16()
    cfg = _mma_cfg(M, 128, 4, 4, 3)
    fast, slow = (torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16) for _ in range(2))
    I.int4_linear_with_config(x, w, None, fast, cfg)
    I.int4_linear_with_config(x, w, None, slow, {**cfg, "asm": False})
    torch.testing.assert_close(fast, slow, rtol=4e-3, atol=1e-3 * slow.float().abs().max().item())
    again = torch.empty_like(fast)
    I.int4_linear_with_config(x, w, None, again, cfg)
    assert torch.equal(fast, again)
    out = torch.empty_like(fast)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        I.int4_linear_with_config(x, w, None, out, cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _close(out, I.int4_linear_ref(x, w))


@gpu
def test_mma_config_on_a_weight_it_does_not_compute_takes_the_heuristic():
    """A table entry of kind "mma" on a GGUF-style weight with fp16 scales under bf16 activations (the packed
    FMAs would round the scales to bf16) runs the heuristic's config instead, with the right values."""
    from fastdecode.kernels.int4_mma import mma_supported

    N, K, M = 576, 1536, 1
    w = _packed(N, K, 32, "min", torch.float16)
    x = torch.randn(M, K, device=DEV).bfloat16()
    assert not mma_supported(x.dtype, w.scales.dtype, "min", 32, K)
    assert mma_supported(torch.float16, w.scales.dtype, "min", 32, K)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    I.int4_linear_with_config(x, w, None, out, _mma_cfg(M, 64, 4, 1, 2))
    _close(out, I.int4_linear_ref(x, w))


# ----------------------------------------------------------------------------- tuner on the CPU (no gpu mark)

# Shared memory (bytes) of dot configs (BLOCK_M, BLOCK_N, num_stages; BLOCK_K = 256, bf16 x, fast
# conversion), from triton 3.6's compile for sm_90 (triton.compile for GPUTarget("cuda", 90, 32), the
# pointers and sizes 16-divisible as on the H200) of N, K = 1024, 4096; (64, 128, 4) is also what the
# H200 reported when it refused to launch it.
COMPILED_SMEM_SM90 = {
    (16, 128, 4): 81920, (32, 128, 4): 106496, (64, 32, 4): 159744, (64, 64, 4): 188416,
    (64, 128, 3): 196608, (64, 128, 4): 245760, (128, 32, 3): 221184, (128, 32, 4): 290816,
    (128, 64, 2): 172032, (128, 64, 3): 245760, (128, 128, 2): 212992,
}


def _dot(bm, bn, st, **kw):
    return {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": 1,
            "num_warps": 8 if bm * bn >= 128 * 128 else 4, "num_stages": st, "PREFETCH": False, **kw}


def test_smem_estimate_bounds_the_compiled_size_and_drops_what_cannot_launch():
    for (bm, bn, st), used in COMPILED_SMEM_SM90.items():
        est = I.smem_bytes(_dot(bm, bn, st))
        assert used <= est, (bm, bn, st, used, est)
        if bm >= 64:  # wgmma tiles stage the whole dequantised tile: over by one word buffer, no more
            assert est == used + bn * 256 // 2, (bm, bn, st, used, est)
        assert (est <= H200_SMEM) == (used <= H200_SMEM), (bm, bn, st, used, est)
    for M in (1, 4, 16, 64, 256, 1024):
        for fp8 in (False, True):
            every = candidates(M, 1024, 4096, fp8)
            kept = candidates(M, 1024, 4096, fp8, smem_limit=H200_SMEM)
            xb = 1 if fp8 else 2
            assert kept == [c for c in every if I.smem_bytes(c, xb) <= H200_SMEM]
            assert kept, M
    assert _dot(64, 128, 4) in candidates(64, 1024, 4096)
    assert _dot(64, 128, 4) not in candidates(64, 1024, 4096, smem_limit=H200_SMEM)  # the config of the crash
    assert _dot(128, 128, 2) in candidates(256, 1024, 4096, smem_limit=H200_SMEM)
    for M in (1, 3, 16, 64, 257, 1024):  # the dispatcher's fallback fits too
        _, cfg = I.heuristic_config(M, 4096, 4096, 128)
        assert I.smem_bytes(cfg) <= H200_SMEM, cfg
    assert I.smem_limit(torch.device("cpu")) is None


def test_tuner_skips_a_config_that_cannot_launch_with_one_log_line(monkeypatch, caplog):
    """The launcher raises Triton's OutOfResources for one config (as the H200 did): the tuner logs one
    line naming the config and the reason, and goes on to time the others; wrong values are skipped the
    same way; any other error propagates."""
    from triton.runtime.errors import OutOfResources

    import fastdecode.kernels.int4 as KI

    M, N, K = 16, 32, 256  # small enough for the interpreter
    dev = DEV if torch.cuda.is_available() else "cpu"
    w = Q.quantize_int4(torch.randn(N, K, device=dev) / K**0.5, 128, symmetric=True)
    # fp16: the interpreter's bf16 tl.dot is wrong (docs/architecture.md, "The Triton interpreter")
    x = torch.randn(M, K, device=dev).half()
    ref = I.int4_linear_ref(x, w)
    too_big = _dot(64, 128, 4)
    cands = [_dot(16, 32, 2), too_big, _dot(16, 64, 3)]
    real_launch = KI.launch_int4_linear

    def launch(*args, **kw):
        cfg = args[10]
        if cfg["BLOCK_M"] == too_big["BLOCK_M"] and cfg["BLOCK_N"] == too_big["BLOCK_N"]:
            raise OutOfResources(245760, H200_SMEM, "shared memory")  # what the H200 said
        return real_launch(*args, **kw)

    monkeypatch.setattr(KI, "launch_int4_linear", launch)
    checked, timed = [], []

    def check(cfg):
        out = torch.full((M, N), float("nan"), device=dev, dtype=x.dtype)
        checked.append(cfg)
        I.int4_linear_with_config(x, w, None, out, cfg)
        err = (out.float() - ref.float()).abs().max().item()
        return None if err <= 1e-2 else f"max error {err:.3g}"

    def time(cfg):
        timed.append(cfg)
        return 100.0 / cfg["BLOCK_N"]  # the last one is the fastest

    with caplog.at_level(logging.WARNING, logger="fastdecode"):
        best = B.fastest(cands, check, time, "int4_linear test M=16")
    assert best == (100.0 / 64, cands[2])
    assert checked == cands and timed == [cands[0], cands[2]]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert str(too_big) in msgs[0] and "out of resource: shared memory" in msgs[0] and "M=16" in msgs[0]
    # a wrong result is skipped with one line too; an unexpected error is not swallowed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdecode"):
        assert B.fastest(cands[:1], lambda c: "max error 3", time, "w") is None
    assert len(caplog.records) == 1 and "max error 3" in caplog.records[0].getMessage()
    with pytest.raises(ZeroDivisionError):
        B.fastest(cands[:1], lambda c: 1 / 0, time, "w")


@gpu
def test_fp16_scales_under_bf16_activations_round_once(compiled):
    """GGUF Q4_1 keeps fp16 ``d`` / ``m``; under bf16 activations the dot path used to round them to bf16
    in its packed conversion (two more roundings per weight, coherent over a group). Now such weights take
    the portable conversion: within summation order of ``int4_linear_ref``, several times closer than the
    old recipe (emulated here: the reference on bf16-rounded scales and mins)."""
    from fastdecode.kernels.int4 import fast_cvt_ok

    N, K, M = 1024, 4096, 48
    w = _packed(N, K, 32, "min", torch.float16)
    x = torch.randn(M, K, device=DEV).bfloat16()
    assert not fast_cvt_ok(x, True, 0, torch.float16) and fast_cvt_ok(x, True, 0, torch.bfloat16)
    cfg = DOT_CFG
    y = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    I.int4_linear_with_config(x, w, None, y, cfg)
    ref = I.int4_linear_ref(x, w).float()
    old = I.int4_linear_ref(x, dataclasses.replace(w, scales=w.scales.bfloat16(), mins=w.mins.bfloat16())).float()
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(y.float() - ref) < 0.25 * rms(old - ref), (rms(y.float() - ref), rms(old - ref))
