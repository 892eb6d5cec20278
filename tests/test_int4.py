"""Int4 weights (fastdecode.quant.int4) and the W4A16 linear (fastdecode.ops.int4), on the CPU.

Importer fixtures are packed here with plain torch loops written from the published layouts (GPTQ,
AWQ), or produced by the ``gguf`` package itself (GGUF), never by the code under test. Kernels run
under the Triton interpreter; ``tl.dot`` on bf16 is wrong there (docs/architecture.md, "The Triton interpreter"),
so the dot path is tested in fp16 and bf16 only on the FMA path; the GPU suite is test_int4_gpu.py.
"""

import json
import os

import numpy as np
import pytest
import torch

import fastdecode.ops.int4 as I
from fastdecode.quant import int4 as Q
import helpers
from helpers import gptq_qweight, interpreter_on, k_loop, pack_words_along, poison_, sm90_ptx, strided_rows
from fastdecode.kernels.host import next_pow2


def assert_close(actual, expected):
    """Two output ulps: the reference multiplies by the weight rounded to x.dtype (``dequantize_int4``),
    the FMA path (and the GPU dot path) by the exact dequantised weight, so the two may round apart."""
    helpers.assert_close(actual, expected, ulps=2)

if torch.cuda.is_available():  # this file is the CPU (interpreter) suite
    pytestmark = pytest.mark.skip(reason="CPU interpreter suite; see test_int4_gpu.py")


# ----------------------------------------------------------------------------- fixtures


def _rand_params(N, K, g, scale_dtype=torch.float16):
    G = K // g
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = (torch.rand(N, G) * 0.02 + 0.005).to(scale_dtype)
    z = torch.randint(0, 16, (N, G), dtype=torch.uint8)
    m = (torch.randn(N, G) * 0.05).to(scale_dtype)
    return q, s, z, m


def _formula(q, s, g_idx, z=None, m=None):
    """w[n, k] from integers in original order, fp32 (independent of the code under test)."""
    sk = s.float()[:, g_idx]
    if m is not None:
        return q.float() * sk + m.float()[:, g_idx]
    zk = 8.0 if z is None else z.float()[:, g_idx]
    return (q.float() - zk) * sk


def _act_order_g_idx(K, g):
    perm = torch.randperm(K)  # GPTQ act-order: columns quantised in a permuted order, g per group
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // g
    return g_idx


def _packed(fmt, N, K, g, scale_dtype=torch.float16):
    q, s, z, m = _rand_params(N, K, g, scale_dtype)
    kw = {"zeros": z} if fmt == "zero" else ({"mins": m} if fmt == "min" else {})
    return Q.prepack(q, s, group_size=g, **kw)


# ----------------------------------------------------------------------------- packing and prepack


def test_nibble_words_round_trip_and_bit_positions():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    w = Q.pack_nibbles(q)
    assert w.dtype == torch.int32 and w.shape == (7, 8)
    assert torch.equal(w, pack_words_along(q))  # column 8j + p at bits 4p
    assert torch.equal(Q.unpack_nibbles(w), q)
    assert Q.pack_nibbles(torch.full((1, 8), 15, dtype=torch.uint8)).item() == -1  # all ones, wrapped


def test_kernel_layout_stride_32_interleave_and_padding():
    q = torch.randint(0, 16, (3, 288), dtype=torch.uint8)  # 288 = 256 + 32: one padded tile
    w = Q.pack_kernel_layout(q)
    assert w.shape == (3, 64)
    nib = Q.unpack_nibbles(w).view(3, 64, 8)  # [n, word, p]
    for j in (0, 5, 31):
        assert torch.equal(nib[:, j, :], q[:, [32 * p + j for p in range(8)]])  # tile 0: columns 32p + j
    assert torch.equal(nib[:, 32 + 7, 0], q[:, 256 + 7]) and int(nib[:, 32:, 1:].max()) == 0  # padding 0
    assert torch.equal(Q.unpack_kernel_layout(w, 288), q)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["sym", "zero", "min"])
@pytest.mark.parametrize("g", [32, 64, 128, 256])  # 256 == K: per channel
def test_prepack_round_trip_exact(fmt, g, scale_dtype):
    N, K = 24, 256
    q, s, z, m = _rand_params(N, K, g, scale_dtype)
    kw = {"zeros": z} if fmt == "zero" else ({"mins": m} if fmt == "min" else {})
    w = Q.prepack(q, s, group_size=g, **kw)
    u = w.unpack()
    assert w.zero_mode == fmt and w.group_size == g and w.layout == Q.LAYOUT and w.shape == (N, K)
    assert torch.equal(u["q"], q) and torch.equal(u["scales"], s)
    if fmt == "zero":
        assert torch.equal(u["zeros"], z)
    if fmt == "min":
        assert torch.equal(u["mins"], m)
    g_idx = torch.arange(K) // g
    expect = _formula(q, s, g_idx, z if fmt == "zero" else None, m if fmt == "min" else None)
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), expect, atol=1e-7, rtol=1e-6)
    assert torch.equal(Q.dequantize_int4(w, torch.float16), expect.half())
    assert w.format == f"int4.g{'K' if g == K else g}.{fmt}"


