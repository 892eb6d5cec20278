"""SiLU-and-mul inside the int4 FMA kernel's loads: ``int4_add_linear_(residual, gu, W, glu=True)`` and the
``int4_glu`` switch of the ``norm_gemm`` step (session 30; on by default since session 31, for w2 of at most
``norm_gemm.INT4_GLU_MAX_K`` input features).

The kernel computes ``silu(gate) * up`` in fp32 at each load and rounds it to x's dtype as the SiLU-and-mul kernel
stores it, so the fused op equals SiLU-and-mul then the same int4 kernel bit for bit. Other kinds, act-order
weights and the dequantise path run the two kernels. Device-agnostic: the interpreter on the CPU (fp16), bf16 on a
GPU.
"""

import pytest
import torch

import fastdecode.ops.activation as A
import fastdecode.ops.int4 as I
from fastdecode.ops.activation import silu_and_mul
from fastdecode.ops.int4_norm_linear import int4_add_linear_, int4_add_linear_ref
from helpers import load_script, poison_, random_int4, strided_rows, ulp

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
XDT = torch.bfloat16 if CUDA else torch.float16
N, K = 37, 640  # odd N: partial N tiles; K = 2.5 layout tiles: padding, a partial K block

# (FMA config, M, weight format, group): one row and four, split-K, PREFETCH, a K block of 512, every zero mode
FMA = {
    "m1_sym_g128": (dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1), 1, "sym", 128),
    "m3_split3_prefetch_zero_g32": (dict(kind="fma", BLOCK_M=4, BLOCK_N=8, BLOCK_K=256, SPLIT_K=3, PREFETCH=True),
                                    3, "zero", 32),
    "m2_bk512_split2_min_g64": (dict(kind="fma", BLOCK_M=2, BLOCK_N=16, BLOCK_K=512, SPLIT_K=2), 2, "min", 64),
}


def _packed(fmt, g, g_idx=None):
    return random_int4(fmt, N, K, g, XDT, DEV, g_idx)


def _gu(M):
    """``[gate | up]`` rows (M, 2K) of the w13 output, strided."""
    return (strided_rows(M, 2 * K, torch.float32, DEV) * 2).to(XDT)


@pytest.fixture(scope="module")
def fma_compiled():
    """On a GPU, the next test's int4 launches (three a case) compiled first in parallel threads
    (``kernels.compile.precompile``): one after another they took 18.7 s of session 44's H100 suite."""
    if not CUDA:
        return
    from functools import partial

    from fastdecode.kernels.compile import precompile

    calls = []
    for cfg, M, fmt, g in FMA.values():
        w, gu = _packed(fmt, g), _gu(M)  # the test's strides, so the compile is the one its launch looks up
        bias = torch.empty(N, device=DEV, dtype=XDT) if fmt == "zero" else None
        out, x = torch.empty(M, N, device=DEV, dtype=XDT), torch.empty(M, K, device=DEV, dtype=XDT)
        calls += [partial(I.int4_linear_with_config, gu, w, bias, out, cfg, accumulate=True, glu=True, warmup=True),
                  partial(I.int4_linear_with_config, x, w, bias, out, cfg, accumulate=True, warmup=True),
                  partial(I.int4_linear_with_config, gu, w, bias, out, cfg, glu=True, warmup=True)]
    precompile(lambda call: call(), calls)


