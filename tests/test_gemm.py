"""Skinny linear (BF16/FP16 and FP8 W8A8), its dispatcher and the FP8 weight helpers, on the CPU.

The Triton kernels run under the interpreter (conftest.py sets TRITON_INTERPRET=1 without a GPU).
Under the interpreter ``tl.dot`` on bf16 is wrong (docs/architecture.md, "The Triton interpreter"), so dot-path
cases use fp16/fp32 here; bf16 and the real tensor-core paths are in test_gemm_gpu.py.
"""

import json
import logging

import pytest
import torch

import fastdecode.ops.gemm as L
from fastdecode.ops import _common
from fastdecode.quant import dequantize_fp8, quantize_activation_fp8, quantize_weight_fp8
from helpers import FP8, assert_close, e4m3_step, k_loop, poison_, sm90_ptx, strided_rows

if torch.cuda.is_available():  # this file is the CPU (interpreter) suite
    pytestmark = pytest.mark.skip(reason="CPU interpreter suite; see test_gemm_gpu.py")

DEV = "cpu"


def _weight(N, K, dtype=torch.float32):
    # scaled like a real projection (std 1/sqrt(K)) so outputs are O(1) and the per-dtype
    # output tolerances of helpers.TOLERANCES apply whatever K is
    return (torch.randn(N, K) / K**0.5).to(dtype)


def _fp8_operands(M, N, K, w_gran, x_dynamic, lead=None):
    wq, ws = quantize_weight_fp8(_weight(N, K), w_gran)
    x = torch.randn(*(lead or (M,)), K)
    xq, xs = quantize_activation_fp8(x, None if x_dynamic else x.abs().amax().item() / 448)
    return xq, xs, wq, ws


# the configs every kernel variant is checked with; SPLIT_K > 1 exercises the in-kernel fix-up
CONFIGS = {
    "fma_m1": dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
    "fma_m2_split3": dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=3),
    "fma_m4_split5": dict(kind="fma", BLOCK_M=4, BLOCK_N=4, BLOCK_K=32, SPLIT_K=5),
    "fma_m1_prefetch": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=128, SPLIT_K=1, PREFETCH=True),
    "fma_m2_prefetch_split3": dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, PREFETCH=True),
    "fma_m1_evict_split2": dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, EVICT=True),
    "dot_split1": dict(kind="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),
    "dot_evict": dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, EVICT=True),
    "dot_split4": dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4),
    "dot_m32_split2": dict(kind="dot", BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2),
}