def test_prepack_act_order_round_trip():
    N, K, g = 16, 256, 64
    q, s, z, _ = _rand_params(N, K, g)
    g_idx = _act_order_g_idx(K, g)
    w = Q.prepack(q, s, group_size=g, zeros=z, g_idx=g_idx)
    assert w.perm is not None
    u = w.unpack()
    assert torch.equal(u["q"], q) and torch.equal(u["g_idx"], g_idx) and torch.equal(u["zeros"], z)
    # in kernel order every group is contiguous
    assert torch.equal(g_idx[w.perm], torch.arange(K) // g)
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), _formula(q, s, g_idx, z), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g", [32, 128, None])
def test_quantize_int4_rtn(symmetric, g):
    N, K = 32, 256
    w = torch.randn(N, K).bfloat16()
    p = Q.quantize_int4(w, g, symmetric=symmetric)
    gs = K if g is None else g
    assert p.group_size == gs and p.zero_mode == ("sym" if symmetric else "zero")
    wf = w.float().view(N, K // gs, gs)
    s = p.scales.float().unsqueeze(-1)
    u = p.unpack()
    # RTN: each integer is the nearest one to w / s (+ zero) within the representable range
    zero = 8.0 if symmetric else u["zeros"].float().unsqueeze(-1)
    ideal = torch.clamp(torch.round(wf / s) + zero, 0, 15)
    assert torch.equal(u["q"].float().view(N, K // gs, gs), ideal)
    err = (Q.dequantize_int4(p, torch.float32).view(N, K // gs, gs) - wf).abs()
    # half a step, plus (asymmetric) the rounded zero point shifting the range by up to half a step
    bound = s * (0.51 if symmetric else 1.01) + 1e-6
    assert torch.all(err <= bound), "RTN error above the bound"


def test_gptq_import_v1_zeros_and_round_trip():
    N, K, g = 40, 256, 64
    q, s, z, _ = _rand_params(N, K, g)
    z = z.clamp(1, 15)  # v1 stores z - 1, so a true zero of 0 cannot be written
    qweight = gptq_qweight(q)
    qzeros = pack_words_along(z.t().contiguous() - 1)  # (G, N // 8), zero - 1 (AutoGPTQ v1)
    w = Q.from_gptq(qweight, qzeros, s.t().contiguous())
    u = w.unpack()
    assert torch.equal(u["q"], q) and torch.equal(u["zeros"], z) and torch.equal(u["scales"], s)
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), _formula(q, s, torch.arange(K) // g, z),
                               atol=1e-7, rtol=1e-6)
    # the same tensors read as gptq_v2 (no offset) are off by one everywhere
    w2 = Q.from_gptq(qweight, pack_words_along(z.t().contiguous()), s.t().contiguous(), zero_offset=0)
    assert torch.equal(w2.unpack()["zeros"], z)


def test_gptq_import_act_order_and_symmetric():
    N, K, g = 24, 256, 32
    q, s, _, _ = _rand_params(N, K, g)
    g_idx = _act_order_g_idx(K, g)
    qzeros = torch.full((K // g, N // 8), 0x77777777, dtype=torch.int32)  # v1: every zero 8, stored 7
    w = Q.from_gptq(gptq_qweight(q), qzeros, s.t().contiguous(), g_idx.to(torch.int32))
    assert w.zero_mode == "sym" and w.perm is not None and w.format == "int4.g32.sym.actorder"
    u = w.unpack()
    assert torch.equal(u["q"], q) and torch.equal(u["g_idx"], g_idx)
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), _formula(q, s, g_idx), atol=1e-7, rtol=1e-6)
    wz = Q.from_gptq(gptq_qweight(q), qzeros, s.t().contiguous(), g_idx, symmetric=False)
    assert wz.zero_mode == "zero" and torch.all(wz.zeros == 8)


def test_gptq_import_errors():
    N, K, g = 16, 128, 32
    q, s, z, _ = _rand_params(N, K, g)
    qz = pack_words_along(z.t().contiguous())
    with pytest.raises(ValueError, match="fall outside 0..15"):
        Q.from_gptq(gptq_qweight(q), torch.full_like(qz, -1), s.t().contiguous())  # stored 15 -> 16
    with pytest.raises(ValueError, match="qweight must be a 2-D int32"):
        Q.from_gptq(gptq_qweight(q).float(), qz, s.t().contiguous())
    with pytest.raises(ValueError, match="qzeros must be int32"):
        Q.from_gptq(gptq_qweight(q), qz[:, :1], s.t().contiguous())
    with pytest.raises(ValueError, match="exactly group_size"):
        Q.from_gptq(gptq_qweight(q), qz, s.t().contiguous(), torch.zeros(K, dtype=torch.int32), zero_offset=0)


def test_awq_import_interleaved_order():
    N, K, g = 32, 256, 128
    q, s, z, _ = _rand_params(N, K, g)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    qweight = pack_words_along(q.t().contiguous(), order)  # (K, N // 8) along N, AWQ order
    qzeros = pack_words_along(z.t().contiguous(), order)  # (G, N // 8)
    w = Q.from_awq(qweight, qzeros, s.t().contiguous())
    u = w.unpack()
    assert torch.equal(u["q"], q) and torch.equal(u["zeros"], z) and w.zero_mode == "zero"
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), _formula(q, s, torch.arange(K) // g, z),
                               atol=1e-7, rtol=1e-6)
    # reading AWQ words in natural order would scramble columns: the order matters
    natural = Q.from_awq(pack_words_along(q.t().contiguous()), qzeros, s.t().contiguous())
    assert not torch.equal(natural.unpack()["q"], q)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g", [32, 64, 128, 256])  # 256 == K: per channel
@pytest.mark.parametrize("source", ["gptq", "gptq_act_order", "awq"])
def test_importer_round_trips_every_group_size(source, g, scale_dtype):
    """unpack(import(packed q)) == q, zeros, scales and g_idx, for every group size and scale dtype."""
    N, K = 16, 256
    q, s, z, _ = _rand_params(N, K, g, scale_dtype)
    g_idx = _act_order_g_idx(K, g) if source == "gptq_act_order" else torch.arange(K) // g
    if source == "awq":
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        w = Q.from_awq(pack_words_along(q.t().contiguous(), order), pack_words_along(z.t().contiguous(), order),
                       s.t().contiguous())
    else:
        z = z.clamp(1, 15)  # AutoGPTQ v1 stores zero - 1
        w = Q.from_gptq(gptq_qweight(q), pack_words_along(z.t().contiguous() - 1), s.t().contiguous(),
                        g_idx.to(torch.int32) if source == "gptq_act_order" else None)
    u = w.unpack()
    assert w.group_size == g and w.zero_mode == "zero" and w.scales.dtype == scale_dtype
    assert torch.equal(u["q"], q) and torch.equal(u["zeros"], z) and torch.equal(u["scales"], s)
    assert torch.equal(u["g_idx"], g_idx)
    assert (w.perm is not None) == (source == "gptq_act_order" and g != K)
    torch.testing.assert_close(Q.dequantize_int4(w, torch.float32), _formula(q, s, g_idx, z), atol=1e-7, rtol=1e-6)


def test_fp32_checkpoint_scales_become_16_bit_without_overflow():
    N, K, g = 16, 128, 32
    q, s, z, _ = _rand_params(N, K, g)
    qw, qz = gptq_qweight(q), pack_words_along(z.clamp(1, 15).t().contiguous() - 1)
    w = Q.from_gptq(qw, qz, s.float().t().contiguous())
    assert w.scales.dtype == torch.float16 and torch.equal(w.scales, s)  # fp16 values: exact
    big = s.float() * 1e7  # beyond fp16's 65504: bf16, finite
    w = Q.from_gptq(qw, qz, big.t().contiguous())
    assert w.scales.dtype == torch.bfloat16 and torch.isfinite(w.scales.float()).all()
    with pytest.raises(ValueError, match="inf or NaN"):
        Q.from_awq(pack_words_along(q.t().contiguous()), pack_words_along(z.t().contiguous()),
                   torch.full((K // g, N), float("inf")))


def test_a_packed_weight_with_an_inconsistent_record_is_refused():
    """A record edited by hand (or built by other code) must not produce a silently wrong output."""
    import dataclasses

    x = _x(2, 256)
    w = _packed("zero", 32, 256, 128)
    wm = _packed("min", 32, 256, 128)
    cases = {
        "group_size 64 with group-128 scales": (dataclasses.replace(w, group_size=64), "scales must be"),
        "zero mode 'zero' without zeros": (dataclasses.replace(w, zeros=None), "needs zeros"),
        "zero mode 'sym' with zeros": (dataclasses.replace(w, zero_mode="sym"), "needs neither"),
        "scales of half the rows": (dataclasses.replace(w, scales=w.scales[:16]), "scales must be"),
        "fp32 scales": (dataclasses.replace(w, scales=w.scales.float()), "scales must be"),
        "unknown zero mode": (dataclasses.replace(w, zero_mode="foo"), "zero_mode must be one of"),
        "mins of another dtype": (dataclasses.replace(wm, mins=wm.mins.float()), "mins must be"),
        "perm of the wrong length": (dataclasses.replace(w, perm=torch.arange(128)), "perm must be"),
        "group size 48": (dataclasses.replace(w, group_size=48), "group_size 48"),
    }
    for what, (bad, msg) in cases.items():
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError, match=msg):
                I.int4_linear(x, bad, backend=backend)
                pytest.fail(f"{what}: accepted by the {backend} backend")


def test_prepack_refuses_mins_of_another_dtype():
    q, s, _, m = _rand_params(8, 64, 32)
    with pytest.raises(ValueError, match="mins must be torch.float16"):
        Q.prepack(q, s, group_size=32, mins=m.float())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_import_matches_gguf_package(kind):
    gguf = pytest.importorskip("gguf")
    qt = getattr(gguf.GGMLQuantizationType, kind)
    N, K = 12, 256
    wf = (np.random.randn(N, K) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(wf, qt)
    ref = gguf.quants.dequantize(raw, qt)
    fn = Q.from_gguf_q4_0 if kind == "Q4_0" else Q.from_gguf_q4_1
    w = fn(torch.from_numpy(raw.copy()), (N, K))
    assert w.group_size == 32 and w.zero_mode == ("sym" if kind == "Q4_0" else "min")
    assert np.array_equal(Q.dequantize_int4(w, torch.float32).numpy(), ref)
    # round trip of the integers: the nibbles of every block, low halves = elements 0..15
    blk = raw.reshape(N, K // 32, -1)[..., (2 if kind == "Q4_0" else 4):]
    nib = np.concatenate([blk & 0xF, blk >> 4], axis=-1).reshape(N, K)
    assert np.array_equal(w.unpack()["q"].numpy(), nib)
    with pytest.raises(ValueError, match="expected .* bytes"):
        fn(torch.from_numpy(raw.copy()).reshape(-1)[:-1], (N, K))


def test_prepack_errors():
    q, s, z, m = _rand_params(8, 64, 32)
    with pytest.raises(ValueError, match="group_size must divide K"):
        Q.prepack(q, s, group_size=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.prepack(q, torch.ones(8, 4).half(), group_size=16)
    with pytest.raises(ValueError, match=r"q must hold values in \[0, 15\]"):
        Q.prepack(q.to(torch.int32) + 1, s, group_size=32)
    with pytest.raises(ValueError, match="scales must be bf16 or fp16 of shape"):
        Q.prepack(q, s.float(), group_size=32)
    with pytest.raises(ValueError, match="not both"):
        Q.prepack(q, s, group_size=32, zeros=z, mins=m)
    with pytest.raises(ValueError, match="K must be a multiple of 8"):
        Q.prepack(q[:, :60], s, group_size=60)


# ----------------------------------------------------------------------------- kernels


def _x(M, K, dtype=torch.float16):
    return (torch.randn(M, K) * 0.5).to(dtype)


# small configs of both paths; SPLIT_K > 1 exercises the in-kernel fix-up, BLOCK_K > group the gather
CONFIGS = {
    "fma_m1": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1),
    "fma_m2_split3": dict(kind="fma", BLOCK_M=2, BLOCK_N=4, BLOCK_K=256, SPLIT_K=3),
    "fma_m1_prefetch_split2": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=2, PREFETCH=True),
    "dot_prefetch_split2": dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, PREFETCH=True),
    # PREFETCH 2 (session 31): the words of two steps ahead; one split of 3 steps, and splits of 2 and 1
    "fma_m2_prefetch2": dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1, PREFETCH=2),
    "fma_m1_prefetch2_split2": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=2, PREFETCH=2),
    "dot_prefetch2": dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, PREFETCH=2),
    # SCALE_PF (session 31): the next step's group parameters with its words (one split, and splits of 2 and 1)
    "fma_m2_scale_pf": dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1, PREFETCH=True, SCALE_PF=True),
    "fma_m1_prefetch2_scale_pf_split2": dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=2, PREFETCH=2,
                                             SCALE_PF=True),
    "fma_m4_bk512_split2": dict(kind="fma", BLOCK_M=4, BLOCK_N=4, BLOCK_K=512, SPLIT_K=2),
    "dot_bk512": dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, SPLIT_K=1),
    "dot_split3": dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=3),
    # the mma kind (kernels.int4_mma; the interpreter runs its fp32 conversion, fp16 for tl.dot)
    "mma_split3": dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=3),
    "mma_m32_bn128": dict(kind="mma", BLOCK_M=32, BLOCK_N=128, BLOCK_K=256, SPLIT_K=1),
    "mma_bn32_split2": dict(kind="mma", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=2),  # mma.sync
}


