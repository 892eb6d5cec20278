"""NaN and Inf rows: one rule on both backends (docs/engine.md, "FP8 W8A8").

A NaN in a row propagates as in PyTorch: with dynamic FP8 output the row's scale and all its FP8 values
are NaN; an Inf gives a non-finite scale (inf, or NaN after RMSNorm) and the row dequantises to NaN. Other
rows are untouched: they equal, bit for bit, the same call with the bad value replaced by a finite one.
"""

import pytest
import torch

import fastdecode as fd
from helpers import FP8, interpreter_on

# numpy's "invalid value" / "All-NaN slice" notes from the interpreter: NaN and Inf are the point here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
M, H, BAD_ROW, BAD_COL = 5, 96, 2, 7


def _w(h):
    return torch.rand(h, device=DEV) + 0.5


# name -> (function of (x, backend) -> (out, scale or None), fp8 output, per-row scale)
def _res_op(fn):
    def run(x, be):
        res = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
        r = fn(x, res, be)
        return r if isinstance(r, tuple) else (r, None)
    return run


W = _w(H).cpu()
OPS = {
    "quantize_fp8_per_token": (lambda x, be: fd.quantize_fp8(x, per_token=True, backend=be), True, True),
    "quantize_fp8_per_tensor": (lambda x, be: fd.quantize_fp8(x, backend=be), True, False),
    "rms_norm_fp8": (lambda x, be: fd.rms_norm_fp8(x, W.to(DEV), backend=be), True, True),
    "fused_add_rms_norm_fp8": (_res_op(lambda x, r, be: fd.fused_add_rms_norm_fp8(x, r, W.to(DEV), backend=be)),
                               True, True),
    "silu_and_mul_fp8": (lambda x, be: fd.silu_and_mul_fp8(x, backend=be), True, True),
    "rms_norm": (lambda x, be: (fd.rms_norm(x, W.to(DEV), backend=be), None), False, False),
    "fused_add_rms_norm": (_res_op(lambda x, r, be: fd.fused_add_rms_norm(x, r, W.to(DEV), backend=be)), False, False),
    "silu_and_mul": (lambda x, be: (fd.silu_and_mul(x, backend=be), None), False, False),
}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _inputs(bad, dtype=torch.float32):
    x = torch.randn(M, H, device=DEV).to(dtype)
    x_bad = x.clone()
    x_bad[BAD_ROW, BAD_COL] = bad
    return x, x_bad


def _dequant(q, s, per_row):
    return q.float() * (s.reshape(-1, 1) if per_row else s)


def _run_both(name, bad):
    fn, fp8, per_row = OPS[name]
    x, x_bad = _inputs(bad)
    res = {}
    for be in BACKENDS:
        if be == "triton" and DEV == "cpu" and not interpreter_on():
            pytest.skip("no GPU and no Triton interpreter")
        res[be] = (fn(x_bad, be), fn(x, be))
    return res, fp8, per_row


def _check_other_rows(got, clean, per_row):
    (q, s), (q0, s0) = got, clean
    good = [i for i in range(M) if i != BAD_ROW]
    assert torch.equal(_bits(q[good]), _bits(q0[good])), "a row without NaN / Inf changed"
    if s is not None and per_row:
        assert torch.equal(s[good], s0[good])


