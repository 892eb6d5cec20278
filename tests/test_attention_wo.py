"""rope_attention_add_linear_ (the attn_wo switch): the decode attention and wo's residual add in one kernel
(interpreter on CPU, or the GPU), against the two references composed and against the two ops."""

import copy
import math

import pytest
import torch

from fastdecode.ops.attention import rope_decode_attention, rope_decode_attention_ref
from fastdecode.ops.attention_wo import applies, rope_attention_add_linear_, rope_attention_add_linear_ref
from fastdecode.ops.norm_linear import add_linear_
from helpers import assert_close, decode_positions_and_caches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hkv, T, D, N, block_n): SmolLM2's heads and dim, MHA, Llama-3's GQA 4 at D 128, MQA, odd half (D 80) with
# N not a multiple of the block, D 16
SHAPES = [
    (1, 9, 3, 129, 64, 576, None),
    (2, 4, 4, 40, 64, 100, 16),
    (2, 8, 2, 70, 128, 256, 64),
    (1, 8, 1, 33, 32, 48, 32),
    (3, 6, 2, 99, 80, 130, 16),
    (2, 4, 2, 30, 16, 64, 128),
]


def _inputs(B, Hq, Hkv, T, D, N, dtype, bias=False):
    """qkv, rope, positions (0 and T - 1 among them), random caches with a spare sequence and spare positions
    (views, as the engine passes them), wo scaled by 1 / sqrt(K) (outputs of about unit size), a bias, and the
    residual."""
    half = D // 2
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=DEV).to(dtype)
    ang = torch.arange(T + 2, device=DEV)[:, None].float() * torch.rand(half, device=DEV)[None, :]
    rope = torch.stack([ang.cos(), ang.sin()], dim=-1)  # [T + 2, D/2, 2] fp32
    pos, k, v = decode_positions_and_caches(B, Hkv, T, D, dtype, DEV)
    w = (torch.randn(N, Hq * D, device=DEV) / math.sqrt(Hq * D)).to(dtype)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    h = torch.randn(B, N, device=DEV).to(dtype)
    return qkv, rope, pos, k, v, w, b, h


def _check_caches(k, v, k2, v2, pos):
    """The new K / V at pos as the reference writes them (RoPE in fp32 either way; 1 ulp), nothing else touched."""
    rows = torch.arange(k.shape[0], device=DEV)
    assert_close(k[rows, :, pos], k2[rows, :, pos])
    torch.testing.assert_close(v, v2, atol=0, rtol=0)
    k[rows, :, pos] = k2[rows, :, pos]
    torch.testing.assert_close(k, k2, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_ref(shape, dtype):
    B, Hq, Hkv, T, D, N, block_n = shape
    qkv, rope, pos, k, v, w, _, h = _inputs(B, Hq, Hkv, T, D, N, dtype)
    k2, v2 = k.clone(), v.clone()
    want = rope_attention_add_linear_ref(h, qkv, rope, pos, k2, v2, w, None, Hq)
    got = rope_attention_add_linear_(h, qkv, rope, pos, k, v, w, n_q_heads=Hq, block_n=block_n, backend="triton")
    assert got is h
    assert_close(h, want)
    _check_caches(k, v, k2, v2, pos)


def test_equals_the_two_ops():
    """fp32: what rope_decode_attention then add_linear_ compute, up to the summation order; with a bias."""
    B, Hq, Hkv, T, D, N = 2, 8, 2, 90, 64, 200
    qkv, rope, pos, k, v, w, b, h = _inputs(B, Hq, Hkv, T, D, N, torch.float32, bias=True)
    k2, v2, h2 = k.clone(), v.clone(), h.clone()
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, w, b, n_q_heads=Hq, block_n=32, backend="triton")
    o = rope_decode_attention(qkv, rope, pos, k2, v2, Hq, num_splits=1, backend="triton")
    add_linear_(h2, o.reshape(B, -1), w, b, backend="triton")
    torch.testing.assert_close(h, h2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k2, atol=0, rtol=0)
    torch.testing.assert_close(v, v2, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bias_and_a_second_launch(dtype):
    """The counters end at 0: a second launch (the next step, same counters) is right too; with a bias."""
    B, Hq, Hkv, T, D, N = 2, 9, 3, 50, 64, 96
    qkv, rope, pos, k, v, w, b, h = _inputs(B, Hq, Hkv, T, D, N, dtype, bias=True)
    pos = pos.clamp(max=T - 2)  # room for the next step's position
    k2, v2 = k.clone(), v.clone()
    want = h
    for step in range(2):
        want = rope_attention_add_linear_ref(want, qkv, rope, pos + step, k2, v2, w, b, Hq)
        rope_attention_add_linear_(h, qkv, rope, pos + step, k, v, w, b, n_q_heads=Hq, block_n=16, backend="triton")
        assert_close(h, want, ulps=2)


def test_ignores_what_lies_past_pos():
    """Cache rows at and past each position hold NaN (stale or never written): nothing of them reaches the
    residual (the first tile is read before pos is known and masked at use)."""
    B, Hq, Hkv, T, D, N = 3, 8, 2, 70, 32, 64
    qkv, rope, pos, k, v, w, _, h = _inputs(B, Hq, Hkv, T, D, N, torch.float32)
    pos = torch.tensor([0, 5, 40], device=DEV)
    for b in range(B):
        k[b, :, int(pos[b]):] = float("nan")
        v[b, :, int(pos[b]):] = float("nan")
    k2, v2 = k.clone(), v.clone()
    want = rope_attention_add_linear_ref(h, qkv, rope, pos, k2, v2, w, None, Hq)
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, w, n_q_heads=Hq, backend="triton")
    assert not h.isnan().any()
    assert_close(h, want)


