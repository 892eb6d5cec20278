"""Skinny linear on a real GPU: bf16 and FP8 tensor-core paths, real Llama shapes, every tuner
candidate, split-K determinism, CUDA-graph capture and torch.compile(fullgraph=True).

The tests marked ``gpu`` skip without CUDA (conftest.py); the CPU interpreter suite is test_gemm.py.
The unmarked tests at the end pin the FP8 rounding recipe on the CPU (interpreter, emulated cuBLAS).
"""

import itertools
from functools import partial

import pytest
import torch

import fastdecode.kernels.gemm as KG
import fastdecode.ops.gemm as L
from fastdecode.bench.gemm import candidates
from fastdecode.constants import SCALE_TENSOR, SCALE_VECTOR
from fastdecode.quant import quantize_activation_fp8, quantize_weight_fp8
from helpers import assert_close, interpreter_on, poison_, precompile_calls

gpu = pytest.mark.gpu
DEV = "cuda"
SHAPES = [(6144, 4096), (4096, 14336), (28672, 4096), (111, 4099)]  # (N, K); the last is odd
FP8_SHAPES = [(6144, 4096), (4096, 14336), (111, 4099)]
MS = [1, 3, 16, 64]
TUNER_MS = [1, 2, 4, 16, 64, 256]


def _weight(N, K, dtype=torch.float32):
    return (torch.randn(N, K, device=DEV) / K**0.5).to(dtype)


def _fp8_operands(M, N, K, w_gran, x_dynamic):
    wq, ws = quantize_weight_fp8(_weight(N, K), w_gran)
    x = torch.randn(M, K, device=DEV)
    xq, xs = quantize_activation_fp8(x, None if x_dynamic else float(x.abs().amax()) / 448)
    return xq, xs, wq, ws


def _fp8_ok():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _bf16_operands(N, K, M, bias):
    x = torch.randn(M, K, device=DEV).bfloat16()
    w = _weight(N, K, torch.bfloat16)
    return x, w, torch.randn(N, device=DEV).bfloat16() if bias else None


def _fp16_strided_x(M):
    return torch.randn(M, 4096 + 8, device=DEV).half()[:, :4096]


def _fp8_bias(N, bias):
    return torch.randn(N, device=DEV).bfloat16() if bias else None


def _tuner_operands(dkey, M):
    """(x, weight, x_scale, x_mode, w_scale, w_mode, reference) of test_every_tuner_candidate: N = K = 4096,
    FP8 with per-tensor scales, as the tuner runs them (it shares their compiled kernels)."""
    N, K = 4096, 4096
    if dkey == "fp8":
        xq, xs, wq, ws = _fp8_operands(M, N, K, "tensor", False)
        return xq, wq, xs, 1, ws, 1, L.linear_fp8_ref(xq, xs, wq, ws)
    x, w = torch.randn(M, K, device=DEV).bfloat16(), _weight(N, K, torch.bfloat16)
    return x, w, None, 0, None, 0, L.linear_ref(x, w)


def _tuner_configs(dkey, M):
    """Every config the tuner may try at (M, 4096, 4096): its candidates, and each FMA one with PREFETCH."""
    cands = candidates(M, 4096, 4096, dkey, torch.cuda.get_device_properties(0).multi_processor_count)
    return cands + [{**c, "PREFETCH": True} for c in cands if c["kind"] == "fma"]