# ----------------------------------------------------------------------------- linear (bf16/fp16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
@pytest.mark.parametrize("N,K", [(111, 199), (67, 1031)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_linear_dispatch_matches_ref(dtype, N, K, M, bias):
    x = torch.randn(M, K).to(dtype)
    w = _weight(N, K, dtype)
    b = torch.randn(N).to(dtype) if bias else None
    out = poison_(torch.empty(M, N, dtype=dtype))
    y = L.linear(x, w, b, out=out, backend="triton")
    assert y is out
    assert_close(y, L.linear_ref(x, w, b))


@pytest.mark.parametrize("M", [1, 2])
def test_linear_bf16_fma_path(M):
    # the FMA path never calls tl.dot, so bf16 runs under the interpreter too
    x = torch.randn(M, 4099).bfloat16()
    w = _weight(199, 4099, torch.bfloat16)
    b = torch.randn(199).bfloat16()
    cfg = L.get_linear_config(M, 199, 4099, torch.bfloat16)[1]
    assert cfg["kind"] == "fma"
    assert_close(L.linear(x, w, b, backend="triton"), L.linear_ref(x, w, b))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("M", [1, 5, 33])
def test_every_kernel_config(name, M):
    N, K = 75, 999  # odd: partial N tiles, a partial last K block, splits of unequal length
    if CONFIGS[name]["kind"] == "fma" and M == 33:
        M = 9  # the 3-D FMA tile is slow under the interpreter; 9 rows still spans several M tiles
    x = strided_rows(M, K, torch.float16)
    w = _weight(N, K, torch.float16)
    b = torch.randn(N).half()
    out = poison_(torch.empty(M, N, dtype=torch.float16))
    L.linear_with_config(x, w, b, None, 0, None, 0, out, CONFIGS[name])
    assert_close(out, L.linear_ref(x, w, b))


def test_split_k_is_deterministic_and_resets_its_counters():
    x = torch.randn(3, 1031).half()
    w = _weight(70, 1031, torch.float16)
    cfg = CONFIGS["dot_split4"]
    outs = []
    for _ in range(2):
        out = poison_(torch.empty(3, 70, dtype=torch.float16))
        L.linear_with_config(x, w, None, None, 0, None, 0, out, cfg)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    locks = L._LOCKS[("cpu", None)]
    assert int(locks.abs().sum()) == 0, "split-K tile counters were not reset to 0"


def test_nd_and_strided_input():
    x = torch.randn(2, 3, 300).half()[:, :, :257]  # strided rows, leading dims (2, 3)
    w = _weight(40, 257, torch.float16)
    y = L.linear(x, w, backend="triton")
    assert y.shape == (2, 3, 40)
    assert_close(y, L.linear_ref(x, w))


def test_empty_and_torch_backend():
    w = _weight(40, 64, torch.float16)
    assert L.linear(torch.empty(0, 64).half(), w, backend="triton").shape == (0, 40)
    # linear_fp8 with M = 0 (per-token scales of shape (0, 1), as the fused norm returns them)
    xq, xs, wq, ws = _fp8_operands(3, 40, 64, "channel", True)
    for backend in ("triton", "torch"):
        y = L.linear_fp8(xq[:0], xs[:0], wq, ws, backend=backend)
        assert y.shape == (0, 40) and y.dtype == torch.bfloat16
        y = L.linear_fp8(xq[:0].reshape(2, 0, 64), xs[0].reshape(1), wq, ws, backend=backend)  # per tensor
        assert y.shape == (2, 0, 40)
    x = torch.randn(5, 64).half()
    torch.testing.assert_close(L.linear(x, w, backend="torch"), L.linear_ref(x, w), atol=0, rtol=0)


# ----------------------------------------------------------------------------- FP8 W8A8


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("w_gran", ["channel", "tensor"])
@pytest.mark.parametrize("x_dynamic", [True, False])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_linear_fp8_dispatch_matches_ref(M, x_dynamic, w_gran, bias):
    N, K = 111, 4099
    xq, xs, wq, ws = _fp8_operands(M, N, K, w_gran, x_dynamic)
    b = torch.randn(N).bfloat16() if bias else None
    out = poison_(torch.empty(M, N, dtype=torch.bfloat16))
    y = L.linear_fp8(xq, xs, wq, ws, b, out=out, backend="triton")
    assert y is out
    assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws, b))


@pytest.mark.parametrize("name,dot_fp8", [("fma_m2_split3", False), ("fma_m2_prefetch_split3", False),
                                           ("dot_split4", False), ("dot_split4", True)])
def test_linear_fp8_configs_and_fp16_out(name, dot_fp8):
    M, N, K = 5, 75, 999
    xq, xs, wq, ws = _fp8_operands(M, N, K, "channel", True)
    b = torch.randn(N)  # an fp32 bias with fp16 output
    out = poison_(torch.empty(M, N, dtype=torch.float16))
    L.linear_with_config(xq, wq, b, xs.reshape(M), 2, ws, 2, out, {**CONFIGS[name], "DOT_FP8": dot_fp8})
    assert_close(out, L.linear_fp8_ref(xq, xs, wq, ws, b, out_dtype=torch.float16))


def test_linear_fp8_nd_scales_from_norm_shape():
    # dynamic scales come from the fused norm as (..., 1)
    xq, xs, wq, ws = _fp8_operands(None, 48, 160, "channel", True, lead=(2, 3))
    assert xs.shape == (2, 3, 1)
    y = L.linear_fp8(xq, xs, wq, ws.reshape(48, 1), out_dtype=torch.float16, backend="triton")
    assert y.shape == (2, 3, 48) and y.dtype == torch.float16
    assert_close(y, L.linear_fp8_ref(xq, xs, wq, ws, out_dtype=torch.float16))


