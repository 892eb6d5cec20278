"""W8A16 (fastdecode.ops.w8a16): FP8 weights times a 16-bit activation (or SiLU-and-mul of ``[gate | up]``) on the
FMA kind of the skinny GEMM; against the fp32 reference, on the CPU through the Triton interpreter, and on the GPU
(``gpu`` marks) at the Llama-3.1-8B shapes of ``wo`` and ``w2``."""

import re

import pytest
import torch

from fastdecode.ops.activation import silu_and_mul_ref
from fastdecode.ops.w8a16 import MAX_M, get_w8a16_config, linear_w8a16, linear_w8a16_ref
from helpers import assert_product_close, fp8_weight, poison_, strided_rows

gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _weight(N, K, per_tensor=False):
    return fp8_weight(N, K, per_tensor, DEV)


def _check(y, x, w, ws, bias, glu):
    """Against the reference: the two recipes sum the same fp32 products in different orders, one rounding each."""
    ref = linear_w8a16_ref(x, w, ws, bias, glu=glu)
    a = (silu_and_mul_ref(x) if glu else x).float()
    wf = w.float() * (ws.reshape(-1, 1) if ws.numel() > 1 else ws)
    # the bias is in both (its rounding: the ulp of |ref|); the SiLU-and-mul input is rounded to x's dtype on both
    # sides, but the interpreter's fp32 -> bf16 cast truncates (docs/architecture.md): the default 3 roundings
    # (session 23: 1 of 192 elements beyond a bound of 1 rounding, 2 bf16 ulps at |y| = 9.2, glu under the interpreter)
    assert_product_close(y, ref, a, wf)
    assert y.shape == ref.shape and y.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,glu,per_tensor,bias", [
    (1, 40, 300, False, False, True), (2, 96, 2048, True, False, False), (3, 17, 2112, False, True, False),
    (4, 64, 256, True, False, True), (1, 33, 4096 + 16, True, True, False)])
def test_matches_the_reference(M, N, K, glu, per_tensor, bias, dtype):
    """Odd N and K (masked tiles), per-channel and per-tensor scales, a bias, 1-4 rows, the SiLU-and-mul input."""
    w, ws = _weight(N, K, per_tensor)
    x = (torch.randn(M, 2 * K if glu else K, device=DEV) * 2).to(dtype)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    out = poison_(torch.empty(M, N, device=DEV, dtype=dtype))
    y = linear_w8a16(x, w, ws, b, glu=glu, out=out, backend="triton")
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(y).any()
    _check(y, x, w, ws, b, glu)


def test_strided_rows_leading_dims_and_torch_backend():
    w, ws = _weight(24, 512)
    x = strided_rows(3, 1024, torch.bfloat16, DEV)  # [gate | up] rows with a row stride of 1037
    y = linear_w8a16(x, w, ws, glu=True, backend="triton")
    _check(y, x, w, ws, None, True)
    x3 = torch.randn(2, 1, 512, device=DEV).bfloat16()
    y3 = linear_w8a16(x3, w, ws, backend="triton")
    assert y3.shape == (2, 1, 24)
    torch.testing.assert_close(linear_w8a16(x3, w, ws, backend="torch"), linear_w8a16_ref(x3, w, ws), atol=0,
                               rtol=0)


def test_refusals_name_the_argument():
    w, ws = _weight(16, 256)
    with pytest.raises(ValueError, match=f"at most {MAX_M} token rows"):
        linear_w8a16(torch.randn(5, 256, device=DEV).bfloat16(), w, ws)
    with pytest.raises(ValueError, match="x must have dtype"):
        linear_w8a16(torch.randn(1, 256, device=DEV), w, ws)
    with pytest.raises(ValueError, match="2 \\* K"):
        linear_w8a16(torch.randn(1, 256, device=DEV).bfloat16(), w, ws, glu=True)
    with pytest.raises(ValueError, match="weight_fp8 must have dtype"):
        linear_w8a16(torch.randn(1, 256, device=DEV).bfloat16(), w.bfloat16(), ws)
    with pytest.raises(ValueError, match="mismatched K"):
        linear_w8a16(torch.randn(1, 128, device=DEV).bfloat16(), w, ws)


def test_config_is_an_fma_one():
    """The FMA kind, whatever the FP8 table picks for W8A8 at that M (cuBLAS, a dot tile): x is 16-bit here."""
    for M in (1, 2, 3, 4):
        cfg = get_w8a16_config(M, 4096, 14336, DEV)
        assert cfg["kind"] == "fma" and cfg["BLOCK_M"] >= M and cfg["SPLIT_K"] >= 1


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_kind_keeps_x_in_its_own_dtype(glu, dtype):
    """A tuned ``w8a16`` entry may be a tensor-core (dot) tile: the FP8 weight is widened to x's dtype for the MMA.
    A bf16 x beyond fp16's range (|x| up to ~2e5) stays finite and right; before, the dot tile cast x to fp16."""
    from fastdecode.constants import SCALE_NONE, SCALE_VECTOR
    from fastdecode.ops.gemm import linear_with_config

    M, N, K = 3, 40, 320
    w, ws = _weight(N, K)
    big = 2e5 if dtype == torch.bfloat16 else (20 if glu else 2e3)  # fp16: SiLU(gate) * up stays in range
    x = ((torch.rand(M, 2 * K if glu else K, device=DEV) - 0.5) * big).to(dtype)
    cfg = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4,
           "num_stages": 2}
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("tl.dot on bf16 is wrong under the Triton interpreter (docs/architecture.md, \"The Triton "
                    "interpreter\"); test_sm90_dot_kind_multiplies_bf16_on_the_tensor_cores checks the code, the GPU "
                    "suite the values")
    out = poison_(torch.empty(M, N, device=DEV, dtype=dtype))
    linear_with_config(x, w, None, None, SCALE_NONE, ws, SCALE_VECTOR, out, cfg, glu=glu)
    assert torch.isfinite(out).all()
    _check(out, x, w, ws, None, glu)


