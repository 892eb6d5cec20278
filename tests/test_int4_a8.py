"""W4A8 with int8 activations (fastdecode.ops.int4_a8): the activation's quantisation and the int4 x int8 GEMV.

CPU: the Triton interpreter runs the kernels' portable integer maths (the ``dp4a`` / ``prmt`` inline PTX is
compiled CUDA only; ``test_sm90_loop_is_dp4a_with_no_shared_memory`` reads the sm_90 code of the PTX path).
GPU (``gpu`` marks): the PTX path on real Llama sizes, CUDA-graph capture and torch.compile.
"""

import json
import re

import pytest
import torch

import fastdecode.ops.int4_a8 as A
from fastdecode.ops.int4 import int4_linear_ref
from fastdecode.ops.norm import rms_norm_ref
from fastdecode.ops.int4_format import dequantize_int4, packed_cols
from fastdecode.quant import int4 as Q
import helpers
from helpers import k_loop, poison_, sm90_ptx, strided_rows

gpu = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(N, K, g, fmt, dtype=torch.float16, act_order=False):
    w = torch.randn(N, K, device=DEV) / K**0.5
    if fmt == "min":  # GGUF Q4_1 style: float minimums
        G = K // g
        q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=DEV)
        s = (torch.rand(N, G, device=DEV) * 0.02 + 0.005).to(dtype)
        return Q.prepack(q, s, group_size=g, mins=(torch.randn(N, G, device=DEV) * 0.05).to(dtype))
    packed = Q.quantize_int4(w, g, symmetric=fmt == "sym", scale_dtype=dtype)
    if act_order:
        packed.perm = torch.randperm(K, device=DEV)
    return packed


def _quant_bound(x, packed):
    """|a8 - w4a16| <= sum_k |w_k| * s_g / 2: each activation moves by at most half its group's step (s = amax / 127),
    plus an fp32 / output rounding margin."""
    x2 = x.float().reshape(-1, x.shape[-1])
    K = x2.shape[1]
    xp = torch.zeros(x2.shape[0], packed_cols(K) * 8, device=x.device)
    xk = x2.index_select(1, packed.perm) if packed.perm is not None else x2
    xp[:, :K] = xk
    step = xp.view(x2.shape[0], -1, A.ACT_GROUP).abs().amax(-1) / 127.0
    half = step.repeat_interleave(A.ACT_GROUP, dim=1)[:, :K] / 2  # (M, K) in kernel column order
    w = dequantize_int4(packed, torch.float32, kernel_order=True).abs()
    return half @ w.t()


def _check_quantised(x2, q, s, sums, truncated: bool = False, producer: bool = False):
    """Against the reference: scales equal, q within one step where the division rounded apart (``x / s`` is an
    approximate division in compiled Triton), sums those of q; and the dequantised values within half a step.
    ``truncated``: the kernel rounded its values to bf16 first under the interpreter, whose fp32 -> bf16 cast
    truncates (docs/architecture.md): scales within two bf16 ulps (a residual truncated too), q within 3 (a bf16 ulp
    is ~1 code near 127: the value's truncation, the residual's, and the scale's move it; 3 was seen once).
    ``producer``: x2 is the reference of a producer's output (a norm, SiLU-and-mul), which the kernel computes in
    another order and may round one ulp of x2.dtype apart: so may a group's maximum, hence its scale (fp16, seed 11:
    one scale of 96 off by 6e-4)."""
    rq, rs, rsums = A.quantize_act_int8_ref(x2)
    rtol = 2.0**-6 if truncated else (torch.finfo(x2.dtype).eps if producer else 1e-6)
    torch.testing.assert_close(s, rs, rtol=rtol, atol=0)
    d = (q.int() - rq.int()).abs()
    assert int(d.max()) <= (3 if truncated else 1) and float((d > 0).float().mean()) <= (0.5 if truncated else 0.01)
    nat = A.dequantize_act_int8(q, torch.ones_like(s), q.shape[1])  # the integers, natural order, padding included
    assert torch.equal(sums, nat.view(q.shape[0], -1, A.ACT_GROUP).sum(-1).round().int()), "sums are not those of q"
    if not truncated:  # within half a step of x, plus one ulp of x where a producer rounded it apart from the ref
        err = (A.dequantize_act_int8(q, s, x2.shape[1]) - x2.float()).abs()
        step = s.repeat_interleave(A.ACT_GROUP, dim=1)[:, :x2.shape[1]]
        ulp = x2.float().abs() * torch.finfo(x2.dtype).eps
        assert bool((err <= step * 0.5 * (1 + 1e-5) + ulp + 1e-30).all()), "a value moved by more than half a step"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 4096), (3, 200), (2, 1000)])