# ----------------------------------------------------------------------------- bad input


def test_linear_errors():
    x = torch.randn(4, 64).half()
    w = _weight(32, 64, torch.float16)
    with pytest.raises(ValueError, match=r"weight must have shape \(N, 64\).*mismatched K"):
        L.linear(x, _weight(32, 65, torch.float16))
    with pytest.raises(ValueError, match="weight must have the dtype of x"):
        L.linear(x, w.float())
    with pytest.raises(ValueError, match="x must have dtype"):
        L.linear(x.to(FP8), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        L.linear(x, _weight(64, 32, torch.float16).t())
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\)"):
        L.linear(x, w, torch.randn(31).half())
    with pytest.raises(ValueError, match="out must be a tensor of shape"):
        L.linear(x, w, out=torch.empty(4, 33).half())
    with pytest.raises(ValueError, match="impl must be one of"):
        L.linear(x, w, impl="cutlass")
    with pytest.raises(RuntimeError, match="impl='cublas' needs CUDA"):
        L.linear(x, w, impl="cublas", backend="triton")
    with pytest.raises(ValueError, match="needs the triton backend"):
        L.linear(x, w, impl="triton", backend="torch")


def test_linear_fp8_errors():
    xq, xs, wq, ws = _fp8_operands(4, 32, 64, "channel", True)
    with pytest.raises(ValueError, match="x_fp8 must have dtype"):
        L.linear_fp8(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="weight_fp8 must have dtype"):  # the argument's name
        L.linear_fp8(xq, xs, wq.float(), ws)
    with pytest.raises(ValueError, match=r"weight_fp8 must have shape \(N, 48\) to match the last dimension "
                                         r"of x_fp8.*mismatched K"):
        L.linear_fp8(xq[:, :48], xs, wq, ws)
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\) \(N, the rows of weight_fp8\)"):
        L.linear_fp8(xq, xs, wq, ws, torch.randn(31))
    with pytest.raises(ValueError, match=r"x_scale must be per-tensor .* or per-token"):
        L.linear_fp8(xq, torch.ones(3, 1), wq, ws)
    with pytest.raises(ValueError, match=r"weight_scale must be per-tensor .* or per-channel"):
        L.linear_fp8(xq, xs, wq, torch.ones(31))
    with pytest.raises(ValueError, match="weight_scale must have dtype"):
        L.linear_fp8(xq, xs, wq, ws.double())
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        L.linear_fp8(xq, xs, wq, ws, out_dtype=FP8)
    with pytest.raises(ValueError, match="weight_fp8 must be contiguous"):
        L.linear_fp8(xq, xs, wq.t().contiguous().t(), ws)


# ----------------------------------------------------------------------------- dispatcher


def _table(tmp_path, entries):
    p = tmp_path / "linear_test.json"
    p.write_text(json.dumps({"gpu": "test", "linear": entries}))
    return str(p)


