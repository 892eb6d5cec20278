"""The ``l2_prefetch`` switch: the decode attention kernel warms wo's weight in L2 (``fastdecode.kernels.prefetch``).
A hint: the step's numbers do not change. The kernel side: tests/test_attention.py (the op, its sm_90 PTX); the GPU
graph step with and without it: tests/test_engine_gpu.py."""

import copy

import pytest
import torch

import fastdecode.models.llama as L
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import random_model
from fastdecode.models.config import ModelConfig
from fastdecode.models.decode_attention import wo_prefetch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _model(fmt):
    from fastdecode.models.quantize import quantize_model

    cfg = ModelConfig.from_preset("tiny").replace(n_layers=2)
    m = random_model(cfg, device=DEV, dtype=torch.bfloat16, backend="triton", max_seq_len=64, std=0.08,
                     seed=int(torch.randint(0, 2**31, ())))
    return quantize_model(m, None if fmt == "bf16" else fmt)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_wo_prefetch_is_the_weight_bytes_whole_or_capped(fmt):
    wo = _model(fmt).layers[0].attention.wo
    w = wo.qweight if fmt == "int4" else wo.weight
    full = wo_prefetch(wo)
    assert full.dtype == torch.uint8 and full.data_ptr() == w.data_ptr()
    assert full.numel() == w.numel() * w.element_size()
    assert torch.equal(wo_prefetch(wo, 10**9), full)
    part = wo_prefetch(wo, 1000)
    assert part.data_ptr() == w.data_ptr() and part.numel() == 992  # rounded down to 16
    assert wo_prefetch(wo, 3).numel() == 16


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_switch_passes_wo_to_the_attention_and_changes_no_step(monkeypatch, fmt):
    """On (``set_kernels(l2_prefetch=True)``), every decode attention of the step gets its layer's wo bytes (capped by
    ``Attention.l2_prefetch_limit``), on the norm_gemm step and on the unfused one; off, none. Logits and caches
    equal the step without the switch exactly (the interpreter and CPUs ignore the hint; a GPU's graph step:
    tests/test_engine_gpu.py)."""
    import fastdecode.models.decode_attention as DA

    m = _model(fmt)
    plain = copy.deepcopy(m)
    seen = []
    real = DA.rope_decode_attention
    monkeypatch.setattr(DA, "rope_decode_attention",
                        lambda *a, prefetch=None, **kw: (seen.append(prefetch), real(*a, prefetch=prefetch, **kw))[1])
    cfg = m.config
    toks = torch.randint(0, cfg.vocab_size, (2, 7), device=DEV)
    caches = [KVCache(cfg, 2, 16, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    for c, model in zip(caches, (m, plain)):
        model.prefill(toks[:, :4], c)
    m.set_kernels(l2_prefetch=True)
    m.layers[1].attention.l2_prefetch_limit = 256
    for norm_gemm in (True, False):
        m.set_kernels(norm_gemm=norm_gemm)
        plain.set_kernels(norm_gemm=norm_gemm)
        for t in (4, 5):
            pos = torch.tensor([t, t - 2], device=DEV)
            seen.clear()
            got = m.decode(toks[:, t], pos, caches[0])
            assert [p.data_ptr() for p in seen] == [wo_prefetch(layer.attention.wo).data_ptr() for layer in m.layers]
            assert [p.numel() for p in seen] == [wo_prefetch(m.layers[0].attention.wo).numel(), 256]
            seen.clear()
            want = plain.decode(toks[:, t], pos, caches[1])
            assert seen == [None, None]
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            torch.testing.assert_close(caches[0].k, caches[1].k, atol=0, rtol=0)
    assert "l2_prefetch" in L.OPT_IN_KERNELS and not plain.kernels["l2_prefetch"]


def test_bench_rows_take_several_opt_in_switches():
    """``fastdecode-graph-with-<a>+<b>`` turns each on (the graph itself needs CUDA); ``weight_prefetch`` is the launch
    policy, captured into the graph; an unknown name is refused by name, by the runner and by the CLI."""
    from fastdecode.bench.decode import ABLATIONS, DecodeRunner, check_impl

    assert "fastdecode-graph-with-weight_prefetch" in ABLATIONS and "fastdecode-graph-with-l2_prefetch" in ABLATIONS
    assert check_impl("fastdecode-graph-no-weight_prefetch") in ABLATIONS  # the default rule's ablation
    assert check_impl("fastdecode-graph-with-int4_a8+l2_prefetch+weight_prefetch")
    for bad in ("fastdecode-graph-with-l2_prefetch+norm_gemm", "fastdecode-graph-with-l2_prefetch+l2_prefetch",
                "fastdecode-graph-with-", "graph"):
        with pytest.raises(ValueError, match="unknown decode row"):
            check_impl(bad)
    m = _model("int4")
    cache = KVCache(m.config, 1, 16, dtype=torch.bfloat16, device=DEV)
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            DecodeRunner("fastdecode-graph-with-int4_a8+l2_prefetch+weight_prefetch", m, cache, 1)
        assert m.kernels["int4_a8"] and m.kernels["l2_prefetch"]
    with pytest.raises(ValueError, match="unknown opt-in kernel switch 'norm_gemm'"):
        DecodeRunner("fastdecode-graph-with-l2_prefetch+norm_gemm", m, cache, 1)


def test_cli_takes_combined_rows_and_names_a_bad_one(capsys):
    import argparse

    from fastdecode.cli.bench import add_decode_arguments

    p = argparse.ArgumentParser()
    add_decode_arguments(p)
    a = p.parse_args(["--impl", "fastdecode-graph", "fastdecode-graph-with-l2_prefetch+weight_prefetch"])
    assert a.impl == ["fastdecode-graph", "fastdecode-graph-with-l2_prefetch+weight_prefetch"]
    with pytest.raises(SystemExit):
        p.parse_args(["--impl", "fastdecode-graph-with-bogus"])
    assert "unknown decode row 'fastdecode-graph-with-bogus'" in capsys.readouterr().err


def test_weight_prefetch_policy_needs_pdl_and_restores():
    """The GEMVs' weight-slab prefetch is set and restored like PDL, and never on where PDL is off (a CPU, the
    interpreter)."""
    from fastdecode.ops import set_weight_prefetch, weight_prefetch_enabled, weight_prefetch_override
    from fastdecode.ops._common import pdl_enabled

    x = torch.zeros(4, device=DEV)
    with weight_prefetch_override(False):
        assert not weight_prefetch_enabled(x)
    with weight_prefetch_override(True):
        assert weight_prefetch_enabled(x) == pdl_enabled(x)
        with weight_prefetch_override(False):
            assert not weight_prefetch_enabled(x)
        assert weight_prefetch_enabled(x) == pdl_enabled(x)
    assert set_weight_prefetch(None) is None
    assert not weight_prefetch_enabled(torch.zeros(4))  # a CPU tensor: no PDL


def test_weight_prefetch_bytes_cap(monkeypatch):
    """A program's slab prefetch: 0 where the policy is off, else ``FASTDECODE_WEIGHT_PREFETCH_KB`` (default 64 KB;
    "all": the whole slab; 0: none); a bad value is named."""
    import fastdecode.ops._common as C

    x = torch.zeros(4)
    monkeypatch.setattr(C, "weight_prefetch_enabled", lambda t, w=None: False)
    assert C.weight_prefetch_bytes(x) == 0
    monkeypatch.setattr(C, "weight_prefetch_enabled", lambda t, w=None: True)
    monkeypatch.delenv("FASTDECODE_WEIGHT_PREFETCH_KB", raising=False)
    assert C.weight_prefetch_bytes(x) == C.WEIGHT_PREFETCH_KB * 1024 == 65536
    for v, want in (("128", 131072), ("0.5", 512), ("ALL", 2**31 - 1), ("0", 0), ("0.001", 16)):
        monkeypatch.setenv("FASTDECODE_WEIGHT_PREFETCH_KB", v)
        assert C.weight_prefetch_bytes(x) == want
    monkeypatch.setenv("FASTDECODE_WEIGHT_PREFETCH_KB", "lots")
    with pytest.raises(ValueError, match="FASTDECODE_WEIGHT_PREFETCH_KB must be a number of KB or 'all'"):
        C.weight_prefetch_bytes(x)


def test_weight_prefetch_env_default(monkeypatch):
    from fastdecode.ops import weight_prefetch_enabled
    from fastdecode.ops._common import pdl_enabled

    x = torch.zeros(4, device=DEV)
    monkeypatch.delenv("FASTDECODE_WEIGHT_PREFETCH", raising=False)
    assert not weight_prefetch_enabled(x)
    monkeypatch.setenv("FASTDECODE_WEIGHT_PREFETCH", "1")
    assert weight_prefetch_enabled(x) == pdl_enabled(x)


# ----------------------------------------------------------------------------- on a GPU: every GEMV kind with the slabs


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the slab prefetch is inline PTX (sm_90+)")
@pytest.mark.parametrize("M", [1, 3, 16])
def test_gpu_every_gemv_kind_equals_itself_without_the_slabs(M):
    """The ``weight_prefetch`` policy on odd shapes (rows past N, K not a multiple of the tiles, split-K) through each
    GEMV op the decode step calls: bf16 ``linear``, FP8 ``linear_w8a16`` (up to 4 rows) and ``linear_fp8``, int4
    ``int4_linear`` (FMA at few rows, tensor-core kinds at 16) and ``int4_linear_a8`` (up to 4 rows). Each output
    equals the same call without the prefetch (a hint; a prefetch past a weight's end would fault)."""
    from fastdecode.ops import (
        int4_linear, int4_linear_a8, linear, linear_fp8, quantize_fp8, weight_prefetch_override,
    )
    from fastdecode.ops.w8a16 import linear_w8a16
    from fastdecode.quant.fp8 import quantize_weight_fp8
    from fastdecode.quant.int4 import quantize_int4

    N, K = 1000, 1536
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    w8, ws = quantize_weight_fp8(w)
    w4 = quantize_int4(w, 128)
    x_odd, w_odd = x[:, :1000].contiguous(), w[:, :1000].contiguous()  # K not a multiple of any tile
    calls = {"linear": lambda: linear(x, w), "linear_odd_k": lambda: linear(x_odd, w_odd),
             "linear_fp8": lambda: linear_fp8(*quantize_fp8(x, per_token=True), w8, ws),
             "int4_linear": lambda: int4_linear(x, w4)}
    if M <= 4:
        calls.update(linear_w8a16=lambda: linear_w8a16(x, w8, ws), int4_linear_a8=lambda: int4_linear_a8(x, w4))
    for name, call in calls.items():
        with weight_prefetch_override(False):
            want = call()
        with weight_prefetch_override(True):
            got = call()
        torch.cuda.synchronize()
        assert _rel(got, want) < 1e-3, (name, _rel(got, want))


def test_weight_prefetch_default_rule(monkeypatch):
    """Neither set nor in the environment, the slab prefetch runs only where it was measured to gain: one token, a
    bf16 / fp16 weight of at most ``WEIGHT_PREFETCH_AUTO_BYTES`` handed over by the skinny GEMM (the int4 kernels
    hand none over), with PDL. Set, or in the environment, it is every GEMV or none."""
    import fastdecode.ops._common as C

    monkeypatch.setattr(C, "pdl_enabled", lambda t: True)  # what an sm_90 GPU answers
    monkeypatch.delenv("FASTDECODE_WEIGHT_PREFETCH", raising=False)
    meta = dict(device="meta")
    x1, x2 = torch.empty(1, 1024, **meta), torch.empty(2, 1024, **meta)
    at_bound = torch.empty(C.WEIGHT_PREFETCH_AUTO_BYTES // 2048, 1024, dtype=torch.bfloat16, **meta)
    past = torch.empty(at_bound.shape[0] + 1, 1024, dtype=torch.bfloat16, **meta)
    small = {dt: torch.empty(960, 576, dtype=dt, **meta) for dt in (torch.bfloat16, torch.float16, torch.float32,
                                                                     torch.float8_e4m3fn, torch.int32, torch.uint8)}
    with C.weight_prefetch_override(None):
        assert C.weight_prefetch_enabled(x1, at_bound) and not C.weight_prefetch_enabled(x1, past)
        assert C.weight_prefetch_enabled(x1, small[torch.float16]) and not C.weight_prefetch_enabled(x2, at_bound)
        assert [dt for dt, w in small.items() if C.weight_prefetch_enabled(x1, w)] == [torch.bfloat16, torch.float16]
        assert not C.weight_prefetch_enabled(x1) and C.weight_prefetch_bytes(x1) == 0  # no weight handed over
        assert C.weight_prefetch_bytes(x1, at_bound) == C.WEIGHT_PREFETCH_KB * 1024
        monkeypatch.setenv("FASTDECODE_WEIGHT_PREFETCH", "1")
        assert C.weight_prefetch_enabled(x2, past) and C.weight_prefetch_enabled(x1)
        monkeypatch.setenv("FASTDECODE_WEIGHT_PREFETCH", "0")
        assert not C.weight_prefetch_enabled(x1, at_bound)
    with C.weight_prefetch_override(True):  # set: the environment is not read
        assert C.weight_prefetch_enabled(x2, past)
    monkeypatch.delenv("FASTDECODE_WEIGHT_PREFETCH")
    monkeypatch.setattr(C, "pdl_enabled", lambda t: False)
    with C.weight_prefetch_override(None):
        assert not C.weight_prefetch_enabled(x1, at_bound)
    with C.weight_prefetch_override(True):
        assert not C.weight_prefetch_enabled(x1, at_bound)


def test_skinny_gemm_hands_its_weight_to_the_prefetch_rule(monkeypatch):
    """``linear`` asks ``weight_prefetch_bytes`` with its weight, so the default rule can see it."""
    import fastdecode.ops.gemm as G

    seen = []
    monkeypatch.setattr(G, "weight_prefetch_bytes", lambda t, w=None: seen.append((t.shape, w)) or 0)
    x = torch.randn(1, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(48, 64, device=DEV, dtype=torch.bfloat16)
    out = G.linear(x, w, impl="triton")
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)
    assert len(seen) == 1 and seen[0][0] == (1, 64) and seen[0][1] is w