@pytest.mark.parametrize("fmt", ["sym", "zero", "min"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_path_and_format(name, fmt):
    N, K, g = 75, 640, 64  # odd N: partial N tiles; K = 2.5 layout tiles: padding, a partial K block
    M = 3 if CONFIGS[name]["kind"] == "fma" else 19
    w = _packed(fmt, N, K, g)
    x = _x(M, K)
    b = torch.randn(N).half()
    out = poison_(torch.empty(M, N, dtype=torch.float16))
    I.int4_linear_with_config(x, w, b, out, CONFIGS[name])
    assert_close(out, I.int4_linear_ref(x, w, b))


@pytest.mark.parametrize("g", [128, 512])
@pytest.mark.parametrize("cfg", [dict(PREFETCH=True, SCALE_PF=True, SPLIT_K=2), dict(PREFETCH=2, SCALE_PF=True)],
                         ids=["scale_pf_split2", "prefetch2_scale_pf"])
def test_scale_pf_groups_of_several_shifts(cfg, g):
    """SCALE_PF where a group spans four shifts (g128, the 8B's: one load serves four) or two layout tiles (g512),
    (g128: 4.5 layout tiles of K, a partial last step; g512: 6) whose next-step parameters clamp to the last group
    past the end (``--grid table`` of the small-tile sweep times these on the 8B shapes, session 32)."""
    N, K = 40, 1152 if g == 128 else 1536
    w = _packed("zero", N, K, g)
    x = _x(2, K)
    out = poison_(torch.empty(2, N, dtype=torch.float16))
    base = dict(kind="fma", BLOCK_M=2, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1)
    I.int4_linear_with_config(x, w, None, out, {**base, **cfg})
    assert_close(out, I.int4_linear_ref(x, w, None))


@pytest.mark.parametrize("g", [32, 128, 256])
@pytest.mark.parametrize("M", [1, 4, 33])
def test_dispatch_group_sizes(M, g):
    N, K = 64, 256
    w = _packed("sym", N, K, g, torch.bfloat16)  # bf16 scales with fp16 activations: allowed
    x = _x(M, K)
    out = poison_(torch.empty(M, N, dtype=torch.float16))
    y = I.int4_linear(x, w, out=out, backend="triton")
    assert y is out
    assert I.get_int4_config(M, N, K, g)[1]["kind"] == ("fma" if M <= 4 else "dot")
    assert_close(y, I.int4_linear_ref(x, w))


def test_against_plain_matmul_of_dequantised_weight():
    # the statement of correctness: x @ dequantise(w).T computed in fp32
    w = Q.quantize_int4(torch.randn(48, 256) * 0.05, 32, symmetric=False, scale_dtype=torch.float16)
    x = _x(2, 256)
    y = I.int4_linear(x, w, backend="triton")
    expect = (x.float() @ Q.dequantize_int4(w, torch.float16).float().t()).half()
    assert_close(y, expect)


def test_bf16_fma_path():
    # the FMA path has no tl.dot, so bf16 runs under the interpreter
    w = _packed("zero", 40, 256, 128, torch.bfloat16)
    x = _x(2, 256, torch.bfloat16)
    b = torch.randn(40).bfloat16()
    assert_close(I.int4_linear(x, w, b, backend="triton"), I.int4_linear_ref(x, w, b))


def _gptq_act_order_weight(N, K, g):
    """A GPTQ act-order weight with integer zeros (v2, no offset) and its (q, s, z, g_idx)."""
    q, s, z, _ = _rand_params(N, K, g)
    g_idx = _act_order_g_idx(K, g)
    w = Q.from_gptq(gptq_qweight(q), pack_words_along(z.t().contiguous()), s.t().contiguous(), g_idx,
                    zero_offset=0)
    return w, (q, s, z, g_idx)


def test_act_order_through_the_op_strided_and_nd():
    N, K, g = 32, 256, 64
    w, (q, s, z, g_idx) = _gptq_act_order_weight(N, K, g)
    x = torch.randn(2, 3, K + 8).half()[..., :K]  # leading dims, strided rows
    y = I.int4_linear(x, w, backend="triton")
    assert y.shape == (2, 3, N)
    expect = (x.float() @ _formula(q, s, g_idx, z).half().float().t()).half()  # original column order
    assert_close(y, expect)
    xs = strided_rows(5, K, torch.float16)
    assert_close(I.int4_linear(xs, w, backend="triton"), I.int4_linear_ref(xs, w))


def test_split_k_is_deterministic_and_resets_its_counters():
    from fastdecode.ops._tuned import SPLIT_K_LOCKS as _LOCKS

    w = _packed("min", 40, 512, 32)
    x = _x(3, 512)
    outs = []
    for _ in range(2):
        out = poison_(torch.empty(3, 40, dtype=torch.float16))
        I.int4_linear_with_config(x, w, None, out, CONFIGS["dot_split3"])
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert int(_LOCKS[("cpu", None)].abs().sum()) == 0, "split-K tile counters were not reset to 0"


@pytest.mark.parametrize("fmt,g", [("sym", 32), ("zero", 128), ("min", 64)])
def test_dequant_kernel_is_bit_exact(fmt, g):
    from fastdecode.kernels.int4_dequant import launch_int4_dequant

    w = _packed(fmt, 33, 384, g)
    out = poison_(torch.empty(33, 384, dtype=torch.float16))
    launch_int4_dequant(w.qweight, w.scales, I._zm(w), w.group_size, w.zero_mode, out, block_k=512)
    assert torch.equal(out, Q.dequantize_int4(w, torch.float16, kernel_order=True))


def test_torch_backend_and_empty():
    w = _packed("sym", 24, 64, 32)
    x = _x(5, 64)
    assert torch.equal(I.int4_linear(x, w, backend="torch"), I.int4_linear_ref(x, w))
    assert I.int4_linear(torch.empty(0, 64).half(), w, backend="triton").shape == (0, 24)


def test_tuned_table_lookup(tmp_path):
    cfg = dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=2)
    table = {"gpu": "cpu", "int4_linear": {"64,256,128": {"16": {"impl": "triton", "config": cfg},
                                                          "1": {"impl": "triton", "config": CONFIGS["fma_m1"]}}}}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(table))
    I.clear_config_cache()
    assert I.get_int4_config(12, 64, 256, 128, path=str(p)) == ("triton", cfg)  # nearest on log2: 16
    assert I.get_int4_config(2, 64, 256, 128, path=str(p))[1] == CONFIGS["fma_m1"]  # tie -> smaller
    assert I.get_int4_config(2, 64, 256, 32, path=str(p))[1]["kind"] == "fma"  # no entry: heuristic
    I.clear_config_cache()