def test_dispatcher_nearest_m_on_log_scale(tmp_path):
    fma = dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2)
    dot = dict(kind="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4)
    path = _table(tmp_path, {"bf16": {"4096,4096": {
        "1": {"impl": "triton", "config": fma},
        "8": {"impl": "triton", "config": dot},
        "64": {"impl": "cublas"},
    }}})
    L.clear_config_cache()
    get = lambda M, dtype=torch.bfloat16: L.get_linear_config(M, 4096, 4096, dtype, "cpu", path=path)  # noqa: E731
    assert get(1) == ("triton", fma)
    assert get(2) == ("triton", fma)    # log2 distance 1 vs 2
    assert get(3) == ("triton", dot)    # 3 is nearer 8 than 1 on a log scale
    assert get(16) == ("triton", dot)   # log2 distance 1 to 8, 2 to 64
    assert get(23) == ("cublas", None)  # nearer 64
    assert get(4096) == ("cublas", None)  # above the largest tuned M
    assert get(1, torch.float16) == ("triton", fma)  # fp16 shares the bf16 table (same bytes)


def test_dispatcher_fallback_heuristic(tmp_path):
    path = _table(tmp_path, {"bf16": {}})
    L.clear_config_cache()
    impl, cfg = L.get_linear_config(4, 1000, 512, torch.bfloat16, "cpu", path=path)
    assert impl == "triton" and cfg == L.heuristic_config(4, 1000, 512, "bf16")
    assert L.get_linear_config(64, 1000, 512, torch.bfloat16, "cpu", path=path) == ("cublas", None)


def test_dispatcher_warns_once_without_a_file(tmp_path, caplog):
    L.clear_config_cache()
    _common._logged_once.clear()
    missing = str(tmp_path / "linear_none.json")
    with caplog.at_level(logging.WARNING, logger="fastdecode"):
        for M in (1, 2, 3):
            assert L.get_linear_config(M, 64, 64, torch.bfloat16, "cpu", path=missing)[0] == "triton"
    assert sum("no tuned linear configs" in r.message for r in caplog.records) == 1


def test_dispatcher_warns_once_per_missing_shape(tmp_path, caplog):
    """A table without an entry for (dtype, N, K): the heuristic, with one warning per missing key
    (not per M, not per call), and none for a shape the table has."""
    fma = dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2)
    path = _table(tmp_path, {"bf16": {"64,64": {"1": {"impl": "triton", "config": fma},
                                                "8": {"impl": "triton", "config": fma}}}})
    L.clear_config_cache()
    _common._logged_once.clear()
    with caplog.at_level(logging.WARNING, logger="fastdecode"):
        for M in (1, 2, 4, 1):
            assert L.get_linear_config(M, 64, 64, torch.bfloat16, "cpu", path=path) == ("triton", fma)
        for M in (1, 2, 32):
            L.get_linear_config(M, 96, 64, torch.bfloat16, "cpu", path=path)
            L.get_linear_config(M, 64, 64, FP8, "cpu", path=path)
    msgs = [r.getMessage() for r in caplog.records if "no tuned linear config" in r.getMessage()]
    assert len(msgs) == 2, msgs
    assert any("bf16 N=96, K=64" in m for m in msgs) and any("fp8 N=64, K=64" in m for m in msgs)
    assert all("linear_test.json" in m for m in msgs)