@pytest.fixture(scope="module")
def compiled():
    """The kernels the parametrized tests below launch (test_linear_bf16, test_linear_fp16_and_strided_rows,
    test_linear_fp8, test_every_tuner_candidate, test_fp8_bias_cancelling_a_large_product_rounds_once), compiled
    first in parallel threads: the tests' calls (operands of the same shapes, dtypes, strides and scale modes;
    the dispatcher, or each config) made once with every launch turned into a compile (helpers.precompile_calls).
    One after another these compiles took ~50 s of the tests on the H200's host; the tests then launch and check
    every kernel as before."""
    if not torch.cuda.is_available():
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def bf16(N, K, M, bias, impl):
        L.linear(*_bf16_operands(N, K, M, bias), impl=impl)

    def fp16_strided(M, impl):
        L.linear(_fp16_strided_x(M), _weight(6144, 4096, torch.float16), impl=impl)

    def fp8(N, K, M, scales, bias, impl):
        x_gran, w_gran = scales.split("-")
        L.linear_fp8(*_fp8_operands(M, N, K, w_gran, x_gran == "token"), _fp8_bias(N, bias), impl=impl)

    def tuner(dkey, M):
        x, w, xs, x_mode, ws, w_mode, _ = _tuner_operands(dkey, M)
        for cfg in _tuner_configs(dkey, M):
            L.linear_with_config(x, w, None, xs, x_mode, ws, w_mode,
                                 torch.empty(M, 4096, device=DEV, dtype=torch.bfloat16), cfg)

    def bias_cancelling(scales):
        M, N, K = 3, 4096, 4096
        xq, xs, wq, ws, b = _cancelling_fp8(M, N, K, scales, DEV, torch.bfloat16)
        for impl in (None, "triton"):
            L.linear_fp8(xq, xs, wq, ws, b, impl=impl)
        x_mode = SCALE_TENSOR if xs.numel() == 1 else SCALE_VECTOR
        w_mode = SCALE_TENSOR if ws.numel() == 1 else SCALE_VECTOR
        for cfg in candidates(M, N, K, "fp8", sms):
            out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
            L.linear_with_config(xq, wq, b, xs.reshape(-1), x_mode, ws, w_mode, out, cfg)

    impls = (None, "triton")  # cuBLAS compiles nothing
    calls = [partial(bf16, N, K, M, bias, impl)
             for (N, K), M, bias, impl in itertools.product(SHAPES, MS, (False, True), impls)]
    calls += [partial(fp16_strided, M, impl) for M, impl in itertools.product(MS, impls)]
    calls += [partial(tuner, "bf16", M) for M in TUNER_MS]
    if _fp8_ok():
        calls += [partial(fp8, N, K, M, scales, bias, impl)
                  for (N, K), M, (scales, bias), impl in itertools.product(FP8_SHAPES, MS, SCALES_BIAS, impls)]
        calls += [partial(tuner, "fp8", M) for M in TUNER_MS]
        calls += [partial(bias_cancelling, scales) for scales in BIAS_CANCELLING_SCALES]
    precompile_calls(calls, [(KG, "_skinny_linear_kernel")])


@gpu
@pytest.mark.parametrize("impl", [None, "triton", "cublas"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_bf16(N, K, M, bias, impl, compiled):
    x, w, b = _bf16_operands(N, K, M, bias)
    out = poison_(torch.empty(M, N, device=DEV, dtype=torch.bfloat16))
    y = L.linear(x, w, b, out=out, impl=impl)
    assert y is out
    ref = L.linear_ref(x, w, b)
    # cuBLAS may round x @ w.T to bf16 before adding the bias (measured: 0.0117 off at |y| = 0.42,
    # N=111, K=4099): the error scales with the largest terms, not with the element itself
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=8e-3 * ref.float().abs().max().item())


@gpu
@pytest.mark.parametrize("impl", [None, "triton"])
@pytest.mark.parametrize("M", MS)
def test_linear_fp16_and_strided_rows(M, impl, compiled):
    x = _fp16_strided_x(M)  # row stride 4104
    w = _weight(6144, 4096, torch.float16)
    assert_close(L.linear(x, w, impl=impl), L.linear_ref(x, w))


# every scale combination, each once with and once without bias would double the compiled variants
# (bias and scale modes are compile-time constants): four pairs cover all of them
SCALES_BIAS = [("tensor-tensor", False), ("token-channel", True), ("tensor-channel", True), ("token-tensor", False)]


@gpu
@pytest.mark.skipif(not _fp8_ok(), reason="FP8 needs sm_89+")
@pytest.mark.parametrize("impl", [None, "triton", "cublas"])
@pytest.mark.parametrize("scales,bias", SCALES_BIAS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N,K", FP8_SHAPES)
def test_linear_fp8(N, K, M, scales, bias, impl, compiled):
    x_gran, w_gran = scales.split("-")
    if impl == "cublas" and (N % 16 or K % 16):
        pytest.skip("torch._scaled_mm needs N and K multiples of 16")
    xq, xs, wq, ws = _fp8_operands(M, N, K, w_gran, x_gran == "token")
    b = _fp8_bias(N, bias)
    out = poison_(torch.empty(M, N, device=DEV, dtype=torch.bfloat16))
    y = L.linear_fp8(xq, xs, wq, ws, b, out=out, impl=impl)
    assert y is out
    assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws, b))