def test_tuned_w8a16_section_is_read_per_shape_and_glu(monkeypatch, tmp_path):
    """A linear table's ``w8a16`` section (``benchmarks/sweep_w8a16.py --table``) gives the config per (N, K, glu)
    and the nearest tuned M; a shape or glu it lacks falls back to the FP8 table / heuristic; an entry with fewer
    accumulator rows than M is not taken."""
    import json

    from fastdecode.ops import _tuned, gemm, w8a16

    pkg = json.loads((_tuned._common.CONFIG_DIR / "linear_nvidia_h200.json").read_text())
    mine = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 1024, "SPLIT_K": 7, "num_warps": 8, "num_stages": 1}
    pkg[w8a16.TABLE_SECTION] = {w8a16.table_key(4096, 14336, True): {"1": {"config": mine, "us": 1.0}}}
    (tmp_path / "linear_nvidia_h200.json").write_text(json.dumps(pkg))
    monkeypatch.setenv("FASTDECODE_CONFIG_DIR", str(tmp_path))
    for mod in (w8a16, gemm):
        monkeypatch.setattr(mod, "device_info", lambda device: ("NVIDIA H200", 132))
    _tuned.clear_config_cache()
    try:
        cuda = torch.device("cuda", 0)  # a name only: the lookup reads tables, nothing runs
        assert get_w8a16_config(1, 4096, 14336, cuda, glu=True) == mine
        assert get_w8a16_config(1, 4096, 14336, cuda, glu=False) != mine  # no entry without glu
        assert get_w8a16_config(2, 4096, 14336, cuda, glu=True)["BLOCK_M"] >= 2  # M = 1's entry holds one row
        assert get_w8a16_config(1, 4096, 4096, cuda, glu=True)["kind"] == "fma"
    finally:
        monkeypatch.undo()
        _tuned.clear_config_cache()


@gpu
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N,K,glu", [(4096, 4096, False), (4096, 14336, True)])
def test_gpu_llama8b_wo_and_w2(N, K, glu, M):
    w, ws = _weight(N, K)
    x = torch.randn(M, 2 * K if glu else K, device=DEV).bfloat16()
    y = linear_w8a16(x, w, ws, glu=glu)
    _check(y, x, w, ws, None, glu)
    g = torch.cuda.CUDAGraph()
    out = torch.empty_like(y)
    linear_w8a16(x, w, ws, glu=glu, out=out)  # compiled before the capture
    with torch.cuda.graph(g):
        linear_w8a16(x, w, ws, glu=glu, out=out)
    out.zero_()
    g.replay()
    torch.testing.assert_close(out, y, atol=0, rtol=0)


DOT_PTX = dict(num_stages=4, USE_DOT=True, PREFETCH=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)


@pytest.fixture(scope="module")
def ptx_ahead():
    """The sm_90 tests' three compiles at once (``helpers.sm90_ptx_ahead``)."""
    from helpers import sm90_ptx_ahead, w8a16_job

    sm90_ptx_ahead([w8a16_job(X_GLU=False), w8a16_job(X_GLU=True), w8a16_job(**DOT_PTX)])


@pytest.mark.parametrize("glu", ["plain", "glu"])
def test_sm90_compiles_the_fp8_weight_with_a_bf16_activation(ptx_ahead, glu):
    """No GPU needed: the FMA kind with FP8 weights and a bf16 x (and its SiLU-and-mul loads) compiles for sm_90,
    and converts the weight bytes with the paired e4m3 conversion (2 values an instruction)."""
    from helpers import k_loop, w8a16_ptx

    body = k_loop(w8a16_ptx(X_GLU=glu == "glu"))
    assert "cvt.rn.f16x2.e4m3x2" in body
    assert ("ex2.approx" in body) == (glu == "glu")  # SiLU's exp in the loads


def test_sm90_dot_kind_multiplies_bf16_on_the_tensor_cores(ptx_ahead):
    """No GPU needed: the dot kind (a tuned ``w8a16`` entry may pick it) widens the FP8 weight to bf16 and runs a
    bf16 MMA with fp32 accumulation; x is never cast to fp16 (no bf16 -> f16 conversion in the loop). The
    interpreter cannot check its values (its bf16 ``tl.dot`` is wrong: ``test_dot_kind_keeps_x_in_its_own_dtype``)."""
    from helpers import k_loop, w8a16_ptx

    body = k_loop(w8a16_ptx(**DOT_PTX))
    assert re.search(r"(mma|wgmma)[\w.]*\.bf16\.bf16", body), "no bf16 MMA in the K loop"
    assert not re.search(r"cvt\.rn\.f16\.bf16|cvt\.rn\.f16\.f32", body)
    assert "e4m3x2" in body  # the weight bytes' paired conversion