def test_heuristic_fills_the_gpu():
    # enough programs for ~4 per SM on 132 SMs at M=1, and every split gets K blocks
    for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 14336)]:
        for M in (1, 2, 4, 16):
            cfg = L.heuristic_config(M, N, K, "bf16")
            tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
            assert tiles * cfg["SPLIT_K"] >= 2 * 132, (N, K, M, cfg)
            assert -(-K // cfg["BLOCK_K"]) >= cfg["SPLIT_K"]


# ----------------------------------------------------------------------------- quant helpers


@pytest.mark.parametrize("gran", ["channel", "tensor"])
def test_quantize_weight_fp8_round_trip(gran):
    w = _weight(37, 211) * torch.logspace(-1, 2, 37)[:, None]  # rows of different ranges (all above the minimum scale)
    w[3] = 0.0  # an all-zero channel must not divide by zero
    q, s = quantize_weight_fp8(w.bfloat16(), gran, chunk_rows=16)
    assert q.dtype == FP8 and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == ((37,) if gran == "channel" else (1,))
    wb = w.bfloat16().float()
    amax = wb.abs().amax(dim=1) if gran == "channel" else wb.abs().amax().reshape(1)
    torch.testing.assert_close(s, torch.clamp(amax / 448, min=1 / (448 * 512)))
    deq = dequantize_fp8(q, s)
    assert torch.isfinite(deq).all()
    # round to nearest: within half an e4m3 step of the scaled value
    scaled = wb / s.reshape(-1, 1)
    assert torch.all((q.float() - scaled).abs() <= e4m3_step(scaled) / 2 + 2.0**-10)
    qmax = q.float().abs().amax(dim=1)
    if gran == "channel":  # every non-zero channel uses the full range
        assert torch.all(qmax[torch.arange(37) != 3] == 448) and qmax[3] == 0
    else:
        assert qmax.max() == 448


def test_quantize_activation_fp8_static_and_dynamic():
    x = torch.randn(2, 5, 64)
    q, s = quantize_activation_fp8(x)
    assert s.shape == (2, 5, 1)
    # e4m3 keeps 3 mantissa bits: within 1/16 relative, or a subnormal step near zero
    torch.testing.assert_close(q.float() * s, x, atol=float(s.max()) * 2.0**-9, rtol=1 / 16)
    torch.testing.assert_close(dequantize_fp8(q.reshape(10, 64), s.reshape(10), dim=0), (q.float() * s).reshape(10, 64))
    q2, s2 = quantize_activation_fp8(x, 0.05)
    assert s2.shape == (1,) and q2.float().abs().max() <= 448
    with pytest.raises(ValueError, match="granularity must be one of"):
        quantize_weight_fp8(torch.randn(4, 4), "group")
    with pytest.raises(ValueError, match="weight must be a 2-D tensor"):
        quantize_weight_fp8(torch.randn(4))


# ----------------------------------------------------------------------------- tuner / bench helpers


@pytest.mark.parametrize("M", [1, 2, 4, 16])
def test_tuner_candidates_are_valid_and_correct(M):
    from fastdecode.bench.gemm import candidates

    N, K = 48, 512  # small enough for the interpreter; the GPU suite runs them on real shapes
    for dkey in ("bf16", "fp8"):
        cands = candidates(M, N, K, dkey, num_sms=4)
        assert cands and len(cands) <= 12
        for cfg in cands:
            for d in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
                assert cfg[d] & (cfg[d] - 1) == 0, cfg
            if cfg["kind"] == "dot":
                assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16
            else:
                assert cfg["BLOCK_M"] in (1, 2, 4)
    # run one of each kind: bf16 FMA (no tl.dot), fp8 dot with fp8 operands
    fma = [c for c in candidates(M, N, K, "bf16", 4) if c["kind"] == "fma"][:1]
    dot = [c for c in candidates(M, N, K, "fp8", 4) if c["kind"] == "dot"][:1]
    for cfg in fma:
        x, w = torch.randn(M, K).bfloat16(), _weight(N, K, torch.bfloat16)
        out = poison_(torch.empty(M, N, dtype=torch.bfloat16))
        L.linear_with_config(x, w, None, None, 0, None, 0, out, cfg)
        assert_close(out, L.linear_ref(x, w))
    for cfg in dot:
        xq, xs, wq, ws = _fp8_operands(M, N, K, "tensor", False)
        out = poison_(torch.empty(M, N, dtype=torch.bfloat16))
        L.linear_with_config(xq, wq, None, xs, 1, ws, 1, out, cfg)
        assert_close(out, L.linear_fp8_ref(xq, xs, wq, ws))


def test_bench_summary_checks_the_targets():
    from fastdecode.bench.gemm import summarize

    def row(op, M, sp, tbps, vs_best=1.0):
        return {"op": op, "impl": "fastdecode", "shape": {"M": M}, "target": M <= 16,
                "speedup_vs_cublas": sp, "weight_tbps": tbps, "vs_best": vs_best}

    rows = [row("linear", 1, 1.3, 4.0), row("linear", 16, 1.1, 3.9), row("linear", 64, 1.0, 3.0, 0.99),
            row("linear_fp8", 1, 1.5, 3.6), row("linear_fp8", 4, 1.2, 3.4)]
    s = {r["op"]: r for r in summarize(rows)}
    from fastdecode.bench.harness import ROW_FIELDS

    for r in s.values():  # summary rows carry every required field, None where it means nothing
        assert set(ROW_FIELDS) <= set(r) and r["median_us"] is None and r["tbps"] is None
    assert s["linear"]["geomean_speedup_vs_cublas"] == pytest.approx((1.3 * 1.1) ** 0.5, abs=1e-3)
    assert s["linear"]["pass"] and s["linear"]["dispatch_min_vs_best"] == 0.99
    assert not s["linear_fp8"]["pass"]  # 3.4 TB/s on one shape is below the 3.5 TB/s target


# ----------------------------------------------------------------------------- generated code


_COMPILE_SNIPPET = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.gemm import _skinny_linear_kernel

cfg, elem_ty = json.loads(sys.argv[1]), sys.argv[2]
pt = "*" + elem_ty
sig = {"x_ptr": pt, "w_ptr": pt, "bias_ptr": "*bf16", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
       "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "nw_ptr": pt, "eps": "fp32",
       "M": "i32", "N": "i32", "K": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "stride_part": "i32", "split_k": "i32"}
consts = dict(HAS_BIAS=False, X_SCALE_MODE=0, W_SCALE_MODE=0, USE_DOT=False, DOT_FP8=False, EVEN_K=True,
              USE_PDL=cfg.get("USE_PDL", False), PREFETCH=cfg.get("PREFETCH", False), W_EVICT=cfg.get("EVICT", False),
              X_GLU=False, L2_SLAB=cfg.get("L2_SLAB", 0), PF_LANES=32 * cfg["num_warps"], W_VEC=0,
              X_NORM=cfg.get("X_NORM", False), NORM_VEC=16 // (1 if "fp8" in elem_ty else 2),
              NORM_AFFINE=cfg.get("NORM_AFFINE", True),
              ACCUMULATE=cfg.get("ACCUMULATE", False),
              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
              SPLIT=not cfg.get("X_NORM", False))
sig.update({k: "constexpr" for k in consts})
aligned = {"x_ptr", "w_ptr", "bias_ptr", "xs_ptr", "ws_ptr", "out_ptr", "part_ptr", "lock_ptr", "nw_ptr",
           "N", "K", "stride_xm", "stride_wn", "stride_om"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
cc = triton.compile(ASTSource(_skinny_linear_kernel, sig, consts, attrs),
                    target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
sys.stdout.write(cc.asm["ptx"])
"""


def _ptx_for_h100(cfg, elem_ty) -> str:
    return sm90_ptx(_COMPILE_SNIPPET, json.dumps(cfg), elem_ty)


@pytest.mark.parametrize("dkey,elem_ty,M,prefetch,evict,norm", [
    ("bf16", "bf16", 1, False, False, False), ("bf16", "bf16", 2, True, False, False),
    ("fp8", "fp8e4nv", 1, True, False, False), ("fp8", "fp8e4nv", 2, False, False, False),
    ("fp8", "fp8e4nv", 1, False, True, False), ("bf16", "bf16", 1, True, True, True),
    ("bf16", "bf16", 4, False, True, True), ("bf16", "bf16", 1, False, False, "folded"),
    ("fp8", "fp8e4nv", 1, 2, True, False), ("bf16", "bf16", 2, 2, False, True),
])
def test_fma_loop_streams_16_byte_loads_without_shuffles(dkey, elem_ty, M, prefetch, evict, norm):
    """Regression guard for the FMA path's speed: in the K loop every weight load is 16 bytes wide
    and nothing goes through shared memory (an x layout that differs from the weight tile's puts a
    shared-memory round trip and two barriers into every step); with EVICT the weight loads, and
    not the x load, carry ``evict_first``. Also with the RMSNorm inside (X_NORM, ``ops.norm_linear``):
    the norm weight's slice and the squares of h stay in the weight tile's layout too."""
    import re

    cfg = {**L.fma_tile(M, 1 if dkey == "fp8" else 2), "PREFETCH": prefetch, "EVICT": evict, "X_NORM": bool(norm),
           "NORM_AFFINE": norm != "folded", "ACCUMULATE": bool(norm)}
    ptx = _ptx_for_h100(cfg, elem_ty)
    body = k_loop(ptx)
    assert "shared" not in body and "bar.sync" not in body, "the K loop shuffles through shared memory"
    w_loads = re.findall(r"ld\.global(?:\.[\w:]+)*\.v4\.b32", body)
    assert len(w_loads) >= cfg["BLOCK_N"], f"expected >= {cfg['BLOCK_N']} 16-byte loads per step, got {len(w_loads)}"
    hinted = [ld for ld in w_loads if "evict_first" in ld]
    assert len(hinted) == (cfg["BLOCK_N"] if evict else 0), w_loads  # one per weight row; x keeps the default


@pytest.mark.parametrize("elem_ty", ["fp8e4nv", "bf16"])
def test_prefetch_depth_is_the_tiles_loaded_before_the_loop(elem_ty):
    """PREFETCH 0 / 1 / 2 (``kernels.gemm.prefetch_depth``): the program loads 0, 1 or 2 weight tiles (BLOCK_N
    16-byte loads each) before its K loop, and each step of the loop loads one tile (the one PREFETCH tiles ahead)."""
    import re

    vec = r"ld\.global(?:\.[\w:]+)*\.v4\.b32"
    cfg = L.fma_tile(1, 1 if "fp8" in elem_ty else 2)
    for depth in (0, 1, 2):
        ptx = _ptx_for_h100({**cfg, "PREFETCH": depth}, elem_ty)
        body = k_loop(ptx)
        before = ptx[:ptx.index(body)]
        in_loop = len(re.findall(vec, body))
        assert in_loop >= cfg["BLOCK_N"] and in_loop <= cfg["BLOCK_N"] + 1, (depth, in_loop)  # + x's load
        assert len(re.findall(vec, before)) == depth * cfg["BLOCK_N"], depth


@pytest.mark.parametrize("kind,elem_ty,prefetch", [("fma", "fp8e4nv", True), ("fma", "bf16", False),
                                                    ("dot", "fp8e4nv", False)])
def test_l2_slab_prefetch_comes_before_the_pdl_wait(kind, elem_ty, prefetch):
    """L2_SLAB (``ops._common.weight_prefetch_enabled``): every thread issues its bulk L2 prefetches of the
    program's weight slab before ``griddepcontrol.wait``, none in the K loop; without it there are none."""
    cfg = ({**L.fma_tile(1, 1 if "fp8" in elem_ty else 2), "PREFETCH": prefetch} if kind == "fma" else
           {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4})
    snippet = _COMPILE_SNIPPET if kind == "fma" else _COMPILE_SNIPPET.replace("USE_DOT=False, DOT_FP8=False",
                                                                              "USE_DOT=True, DOT_FP8=True")
    from helpers import bulk_prefetches

    for slab in (True, False):
        ptx = sm90_ptx(snippet, json.dumps({**cfg, "USE_PDL": True, "L2_SLAB": 65536 if slab else 0}), elem_ty)
        n_before, n_all = bulk_prefetches(ptx)
        rows, lanes = cfg["BLOCK_N"], 32 * cfg["num_warps"]
        assert n_all == n_before == ((rows * max(1, lanes // rows)) // lanes if slab else 0), (n_before, n_all)
        assert "cp.async.bulk.prefetch" not in k_loop(ptx)


def test_fp8_dot_promotes_every_mma_into_fp32():
    """Regression guard (H200: FP8 dot outputs 1e-3 relative off at K = 64): Triton's default lets Hopper's
    reduced-precision FP8 accumulator run over the whole K. Every ``wgmma`` must write a fresh partial
    (scale-d 0) that the K loop then adds into the fp32 accumulator: one ``add.f32`` per accumulator
    register and MMA."""
    import re

    cfg = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4}
    snippet = _COMPILE_SNIPPET.replace("USE_DOT=False, DOT_FP8=False", "USE_DOT=True, DOT_FP8=True")
    assert snippet != _COMPILE_SNIPPET
    body = k_loop(sm90_ptx(snippet, json.dumps(cfg), "fp8e4nv"))
    mmas = re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3 \{[^}]*\}, %rd\d+, %rd\d+, (\d)", body)
    assert len(mmas) == cfg["BLOCK_K"] // 32, mmas
    assert set(mmas) == {"0"}, "an FP8 MMA accumulates into the loop's accumulator (scale-d 1)"
    acc_regs = cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["num_warps"])
    assert len(re.findall(r"\badd\.f32", body)) >= len(mmas) * acc_regs