@gpu
@pytest.mark.parametrize("dkey", ["bf16", "fp8"])
@pytest.mark.parametrize("M", TUNER_MS)
def test_every_tuner_candidate(dkey, M, compiled):
    """Each config the tuner may pick compiles (registers, shared memory) and is right."""
    if dkey == "fp8" and not _fp8_ok():
        pytest.skip("FP8 needs sm_89+")
    x, w, xs, x_mode, ws, w_mode, ref = _tuner_operands(dkey, M)
    for cfg in _tuner_configs(dkey, M):
        out = poison_(torch.empty(M, 4096, device=DEV, dtype=torch.bfloat16))
        L.linear_with_config(x, w, None, xs, x_mode, ws, w_mode, out, cfg)
        try:
            assert_close(out, ref)
        except AssertionError as e:
            raise AssertionError(f"config {cfg}: {e}") from None


@gpu
def test_split_k_is_deterministic_and_counters_reset():
    x = torch.randn(5, 14336, device=DEV).bfloat16()
    w = _weight(4096, 14336, torch.bfloat16)
    cfg = dict(kind="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=4)
    first = torch.empty(5, 4096, device=DEV, dtype=torch.bfloat16)
    L.linear_with_config(x, w, None, None, 0, None, 0, first, cfg)
    for _ in range(50):
        out = poison_(torch.empty_like(first))
        L.linear_with_config(x, w, None, None, 0, None, 0, out, cfg)
        assert torch.equal(out, first), "split-K result changed between identical launches"
    torch.cuda.synchronize()
    assert int(L._LOCKS[("cuda", x.device.index)].abs().sum()) == 0
    assert_close(first, L.linear_ref(x, w))


@gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("M", [1, 16])
def test_cuda_graph_capture_and_replay(M, fp8):
    if fp8 and not _fp8_ok():
        pytest.skip("FP8 needs sm_89+")
    N, K = 4096, 4096
    if fp8:
        xq, xs, wq, ws = _fp8_operands(M, N, K, "channel", True)
        run = lambda: L.linear_fp8(xq, xs, wq, ws)  # noqa: E731
    else:
        x, w = torch.randn(M, K, device=DEV).bfloat16(), _weight(N, K, torch.bfloat16)
        run = lambda: L.linear(x, w)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up: compiles, allocates the split-K counters outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    for _ in range(3):  # new inputs in the same buffers
        if fp8:
            xn, xsn = quantize_activation_fp8(torch.randn(M, K, device=DEV))
            xq.copy_(xn)
            xs.copy_(xsn)
        else:
            x.copy_(torch.randn(M, K, device=DEV))
        poison_(y)
        g.replay()
        torch.cuda.synchronize()
        assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws) if fp8 else L.linear_ref(x, w))


@gpu
def test_capture_before_any_call_falls_back_to_one_split():
    saved = dict(L._LOCKS)
    L._LOCKS.clear()
    try:
        x, w = torch.randn(2, 4096, device=DEV).bfloat16(), _weight(4096, 4096, torch.bfloat16)
        cfg = dict(kind="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=4)
        out = torch.empty(2, 4096, device=DEV, dtype=torch.bfloat16)
        L.linear_with_config(x, w, None, None, 0, None, 0, out, {**cfg, "SPLIT_K": 1})  # compile only
        L._LOCKS.clear()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            L.linear_with_config(x, w, None, None, 0, None, 0, out, cfg)
        assert not L._LOCKS, "a counter buffer was allocated inside the capture"
        poison_(out)
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, L.linear_ref(x, w))
    finally:
        L._LOCKS.update(saved)