def test_torch_backend_is_the_reference():
    B, Hq, Hkv, T, D, N = 2, 4, 2, 20, 32, 40
    qkv, rope, pos, k, v, w, b, h = _inputs(B, Hq, Hkv, T, D, N, torch.float32, bias=True)
    k2, v2 = k.clone(), v.clone()
    want = rope_attention_add_linear_ref(h, qkv, rope, pos, k2, v2, w, b, Hq)
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, w, b, n_q_heads=Hq, backend="torch")
    torch.testing.assert_close(h, want, atol=0, rtol=0)
    torch.testing.assert_close(k, k2, atol=0, rtol=0)


def test_no_rows_and_no_outputs():
    """B = 0: nothing happens. N = 0 (a weight of no rows): nothing to add, the caches are still written."""
    Hq, Hkv, T, D = 4, 2, 20, 32
    qkv, rope, pos, k, v, w, _, h = _inputs(1, Hq, Hkv, T, D, 0, torch.float32)
    k2, v2 = k.clone(), v.clone()
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, w, n_q_heads=Hq, backend="triton")
    rope_decode_attention_ref(qkv, rope, pos, k2, v2, Hq)
    assert_close(k, k2)
    torch.testing.assert_close(v, v2, atol=0, rtol=0)
    e = torch.empty(0, qkv.shape[1], device=DEV)
    w1, h0 = torch.randn(8, Hq * D, device=DEV), torch.empty(0, 8, device=DEV)
    assert rope_attention_add_linear_(h0, e, rope, pos[:0], k[:0], v[:0], w1, n_q_heads=Hq, backend="triton") is h0


def test_bad_arguments():
    B, Hq, Hkv, T, D, N = 2, 4, 2, 20, 32, 40
    qkv, rope, pos, k, v, w, _, h = _inputs(B, Hq, Hkv, T, D, N, torch.float32)
    call = rope_attention_add_linear_
    with pytest.raises(ValueError, match="columns"):
        call(h, qkv, rope, pos, k, v, w[:, :-1], n_q_heads=Hq)
    with pytest.raises(ValueError, match="unit stride"):
        call(h, qkv, rope, pos, k, v, torch.randn(Hq * D, N, device=DEV).t(), n_q_heads=Hq)
    with pytest.raises(ValueError, match="weight"):
        call(h, qkv, rope, pos, k, v, w.double(), n_q_heads=Hq)
    with pytest.raises(ValueError, match="residual must have shape"):
        call(h[:, :-1], qkv, rope, pos, k, v, w, n_q_heads=Hq)
    with pytest.raises(ValueError, match="contiguous"):
        call(torch.randn(N, B, device=DEV).t(), qkv, rope, pos, k, v, w, n_q_heads=Hq)
    with pytest.raises(ValueError, match="bias must have shape"):
        call(h, qkv, rope, pos, k, v, w, torch.randn(N + 1, device=DEV), n_q_heads=Hq)
    for bad in (8, 24, 256, True, 32.0):
        with pytest.raises(ValueError, match="block_n"):
            call(h, qkv, rope, pos, k, v, w, n_q_heads=Hq, block_n=bad)
    with pytest.raises(ValueError, match="n_q_heads"):
        call(h, qkv, rope, pos, k, v, w, n_q_heads=3)
    h0 = h.clone()
    with pytest.raises(ValueError):
        call(h, qkv, rope, pos + T, k, v, w, n_q_heads=Hq)  # a position past the cache (checked on a CPU only)
    if DEV == "cpu":
        torch.testing.assert_close(h, h0, atol=0, rtol=0)  # nothing written when rejected