def test_fused_ops_take_their_own_entries_over_the_plain_gemvs(tmp_path):
    """A fused op's table section (``I.FUSED_OPS``, session 32) overrides the plain GEMV's entry at its shape and M;
    at another M, for another shape and for the plain op the ``int4_linear`` entries hold; above every tuned M the
    fused W4A16 ops take the dequant path as the plain one does; an unknown op is refused by name."""
    dot = dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=2)
    norm = {**CONFIGS["fma_m1"], "BLOCK_N": 4, "NORM_LOOP": True}
    table = {"gpu": "NVIDIA test",
             "int4_linear": {"64,256,128": {"16": {"impl": "triton", "config": dot},
                                            "1": {"impl": "triton", "config": CONFIGS["fma_m1"]}},
                             "32,256,128": {"1": {"impl": "triton", "config": CONFIGS["fma_m1"]}}},
             "int4_rms_norm_linear": {"64,256,128": {"1": {"impl": "triton", "config": norm}}}}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(table))
    I.clear_config_cache()
    try:
        assert I.get_int4_config(1, 64, 256, 128, path=str(p), op="int4_rms_norm_linear") == ("triton", norm)
        assert I.get_int4_config(1, 64, 256, 128, path=str(p)) == ("triton", CONFIGS["fma_m1"])
        assert I.get_int4_config(16, 64, 256, 128, path=str(p), op="int4_rms_norm_linear") == ("triton", dot)
        for op in ("int4_add_linear", "int4_add_linear_glu"):
            assert I.get_int4_config(1, 64, 256, 128, path=str(p), op=op) == ("triton", CONFIGS["fma_m1"])
        assert I.get_int4_config(1, 32, 256, 128, path=str(p), op="int4_rms_norm_linear") == ("triton",
                                                                                               CONFIGS["fma_m1"])
        heuristic = I.heuristic_config(64, 64, 256, 128)[1]
        assert I._lookup("NVIDIA test", 132, 64, 64, 256, 128, str(p), "int4_rms_norm_linear") == ("dequant",
                                                                                                  heuristic)
        with pytest.raises(ValueError, match="op must be one of"):
            I.get_int4_config(1, 64, 256, 128, path=str(p), op="int4_norm")
    finally:
        I.clear_config_cache()


# ----------------------------------------------------------------------------- bad input