BIAS_CANCELLING_SCALES = ["token-channel", "tensor-tensor", "tensor-channel"]


@gpu
@pytest.mark.skipif(not _fp8_ok(), reason="FP8 needs sm_89+")
@pytest.mark.parametrize("scales", BIAS_CANCELLING_SCALES)
def test_fp8_bias_cancelling_a_large_product_rounds_once(scales, compiled):
    """Every path (the dispatcher's, each tuner candidate, cuBLAS) rounds ``acc * xs * ws + bias`` once,
    as the reference: within one ulp of the output where the bias cancels a large product. cuBLAS used
    to round the product to bf16 and then add the bias (a second rounding): up to half an ulp of the
    pre-bias value off, 4 ulps of the output here (test_torch_compile_fullgraph[True] caught it)."""
    M, N, K = 3, 4096, 4096
    xq, xs, wq, ws, b = _cancelling_fp8(M, N, K, scales, DEV, torch.bfloat16)
    ref = L.linear_fp8_ref(xq, xs, wq, ws, b)
    assert _ulps(_double_rounded(xq, xs, wq, ws, b, torch.bfloat16), ref) > 1  # the case has teeth
    for impl in (None, "triton", "cublas"):
        y = L.linear_fp8(xq, xs, wq, ws, b, impl=impl)
        assert _ulps(y, ref) <= 1, f"impl={impl}: {_ulps(y, ref)} ulps"
    x_mode = SCALE_TENSOR if xs.numel() == 1 else SCALE_VECTOR
    w_mode = SCALE_TENSOR if ws.numel() == 1 else SCALE_VECTOR
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in candidates(M, N, K, "fp8", sms):
        out = poison_(torch.empty(M, N, device=DEV, dtype=torch.bfloat16))
        L.linear_with_config(xq, wq, b, xs.reshape(-1), x_mode, ws, w_mode, out, cfg)
        assert _ulps(out, ref) <= 1, f"config {cfg}: {_ulps(out, ref)} ulps"


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_torch_compile_fullgraph(fp8):
    if fp8 and not _fp8_ok():
        pytest.skip("FP8 needs sm_89+")
    torch._dynamo.reset()
    M, N, K = 3, 4096, 4096
    if fp8:
        xq, xs, wq, ws = _fp8_operands(M, N, K, "channel", True)
        b = torch.randn(N, device=DEV).bfloat16()
        f = torch.compile(lambda a, s: L.linear_fp8(a, s, wq, ws, b) * 2, fullgraph=True)
        y = f(xq, xs)
        # the registered op runs eagerly inside the graph, on the same dispatcher decision: bitwise equal
        assert torch.equal(y, L.linear_fp8(xq, xs, wq, ws, b) * 2)
        # was 5 of 12,288 elements off by 0.0156: cuBLAS (M=3 dispatches there) rounded x @ w.T to bf16
        # before the bias was added (test_fp8_bias_cancelling_a_large_product_rounds_once)
        assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws, b) * 2)
    else:
        w = _weight(N, K, torch.bfloat16)
        f = torch.compile(lambda a: torch.relu(L.linear(a, w)), fullgraph=True)
        x = torch.randn(M, K, device=DEV).bfloat16()
        assert_close(f(x), torch.relu(L.linear_ref(x, w)))