def test_act_quant_matches_the_reference(M, K, dtype):
    x = (torch.randn(M, K, device=DEV) * torch.rand(M, 1, device=DEV) * 4).to(dtype)
    q, s, sums = A.quantize_act_int8(x, backend="triton")
    assert q.shape == (M, packed_cols(K) * 8) and s.shape == sums.shape == (M, packed_cols(K) * 8 // 128)
    _check_quantised(x, q, s, sums)
    Kp = q.shape[1]
    if Kp > K:  # the layout's padding columns are zeros of the last groups
        nat = A.dequantize_act_int8(q, torch.ones_like(s), Kp)
        assert bool((nat[:, K:] == 0).all())


def test_act_quant_strided_rows_leading_dims_and_torch_backend():
    x = strided_rows(3, 640, torch.float16, DEV)
    q, s, sums = A.quantize_act_int8(x, backend="triton")
    _check_quantised(x, q, s, sums)
    q3, s3, sums3 = A.quantize_act_int8(x.reshape(3, 1, 640).expand(3, 1, 640), backend="torch")
    assert q3.shape == (3, 1, 768) and s3.shape == sums3.shape == (3, 1, 6)  # leading dims kept
    assert torch.equal(s3.reshape(3, 6), s) and torch.equal(sums3.reshape(3, 6), A.quantize_act_int8_ref(x)[2])


def test_act_quant_nan_zero_and_inf_groups():
    """A group holding a NaN gets a NaN scale (its values 0), so the GEMV's output is NaN, as the FP8 outputs' NaN
    rule (kernels.quant); an all-zero group quantises to zeros with a tiny positive scale."""
    x = torch.randn(2, 512, device=DEV).half()
    x[0, 5] = float("nan")  # group 0 of row 0
    x[1, 128:256] = 0  # group 1 of row 1
    q, s, sums = A.quantize_act_int8(x, backend="triton")
    assert torch.isnan(s[0, 0]) and not torch.isnan(s[0, 1:]).any() and not torch.isnan(s[1]).any()
    g1 = A.dequantize_act_int8(q, torch.ones_like(s), 512)[1, 128:256]
    assert bool((g1 == 0).all()) and int(sums[1, 1]) == 0 and 0 < float(s[1, 1]) < 1e-20
    w = _weight(40, 512, 128, "zero")
    y = A.int4_linear_a8(x, w, backend="triton")
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1]).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [4096, 1280, 576, 200])
def test_norm_and_silu_int8_outputs_match_the_two_kernel_path(H, dtype):
    """rms_norm_int8 / fused_add_rms_norm_int8 / silu_and_mul_int8: the native output rounded to x.dtype, then
    quantised, in one kernel; against their references (the native reference, then ``quantize_act_int8_ref``).
    H = 200 (next power of two 256 = its padded width), 576 (1024 >= 768) and 1280 (SiLU: two blocks of 1024 over
    five padded tiles) take the one-kernel path."""
    x = (torch.randn(3, 1, H, device=DEV) * 3).to(dtype)
    w = (torch.rand(H, device=DEV) + 0.5).to(dtype)
    act = A.rms_norm_int8(x, w, 1e-5, backend="triton")
    assert act[0].shape == (3, 1, packed_cols(H) * 8)
    trunc = dtype == torch.bfloat16 and helpers.interpreter_on()
    _check_quantised(rms_norm_ref(x, w, 1e-5).reshape(3, H), *[t.reshape(3, -1) for t in act], truncated=trunc,
                     producer=True)
    r = torch.randn(3, 1, H, device=DEV).to(dtype)
    r_kernel = r.clone()
    act = A.fused_add_rms_norm_int8(x, r_kernel, w, 1e-5, backend="triton")
    ref_act, r_ref = A.fused_add_rms_norm_int8_ref(x, r, w, 1e-5)
    helpers.assert_rounding_equal(r_kernel, r_ref)
    y_ref = rms_norm_ref(r_ref, w, 1e-5)
    _check_quantised(y_ref.reshape(3, H), *[t.reshape(3, -1) for t in act], truncated=trunc, producer=True)
    gu = (torch.randn(2, 2 * H, device=DEV) * 2).to(dtype)
    act = A.silu_and_mul_int8(gu, backend="triton")
    from fastdecode.ops.activation import silu_and_mul_ref

    _check_quantised(silu_and_mul_ref(gu), *act, truncated=trunc, producer=True)
    # what the GEMV makes of it: an int8 activation in, a bf16 output
    wq = _weight(24, H, H if H % 128 else 128, "zero", dtype)
    y = A.int4_linear_a8(act, wq, backend="triton")
    assert y.shape == (2, 24) and y.dtype == torch.bfloat16
    helpers.assert_close(y, A.int4_linear_a8_ref(act, wq), ulps=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,T,pos,splits", [(2, 4, 2, 40, [5, 37], None), (1, 3, 1, 700, [650], 3),
                                                   (2, 8, 2, 300, [0, 263], 2)], ids=["one_split", "odd_heads_merge",
                                                                                      "two_splits"])