@pytest.mark.parametrize("name", list(FMA))
def test_the_fma_kernel_with_glu_equals_silu_and_mul_then_the_kernel(fma_compiled, name):
    cfg, M, fmt, g = FMA[name]
    w = _packed(fmt, g)
    gu = _gu(M)
    bias = torch.randn(N, device=DEV).to(XDT) if fmt == "zero" else None
    r0 = (torch.randn(M, N, device=DEV) * 3).to(XDT)
    fused, two = r0.clone(), r0.clone()
    I.int4_linear_with_config(gu, w, bias, fused, cfg, accumulate=True, glu=True)
    I.int4_linear_with_config(silu_and_mul(gu, backend="triton"), w, bias, two, cfg, accumulate=True)
    assert not torch.equal(fused, r0)
    assert torch.equal(fused, two)
    out = poison_(torch.empty(M, N, dtype=XDT, device=DEV))  # without the add: every element written
    I.int4_linear_with_config(gu, w, bias, out, cfg, glu=True)
    # out is the fp32 result rounded once, two = the fp32 result + r0 rounded once: each is within half an ulp of
    # its own value (at |out| in [4, 8) a bf16 half ulp is 0.0156: a fixed atol of 1e-2 failed once on an H100,
    # session 32)
    bound = (ulp(out, XDT) + ulp(two, XDT)) / 2 + 1e-6
    diff = (out.float() + r0.float() - two.float()).abs()
    assert (diff <= bound).all(), (diff - bound).max()



def _count_silu(monkeypatch):
    """Count the SiLU-and-mul kernel's calls, from the activation module and from the int4 op's fallback."""
    import fastdecode.ops.int4_norm_linear as INL

    calls = []
    real = A.silu_and_mul
    counted = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(A, "silu_and_mul", counted)
    monkeypatch.setattr(INL, "silu_and_mul", counted)
    return calls


@pytest.mark.parametrize("M", [1, 6])
def test_the_op_fuses_on_the_fma_kind_else_runs_two_kernels(M, monkeypatch):
    """M = 1 takes the FMA kind (no SiLU-and-mul kernel); M = 6 the dot kind (the heuristics on a CPU; a table on a
    GPU may pick either): the two kernels. Both equal SiLU-and-mul then ``int4_add_linear_`` exactly."""
    w = _packed("zero", 64)
    gu = _gu(M)
    r0 = (torch.randn(M, N, device=DEV) * 3).to(XDT)
    expect = int4_add_linear_(r0.clone(), silu_and_mul(gu, backend="triton"), w, backend="triton")
    calls = _count_silu(monkeypatch)
    got = int4_add_linear_(r0.clone(), gu, w, glu=True, backend="triton")
    assert torch.equal(got, expect)
    _, cfg = I.dispatch("triton", gu[:, :K], w)
    assert len(calls) == (0 if cfg["kind"] == "fma" else 1), (cfg, calls)