def test_int4_linear_errors():
    w = _packed("sym", 32, 128, 32)
    x = _x(4, 128)
    with pytest.raises(ValueError, match="packed must be a fastdecode.quant.int4.Int4Weight"):
        I.int4_linear(x, w.qweight)
    with pytest.raises(ValueError, match="mismatched K"):
        I.int4_linear(_x(4, 96), w)
    with pytest.raises(ValueError, match="x must have dtype"):
        I.int4_linear(x.float(), w)
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\)"):
        I.int4_linear(x, w, torch.randn(31).half())
    with pytest.raises(ValueError, match="bias must have dtype"):
        I.int4_linear(x, w, torch.randn(32))
    with pytest.raises(ValueError, match="out must be a tensor of shape"):
        I.int4_linear(x, w, out=torch.empty(4, 33).half())
    with pytest.raises(ValueError, match="impl must be one of"):
        I.int4_linear(x, w, impl="marlin")
    with pytest.raises(RuntimeError, match="impl='dequant' needs CUDA"):
        I.int4_linear(x, w, impl="dequant", backend="triton")
    with pytest.raises(ValueError, match="needs the triton backend"):
        I.int4_linear(x, w, impl="triton", backend="torch")
    old = Q.Int4Weight(w.qweight, w.scales, None, None, 32, "sym", layout="int4.other")
    with pytest.raises(ValueError, match="packed layout 'int4.other' is not this kernel's"):
        I.int4_linear(x, old)
    with pytest.raises(ValueError, match="expected group_size 128, the weight has 32"):
        w.check_format(group_size=128)
    with pytest.raises(ValueError, match="expected zero mode 'zero'"):
        w.check_format(zero_mode="zero")


# ----------------------------------------------------------------------------- W4A8 (FP8 activations)


def _fp8_x(M, K, per_token=True, lead=None):
    from fastdecode.quant import quantize_activation_fp8

    x = torch.randn(*(lead or (M,)), K)
    return quantize_activation_fp8(x, None if per_token else x.abs().amax().item() / 448)


@pytest.mark.parametrize("fmt", ["sym", "zero", "min"])
@pytest.mark.parametrize("name,per_token", [("fma_m2_split3", True), ("dot_split3", True), ("dot_split1_bk256", False)])
def test_w4a8_paths_and_formats(name, per_token, fmt):
    cfgs = {**CONFIGS, "dot_split1_bk256": dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1)}
    N, K, g = 40, 640, 32 if fmt == "min" else 128
    M = 2 if cfgs[name]["kind"] == "fma" else 19
    w = _packed(fmt, N, K, g, torch.bfloat16)
    xq, xs = _fp8_x(M, K, per_token)
    b = torch.randn(N).bfloat16()
    out = poison_(torch.empty(M, N, dtype=torch.float16))
    I.int4_linear_with_config(xq, w, b, out, cfgs[name], xs.reshape(-1))
    ref = I.int4_linear_fp8_ref(xq, xs, w, b, out_dtype=torch.float16)
    assert_close(out, ref)


def test_w4a8_public_op_act_order_nd_and_torch_backend():
    N, K, g = 32, 256, 64
    w, (q, s, z, g_idx) = _gptq_act_order_weight(N, K, g)
    xq, xs = _fp8_x(None, K, True, lead=(2, 9))  # M = 18: the dot path
    y = I.int4_linear_fp8(xq, xs, w, backend="triton")
    assert y.shape == (2, 9, N) and y.dtype == torch.bfloat16
    expect = ((xq.float() * xs) @ _formula(q, s, g_idx, z).t()).bfloat16()  # original column order
    assert_close(y, expect)
    assert torch.equal(I.int4_linear_fp8(xq, xs, w, backend="torch"), I.int4_linear_fp8_ref(xq, xs, w))
    x1, s1 = _fp8_x(1, K, False)
    assert_close(I.int4_linear_fp8(x1, s1, w, out_dtype=torch.float16, backend="triton"),
                 I.int4_linear_fp8_ref(x1, s1, w, out_dtype=torch.float16))


def test_w4a8_errors_and_config():
    w = _packed("sym", 32, 512, 32)
    xq, xs = _fp8_x(4, 512)
    with pytest.raises(ValueError, match="x_fp8 must have dtype"):
        I.int4_linear_fp8(xq.float(), xs, w)
    with pytest.raises(ValueError, match="x_scale must be per-tensor"):
        I.int4_linear_fp8(xq, torch.ones(3, 1), w)
    with pytest.raises(ValueError, match="mismatched K"):
        I.int4_linear_fp8(xq[:, :256], xs, w)
    # the FP8 dot scales each 32-column slice by one group scale: BLOCK_K is cut to 256 when needed
    p = {"int4_linear_fp8": {"32,512,32": {"32": {"impl": "triton", "config": dict(CONFIGS["dot_bk512"])}}}}
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(p, f)
    I.clear_config_cache()
    assert I.get_int4_config(32, 32, 512, 32, path=f.name, op="int4_linear_fp8")[1]["BLOCK_K"] == 256
    assert I.get_int4_config(32, 32, 512, 32, path=f.name)[1]["kind"] == "dot"  # W4A16: no entry, heuristic
    I.clear_config_cache()
    os.unlink(f.name)


# ----------------------------------------------------------------------------- generated code

_COMPILE_SNIPPET = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.int4 import _int4_linear_kernel

cfg = json.loads(sys.argv[1])
xt = cfg["x"]
sig = {"x_ptr": "*" + xt, "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "bias_ptr": "*bf16",
       "xs_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "nw_ptr": "*" + xt,
       "eps": "fp32", "M": "i32", "N": "i32",
       "K": "i32", "G": "i32", "KW": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_part": "i32",
       "split_k": "i32"}
consts = dict(GROUP=128, ZERO_MODE=cfg["ZM"], HAS_BIAS=False, USE_DOT=cfg["kind"] == "dot", UNIFORM=True, SPG=4,
              EVEN_K=True, X_SCALE_MODE=0, FAST_CVT=cfg["kind"] == "dot", PREFETCH=cfg.get("PF", False),
              SCALE_PF=cfg.get("SPF", False), NORM_LOOP=cfg.get("NL", False),
              LOP3_ASM=cfg["kind"] == "fma", USE_PDL=cfg.get("PDL", False), L2_SLAB=cfg.get("SLAB", 0),
              PACKED=cfg.get("PK", False), PF_UNROLL=cfg.get("PFU", False), SUM16=False,
              PF_LANES=128,
              X_NORM=cfg.get("XN", False), NORM_AFFINE=cfg.get("XN", False), NORM_NB=2048 // cfg["BLOCK_M"],
              NORM_RM=cfg["BLOCK_M"],
              ACCUMULATE=cfg.get("XN", False) or cfg.get("GLU", False), X_GLU=cfg.get("GLU", False),
              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=256, SPLIT=cfg.get("SPLIT", True))