@gpu
def test_fp8_needs_sm89(monkeypatch):
    import fastdecode.ops._common as common

    xq, xs, wq, ws = (torch.zeros(2, 32, device=DEV).to(torch.float8_e4m3fn), torch.ones(1, device=DEV),
                      torch.zeros(16, 32, device=DEV).to(torch.float8_e4m3fn), torch.ones(16, device=DEV))
    monkeypatch.setattr(common, "device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match=r"FP8 linear needs a GPU with compute capability >= 8.9"):
        L.linear_fp8(xq, xs, wq, ws)


@gpu
def test_dispatcher_uses_the_tuned_table_for_this_gpu():
    impl, cfg = L.get_linear_config(1, 4096, 4096, torch.bfloat16, DEV)
    assert impl in ("triton", "cublas")
    if impl == "triton":
        assert cfg["kind"] in ("fma", "dot")
    # far above any tuned M: cuBLAS
    assert L.get_linear_config(8192, 4096, 4096, torch.bfloat16, DEV) == ("cublas", None)


@gpu
@pytest.mark.parametrize("kind,prefetch", [("fma", False), ("fma", True), ("dot", False)])
def test_programmatic_dependent_launch(kind, prefetch):
    """PDL configs give the same results eagerly and when chained inside a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    M, N, K = (1, 4096, 4096) if kind == "fma" else (8, 4096, 4096)
    cfg = {**L.heuristic_config(M, N, K, "bf16"), "PDL": True, "PREFETCH": prefetch}  # split-K > 1 in both
    assert cfg["kind"] == kind and cfg["SPLIT_K"] > 1
    x, w = torch.randn(M, K, device=DEV).bfloat16(), _weight(N, K, torch.bfloat16)
    w2 = _weight(K, N, torch.bfloat16)
    h = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    y = torch.empty(M, K, device=DEV, dtype=torch.bfloat16)

    def chain():  # y = (x @ w.T) @ w2.T: the second launch depends on the first's output
        L.linear_with_config(x, w, None, None, 0, None, 0, h, cfg)
        L.linear_with_config(h, w2, None, None, 0, None, 0, y, cfg)

    chain()
    torch.cuda.synchronize()
    ref = L.linear_ref(L.linear_ref(x, w), w2)
    assert_close(y, ref)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for _ in range(3):
        x.copy_(torch.randn(M, K, device=DEV))
        poison_(h)
        poison_(y)
        g.replay()
        torch.cuda.synchronize()
        assert_close(y, L.linear_ref(L.linear_ref(x, w), w2))


@gpu
def test_cublas_fp8_rejects_what_scaled_mm_cannot_run():
    if not _fp8_ok():
        pytest.skip("FP8 needs sm_89+")
    xq, xs, wq, ws = _fp8_operands(2, 111, 4099, "channel", True)
    with pytest.raises(ValueError, match=r"impl='cublas': torch._scaled_mm cannot run N=111, K=4099"):
        L.linear_fp8(xq, xs, wq, ws, impl="cublas")
    assert_close(L.linear_fp8(xq, xs, wq, ws), L.linear_fp8_ref(xq, xs, wq, ws))  # dispatch: Triton


# ----------------------------------------------------------------------------- FP8 rounding recipe (no gpu mark)


def _integer_fp8(rows, K, device, gen_scale):
    """FP8 values that are small integers (|v| <= 8, exact in e4m3) and a scale of the asked granularity
    ("token"/"channel": one per row, "tensor": one). Every partial sum of such a product is an integer
    below 2**18, exact in fp32 and in any accumulation order or precision of an FP8 MMA (Hopper keeps
    ~14 bits inside one wgmma), so a test on them sees the epilogue's rounding and nothing else."""
    q = torch.randint(-8, 9, (rows, K), device=device).float().to(torch.float8_e4m3fn)
    if gen_scale == "tensor":
        return q, torch.rand(1, device=device) + 0.5  # shape (1,), as quantize_*_fp8 give
    s = torch.rand(rows, device=device) + 0.5
    return q, s.reshape(rows, 1) if gen_scale == "token" else s


def _cancelling_fp8(M, N, K, scales, device, bias_dtype, big=3.0):
    """FP8 operands whose product ``acc * xs * ws`` has |.| ~ ``big`` and a bias that cancels it to
    0.1 <= |y| <= 0.4 (rows of x equal, so one bias cancels every row), give or take the rounding of the
    bias to ``bias_dtype``: a path that rounds before adding the bias is off by up to half an ulp of the
    large value, several ulps of y. The operands are integer-valued (_integer_fp8), so ``acc`` is exact
    on every path: an FP8 MMA's own accumulation precision (2-3 bf16 ulps of y here with random
    operands, measured on the H200) does not enter a test of the epilogue's rounding."""
    x_gran, w_gran = scales.split("-")
    x0, xs = _integer_fp8(1, K, device, x_gran)
    wq, ws = _integer_fp8(N, K, device, w_gran)
    xq = x0.expand(M, K).contiguous()
    xs = xs.expand(M, 1).contiguous() if x_gran == "token" else xs
    # scale the product so that its largest |.| is ``big``: measured from this draw, not from the integer
    # acc's expected spread (std ~ 24 * sqrt(K)), which a draw of a few dozen columns can miss by a third
    acc = L.linear_fp8_ref(xq, xs, wq, ws, out_dtype=torch.float32)[0]
    xs = xs * (big / acc.abs().max().clamp_min(1e-6))
    pre = L.linear_fp8_ref(xq, xs, wq, ws, out_dtype=torch.float32)[0]
    u = (torch.rand(N, device=device) * 0.3 + 0.1) * torch.where(torch.rand(N, device=device) < 0.5, -1.0, 1.0)
    bias = (u - pre).to(bias_dtype)
    assert (pre + bias.float()).abs().min() >= 0.03 and pre.abs().max() > 2 * big / 3
    return xq, xs, wq, ws, bias


def _ulps(y, ref) -> float:
    """Largest |y - ref| in ulps of the output dtype at max(|y|, |ref|) (elementwise)."""
    y, r = y.float(), ref.float()
    mag = torch.maximum(y.abs(), r.abs()).clamp_min(torch.finfo(ref.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(ref.dtype).eps
    return ((y - r).abs() / ulp).max().item()


def _double_rounded(xq, xs, wq, ws, bias, out_dtype):
    """The recipe this test rejects: the product rounded to out_dtype, then the bias added and rounded."""
    pre = L.linear_fp8_ref(xq, xs, wq, ws, out_dtype=out_dtype)
    return (pre.float() + bias.to(out_dtype).float()).to(out_dtype)


# configs of each Triton path: FMA, FMA split-K with prefetch, dot with FP8 / upcast operands, dot split-K
RECIPE_CONFIGS = [
    dict(kind="fma", BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=1),
    dict(kind="fma", BLOCK_M=4, BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, PREFETCH=True),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, DOT_FP8=True),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, DOT_FP8=False),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4, DOT_FP8=True),
]