def test_leading_dims_act_order_and_the_torch_backend():
    w = _packed("sym", 128)
    gu = _gu(6).view(2, 3, 2 * K)
    r0 = (torch.randn(2, 3, N, device=DEV) * 3).to(XDT)
    got = int4_add_linear_(r0.clone(), gu, w, glu=True, backend="triton")
    assert torch.equal(got, int4_add_linear_(r0.clone(), silu_and_mul(gu, backend="triton"), w, backend="triton"))
    ref = int4_add_linear_ref(r0, gu, w, glu=True)
    assert torch.equal(int4_add_linear_(r0.clone(), gu, w, glu=True, backend="torch"), ref)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=5e-2)
    # GPTQ act-order: the gather of [gate | up] is not fused, the two kernels run
    wa = _packed("zero", 64, g_idx=torch.randperm(K) % (K // 64))
    g1 = _gu(1)
    r1 = (torch.randn(1, N, device=DEV) * 3).to(XDT)
    assert torch.equal(int4_add_linear_(r1.clone(), g1, wa, glu=True, backend="triton"),
                       int4_add_linear_(r1.clone(), silu_and_mul(g1, backend="triton"), wa, backend="triton"))


def test_bad_input_is_refused_and_the_residual_left_alone():
    w = _packed("sym", 128)
    r0 = torch.randn(1, N, device=DEV).to(XDT)
    r = r0.clone()
    with pytest.raises(ValueError, match=r"\(\.\.\., 2 \* K\) = \(\.\.\., 1280\) with glu=True"):
        int4_add_linear_(r, _gu(1)[:, :K], w, glu=True)
    with pytest.raises(ValueError, match="x must have dtype|x"):
        int4_add_linear_(r, _gu(1).float(), w, glu=True)
    assert torch.equal(r, r0)
    cfg = dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1)
    with pytest.raises(ValueError, match="x_glu runs on the fma kind"):
        I.int4_linear_with_config(_gu(1), w, None, r, cfg, accumulate=True, glu=True)
    assert torch.equal(r, r0)


def _tiny_int4_model():
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.quantize import quantize_model_int4

    cfg = ModelConfig.from_preset("tiny").replace(n_layers=2)
    m = random_model(cfg, device=DEV, dtype=XDT, backend="triton", max_seq_len=64, std=0.2,
                     seed=int(torch.randint(0, 2**31, ())))
    quantize_model_int4(m)
    return cfg, m


def test_the_int4_glu_switch_gives_the_same_decode_steps(monkeypatch):
    """A tiny int4 model on the ``norm_gemm`` step: with ``int4_glu`` (the default) w2 takes SiLU-and-mul in its
    loads (no SiLU-and-mul kernel runs) and the steps are those of the switch off, bit for bit (logits and
    caches)."""
    import fastdecode.models.norm_gemm as NG
    from fastdecode.engine.kv_cache import KVCache

    cfg, m = _tiny_int4_model()
    assert m.kernels["int4_glu"] and NG.applies(m)
    toks = torch.randint(0, cfg.vocab_size, (2, 6), device=DEV)
    caches = [KVCache(cfg, 2, 16, dtype=XDT, device=DEV) for _ in range(2)]
    for c in caches:
        m.prefill(toks[:, :4], c)
    calls = _count_silu(monkeypatch)
    monkeypatch.setattr(NG, "silu_and_mul", A.silu_and_mul)  # the step's own SiLU-and-mul, counted too
    for t in (4, 5):
        pos = torch.tensor([t, t - 2], device=DEV)
        m.set_kernels(int4_glu=True)
        on = m.decode(toks[:, t], pos, caches[0])
        fused_calls = len(calls)
        m.set_kernels(int4_glu=False)
        off = m.decode(toks[:, t], pos, caches[1])
        assert torch.equal(on, off)
        assert fused_calls == 0 and len(calls) == cfg.n_layers, calls  # the two kernels: one a layer
        calls.clear()
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_int4_glu_leaves_a_w2_of_large_k_to_the_two_kernels(monkeypatch):
    """Above ``INT4_GLU_MAX_K`` input features (the 8B's w2, K = 14336, lost with SiLU in the int4 loads) w2 keeps
    the SiLU-and-mul kernel with the switch on; at the limit it takes the fused loads."""
    import fastdecode.models.norm_gemm as NG
    from fastdecode.engine.kv_cache import KVCache

    assert NG.INT4_GLU_MAX_K < 14336
    cfg, m = _tiny_int4_model()
    toks = torch.randint(0, cfg.vocab_size, (1, 5), device=DEV)
    cache = KVCache(cfg, 1, 16, dtype=XDT, device=DEV)
    m.prefill(toks[:, :4], cache)
    calls = _count_silu(monkeypatch)
    monkeypatch.setattr(NG, "silu_and_mul", A.silu_and_mul)
    pos = torch.tensor([4], device=DEV)
    for limit, want in ((cfg.intermediate_size - 1, cfg.n_layers), (cfg.intermediate_size, 0)):
        monkeypatch.setattr(NG, "INT4_GLU_MAX_K", limit)
        m.decode(toks[:, 4], pos, cache)
        assert len(calls) == want, (limit, calls)
        calls.clear()


def test_a_w2_of_large_k_takes_silu_inside_on_the_glu_ops_own_entry(monkeypatch):
    """Above ``INT4_GLU_MAX_K``, w2 takes SiLU-and-mul in its loads where the int4 table holds the GLU op's own entry
    for its shape at the step's rows (a tile the fused tuner timed so), and only there: the SiLU-and-mul kernel
    runs where the entry is not the op's own (False) or there is none (None). The steps are the same either way."""
    import fastdecode.models.norm_gemm as NG
    from fastdecode.engine.kv_cache import KVCache

    cfg, m = _tiny_int4_model()
    monkeypatch.setattr(NG, "INT4_GLU_MAX_K", cfg.intermediate_size - 1)
    toks = torch.randint(0, cfg.vocab_size, (1, 5), device=DEV)
    caches = [KVCache(cfg, 1, 16, dtype=XDT, device=DEV) for _ in range(3)]
    for c in caches:
        m.prefill(toks[:, :4], c)
    calls = _count_silu(monkeypatch)
    monkeypatch.setattr(NG, "silu_and_mul", A.silu_and_mul)
    pos = torch.tensor([4], device=DEV)
    asked, outs = [], []
    for own, cache in zip((True, False, None), caches):
        def entry(M, N, K, group_size, device=None, *, op, own=own):
            asked.append((M, N, K, op))
            return own if op == "int4_add_linear_glu" else None
        monkeypatch.setattr(I, "fused_entry_is_own", entry)
        outs.append(m.decode(toks[:, 4], pos, cache))
        assert len(calls) == (0 if own else cfg.n_layers), (own, calls)
        calls.clear()
    assert (1, cfg.dim, cfg.intermediate_size, "int4_add_linear_glu") in asked
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_the_step_asks_each_projections_own_op_at_the_batchs_rows(monkeypatch):
    """``norm_gemm.applies(model, B)`` takes the fused step where every int4 projection's tile, for the op it runs
    as and at B rows, is an fma tile: w2 is asked as ``int4_add_linear_glu`` where SiLU-and-mul goes into its loads
    (``int4_glu``, K up to ``INT4_GLU_MAX_K``), else as ``int4_add_linear``; a tensor-core tile in any of them, at
    those rows, keeps the unfused step."""
    import fastdecode.models.norm_gemm as NG

    cfg, m = _tiny_int4_model()
    asked = []
    real = I.get_int4_config

    def spy(M, N, K, group_size, device=None, **kw):
        asked.append((M, N, K, kw["op"]))
        return real(M, N, K, group_size, device, **kw)

    monkeypatch.setattr(I, "get_int4_config", spy)
    D, F, L = cfg.dim, cfg.intermediate_size, cfg.n_layers
    for glu, B in ((True, 1), (True, 3), (False, 2)):
        m.set_kernels(int4_glu=glu)
        asked.clear()
        assert NG.applies(m, B)  # the heuristics give these small shapes fma tiles
        w2_op = "int4_add_linear_glu" if glu else "int4_add_linear"
        assert {(M, N, K, op) for M, N, K, op in asked if K == F} == {(B, D, F, w2_op)}
        assert {op for *_, op in asked} == {"int4_rms_norm_linear", "int4_add_linear", w2_op}
        assert {M for M, *_ in asked} == {B} and len(asked) == 4 * L
    m.set_kernels(int4_glu=True)
    for op in ("int4_add_linear_glu", "int4_rms_norm_linear"):
        def mma_for(M, N, K, group_size, device=None, _op=op, **kw):
            impl, c = real(M, N, K, group_size, device, **kw)
            return (impl, dict(c, kind="mma")) if kw["op"] == _op and M == 4 else (impl, c)

        monkeypatch.setattr(I, "get_int4_config", mma_for)
        assert NG.applies(m, 1) and not NG.applies(m, 4), op


def test_the_step_fuses_only_on_the_fused_ops_own_entries(monkeypatch, tmp_path):
    """Where the int4 table holds the projections' shapes, ``norm_gemm.applies(model, B)`` takes the fused step only
    where each fused op's entry at B rows is its own section's (a tile timed as the fused op): with the fused
    sections at one token only, 4 rows (whose nearest entry is the plain GEMV's M = 4 fma tile) keep the unfused
    step (session 35, H100: 928.4 against 797.2 us on the embedded SmolLM2); with M = 4 entries in every fused
    section, 4 rows fuse too. A shape the table does not hold keeps the heuristics' rule."""
    import json

    import fastdecode.models.norm_gemm as NG
    from fastdecode.ops._common import gpu_key

    cfg, m = _tiny_int4_model()
    fma = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 1}
    plain, fused = {}, {op: {} for op in I.FUSED_OPS}
    for layer in m.layers:
        for p, op in zip(NG._projections(layer), NG._ops(m, layer, 1)):
            key = I.table_key(p.out_features, p.in_features, p.group_size)
            plain[key] = {str(M): {"impl": "triton", "config": dict(fma, BLOCK_M=min(M, 4))} for M in (1, 2, 4, 8)}
            fused[op][key] = {"1": {"impl": "triton", "config": fma}}
    name = I.device_info(torch.device(DEV))[0]
    path = tmp_path / f"int4_linear_{gpu_key(name)}.json"
    monkeypatch.setenv("FASTDECODE_CONFIG_DIR", str(tmp_path))

    def write(table):
        path.write_text(json.dumps({"gpu": name, "int4_linear": plain, **table}))
        I.clear_config_cache()

    try:
        write(fused)
        assert NG.applies(m, 1) and not NG.applies(m, 4) and not NG.applies(m, 2)
        assert I.fused_entry_is_own(4, cfg.dim, cfg.dim, m.layers[0].attention.wo.group_size, DEV,
                                    op="int4_add_linear") is False
        write({op: {k: {**e, "4": e["1"]} for k, e in sec.items()} for op, sec in fused.items()})
        assert NG.applies(m, 1) and NG.applies(m, 4)
        write({})  # the shapes in the plain section only: no tile was timed as a fused op
        assert not NG.applies(m, 1)
        path.unlink()
        I.clear_config_cache()
        assert NG.applies(m, 4)  # no table: the heuristics' fma tiles, as before
        with pytest.raises(ValueError, match="op must be one of"):
            I.fused_entry_is_own(1, 64, 64, 32, DEV, op="int4_linear")
    finally:
        I.clear_config_cache()