def test_applies_where_one_split_serves_a_small_wo():
    """One split of the context (the split-KV heuristic's pick): the bench's 1 in / 128 out cache of 129 positions
    takes the op, a long cache keeps the two kernels; so does a wo over ``MAX_WO_BYTES`` (the 8B's)."""
    k_short = torch.empty(1, 3, 129, 64, device=DEV, dtype=torch.bfloat16)
    k_long = torch.empty(1, 3, 8192, 64, device=DEV, dtype=torch.bfloat16)
    wo = torch.empty(576, 576, device="meta", dtype=torch.bfloat16)
    assert applies(1, 9, k_short, wo)
    assert not applies(1, 9, k_long, wo)
    k_8b = torch.empty(1, 8, 129, 128, device=DEV, dtype=torch.bfloat16)
    assert applies(1, 32, k_8b, torch.empty(2048, 2048, device="meta", dtype=torch.bfloat16))
    assert not applies(1, 32, k_8b, torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- the attn_wo switch in the model


def _model(fmt="fp32", layers=2, device=DEV, preset="tiny"):
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model

    cfg = ModelConfig.from_preset(preset).replace(n_layers=layers)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    m = random_model(cfg, device=device, dtype=dtype, backend="triton", max_seq_len=512, std=0.08,
                     seed=int(torch.randint(0, 2**31, ())))
    return quantize_model(m, fmt if fmt in ("int4", "fp8") else None)


def _count_fused(monkeypatch):
    import fastdecode.models.decode_attention as DA

    calls = []
    real = DA.rope_attention_add_linear_
    monkeypatch.setattr(DA, "rope_attention_add_linear_", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_switch_fuses_dense_blocks_and_keeps_the_step(monkeypatch, fmt):
    """On (``set_kernels(attn_wo=True)``), each block of the norm_gemm step takes the fused op (a dense wo, or a
    W4A16 int4 one), and the logits and caches are those of the step without it (fp32: to the summation order;
    int4 (bf16): to a bf16 rounding of the residual). Off by default; the unfused step (norm_gemm off) never takes
    it."""
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.models import norm_gemm

    calls = _count_fused(monkeypatch)
    m = _model(fmt)
    assert not m.kernels["attn_wo"]
    plain = copy.deepcopy(m)
    m.set_kernels(attn_wo=True)
    cfg = m.config
    dtype = m.tok_embeddings.weight.dtype
    toks = torch.randint(0, cfg.vocab_size, (2, 9), device=DEV)
    caches = [KVCache(cfg, 2, 40, dtype=dtype, device=DEV) for _ in range(2)]
    for c, model in zip(caches, (m, plain)):
        model.prefill(toks[:, :4], c)
    tol = dict(atol=1e-4, rtol=1e-4) if fmt == "fp32" else dict(atol=2e-2, rtol=2e-2)
    for use_norm_gemm in (True, False):
        m.set_kernels(norm_gemm=use_norm_gemm)
        plain.set_kernels(norm_gemm=use_norm_gemm)
        fused = norm_gemm.applies(m, 2)
        # int4: the fused step where the int4 table gives every projection an fma tile (norm_gemm._supported; the
        # heuristics do at these shapes on a CPU; a GPU's tables may not)
        assert fused == use_norm_gemm if fmt == "fp32" or DEV == "cpu" else not fused or use_norm_gemm
        for t in ((4, 5) if use_norm_gemm else (6, 7)):
            pos = torch.tensor([t, t - 2], device=DEV)
            calls.clear()
            got = m.decode(toks[:, t], pos, caches[0])
            assert len(calls) == (cfg.n_layers if fused else 0)
            want = plain.decode(toks[:, t], pos, caches[1])
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(caches[0].k, caches[1].k, **tol)
            torch.testing.assert_close(caches[0].v, caches[1].v, **tol)


def test_switch_keeps_two_kernels_over_a_long_cache(monkeypatch):
    """A cache that the split-KV heuristic splits keeps the attention and wo apart (``applies``)."""
    from fastdecode.engine.kv_cache import KVCache

    calls = _count_fused(monkeypatch)
    m = _model()
    m.set_kernels(attn_wo=True)
    cfg = m.config
    cache = KVCache(cfg, 2, 500, dtype=torch.float32, device=DEV)
    assert not applies(2, cfg.n_heads, cache.k[0], m.layers[0].attention.wo.weight)
    toks = torch.randint(0, cfg.vocab_size, (2, 5), device=DEV)
    m.prefill(toks[:, :4], cache)
    m.decode(toks[:, 4], torch.tensor([4, 4], device=DEV), cache)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs with PDL")
@pytest.mark.parametrize("B", [1, 3])
def test_gpu_graph_step_equals_the_step_without_it(B):
    """SmolLM2's shapes (4 blocks, bf16): the switch's CUDA-graph decode steps (PDL, the wo rows' L2 prefetch, the
    counters across replays) against the same engine's steps without it; the bf16 sums differ in order only."""
    from fastdecode.engine.generate import Engine

    model = _model("bf16", layers=4, preset="smollm2-135m")
    plain = copy.deepcopy(model)
    model.set_kernels(attn_wo=True)
    engines = [Engine(mm, None, max_batch=4, max_seq_len=64, cuda_graph=True, batch_buckets=[1, 4])
               for mm in (model, plain)]
    prompts = [torch.randint(0, model.config.vocab_size, (5,)).tolist() for _ in range(B)]
    got, want = (e.prefill(prompts) for e in engines)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the prefill does not take the switch
    pos = torch.full((B,), 5, device=DEV)
    for _ in range(6):
        nxt = torch.randint(0, model.config.vocab_size, (B,), device=DEV)
        got, want = (e.decode(nxt, pos).float() for e in engines)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.min().item() > 0.999, cos
        pos += 1


def _wo_ptx_job(pf: bool, int4: bool = False) -> tuple:
    """The kernel at SmolLM2's heads (9 q / 3 kv, D 64, bf16), PDL, BN 16, with or without L2_PF; a dense wo, or
    (``int4``) its GGUF's Q4_1 form (min mode, groups of 32)."""
    from helpers import kernel_ptx_job

    ptrs = {"qkv_ptr": "*bf16", "rope_ptr": "*fp32", "pos_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "w_ptr": "*i32" if int4 else "*bf16", "s_ptr": "*bf16", "zm_ptr": "*bf16", "bias_ptr": "*bf16",
            "h_ptr": "*bf16", "o_ptr": "*fp32", "lock_ptr": "*i32"}
    ints = ["stride_qkv", "stride_rope_t", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh",
            "stride_vt", "stride_wn", "stride_sn", "stride_hb", "T", "N"]
    sig = {**ptrs, "scale": "fp32", **{n: "i32" for n in ints}, "pf_ptr": "*u8", "pf_row_bytes": "i32",
           "pf_chunk": "i32"}
    consts = dict(HQ=9, HKV=3, GROUP=3, BLOCK_G=16, HALF=32, BLOCK_HALF=32, BLOCK_D=64, BLOCK_N=64, USE_DOT=True,
                  LOG2E=1.4426950408889634, BN=16, BLOCK_K=128, HAS_BIAS=False, W_INT4=int4, GS=32 if int4 else 1,
                  ZERO_MODE=2 if int4 else 0, USE_PDL=True, L2_PF=pf, PF_LANES=128)
    return kernel_ptx_job("fastdecode.kernels.attention_wo", "_rope_attention_wo_kernel", sig, consts)


WO_PTX_CASES = [(True, False), (False, False), (True, True)]


@pytest.fixture(scope="module")
def wo_ptx_ahead():
    """The compiles at once (``helpers.sm90_ptx_ahead``)."""
    from helpers import sm90_ptx_ahead

    sm90_ptx_ahead([_wo_ptx_job(*c) for c in WO_PTX_CASES])


@pytest.mark.parametrize("pf,int4", WO_PTX_CASES)
def test_sm90_prefetch_before_the_wait_and_one_acq_rel_counter(wo_ptx_ahead, pf, int4):
    """Compiled ahead of time for sm_90 (dense and int4 wo): with L2_PF one bulk L2 prefetch (of the block's wo
    rows), before ``griddepcontrol.wait``, none without; one acquire-release atomic on the counter, after the wait."""
    import re

    from helpers import bulk_prefetches, sm90_ptx

    ptx = sm90_ptx(*_wo_ptx_job(pf, int4))
    assert bulk_prefetches(ptx) == ((1, 1) if pf else (0, 0))
    atoms = [m.start() for m in re.finditer(r"atom\.global\.gpu\.acq_rel\.add", ptx)]
    assert len(atoms) == 1 and atoms[0] > ptx.index("griddepcontrol.wait")


# ----------------------------------------------------------------------------- an int4 wo (W4A16)


def _packed(N, K, mode, gs, act_order=False, sdt=torch.bfloat16):
    from fastdecode.ops.int4_format import prepack

    G = K // gs
    q = torch.randint(0, 16, (N, K), device=DEV)
    scales = (torch.rand(N, G, device=DEV) * 0.02 + 0.005).to(sdt)
    zeros = torch.randint(0, 16, (N, G), device=DEV) if mode == "zero" else None
    mins = (-torch.rand(N, G, device=DEV) * 0.1).to(sdt) if mode == "min" else None
    g_idx = torch.randperm(K, device=DEV) // gs if act_order else None
    return prepack(q, scales, group_size=gs, zeros=zeros, mins=mins, g_idx=g_idx)


# (B, Hq, Hkv, T, D, N, block_n, zero mode, group size): SmolLM2's heads with its GGUF's Q4_1 (min, groups of 32;
# K 576: the last 256-column tile half padding), GPTQ-style zeros at g128, symmetric per channel, fp16
INT4_CASES = [
    (1, 9, 3, 129, 64, 576, None, "min", 32, torch.bfloat16),
    (2, 4, 2, 40, 64, 96, 32, "zero", 128, torch.bfloat16),
    (2, 8, 2, 30, 32, 64, 16, "sym", 256, torch.float16),
    (3, 6, 2, 50, 64, 130, 64, "min", 64, torch.float16),
]


@pytest.mark.parametrize("case", INT4_CASES, ids=str)
def test_int4_wo_matches_ref(case):
    """wo as an ``Int4Weight``: the attention output (as the reference's, rounded to the activation dtype) times the
    exact fp32 dequantised weight (the kernel does not round it to the activation dtype, as the int4 GEMV's FMA
    kernel does not; ``int4_add_linear_ref`` does), plus the bias, into the residual; the caches as for a dense
    wo."""
    from fastdecode.ops.int4_format import dequantize_int4

    B, Hq, Hkv, T, D, N, block_n, mode, gs, dtype = case
    qkv, rope, pos, k, v, _, b, h = _inputs(B, Hq, Hkv, T, D, N, dtype, bias=True)
    packed = _packed(N, Hq * D, mode, gs, sdt=dtype)
    k2, v2 = k.clone(), v.clone()
    o = rope_decode_attention_ref(qkv, rope, pos, k2, v2, Hq).reshape(B, -1)
    want = (o.float() @ dequantize_int4(packed, torch.float32).t() + b.float() + h.float()).to(dtype)
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, packed, b, n_q_heads=Hq, block_n=block_n, backend="triton")
    assert_close(h, want)
    _check_caches(k, v, k2, v2, pos)


def test_int4_wo_equals_the_two_ops():
    """What rope_decode_attention then int4_add_linear_ compute, up to the order of the fp32 sums."""
    from fastdecode.ops.int4_norm_linear import int4_add_linear_

    B, Hq, Hkv, T, D, N = 2, 9, 3, 70, 64, 576
    qkv, rope, pos, k, v, _, _, h = _inputs(B, Hq, Hkv, T, D, N, torch.bfloat16)
    packed = _packed(N, Hq * D, "min", 32)
    k2, v2, h2 = k.clone(), v.clone(), h.clone()
    rope_attention_add_linear_(h, qkv, rope, pos, k, v, packed, n_q_heads=Hq, backend="triton")
    o = rope_decode_attention(qkv, rope, pos, k2, v2, Hq, num_splits=1, backend="triton")
    int4_add_linear_(h2, o.reshape(B, -1), packed, backend="triton")
    assert_close(h, h2)


def test_int4_wo_refusals():
    B, Hq, Hkv, T, D, N = 2, 4, 2, 20, 64, 64
    qkv, rope, pos, k, v, _, _, h = _inputs(B, Hq, Hkv, T, D, N, torch.bfloat16)
    call = rope_attention_add_linear_
    with pytest.raises(ValueError, match="act-order"):
        call(h, qkv, rope, pos, k, v, _packed(N, Hq * D, "zero", 64, act_order=True), n_q_heads=Hq)
    with pytest.raises(ValueError):  # K of the weight is not Hq * D
        call(h, qkv, rope, pos, k, v, _packed(N, Hq * D + 256, "sym", 64), n_q_heads=Hq)
    q32, r32, h32 = qkv.float(), rope, h.float()
    with pytest.raises(ValueError):  # W4A16: a 16-bit activation
        call(h32, q32, r32, pos, k.float(), v.float(), _packed(N, Hq * D, "sym", 64), n_q_heads=Hq)
    packed = _packed(N, Hq * D, "sym", 64)
    assert applies(1, Hq, k[:1], packed)  # the packed words' bytes against MAX_WO_BYTES