def test_attention_int8_output_is_the_kernels_output_quantised(B, Hq, Hkv, T, pos, splits, dtype):
    """rope_decode_attention_int8: the fused attention kernel (one split, or split-KV and its merge kernel) rounds
    each head's output to qkv's dtype and quantises it as one group of 128 columns (wo's int8 input): the bf16 op's
    output quantised (bit for bit under the interpreter), the caches written alike. Three heads pad the 256-column
    row with an all-zero group. The torch backend is the reference."""
    from fastdecode.ops.attention import rope_decode_attention

    D = 128
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=DEV).to(dtype)
    rope = torch.randn(T, D // 2, 2, device=DEV)
    input_pos = torch.tensor(pos, device=DEV)
    kv = torch.randn(2, B, Hkv, T, D, device=DEV).to(dtype)
    caches = [kv.clone() for _ in range(4)]
    act = A.rope_decode_attention_int8(qkv, rope, input_pos, *caches[0], Hq, num_splits=splits, backend="triton")
    o = rope_decode_attention(qkv, rope, input_pos, *caches[1], Hq, num_splits=splits, backend="triton")
    assert torch.equal(caches[0], caches[1])
    Kp = packed_cols(Hq * D) * 8
    assert act[0].shape == (B, Kp) and act[1].shape == act[2].shape == (B, Kp // A.ACT_GROUP)
    _check_quantised(o.reshape(B, -1), *act)
    if helpers.interpreter_on() or DEV == "cpu":
        for a, r in zip(act, A.quantize_act_int8_ref(o.reshape(B, -1))):
            assert torch.equal(a, r)
    ref = A.rope_decode_attention_int8(qkv, rope, input_pos, *caches[2], Hq, backend="torch")
    for a, r in zip(ref, A.rope_decode_attention_int8_ref(qkv, rope, input_pos, *caches[3], Hq)):
        assert torch.equal(a, r)
    assert torch.equal(caches[2], caches[3])


def test_attention_int8_output_refusals():
    qkv = torch.randn(1, 6 * 64).bfloat16()
    rope, pos = torch.randn(8, 32, 2), torch.tensor([3])
    kv = torch.zeros(2, 1, 1, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="head_dim 128"):
        A.rope_decode_attention_int8(qkv, rope, pos, *kv, 4)
    qkv = torch.randn(1, 6 * 128)
    rope, kv = torch.randn(8, 64, 2), torch.zeros(2, 1, 1, 8, 128)
    with pytest.raises(ValueError, match="qkv"):
        A.rope_decode_attention_int8(qkv, rope, pos, *kv, 4)


def test_int8_activation_tuple_is_checked():
    w = _weight(16, 256, 128, "zero")
    q, s, sums = A.quantize_act_int8(torch.randn(1, 256, device=DEV).half())
    with pytest.raises(ValueError, match="x's scales must be contiguous"):
        A.int4_linear_a8((q, s.double(), sums), w)
    with pytest.raises(ValueError, match="x's q must be contiguous"):
        A.int4_linear_a8((q[:, :128], s, sums), w)
    with pytest.raises(ValueError, match="int8 activation"):
        A.int4_linear_a8((q, s), w)
    with pytest.raises(ValueError, match="residual must have the shape"):
        A.fused_add_rms_norm_int8(torch.randn(2, 256).half(), torch.randn(2, 255).half(), torch.ones(256).half())


CASES = [  # (M, N, K, group, zero mode, act_order, bias, config)
    (1, 70, 640, 128, "zero", False, False, dict(BLOCK_M=1, BLOCK_N=64, SPLIT_K=1)),
    (1, 33, 1024, 128, "sym", False, True, dict(BLOCK_M=1, BLOCK_N=16, SPLIT_K=3)),
    (2, 40, 768, 256, "min", False, False, dict(BLOCK_M=2, BLOCK_N=32, SPLIT_K=2)),
    (3, 50, 512, 512, "zero", True, True, dict(BLOCK_M=4, BLOCK_N=32, SPLIT_K=1)),
    (4, 20, 1280, 128, "zero", False, False, dict(BLOCK_M=4, BLOCK_N=16, SPLIT_K=5)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"m{c[0]}_{c[4]}_g{c[3]}" + ("_perm" if c[5] else "") for c in CASES])
def test_gemv_matches_the_reference_and_the_quantisation_bound(case, dtype):
    M, N, K, g, fmt, act_order, with_bias, cfg = case
    w = _weight(N, K, g, fmt, dtype, act_order)
    x = torch.randn(M, K, device=DEV).to(dtype)
    bias = torch.randn(N, device=DEV).to(dtype) if with_bias else None
    # the op (dispatcher's config) against its reference on the op's own quantised activation (fp32 sums): compiled
    # Triton divides approximately, so a value on a rounding boundary may take the other int8 code than the
    # reference's exact division (_check_quantised holds the quantiser to it), moving y by a step times a weight
    y = A.int4_linear_a8(x, w, bias, backend="triton")
    xk = x.index_select(1, w.perm) if w.perm is not None else x
    q, s, sums = A.quantize_act_int8(xk, backend="triton")
    _check_quantised(xk, q, s, sums)
    ref = A.int4_linear_a8_ref((q, s, sums), w, bias, out_dtype=dtype)
    helpers.assert_close(y, ref, ulps=2)
    # the activation's rounding moves the W4A16 result by at most half a step per value
    w16 = int4_linear_ref(x.float(), w, None if bias is None else bias.float())
    assert bool(((y.float() - w16).abs() <= _quant_bound(x, w) * 1.001 + 2e-2 * w16.abs() + 1e-3).all())
    # an explicit config (splits, several token rows a program) into a poisoned out
    out = poison_(torch.empty(M, N, device=DEV, dtype=dtype))
    A.a8_with_config(q, s, sums, w, bias, out, {**cfg, "num_warps": 4})
    helpers.assert_close(out, ref, ulps=2)


def test_gemv_accumulate_adds_into_out():
    w = _weight(64, 512, 128, "zero")
    x = torch.randn(2, 512, device=DEV).half()
    q, s, sums = A.quantize_act_int8(x, backend="triton")
    base = torch.randn(2, 64, device=DEV).half()
    out = base.clone()
    A.a8_with_config(q, s, sums, w, None, out, dict(BLOCK_M=2, BLOCK_N=32, SPLIT_K=2), accumulate=True)
    helpers.assert_close(out, (base.float() + A.int4_linear_a8_ref(x, w).float()).half(), ulps=2)


def test_torch_backend_is_the_reference_and_leading_dims():
    w = _weight(30, 256, 128, "sym")
    x = torch.randn(2, 1, 256, device=DEV).half()
    y = A.int4_linear_a8(x, w, backend="torch")
    assert y.shape == (2, 1, 30)
    assert torch.equal(y, A.int4_linear_a8_ref(x, w))


def test_refusals_name_the_argument():
    w32 = _weight(16, 256, 32, "zero")
    x = torch.randn(1, 256, device=DEV).half()
    with pytest.raises(ValueError, match="multiples of 128"):
        A.int4_linear_a8(x, w32)
    w = _weight(16, 256, 128, "zero")
    with pytest.raises(ValueError, match="at most 4 token rows"):
        A.int4_linear_a8(torch.randn(5, 256, device=DEV).half(), w)
    with pytest.raises(ValueError, match="x must have dtype"):
        A.int4_linear_a8(x.float(), w)
    with pytest.raises(ValueError, match="x must have dtype"):
        A.quantize_act_int8(x.float())
    with pytest.raises(ValueError, match="out must be"):
        A.int4_linear_a8(x, w, out=torch.empty(1, 15, device=DEV).half())
    assert A.supports(w) and not A.supports(w32) and A.supports(_weight(8, 640, 640, "sym"))


def test_heuristic_config_fills_the_gpu():
    c = A.heuristic_config(1, 6144, 4096)
    assert c["BLOCK_M"] == 1 and c["BLOCK_N"] == 64
    assert c["SPLIT_K"] == 4  # 96 row tiles: 4 splits (~3 programs an SM), never fewer than 4 layout tiles a split
    c = A.heuristic_config(3, 4096, 14336)
    assert c["BLOCK_M"] == 4 and c["BLOCK_N"] == 32 and c["SPLIT_K"] == 5  # 128 tiles x 5 <= 4 an SM
    assert A.heuristic_config(1, 28672, 4096)["SPLIT_K"] == 2  # 448 tiles


@pytest.mark.parametrize("K,split", [(640, 1), (640, 2), (640, 3), (1024, 1)])
def test_prefetch_two_is_bit_equal_to_the_double_buffer(K, split):
    """PREFETCH 2 (the next two steps' words in flight, the loop unrolled by two) changes only when the words are
    loaded: the same sums in the same order, so the same bits, with splits of 1 to 4 steps (K = 640 pads to three
    256-column steps, 1024 is four: odd and even counts) and odd rows."""
    w = _weight(70, K, 128, "zero")
    x = torch.randn(1, K, device=DEV).half()
    q, s, sums = A.quantize_act_int8(x, backend="triton")
    outs = []
    for pf in (1, 2):
        out = poison_(torch.empty(1, 70, device=DEV, dtype=torch.float16))
        A.a8_with_config(q, s, sums, w, None, out, dict(BLOCK_M=1, BLOCK_N=32, SPLIT_K=split, PREFETCH=pf))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    helpers.assert_close(outs[1], A.int4_linear_a8_ref((q, s, sums), w, out_dtype=torch.float16), ulps=2)


def test_prefetch_other_than_one_or_two_is_refused():
    w = _weight(32, 256, 128, "zero")
    q, s, sums = A.quantize_act_int8(torch.randn(1, 256, device=DEV).half(), backend="triton")
    out = torch.empty(1, 32, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="PREFETCH is 1 .* or 2"):
        A.a8_with_config(q, s, sums, w, None, out, dict(BLOCK_M=1, BLOCK_N=32, SPLIT_K=1, PREFETCH=3))


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.int4_a8 import _int4_a8_kernel

cfg = json.loads(sys.argv[1])
sig = {"xw_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8",
       "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
       "G": "i32", "KW": "i32", "stride_xw": "i32", "stride_xs": "i32", "stride_om": "i32", "stride_part": "i32",
       "split_k": "i32"}
consts = dict(GROUP=128, ZERO_MODE=1, HAS_BIAS=False, ASM=True, USE_PDL=True, ACCUMULATE=False,
              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT=True, L2_SLAB=cfg.get("SLAB", 0), PF_LANES=128,
              PREFETCH=cfg.get("PREFETCH", 1))
sig.update({k: "constexpr" for k in consts})
aligned = {"xw_ptr", "xs_ptr", "xsum_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "lock_ptr",
           "N", "G", "KW", "stride_xw", "stride_xs", "stride_om"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
cc = triton.compile(ASTSource(_int4_a8_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4, "num_stages": 1})
sys.stdout.write(cc.asm["ptx"])
"""


DP4A_CASES = [(1, 64, 1), (4, 32, 1), (1, 64, 2)]


def _slab_job(slab):
    return _COMPILE, json.dumps({"BLOCK_M": 1, "BLOCK_N": 64, "SLAB": 65536 if slab else 0})


def _dp4a_job(bm, bn, pf):
    return _COMPILE, json.dumps({"BLOCK_M": bm, "BLOCK_N": bn, "PREFETCH": pf})


@pytest.fixture(scope="module")
def ptx_ahead():
    """The sm_90 tests' compiles at once (``helpers.sm90_ptx_ahead``); PREFETCH 2's test reuses two of the loops."""
    from helpers import sm90_ptx_ahead

    sm90_ptx_ahead([_slab_job(True), _slab_job(False), *(_dp4a_job(*c) for c in DP4A_CASES), (_COMPILE_PRODUCERS,)])


def test_sm90_l2_slab_prefetch_comes_before_the_pdl_wait(ptx_ahead):
    """L2_SLAB: the program's weight words after its first step go to L2 by bulk prefetches (one a thread) before
    ``griddepcontrol.wait``; none without it."""
    from helpers import bulk_prefetches

    for slab in (True, False):
        before, total = bulk_prefetches(sm90_ptx(*_slab_job(slab)))
        assert before == total == (1 if slab else 0), (before, total)


@pytest.mark.parametrize("bm,bn,pf", DP4A_CASES)
def test_sm90_loop_is_dp4a_with_no_shared_memory(ptx_ahead, bm, bn, pf):
    """Speed guard, compiled ahead of time for sm_90 (no GPU needed): the K loop converts each word with one shift,
    two ANDs and two PRMTs, multiplies with two dp4a per token row, and never goes through shared memory (a layout
    conversion there put bar.sync into an earlier draft's loop). With PREFETCH 2 the loop body is two steps."""
    body = k_loop(sm90_ptx(*_dp4a_job(bm, bn, pf)))
    words = bn * 32 // 128 * pf  # words a thread per loop iteration (4 warps)
    assert body.count("dp4a.u32.s32") == 2 * words * bm
    assert body.count("prmt.b32") == 2 * words
    assert "bar.sync" not in body and "st.shared" not in body and "ld.shared" not in body


def test_sm90_prefetch_two_loads_one_steps_words_a_step(ptx_ahead):
    """PREFETCH 2 keeps two buffers and unrolls the loop by two: an iteration issues exactly two steps' global loads
    (each step's 16-byte weight vectors and the activation's), no more, no register copies of the buffers (the
    rotated triple buffer it replaces moved 44 registers a step, benchmarks/NOTES.md session 41) and no local memory
    (spilled buffers)."""
    bodies = [k_loop(sm90_ptx(*_dp4a_job(1, 64, pf))) for pf in (1, 2)]
    counts = [b.count("ld.global") for b in bodies]
    assert counts[1] == 2 * counts[0] and bodies[1].count("ld.global.v4") >= 8, counts
    moves = [len(re.findall(r"\bmov\.b32\s+%r\d+, %r\d+;", b)) for b in bodies]
    assert moves[1] <= 2 * moves[0], moves
    assert "ld.local" not in bodies[1] and "st.local" not in bodies[1]


_COMPILE_PRODUCERS = r"""
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.activation import _silu_and_mul_kernel
from fastdecode.kernels.attention import _decode_attention_merge_kernel, _rope_decode_attention_kernel
from fastdecode.kernels.int4_a8 import _act_quant_kernel
from fastdecode.kernels.norm import _rms_norm_kernel

T = GPUTarget("cuda", 90, 32)
ptr = lambda t: "*" + t  # noqa: E731
norm = {"x_ptr": ptr("bf16"), "res_ptr": ptr("bf16"), "w_ptr": ptr("bf16"), "out_ptr": ptr("i8"),
        "scale_ptr": ptr("fp32"), "sum_ptr": ptr("i32"), "M": "i32", "H": "i32", "stride_x": "i32", "stride_r": "i32",
        "stride_o": "i32", "stride_s": "i32", "NG": "i32", "eps": "fp32"}
nc = dict(HAS_RESIDUAL=True, OUT_MODE=3, BLOCK_M=1, BLOCK_H=4096, NUM_CHUNKS=1, FP8_MAX=448.0, MIN_SCALE=1e-5,
          USE_PDL=True)
silu = {"x_ptr": ptr("bf16"), "out_ptr": ptr("i8"), "scale_ptr": ptr("fp32"), "sum_ptr": ptr("i32"), "I": "i32",
        "stride_x": "i32", "stride_o": "i32", "stride_s": "i32", "NG": "i32"}
sc = dict(OUT_MODE=3, BLOCK=1024, NUM_CHUNKS=1, FP8_MAX=448.0, MIN_SCALE=1e-5, USE_PDL=True)
quant = {"x_ptr": ptr("bf16"), "q_ptr": ptr("i8"), "s_ptr": ptr("fp32"), "sum_ptr": ptr("i32"), "K": "i32", "NG": "i32",
         "stride_xm": "i32", "stride_qm": "i32", "stride_sm": "i32"}
qc = dict(GPP=4, USE_PDL=True)
attn = {"qkv_ptr": ptr("bf16"), "rope_ptr": ptr("fp32"), "pos_ptr": ptr("i64"), "k_ptr": ptr("bf16"),
        "v_ptr": ptr("bf16"), "o_ptr": ptr("bf16"), "o_part_ptr": ptr("fp32"), "lse_ptr": ptr("fp32"),
        "lock_ptr": ptr("i32"), "q8_ptr": ptr("i8"), "s8_ptr": ptr("fp32"), "sum8_ptr": ptr("i32"), "scale": "fp32",
        **{k: "i32" for k in ("stride_qkv", "stride_rope_t", "stride_kb", "stride_kh", "stride_kt", "stride_vb",
                              "stride_vh", "stride_vt", "stride_ob", "stride_oh", "stride_q8", "stride_s8", "T")},
        "pf_ptr": ptr("u8"), "pf_bytes": "i32", "pf_chunk": "i32"}
ac = dict(HQ=32, HKV=8, GROUP=4, BLOCK_G=16, HALF=64, BLOCK_HALF=64, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=4,
          MERGE_IN_KERNEL=True, USE_DOT=True, LOG2E=1.4426950408889634, OUT_INT8=True, USE_PDL=True, L2_PF=True,
          PF_LANES=128)
merge = {"o_part_ptr": ptr("fp32"), "lse_ptr": ptr("fp32"), "o_ptr": ptr("bf16"), "stride_ob": "i32",
         "stride_oh": "i32", "Hq": "i32", "q8_ptr": ptr("i8"), "s8_ptr": ptr("fp32"), "sum8_ptr": ptr("i32"),
         "stride_q8": "i32", "stride_s8": "i32"}
mc = dict(D=128, BLOCK_D=128, NUM_SPLITS=4, BLOCK_S=4, OUT_INT8=True, USE_PDL=True)
for fn, sig, consts in ((_rms_norm_kernel, norm, nc), (_silu_and_mul_kernel, silu, sc), (_act_quant_kernel, quant, qc),
                        (_rope_decode_attention_kernel, attn, ac), (_rope_decode_attention_kernel, attn,
                                                                    dict(ac, NUM_SPLITS=1, MERGE_IN_KERNEL=False)),
                        (_decode_attention_merge_kernel, merge, mc)):
    # as the launcher specialises them: pointers and the sizes / strides of these shapes divisible by 16
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items()
             if t.startswith("*") or (t == "i32" and k not in ("M", "T", "Hq"))}
    sig = dict(sig, **{k: "constexpr" for k in consts})
    ptx = triton.compile(ASTSource(fn, sig, consts, attrs), target=T, options={"num_warps": 4}).asm["ptx"]
    stores = re.findall(r"st\.global(\.v\d)?\.b(\d+)", ptx)
    sys.stdout.write(f"{fn.__name__}{consts.get('NUM_SPLITS', '')} {ptx.count('st.global.b8')} {len(stores)}\n")
"""


def test_sm90_compiles_every_int8_producer(ptx_ahead):
    """Regression (H100, session 22: the decode step's int8 RMSNorm failed to compile, ``NameError: Cannot access
    global variable INT8_MIN_SCALE``): the interpreter reads any module global from @triton.jit code, the compiler only
    constexpr ones, so the CPU suite passed a kernel the GPU refused. Compile the RMSNorm, SiLU-and-mul and quantisation
    kernels' int8 outputs for sm_90 ahead of time, and the attention kernel's (one split, and four merged in the
    kernel) and its merge kernel's; each stores bytes."""
    out = sm90_ptx(_COMPILE_PRODUCERS)
    counts = {name: (int(b8), int(n)) for name, b8, n in (line.split() for line in out.strip().splitlines())}
    assert set(counts) == {"_rms_norm_kernel", "_silu_and_mul_kernel", "_act_quant_kernel",
                           "_rope_decode_attention_kernel4", "_rope_decode_attention_kernel1",
                           "_decode_attention_merge_kernel4"}
    # the int8 values leave in whole words: byte stores at scattered addresses made the 8B int8 RMSNorm 6.8 us
    # against 2.4 us (H100, session 24). The merge kernel holds one value a thread (a head of 128 on 4 warps): its
    # bytes are contiguous across the warp.
    assert all(n > 0 for _, n in counts.values()), counts
    assert all(b8 == 0 for name, (b8, _) in counts.items() if name != "_decode_attention_merge_kernel4"), counts


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (28672, 4096), (200, 4160)])
def test_gpu_real_sizes_bf16(N, K, M):
    w = _weight(N, K, 128 if K % 128 == 0 else K, "zero", torch.bfloat16)
    x = torch.randn(M, K, device=DEV).bfloat16()
    y = A.int4_linear_a8(x, w)
    ref = A.int4_linear_a8_ref(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())
    w16 = int4_linear_ref(x.float(), w)
    assert bool(((y.float() - w16).abs() <= _quant_bound(x, w) * 1.001 + 2e-2 * w16.abs() + 1e-3).all())
    q, s, sums = A.quantize_act_int8(x)
    _check_quantised(x, q, s, sums)


@gpu
def test_gpu_graph_capture_and_compile():
    w = _weight(4096, 4096, 128, "zero", torch.bfloat16)
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    ref = A.int4_linear_a8(x, w)  # also allocates the split-K counters before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = A.int4_linear_a8(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y.float(), A.int4_linear_a8(x, w).float(), rtol=0, atol=0)  # integer sums: exact
    assert not torch.equal(y, ref)
    f = torch.compile(lambda t: A.int4_linear_a8(t, w), fullgraph=True)
    torch.testing.assert_close(f(x).float(), y.float(), rtol=0, atol=0)