def test_the_batch_rule_diagnosis_swaps_the_rule_and_restores_it(monkeypatch):
    """``benchmarks/diag_norm_gemm_batch_rule.py`` times the rule as shipped against the rule before session 34 (the
    tile at one token, w2 asked as ``int4_add_linear``): with a dot tile for w13 at 8 rows, the shipped rule keeps
    the unfused step at 8 rows and the old one the fused step; the shipped function is back afterwards."""
    from pathlib import Path

    import fastdecode.models.norm_gemm as NG

    diag = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "diag_norm_gemm_batch_rule.py",
                       "diag_norm_gemm_batch_rule")
    cfg, m = _tiny_int4_model()
    real = I.get_int4_config
    asked = []

    def dot_at_8(M, N, K, group_size, device=None, **kw):
        asked.append((M, kw["op"]))
        impl, c = real(M, N, K, group_size, device, **kw)
        return (impl, dict(c, kind="dot")) if M == 8 and N == 2 * cfg.intermediate_size else (impl, c)

    monkeypatch.setattr(I, "get_int4_config", dot_at_8)
    shipped = NG._supported
    assert NG.applies(m, 1) and not NG.applies(m, 8)
    with diag.batch_rule("one-token"):
        asked.clear()
        assert NG._supported is not shipped and NG.applies(m, 8)
        assert {M for M, _ in asked} == {1} and "int4_add_linear_glu" not in {op for _, op in asked}
    assert NG._supported is shipped and not NG.applies(m, 8)
    with diag.batch_rule("rows"):
        assert NG._supported is shipped
    with pytest.raises(ValueError, match="rule must be one of"):
        with diag.batch_rule("nope"):
            pass