@pytest.mark.parametrize("name", list(OPS))
def test_nan_row_propagates(name):
    res, fp8, per_row = _run_both(name, float("nan"))
    for be, (got, clean) in res.items():
        q, s = got
        if fp8:
            bad_s = s.reshape(-1)[BAD_ROW] if per_row else s.reshape(())
            assert torch.isnan(bad_s), f"{be}: the scale of a NaN row is {bad_s.item()}"
            rows = q[BAD_ROW] if per_row else q
            assert torch.isnan(rows.float()).all(), f"{be}: FP8 values of a NaN row are not all NaN"
            if per_row:
                assert not torch.isnan(s.reshape(-1)[[i for i in range(M) if i != BAD_ROW]]).any()
        elif name.startswith("silu"):
            col = BAD_COL % (H // 2)
            assert torch.isnan(q[BAD_ROW, col]), f"{be}: NaN did not reach its output column"
        else:
            assert torch.isnan(q[BAD_ROW].float()).all(), f"{be}: the RMSNorm of a NaN row is not all NaN"
        if per_row or not fp8:
            assert not torch.isnan(q[[i for i in range(M) if i != BAD_ROW]].float()).any()
            _check_other_rows(got, clean, per_row)
    _check_backends_agree(res)


def _check_backends_agree(res):
    (qa, sa), _ = res["torch"]
    (qb, sb), _ = res["triton"]
    assert torch.equal(torch.isnan(qa.float()), torch.isnan(qb.float())), "backends disagree on NaN outputs"
    assert torch.equal(torch.isinf(qa.float()), torch.isinf(qb.float())), "backends disagree on Inf outputs"
    if sa is not None:
        assert torch.equal(torch.isnan(sa), torch.isnan(sb)), "backends disagree on NaN scales"
        assert torch.equal(torch.isinf(sa), torch.isinf(sb)), "backends disagree on Inf scales"


@pytest.mark.parametrize("name", list(OPS))
def test_inf_row(name):
    """The rule for Inf: as PyTorch arithmetic gives it. FP8: a non-finite scale (inf; NaN after RMSNorm, which
    turns an Inf row into NaN), and the row dequantises to NaN."""
    res, fp8, per_row = _run_both(name, float("inf"))
    for be, (got, clean) in res.items():
        q, s = got
        if fp8:
            bad_s = s.reshape(-1)[BAD_ROW] if per_row else s.reshape(())
            expect_nan = "rms_norm" in name
            assert (torch.isnan(bad_s) if expect_nan else torch.isposinf(bad_s)), f"{be}: scale {bad_s.item()}"
            d = _dequant(q, s, per_row)
            assert torch.isnan(d[BAD_ROW] if per_row else d).all(), f"{be}: an Inf row dequantises to numbers"
            if not expect_nan:  # x / inf: 0, and inf / inf = NaN at the Inf alone
                row = (q[BAD_ROW] if per_row else q.reshape(-1)).float()
                assert int(torch.isnan(row).sum()) == 1
        elif name.startswith("silu"):
            assert torch.isinf(q[BAD_ROW, BAD_COL % (H // 2)])
        else:  # rsqrt(inf) = 0: NaN at the Inf (inf * 0), zeros elsewhere
            row = q[BAD_ROW].float()
            assert torch.isnan(row[BAD_COL]) and int(torch.isnan(row).sum()) == 1
        if per_row or not fp8:
            _check_other_rows(got, clean, per_row)
    _check_backends_agree(res)


@pytest.mark.parametrize("be", BACKENDS)
def test_nan_under_a_static_scale_stays_nan(be):
    """A static scale: a NaN value gives a NaN FP8 value, not +-448 (the fmax clamp) nor 256 (the
    interpreter's cast)."""
    x, x_bad = _inputs(float("nan"))
    for q, _ in (fd.quantize_fp8(x_bad, 0.01, backend=be), fd.rms_norm_fp8(x_bad, W.to(DEV), scale=0.01, backend=be),
                 fd.silu_and_mul_fp8(x_bad, 0.01, backend=be)):
        nan = torch.isnan(q.float())
        assert nan[BAD_ROW].any() and not nan[[i for i in range(M) if i != BAD_ROW]].any()
    q, _ = fd.quantize_fp8(x_bad, 0.01, backend=be)
    assert int(torch.isnan(q.float()).sum()) == 1 and torch.isnan(q[BAD_ROW, BAD_COL].float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_chunked_kernels_follow_the_rule(bad):
    """The multi-chunk paths (rows wider than one block; in production beyond 32K columns), reached with a
    small block: same NaN / Inf pattern and the same scales as the torch backend."""
    if DEV == "cpu" and not interpreter_on():
        pytest.skip("no GPU and no Triton interpreter")
    from fastdecode.constants import OUT_FP8_DYNAMIC
    from fastdecode.kernels.activation import launch_silu_and_mul
    from fastdecode.kernels.norm import launch_rms_norm
    from fastdecode.kernels.quant import QUANT_FROM_AMAX, QUANT_PER_TOKEN, launch_quantize_fp8

    Hc = 100  # 4 chunks of 32 columns, the last one partial
    x = torch.randn(3, Hc, device=DEV)
    x[1, 70] = bad
    cfg = {"BLOCK_M": 2, "BLOCK_H": 32, "num_warps": 1}

    def same(q, s, q_ref, s_ref):
        assert torch.equal(torch.isnan(q.float()), torch.isnan(q_ref.float()))
        assert torch.equal(torch.isnan(s), torch.isnan(s_ref)) and torch.equal(torch.isinf(s), torch.isinf(s_ref))
        fin = torch.isfinite(s_ref)
        torch.testing.assert_close(s[fin], s_ref[fin], atol=0, rtol=1e-5)

    q, s = torch.empty(3, Hc, dtype=FP8, device=DEV), torch.empty(3, 1, device=DEV)
    launch_quantize_fp8(x, q, s, None, QUANT_PER_TOKEN, cfg)
    same(q, s, *fd.quantize_fp8(x, per_token=True, backend="torch"))
    amax_bits = torch.zeros(1, dtype=torch.int32, device=DEV)
    s1 = torch.empty(1, device=DEV)
    launch_quantize_fp8(x, q, s1, amax_bits, QUANT_FROM_AMAX, cfg)
    same(q, s1, *fd.quantize_fp8(x, backend="torch"))
    w = _w(Hc)
    launch_rms_norm(x, None, w, q, s, 1e-6, OUT_FP8_DYNAMIC, cfg)
    same(q, s, *fd.rms_norm_fp8(x, w, backend="torch"))
    x2 = torch.randn(3, 2 * Hc, device=DEV)
    x2[1, 170] = bad
    launch_silu_and_mul(x2, q, s, OUT_FP8_DYNAMIC, {"BLOCK": 32, "num_warps": 1})
    same(q, s, *fd.silu_and_mul_fp8(x2, backend="torch"))