sig.update({k: "constexpr" for k in consts})
aligned = {"x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "xs_ptr", "out_ptr", "part_ptr", "lock_ptr", "N", "K",
           "G", "KW", "stride_xm", "stride_om"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
cc = triton.compile(ASTSource(_int4_linear_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4, "num_stages": 2})
sys.stdout.write(cc.asm["ptx"])
"""


@pytest.mark.parametrize("cfg", [
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=0, x="bf16", PF=True),
    dict(kind="fma", BLOCK_M=4, BLOCK_N=32, ZM=2, x="fp16"),
    # PREFETCH 2 (session 31): the words of two steps ahead; the loop's per-value instructions are unchanged
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=0, x="bf16", PF=2),
    # SCALE_PF (session 31): the next step's scales and mins with its words; the per-value instructions stay
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=2, x="bf16", PF=True, SPF=True),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=64, ZM=1, x="bf16"), dict(kind="dot", BLOCK_M=64, BLOCK_N=64, ZM=2, x="fp16"),
    # the norm inside (with its weight) and the residual add: the loop keeps its per-value instructions
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=0, x="bf16", PF=True, XN=True),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=64, ZM=1, x="bf16", XN=True),
    # one split and NORM_LOOP: the FMA loop sums the rows' squares itself (session 31), no pass over the rows
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=0, x="bf16", PF=True, XN=True, SPLIT=False, NL=True),
    # SiLU-and-mul in the loads (int4_glu, session 30): the weights' instructions stay, the SiLU is added per x
    dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=1, x="bf16", PF=True, GLU=True),
], ids=["fma_m1_sym", "fma_m4_min", "fma_m1_sym_prefetch2", "fma_m1_min_scale_pf", "dot_m16_zero_bf16",
        "dot_m64_min_fp16", "fma_m1_sym_norm", "dot_m16_zero_norm", "fma_m1_sym_norm_one_split", "fma_m1_zero_glu"])
def test_sm90_code_converts_int4_without_float_conversions(cfg):
    """Speed guard, compiled ahead of time for sm_90 (Triton bundles ptxas; no GPU needed): the FMA loop
    turns nibbles into fp32 with one LOP3 each (no cvt of weights), then one FFMA per value for q - zero
    and one per value and row, plus the group fold; the dot loop converts two nibbles per LOP3 and packed
    16-bit FMA (the inline PTX)."""
    import re

    # X_NORM: its pass over the rows first, but with NORM_LOOP on the FMA kind with one split (the loop sums them)
    in_loop = cfg["kind"] == "fma" and not cfg.get("SPLIT", True) and cfg.get("NL", False)
    ptx = sm90_ptx(_COMPILE_SNIPPET, json.dumps(cfg))
    body = k_loop(ptx, 1 if cfg.get("XN") and not in_loop else 0)
    if cfg.get("XN") and in_loop:  # no loop before the K loop: the first loop holds the weights' LOP3s
        assert len(re.findall(r"lop3\.b32", k_loop(ptx, 0))) > 0
    values = cfg["BLOCK_N"] * 256 // 128  # weights per thread per K step (4 warps)
    if cfg["kind"] == "fma":
        # with GLU one rounding of silu(gate) * up per loaded column (an exp each): fewer than the values (sm_90
        # PTX, BLOCK_N 64: 32 columns against 128 values a thread and step); no weight is rounded
        n_silu = len(re.findall(r"ex2\.approx", body))
        assert len(re.findall(r"cvt\.rn\.(bf16|f16)", body)) == n_silu, "the FMA loop rounds weights to 16 bits"
        assert n_silu < values if cfg.get("GLU") else n_silu == 0, (n_silu, values)
        assert not re.search(r"cvt\.rn\.f32\.[su]32", body), "the FMA loop converts ints to float"
        # one LOP3 per value (the inline PTX: nibble -> fp32 2**23 + q * 16**j, AND and OR in one)
        assert len(re.findall(r"lop3\.b32", body)) == values, "nibble extraction: one LOP3 per value"
        # fp32 maths per value: d = f * 16**-j - (2**(23 - 4j) + zero) (an FFMA; an FADD where j = 0), then
        # one FFMA per token row (an FMUL for a group's first shift) + one fold per group and row (+ the
        # min term and the sum of x for "min")
        flops = len(re.findall(r"\b(fma\.rn|mul\.rn|mul|add\.rn|add|sub\.rn|sub)\.f32", body))
        lo = values * (cfg["BLOCK_M"] + 1)
        if cfg.get("GLU"):  # the SiLU's maths per column come on top of the per-value maths
            assert flops >= lo, (flops, lo)
        else:
            assert lo <= flops <= lo * (1.75 if cfg["ZM"] == 2 else 1.25), (flops, lo)
    else:
        ty = "bf16x2" if cfg["x"] == "bf16" else "f16x2"
        # two packed FMAs per pair: q - zero (exact), then * scale (+ min)
        assert len(re.findall(rf"fma\.rn\.{ty}", body)) == values, "packed FMAs per pair of nibbles"
        assert "mma" in body


@pytest.mark.parametrize("g", [32, 128, 640])  # one shift a group, four, one group per row (K = 640)
def test_mma_kind_groups_and_the_fallback(g):
    """The mma kind at each group tiling (scales folded once a group, or per row); a weight it does not compute
    (fp16 scales under bf16 activations in "min" mode, or W4A8) runs the heuristic's config instead."""
    from fastdecode.kernels.int4_mma import mma_supported

    N, K, M = 70, 640, 2
    cfg = dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2)
    for fmt in ("sym", "zero"):
        w = _packed(fmt, N, K, g)
        x = _x(M, K)
        out = poison_(torch.empty(M, N, dtype=torch.float16))
        I.int4_linear_with_config(x, w, None, out, cfg)
        assert_close(out, I.int4_linear_ref(x, w))
    w = _packed("min", N, K, 32)  # fp16 scales and mins
    assert mma_supported(torch.float16, w.scales.dtype, "min", 32, K)
    assert not mma_supported(torch.bfloat16, w.scales.dtype, "min", 32, K)
    assert not mma_supported(torch.float8_e4m3fn, w.scales.dtype, "sym", 32, K)
    assert not mma_supported(torch.float16, w.scales.dtype, "sym", 16, K)  # half a shift a group
    x = _x(M, K, torch.bfloat16)
    out = poison_(torch.empty(M, N, dtype=torch.bfloat16))
    I.int4_linear_with_config(x, w, None, out, cfg)  # the heuristic's fma (no bf16 tl.dot here)
    assert_close(out, I.int4_linear_ref(x, w))


@pytest.mark.parametrize("mask,tiles,split", [(True, 1, 1), (False, 2, 1), (True, 2, 3)])
def test_mma_kind_masked_padding_tokens_and_two_tiles_a_step(mask, tiles, split):
    """MASK_X (the tile's padding tokens as masked loads, not copies of row 0) and TILES = 2 (two layout tiles a
    loop step, splits of whole steps) compute the same outputs; K = 1280 is five tiles: TILES = 2 falls back to
    one tile a step, K = 1024 runs two."""
    for K in (1024, 1280):
        N, M = 70, 3
        cfg = dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=split, MASK_X=mask, TILES=tiles)
        w = _packed("zero", N, K, 128)
        x = _x(M, K)
        out = poison_(torch.empty(M, N, dtype=torch.float16))
        I.int4_linear_with_config(x, w, None, out, cfg)
        assert_close(out, I.int4_linear_ref(x, w))