@pytest.mark.skipif(not interpreter_on(), reason="the Triton interpreter (CPU); the GPU has its own test above")
@pytest.mark.parametrize("scales", ["token-channel", "tensor-tensor"])
def test_fp8_recipe_on_the_interpreter_rounds_once(scales):
    """The kernel's epilogue ``acc * xs * ws + bias`` (fp32, one rounding) and linear_fp8_ref agree
    within one ulp of the OUTPUT where the bias cancels a large product; the double rounding is off by
    tens of ulps there (fp16 output: the interpreter's bf16 casts truncate; an fp32 bias, exact)."""
    M, N, K = 3, 64, 256
    xq, xs, wq, ws, b = _cancelling_fp8(M, N, K, scales, "cpu", torch.float32, big=40.0)
    ref = L.linear_fp8_ref(xq, xs, wq, ws, b, out_dtype=torch.float16)
    assert _ulps(_double_rounded(xq, xs, wq, ws, b, torch.float16), ref) > 8
    x_mode = SCALE_TENSOR if xs.numel() == 1 else SCALE_VECTOR
    w_mode = SCALE_TENSOR if ws.numel() == 1 else SCALE_VECTOR
    for cfg in RECIPE_CONFIGS:
        out = poison_(torch.empty(M, N, dtype=torch.float16))
        cfg = {"num_warps": 4, "num_stages": 1, **cfg}
        L.linear_with_config(xq, wq, b, xs.reshape(-1), x_mode, ws, w_mode, out, cfg)
        assert _ulps(out, ref) <= 1, f"config {cfg}: {_ulps(out, ref)} ulps"
    y = L.linear_fp8(xq, xs, wq, ws, b, out_dtype=torch.float16, backend="triton")
    assert _ulps(y, ref) <= 1