def test_a_table_entry_with_a_diagnostic_key_is_refused(tmp_path):
    """``_ABLATE`` (``kernels.int4_mma``'s ablations: outputs that are not the product) is a benchmark's explicit
    key; a table that holds it is refused by name, not run."""
    cfg = dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3, _ABLATE=1)
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"gpu": "NVIDIA test", "int4_linear": {"64,256,128": {"1": {"impl": "triton",
                                                                                        "config": cfg}}}}))
    I.clear_config_cache()
    try:
        with pytest.raises(ValueError, match="diagnostic key.*_ABLATE"):
            I.get_int4_config(1, 64, 256, 128, path=str(p))
    finally:
        I.clear_config_cache()


def test_mma_ablations_run_and_ablate_0_is_the_kernel():
    """The diagnostic ablations (``benchmarks/diag_int4_gemv.py --ablate``) launch; ``_ABLATE`` 0 is the kernel
    itself, and without the MMAs (2) the outputs are no longer the product (0 here: the ablation's sink times 0)."""
    N, K, M = 70, 512, 1
    w = _packed("zero", N, K, 128)
    x = _x(M, K)
    cfg = dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, MASK_X=True)
    ref = I.int4_linear_ref(x, w)
    outs = {}
    for a in (0, 2):
        out = poison_(torch.empty(M, N, dtype=torch.float16))
        I.int4_linear_with_config(x, w, None, out, {**cfg, "_ABLATE": a})
        outs[a] = out
    assert_close(outs[0], ref)
    assert torch.equal(outs[2], torch.zeros_like(outs[2]))


@pytest.mark.parametrize("fmt", ["zero", "min", "sym"])
def test_every_int4_launch_refuses_non_contiguous_scales_zeros_and_mins(fmt):
    """The int4 kernels read the (N, G) scales and zeros / mins row-major (``row * G + group``): every launch (the
    fma, dot and mma kinds, the dequant kernel, W4A8) refuses a non-contiguous one by name, a group-major view
    (strides (1, N)) or a column slice, rather than reading the wrong values; the same weight made contiguous
    runs. The checked ops refuse it too (``Int4Weight.validate``)."""
    import dataclasses

    import fastdecode.ops.int4_a8 as A
    from fastdecode.kernels.int4_dequant import launch_int4_dequant

    N, K, M, g = 70, 512, 2, 128
    w = _packed(fmt, N, K, g)
    x = _x(M, K)
    group_major = lambda t: t.t().contiguous().t()  # noqa: E731 (the same values, strides (1, N))
    column_slice = lambda t: torch.stack([t, t], -1)[..., 0]  # noqa: E731 (the same values, strides (2G, 2))
    bad = [("scales", {"scales": group_major(w.scales)})]
    if fmt != "sym":
        name = "zeros" if fmt == "zero" else "mins"
        bad.append(("zeros / mins", {name: column_slice(getattr(w, name))}))
    kinds = (CONFIGS["fma_m1"], CONFIGS["dot_split3"], dict(kind="mma", BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
                                                            SPLIT_K=2, MASK_X=True))
    q, s, sums = A.quantize_act_int8(x, backend="torch")
    for what, field in bad:
        assert not any(t.is_contiguous() for t in field.values())
        wb = dataclasses.replace(w, **field)
        for cfg in kinds:
            with pytest.raises(ValueError, match=f"the int4 {cfg['kind']} kind reads int4 {what} row-major"):
                I.int4_linear_with_config(x, wb, None, torch.empty(M, N, dtype=x.dtype), cfg)
        zm = wb.zeros if fmt == "zero" else wb.mins
        with pytest.raises(ValueError, match=f"the int4 dequant kernel reads int4 {what} row-major"):
            launch_int4_dequant(wb.qweight, wb.scales, zm, g, fmt, torch.empty(N, K, dtype=torch.float16))
        with pytest.raises(ValueError, match=f"the W4A8 kernel reads int4 {what} row-major"):
            A.a8_with_config(q, s, sums, wb, None, torch.empty(M, N, dtype=x.dtype),
                             dict(BLOCK_M=1, BLOCK_N=32, SPLIT_K=1))
        with pytest.raises(ValueError, match="must be contiguous"):
            I.int4_linear(x, wb)
        fixed = dataclasses.replace(wb, scales=wb.scales.contiguous(),
                                    zeros=None if wb.zeros is None else wb.zeros.contiguous(),
                                    mins=None if wb.mins is None else wb.mins.contiguous())
        out = poison_(torch.empty(M, N, dtype=x.dtype))
        I.int4_linear_with_config(x, fixed, None, out, kinds[2])
        assert_close(out, I.int4_linear_ref(x, w))


def test_tuner_proposes_mma_tiles_for_few_tokens_only():
    from fastdecode.bench.int4 import candidates

    for M in (1, 16, 64):
        mma = candidates(M, 4096, 4096, kinds=("mma",))
        assert mma and all(c["kind"] == "mma" and c["BLOCK_M"] == max(16, next_pow2(M)) for c in mma)
        assert {c["BLOCK_N"] for c in mma} == {16, 32, 64, 128, 256}
        # the mma.sync tiles (below a warpgroup of 4 warps: test_sm90_mma_kind_below_64_rows_a_warpgroup_is_mma_sync)
        assert {(c["BLOCK_N"], c["num_warps"]) for c in mma if c["num_warps"] < 4} == {(16, 1), (32, 2), (64, 2)}
        assert all(c["num_warps"] == 8 for c in mma if c["BLOCK_N"] == 256)  # 4 warps spill there (sm_90 compile)
        assert [c for c in candidates(M, 4096, 4096) if c["kind"] == "mma"] == mma
    assert not candidates(128, 4096, 4096, kinds=("mma",))
    assert not candidates(1, 4096, 4096, fp8=True, kinds=("mma",))  # W4A16 only
    assert all(c["kind"] == "fma" for c in candidates(1, 4096, 4096, kinds=("fma",)))


_MMA_SNIPPET = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.kernels.int4_mma import _int4_mma_kernel

cfg = json.loads(sys.argv[1])
xt = cfg["x"]
zt = {0: xt, 1: "u8", 2: xt}[cfg["ZM"]]
sig = {"x_ptr": "*" + xt, "qw_ptr": "*i32", "s_ptr": "*" + xt, "z_ptr": "*" + zt, "bias_ptr": "*" + xt,
       "out_ptr": "*" + xt, "part_ptr": "*fp32", "lock_ptr": "*i32", "nw_ptr": "*" + xt, "eps": "fp32", "M": "i32",
       "N": "i32", "K": "i32", "G": "i32",
       "KW": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_part": "i32", "split_k": "i32"}
consts = dict(GROUP=128, ZERO_MODE=cfg["ZM"], HAS_BIAS=False, SPG=4, EVEN_K=True, ASM=True, USE_PDL=True,
              L2_PREFETCH=True, X_NORM=cfg.get("XN", False), NORM_AFFINE=cfg.get("XN", False), NORM_NB=2048, NORM_RM=1,
              ACCUMULATE=cfg.get("XN", False), MASK_X=cfg.get("MASK_X", False), TILES=cfg.get("TILES", 1),
              CVT1=cfg.get("CVT1", False), ABLATE=0, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], SPLIT=True,
              L2_SLAB=cfg.get("SLAB", 0), PF_LANES=32 * cfg.get("num_warps", 4))
sig.update({k: "constexpr" for k in consts})
aligned = {"x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "lock_ptr", "N", "K", "G", "KW",
           "stride_xm", "stride_om"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
cc = triton.compile(ASTSource(_int4_mma_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": cfg.get("num_warps", 4), "num_stages": 2})
sys.stdout.write(cc.asm["ptx"])
"""


@pytest.mark.parametrize("cfg", [dict(BLOCK_N=128, ZM=1, x="bf16"), dict(BLOCK_N=64, ZM=0, x="fp16"),
                                 dict(BLOCK_N=64, ZM=2, x="bf16"), dict(BLOCK_N=64, ZM=1, x="bf16", XN=True),
                                 dict(BLOCK_N=64, ZM=1, x="bf16", CVT1=True, MASK_X=True),
                                 dict(BLOCK_N=128, ZM=0, x="fp16", CVT1=True)],
                         ids=["bn128_zero_bf16", "bn64_sym_fp16", "min", "bn64_zero_norm", "cvt1_zero_bf16",
                              "cvt1_sym_fp16"])
def test_sm90_mma_kind_keeps_the_weight_in_registers(cfg):
    """Speed guard, compiled ahead of time for sm_90: the mma loop feeds wgmma its weight operand from registers
    (``wgmma ... {a0, a1, a2, a3}, desc_b``, no 16-bit weight tile in shared memory), converts two values per
    LOP3 (and one packed add, or two packed FMAs for "min", per pair), two PRMT per two words, and prefetches
    the first weight tiles into L2 before the PDL wait."""
    import re

    ptx = sm90_ptx(_MMA_SNIPPET, json.dumps(cfg))
    body = k_loop(ptx, 1 if cfg.get("XN") else 0)  # X_NORM: its pass over the rows comes first
    pairs = cfg["BLOCK_N"] * 256 // 128 // 2  # packed pairs of weights per thread per K step (4 warps)
    ty = "bf16x2" if cfg["x"] == "bf16" else "f16x2"
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.\w+\.\w+\s+\{[^}]*\},\s*\{[^}]*\},", body)
    assert len(mma) == cfg["BLOCK_N"] // 64 * 16, "every wgmma takes its weight operand from registers"
    assert len(re.findall(r"lop3\.b32", body)) == pairs, "one LOP3 per pair of nibbles"
    assert len(re.findall(r"prmt\.b32", body)) == pairs // 4, "two PRMT per two words"
    assert len(re.findall(rf"fma\.rn\.{ty}", body)) == pairs * (2 if cfg["ZM"] == 2 else 1)
    # the weight tile never goes through shared memory (the few stores there: the per-row scales and zeros
    # changing layout, one value a thread and group)
    assert len(re.findall(r"st\.shared", body)) < pairs // 4, "weights stored to shared memory in the loop"
    head = ptx[:ptx.index("griddepcontrol.wait")]
    assert "prefetch.global.L2" in head, "the L2 prefetch comes before the PDL wait"


@pytest.mark.parametrize("which", ["fma", "fma_prefetch", "mma"])
def test_sm90_l2_slab_prefetch_comes_before_the_pdl_wait(which):
    """L2_SLAB (``ops._common.weight_prefetch_enabled``): the program's weight words go to L2 by bulk prefetches, one
    a thread, before ``griddepcontrol.wait``; the mma kind then skips its first-tiles prefetch; none without it."""
    from helpers import bulk_prefetches

    for slab in (True, False):
        if which == "mma":
            ptx = sm90_ptx(_MMA_SNIPPET, json.dumps(dict(BLOCK_N=64, ZM=1, x="bf16", SLAB=65536 if slab else 0)))
            assert ("prefetch.global.L2 " in ptx) == (not slab)
        else:
            ptx = sm90_ptx(_COMPILE_SNIPPET, json.dumps(dict(kind="fma", BLOCK_M=1, BLOCK_N=64, ZM=0, x="bf16",
                                                             PF=which == "fma_prefetch", PDL=True,
                                                             SLAB=65536 if slab else 0)))
        before, total = bulk_prefetches(ptx)
        assert before == total == (1 if slab else 0), (before, total)


@pytest.mark.parametrize("bn,nw", [(16, 1), (32, 2), (64, 2)])
def test_sm90_mma_kind_below_64_rows_a_warpgroup_is_mma_sync(bn, nw):
    """The tuner's small mma tiles, compiled ahead of time for sm_90: below a warpgroup (4 warps, 64 rows each)
    triton emits Ampere-style ``mma.sync`` (the weight still a register operand) and no ``wgmma.wait_group`` in the
    K loop, the wait that follows every shift's wgmma on the 64-row tiles; each weight value converted once (32 rows
    on 4 warps converted each twice: triton put two of the warps side by side over the tokens)."""
    import re

    body = k_loop(sm90_ptx(_MMA_SNIPPET, json.dumps(dict(BLOCK_N=bn, ZM=1, x="bf16", num_warps=nw))))
    assert "wgmma" not in body
    # at least one MMA a shift (how many depends on how triton spreads the tile over the warps)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", body)) >= 8
    assert len(re.findall(r"lop3\.b32", body)) == bn * 256 // (32 * nw) // 2, "one LOP3 per pair of nibbles"


def test_precompile_does_nothing_under_the_interpreter():
    """kernels.compile.precompile is a compile-time speed-up: with the interpreter there is nothing to
    compile, and it neither calls the warm-up nor fails."""
    from fastdecode.kernels.compile import precompile

    if not interpreter_on():
        pytest.skip("the interpreter's case; the GPU's is tests/test_int4_gpu.py")
    called = []
    assert precompile(called.append, [{"a": 1}, {"a": 2}]) == 0 and called == []


def test_the_int4_tuner_times_the_engines_zero_mode():
    """The tuner, ``bench int4`` and ``diag_int4_gemv`` quantise their weights as the engine's RTN does: the table
    is keyed by shape and group alone, and session 20 found configs tuned on "sym" weights slower in the 8B step,
    whose weights carry zero points (benchmarks/NOTES.md)."""
    from fastdecode.bench import int4 as bi
    from fastdecode.models.llama import Linear
    from fastdecode.models.quantize import int4_linear_from

    lin = Linear(256, 64, bias=False)
    assert int4_linear_from(lin).zero_mode == bi.ZERO_MODE
    assert bi.ZERO_MODE in bi.ZERO_MODES
    with pytest.raises(ValueError, match="zero_mode"):
        bi._Operands(64, 256, 128, 1, zero_mode="min")