@pytest.mark.parametrize("scales", ["token-channel", "tensor-tensor", "token-tensor"])
def test_cublas_fp8_puts_the_bias_in_the_scaled_mm_epilogue(scales, monkeypatch):
    """The cuBLAS path hands the bias to torch._scaled_mm (added in its fp32 epilogue before the one
    rounding) and adds nothing afterwards; a bias it cannot fuse (dtype other than out's) keeps the
    dispatcher on Triton and makes impl='cublas' raise. _scaled_mm is emulated here (CPU): fp32
    ``acc * scale_a * scale_b + bias``, one rounding, as cuBLASLt and the CUTLASS row-wise kernel do."""
    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, out=None, **kw):
        calls.append(bias)
        y = (a.float() @ b.float()) * scale_a.float() * scale_b.float()
        if bias is not None:
            y = y + bias.float()
        return out.copy_(y.to(out_dtype))

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    M, N, K = 3, 64, 256
    xq, xs, wq, ws, b = _cancelling_fp8(M, N, K, scales, "cpu", torch.bfloat16)
    x_mode = SCALE_TENSOR if xs.numel() == 1 else SCALE_VECTOR
    w_mode = SCALE_TENSOR if ws.numel() == 1 else SCALE_VECTOR
    out = poison_(torch.empty(M, N, dtype=torch.bfloat16))
    L._cublas_linear_fp8(xq, xs.reshape(-1), x_mode, wq, ws, w_mode, b, out)
    assert len(calls) == 1 and calls[0] is b
    ref = L.linear_fp8_ref(xq, xs, wq, ws, b)
    assert _ulps(out, ref) <= 1
    assert _ulps(_double_rounded(xq, xs, wq, ws, b, torch.bfloat16), ref) > 1
    # what cuBLAS cannot fuse it does not get
    assert L.cublas_fp8_supported(M, N, K, x_mode, w_mode, torch.bfloat16, torch.bfloat16)
    assert not L.cublas_fp8_supported(M, N, K, x_mode, w_mode, torch.bfloat16, torch.float32)
    assert not L.cublas_fp8_supported(M, N, K, SCALE_TENSOR, SCALE_TENSOR, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"impl='cublas': torch._scaled_mm cannot run N=64, K=256 .*bias dtype "
                                         r"torch.float32"):
        L._check_cublas_fp8(M, N, K, x_mode == SCALE_TENSOR, w_mode == SCALE_TENSOR, torch.bfloat16, torch.float32)


def test_strided_bias_is_read_at_its_strides():
    """A bias view with a stride (here every other element) was read as if contiguous by the kernels."""
    backend = "triton" if (interpreter_on() or torch.cuda.is_available()) else "torch"
    dev = DEV if torch.cuda.is_available() else "cpu"
    # integer-valued operands (|v| <= 8): every product and partial sum is exact in fp32, tf32 and an FP8
    # MMA, so the fp32 outputs may be compared tightly and only the bias read is under test (with
    # random FP8 operands the fp32 output missed the 1e-5 tolerance on the H200: the MMA's own precision)
    x = torch.randint(-8, 9, (3, 64), device=dev).float()
    w = torch.randint(-8, 9, (48, 64), device=dev).float()
    b = torch.randn(96, device=dev)[::2]
    assert_close(L.linear(x, w, b, backend=backend), L.linear_ref(x, w, b))
    xq, xs = x.to(torch.float8_e4m3fn), torch.rand(3, 1, device=dev) + 0.5
    wq, ws = w.to(torch.float8_e4m3fn), torch.rand(48, device=dev) + 0.5
    y = L.linear_fp8(xq, xs, wq, ws, b, out_dtype=torch.float32, backend=backend) if dev == "cpu" or _fp8_ok() else None
    if y is not None:
        assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws, b, out_dtype=torch.float32))
