"""FP8 W8A8 engine path on the CPU (torch backend = the references): the FP8 model against the fp32 model,
the ops path against the plain-PyTorch ``ref`` path, FP8 checkpoints with ``weight_scale`` tensors,
``fastdecode quantize`` round trips and refused formats."""

import collections
import contextlib
import copy
import json
import os

import pytest
import torch

from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.loader import CheckpointError, load, random_model
from fastdecode.models.config import ModelConfig
from fastdecode.models.llama import Fp8Linear
from fastdecode.models.quantize import FP8_FORMAT, INT4_FORMAT, quantize_model, quantize_model_fp8
from fastdecode.quant.fp8 import e4m3_step
from engine_helpers import prefill, rel_rms, save_hf_llama, save_tiny_smollm2_vocab, smollm2_path
from helpers import assert_close, assert_fp8_close, assert_rounding_equal, edit_json, interpreter_on

CFG = ModelConfig.from_preset("tiny")
# FP8 e4m3 has a 3-bit mantissa (rounding error up to 2^-4 relative per element, weights and activations);
# on the tiny random models (dim 64, 2 layers) the logits' relative RMS error against fp32 measured
# 0.090 +- 0.010 (max 0.122 over 200 seeds): 0.15 is 6 sigma
REL_LOGITS = 0.15


def test_fp8_model_close_to_fp32_and_ops_equal_ref():
    m = random_model(CFG, device="cpu", dtype=torch.float32, backend="torch", max_seq_len=64, std=0.08,
                     seed=int(torch.randint(0, 1000, ())))
    q = quantize_model_fp8(copy.deepcopy(m))
    assert all(isinstance(layer.attention.wqkv, Fp8Linear) and layer.attention.wqkv.weight.dtype == torch.float8_e4m3fn
               for layer in q.layers)
    assert type(q.output).__name__ == "Linear"  # the lm head stays in the model dtype
    assert q.layers[0].attention_norm.fp8_out and q.layers[0].feed_forward.fp8_act and not q.norm.fp8_out
    ids = torch.randint(0, CFG.vocab_size, (2, 13))
    ref, _ = prefill(m, ids)
    got, cache = prefill(q, ids)
    assert rel_rms(got, ref) < REL_LOGITS
    assert rel_rms(got, ref) > 1e-4  # it really is quantised
    # the registered ops (torch backend) against the plain-PyTorch references, same FP8 decisions
    q.backend = "ref"
    got_ref, cache_ref = prefill(q, ids)
    torch.testing.assert_close(got, got_ref, atol=1e-5, rtol=0)
    # decode == prefill of the longer sequence, FP8 on both. The two reach each per-token FP8 rounding
    # through different fp32 sums (decode attention vs SDPA), so an activation on a rounding boundary can
    # land one e4m3 step apart: 2 of 300 seeds, relative RMS error up to 2.3e-3 (an absolute 1e-4 bound
    # failed 1 seed in 300). Decoding one position off gives 0.15 to 0.32 (5 seeds).
    # The decode step runs W8A16 wqkv / wo / w2 (fp8_a16, on by default) and a prefill W8A8: the fp8_a16 copy
    # (W8A16 on every row) prefills as the steps decode, the model without the switch as its prefill.
    from fastdecode.engine.accuracy import fp8_a16_copy

    nxt = torch.randint(0, CFG.vocab_size, (2,))
    q.backend = "torch"
    longer = torch.cat([ids, nxt[:, None]], 1)
    a16 = fp8_a16_copy(q)
    step = q.decode(nxt, torch.tensor([13, 13]), prefill(a16, ids)[1])
    assert rel_rms(step, prefill(a16, longer)[0][:, -1]) < 2e-2
    q.set_kernels(fp8_a16=False)
    step = q.decode(nxt, torch.tensor([13, 13]), cache)
    assert rel_rms(step, prefill(q, longer)[0][:, -1]) < 2e-2


def test_fp8_kernel_switches_change_only_where_quantisation_happens():
    m = quantize_model_fp8(random_model(CFG, device="cpu", dtype=torch.float32, backend="torch", max_seq_len=64,
                                        std=0.08, seed=int(torch.randint(0, 1000, ()))))
    ids = torch.randint(0, CFG.vocab_size, (1, 9))
    fused, _ = prefill(m, ids)
    # unfused norm / activation: same maths, the per-token quantisation moves into Fp8Linear
    m.set_kernels(fused_norm=False, fused_act=False)
    assert not m.layers[0].attention_norm.fp8_out and not m.layers[0].feed_forward.fp8_act
    unfused, _ = prefill(m, ids)
    torch.testing.assert_close(unfused, fused, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="unknown kernel switch 'fused_attention'"):
        m.set_kernels(fused_attention=False)
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model_fp8(m)
    with pytest.raises(ValueError, match=r"already quantised \('fp8'\)"):
        quantize_model(copy.deepcopy(m), "int4")


def _fp8_decode_case(backend):
    """A random bf16 FP8 model of the tiny preset on ``backend`` (triton: CUDA on a GPU machine, else the
    interpreter's CPU tensors), two prompts of 7 tokens and one decode step's tokens and positions."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    m = quantize_model_fp8(random_model(CFG, device=dev, dtype=torch.bfloat16, backend=backend, max_seq_len=64,
                                        std=0.08, seed=int(torch.randint(0, 1000, ()))))
    ids = torch.randint(0, CFG.vocab_size, (2, 7), device=dev)
    return m, ids, torch.randint(0, CFG.vocab_size, (2,), device=dev), torch.tensor([7, 7], device=dev)


def _decode_and_ref(m, ids, nxt, pos, backend):
    """One decode step on ``backend`` and on the ``ref`` path, both from the same ``ref`` prefill's cache (two
    prefills' FP8 norms would flip apart): (step, ref)."""
    m.backend = "ref"
    ref_cache = prefill(m, ids)[1]
    own_cache = copy.deepcopy(ref_cache)
    ref = m.decode(nxt, pos, ref_cache)
    m.backend = backend
    return m.decode(nxt, pos, own_cache), ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_a16_switch_runs_wqkv_wo_and_w2_w8a16_at_decode(backend):
    """``fp8_a16`` (on by default): the FP8 wqkv, wo and w2 of up to 4 token rows take their 16-bit input as it is
    (W8A16, ``ops.w8a16``; the attention norm emits 16-bit rows, w2's loads compute SiLU-and-mul): no per-token
    quantisation before any of them; w13 keeps W8A8 with its norm's FP8 rows; prefills keep W8A8. Off, every
    projection is W8A8. The torch backend is the ``ref`` path; Triton (the interpreter on the CPU, CUDA on a GPU
    machine) sums in another order (bf16 rounding apart)."""
    from fastdecode.ops.w8a16 import DECODE_MAX_M

    m, ids, nxt, pos = _fp8_decode_case(backend)
    for layer in m.layers:  # on by default
        a, f = layer.attention, layer.feed_forward
        assert a.wqkv.a16_max_rows == a.wo.a16_max_rows == f.w2.a16_max_rows == DECODE_MAX_M
        assert layer.attention_norm.a16_rows == DECODE_MAX_M and "w8a16" in repr(a.wo)
        assert f.w13.a16_max_rows == layer.ffn_norm.a16_rows == 0 and layer.ffn_norm.fp8_out
    logits16, cache = prefill(m, ids)
    step16 = m.decode(nxt, pos, cache)
    m.set_kernels(fp8_a16=False)
    assert all(lin.a16_max_rows == 0 for layer in m.layers for lin in (layer.attention.wqkv, layer.attention.wo,
                                                                         layer.feed_forward.w2))
    assert all(layer.attention_norm.a16_rows == 0 for layer in m.layers)
    logits88, cache = prefill(m, ids)
    assert torch.equal(logits16, logits88)  # 14 token rows: W8A8 either way
    step88 = m.decode(nxt, pos, cache)
    assert 0 < rel_rms(step16, step88) < 0.2  # three FP8 activation roundings a layer fewer
    m.set_kernels(fp8_a16=True)
    step16, ref = _decode_and_ref(m, ids, nxt, pos, backend)
    if backend == "torch":
        torch.testing.assert_close(step16, ref, atol=0, rtol=0)
    else:
        # w13's FP8 norm rounds apart (see below: no whole-step bound tells recipes apart; the op itself is held to
        # its reference in tests/test_w8a16.py)
        assert rel_rms(step16, ref) < 0.2, rel_rms(step16, ref)
    m.set_kernels(fused_down=False)  # w2 then takes SiLU-and-mul's FP8 pair (W8A8); wqkv and wo stay W8A16
    assert m.layers[0].feed_forward.w2.a16_max_rows == DECODE_MAX_M
    assert 0 < rel_rms(m.decode(nxt, pos, prefill(m, ids)[1]), step16) < 0.2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_a16_all_switch_runs_every_projection_w8a16_at_decode(backend):
    """``fp8_a16_all`` (opt-in): ``fp8_a16``, and the FP8 w13 too, its norm emitting 16-bit rows at decode
    (``RMSNorm.a16_rows``); prefill keeps W8A8 with FP8 norms. No activation is rounded to FP8 at decode: the torch
    backend's step equals the ``ref`` path's, and Triton's is within bf16 roundings of it."""
    from fastdecode.ops.w8a16 import DECODE_MAX_M

    m, ids, nxt, pos = _fp8_decode_case(backend)
    logits88, cache = prefill(m, ids)
    step_default = m.decode(nxt, pos, cache)
    m.set_kernels(fp8_a16=False, fp8_a16_all=True)  # fp8_a16_all alone: every projection
    for layer in m.layers:
        lins = (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
        assert all(lin.a16_max_rows == DECODE_MAX_M for lin in lins)
        assert layer.attention_norm.a16_rows == layer.ffn_norm.a16_rows == DECODE_MAX_M
    assert m.norm.a16_rows == 0  # the head's norm: untouched (a dense head here)
    logits16, cache = prefill(m, ids)
    assert torch.equal(logits16, logits88)  # 14 token rows: W8A8, FP8 norms
    step16 = m.decode(nxt, pos, cache)
    assert 0 < rel_rms(step16, step_default) < 0.2
    step16, ref = _decode_and_ref(m, ids, nxt, pos, backend)
    if backend == "torch":
        torch.testing.assert_close(step16, ref, atol=0, rtol=0)
    else:  # bf16 roundings apart only (the interpreter's truncating casts among them): no FP8 rounding to flip;
        # 0.0096-0.019 over 11 seeds under the interpreter (session 24)
        assert rel_rms(step16, ref) < 0.04, rel_rms(step16, ref)
    m.set_kernels(fp8_a16_all=False)
    assert all(layer.attention.wqkv.a16_max_rows == layer.attention_norm.a16_rows == 0 for layer in m.layers)
    assert all(layer.attention.wo.a16_max_rows == 0 for layer in m.layers)
    m.set_kernels(fp8_a16=True)  # back to the default: w13 W8A8 again
    assert all(layer.feed_forward.w13.a16_max_rows == layer.ffn_norm.a16_rows == 0 for layer in m.layers)


# ----------------------------------------------------------------------------- same FP8 decisions, op by op

# Why the Triton path is held to the references op by op, on the kernels' own inputs, rather than through the
# logits of a whole step: each per-token FP8 rounding (four per layer: attention norm, attention output, FFN
# norm, SiLU-and-mul) turns a relative difference d of its input into about sqrt(d * step) after it (a value
# crosses a rounding boundary with probability ~d / step, then moves a whole e4m3 step of 2^-4..2^-3), so the
# ulp-level differences no two implementations avoid (fp32 summation order, cuBLAS against Triton, tl.rsqrt,
# bf16 P in the attention dot) reach the size of the FP8 noise itself within a layer or two. Measured on the
# CPU (torch backend with one change at a time, 2 layers of Llama-3.1-8B shapes, bf16, decode logits against
# the unchanged step, seeds 11/22/33 x 2 rows): every FP8 GEMM output times (1 + 1e-7 N(0, 1)) before its bf16
# rounding gives cosine 0.9982-0.9993; each recipe variant (amax over the bf16-rounded norm output, the norm
# output rounded to bf16 before the cast, scale amax * (1/448), an fp32 residual into the norm, SiLU rounded to
# bf16, GEMM scales applied in two roundings, P rounded to bf16 in attention, Hopper's FP8 MMA accumulation in
# w2) gives 0.9926-0.9993; a real bug (wo's input left unquantised) gives 0.9948-0.9958: all in one band, the
# H200's 0.9956 / 0.9960 too. A whole-step bound cannot tell a recipe difference from summation order; the
# comparison op by op can, and it is exact where the two must agree (scales, residuals).
#: GEMM outputs against their reference: relative RMS error within one unit roundoff of the output dtype
GEMM_REL_RMS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 1e-5}


@contextlib.contextmanager
def shadowed_by_refs():
    """While active, every fastdecode op the model calls (its names in ``fastdecode.models.llama``, ``.rmsnorm`` and
    ``.decode_attention``) also runs
    its ``*_ref`` on the same inputs (copies of those it updates in place), and the two results are compared at
    once: FP8 pairs with ``assert_fp8_close`` (scales to rtol 1e-5, values within one e4m3 step) and no value
    moved unless it sits at a rounding boundary (see ``fp8``), in-place residuals with ``assert_rounding_equal``,
    GEMM outputs by relative RMS error (``GEMM_REL_RMS``), other float outputs and KV-cache writes with
    ``assert_close``. The model sees only the kernels' results, so each check starts from the Triton path's own
    activations and nothing compounds. Yields a Counter of the checked calls per op name."""
    import fastdecode.models.decode_attention as A
    import fastdecode.models.llama as L
    import fastdecode.models.rmsnorm as N
    from fastdecode.ops import activation as act, attention as att, gemm, norm, quant

    def fp8(got, want, y64):
        """``y64``: the op's unrounded output in float64 from the same inputs, or None."""
        assert_fp8_close(got[0], want[0], got[1], want[1])
        # Tighter than assert_fp8_close's 5%. A value moves by one step only when its quotient y / s lies within
        # the fp32 noise of the two paths (summation order, tl.rsqrt, div.full: each ~1e-7 relative) of an e4m3
        # rounding boundary; those are not counted. With a dynamic scale and a norm weight of 1 the quotient is
        # 448 v / amax(v) for bf16 v (rstd cancels), an exact boundary on ~0.4% of values, which fp32 noise then
        # decides either way: what the H200 showed (0.13%-0.5% moved, against ~1e-5 elsewhere). The window is
        # 1e-5 relative, ~50x that noise; an input rounded to bf16 on one side (~3% moved) or fp16 (~0.8%) stays
        # far outside it. The interpreter's own cast drops carries into the next power of two, rounds subnormals
        # its own way and rounds exact ties to odd, not to even: there those are not counted either.
        a, b = got[0].float(), want[0].float()
        moved = a != b
        mid = (a.double() + b.double()) / 2
        near_boundary = (y64 / want[1].double() - mid).abs() <= 1e-5 * mid.abs()
        explained = moved & near_boundary
        if interpreter_on():
            lost_carry = (torch.log2(a.abs()) % 1 == 0) & ((2 * a - b).abs() <= e4m3_step(b) * 1.0001)
            tie = (got[0].view(torch.uint8) & 1 == 1) & (want[0].view(torch.uint8) & 1 == 0)
            explained |= moved & (lost_carry | tie | (a.abs() < 2**-6) | (b.abs() < 2**-6))
        unexplained = int((moved & ~explained).sum())
        limit = max(2, a.numel() // 10000)
        assert unexplained <= limit, (
            f"{unexplained} of {a.numel()} FP8 values moved away from a rounding boundary (at most {limit}; "
            f"{int(explained.sum())} more moved at a boundary)")

    def norm64(v, w, eps):
        v = v.double()
        return v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps) * w.double()

    def silu64(x):
        g, u = x.double().chunk(2, dim=-1)
        return g / (1.0 + torch.exp(-g)) * u

    def add_norm(ref, is_fp8):
        def check(got, args, saved, kw):
            *want, r = ref(args[0], saved[1], *args[2:], **kw)
            assert_rounding_equal(args[1], r)  # the residual updated in place
            if is_fp8:
                fp8(got, want, norm64(r, args[2], args[3] if len(args) > 3 else kw.get("eps", 1e-6)))
            else:
                assert_close(got, want[0])
        return check

    def plain(ref, y64=None):
        def check(got, args, saved, kw):
            want = ref(*args, **kw)
            fp8(got, want, y64(*args, **kw)) if y64 else assert_close(got, want)
        return check

    def gemm_check(ref):
        # GEMM_REL_RMS: summation order stays far below it; so should Hopper's FP8 MMA accumulation (Triton's
        # fp8 tl.dot; emulated with a 13-bit truncating accumulator on w2's shape: 2.3e-3, where 49% of the bf16
        # outputs round differently, up to 9e-3 of the output RMS, which an elementwise bf16 tolerance of
        # 8e-3 + 8e-3 |y| does not allow for small |y|)
        def check(got, args, saved, kw):
            want = ref(*args, **kw)
            err = rel_rms(got, want)
            assert err <= GEMM_REL_RMS[want.dtype], f"relative RMS error {err:.2e}"
        return check

    def rope(got, args, saved, kw):
        k, v = saved[3], saved[4]
        assert_close(got, att.rope_kv_write_ref(*args[:3], k, v, *args[5:]))
        assert_close(args[3], k)
        assert_close(args[4], v)

    def rope_attention(got, args, saved, kw):
        k, v = saved[3], saved[4]
        kw = {n: x for n, x in kw.items() if n != "prefetch"}  # an L2 hint (l2_prefetch): the reference has none
        assert_close(got, att.rope_decode_attention_ref(*args[:3], k, v, *args[5:], **kw))
        assert_close(args[3], k)
        assert_close(args[4], v)

    checks = {  # name -> (check, positions of the arguments the op updates in place)
        "rms_norm": (plain(norm.rms_norm_ref), ()),
        "rms_norm_fp8": (plain(norm.rms_norm_fp8_ref, lambda x, w, eps=1e-6, **_: norm64(x, w, eps)), ()),
        "fused_add_rms_norm": (add_norm(norm.fused_add_rms_norm_ref, False), (1,)),
        "fused_add_rms_norm_fp8": (add_norm(norm.fused_add_rms_norm_fp8_ref, True), (1,)),
        "silu_and_mul": (plain(act.silu_and_mul_ref), ()),
        "silu_and_mul_fp8": (plain(act.silu_and_mul_fp8_ref, lambda x, **_: silu64(x)), ()),
        "quantize_fp8": (plain(quant.quantize_fp8_ref, lambda x, **_: x.double()), ()),
        "linear_fp8": (gemm_check(gemm.linear_fp8_ref), ()),
        "linear": (gemm_check(gemm.linear_ref), ()),
        "rope_kv_write": (rope, (3, 4)),
        "decode_attention": (plain(att.decode_attention_ref), ()),
        "rope_decode_attention": (rope_attention, (3, 4)),
    }
    counts = collections.Counter()

    def shadow(name, op, check, updated):
        def run(*args, **kw):
            saved = {i: args[i].clone() for i in updated}
            got = op(*args, **kw)
            ref_kw = {k: v for k, v in kw.items() if k not in ("backend", "impl")}
            try:
                check(got, args, saved, ref_kw)
            except AssertionError as e:
                raise AssertionError(f"{name} (call {counts[name] + 1}) differs from its reference: {e}") from e
            counts[name] += 1
            return got
        return run

    with pytest.MonkeyPatch.context() as mp:
        for name, (check, updated) in checks.items():
            # the decode attention's ops are called from models/decode_attention, the norms' from models/rmsnorm
            mod = next(m for m in (A, N, L) if hasattr(m, name))
            mp.setattr(mod, name, shadow(name, getattr(mod, name), check, updated))
        yield counts


def _assert_every_fp8_site_checked(counts, n_layers, fp8_linears_per_layer=4):
    """Prefill + one decode step: each FP8 quantisation site and projection seen twice per layer."""
    assert counts["rms_norm_fp8"] == 2  # layer 0's attention norm (no residual yet)
    assert counts["fused_add_rms_norm_fp8"] == 2 * (2 * n_layers - 1)
    assert counts["silu_and_mul_fp8"] == counts["quantize_fp8"] == 2 * n_layers
    assert counts["linear_fp8"] == 2 * fp8_linears_per_layer * n_layers
    # decode only (prefill: SDPA); RoPE + KV write inside the attention kernel (fused_rope, the default)
    assert counts["rope_decode_attention"] == n_layers
    assert counts["rope_kv_write"] == counts["decode_attention"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_triton_vs_torch_cos_0996_regression_same_decisions_op_by_op(dtype):
    """Regression for test_fp8_llama8b_shapes_triton_graph_equals_torch_gpu (logits' cosine 0.9956 / 0.9960 on
    the H200 against a bound of 0.999): the Triton path makes the references' FP8 decisions at every site of a
    prefill and a decode step, checked op by op on the kernels' own inputs (the interpreter here: fp16 / fp32,
    since its bf16 dots are wrong). The whole step's logits are not the place for a tight bound (see above)."""
    if not interpreter_on():
        pytest.skip("the Triton interpreter (CPU); on a GPU test_fp8_llama8b_shapes_triton_graph_equals_torch_gpu "
                    "runs the same check at 8B shapes")
    cfg = CFG.replace(dim=128, n_heads=8, n_kv_heads=2, head_dim=16, intermediate_size=352)
    m = quantize_model_fp8(random_model(cfg, device="cpu", dtype=dtype, backend="triton", max_seq_len=64,
                                        std=0.05, seed=int(torch.randint(0, 1000, ()))))
    for norm in [m.norm] + [n for layer in m.layers for n in (layer.attention_norm, layer.ffn_norm)]:
        norm.weight.copy_(1 + 0.1 * torch.randn(cfg.dim))  # random_model's are all 1: the weight would go unchecked
    ids = torch.randint(0, cfg.vocab_size, (3, 7))  # 3 rows: the GEMMs take the dot path (the interpreter's fast one)
    cache = KVCache(cfg, 3, 64, dtype=dtype)
    m.set_kernels(fp8_a16=False)  # every FP8 site of W8A8 at decode too (fp8_a16's W8A16: tests/test_w8a16.py)
    with shadowed_by_refs() as counts:
        m.prefill(ids, cache)
        m.decode(torch.randint(0, cfg.vocab_size, (3,)), torch.tensor([7, 3, 6]), cache)  # ragged lengths
    _assert_every_fp8_site_checked(counts, cfg.n_layers)
    assert counts["fused_add_rms_norm"] == 1 and counts["rms_norm"] == 1  # the final norm: decode, prefill


# ----------------------------------------------------------------------------- checkpoints

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _hf_dir(tmp_path, name="src", **config):
    return save_hf_llama(tmp_path / name, **config)


def _fp8_public_layout(src, dst):
    """Rewrite ``src`` as a compressed-tensors / FBGEMM-style FP8 checkpoint: projections float8_e4m3fn with
    ``weight_scale`` (per channel (N, 1) for most, per tensor () for k_proj / o_proj), plus static
    ``input_scale`` tensors the engine ignores; layer 1's MLP stays in full precision."""
    os.makedirs(dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out, expect = {}, {}
    for k, v in sd.items():
        if k.endswith("_proj.weight") and not k.startswith("model.layers.1.mlp."):
            per_tensor = ".k_proj." in k or ".o_proj." in k
            amax = v.abs().amax() if per_tensor else v.abs().amax(dim=1, keepdim=True)
            s = (amax / 448.0).float()
            qv = (v / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[k], out[k + "_scale"] = qv, (s.reshape(()) if per_tensor else s)
            out[k.replace(".weight", ".input_scale")] = torch.tensor(0.01)
            expect[k] = qv.float() * s
        else:  # kept unquantised, like FBGEMM's modules_to_not_convert: quantised at load
            out[k] = v
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return expect


def test_public_fp8_checkpoint_with_weight_scale(tmp_path):
    src = _hf_dir(tmp_path)
    dst = str(tmp_path / "fp8")
    expect = _fp8_public_layout(src, dst)
    loaded = load(dst, dtype=torch.float32, progress=False, max_seq_len=64)
    m = loaded.model
    assert m.quant == "fp8"
    # the stored FP8 bits and scales, q | k | v concatenated with per-tensor k scales expanded per channel
    wqkv = m.layers[1].attention.wqkv
    deq = wqkv.weight.float() * wqkv.weight_scale[:, None]
    want = torch.cat([expect[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(deq, want, atol=0, rtol=0)
    wo = m.layers[0].attention.wo
    assert torch.unique(wo.weight_scale).numel() == 1  # per tensor, expanded
    # layer 1's MLP was stored unquantised: quantised per channel at load, like quantize_model_fp8
    from fastdecode.quant.fp8 import quantize_weight_fp8

    w2 = load_file(os.path.join(src, "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    q2, s2 = quantize_weight_fp8(w2, "channel")
    assert torch.equal(m.layers[1].feed_forward.w2.weight.view(torch.uint8), q2.view(torch.uint8))
    torch.testing.assert_close(m.layers[1].feed_forward.w2.weight_scale, s2.reshape(-1), atol=0, rtol=0)
    # close to the original bf16/fp32 model
    ref = load(src, dtype=torch.float32, progress=False, max_seq_len=64).model
    ids = torch.randint(0, 300, (2, 10))
    assert rel_rms(prefill(m, ids)[0], prefill(ref, ids)[0]) < REL_LOGITS


def test_block_wise_fp8_checkpoint_is_refused(tmp_path):
    src = _hf_dir(tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(sd, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match="block-wise FP8 scales"):
        load(src, dtype=torch.float32, progress=False)


def test_fp8_checkpoint_with_wrong_dtype_is_named(tmp_path):
    src = _hf_dir(tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        sd[k + "_scale"] = torch.ones(sd[k].shape[0], 1)  # scales, but the weights are still fp32
    save_file(sd, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight' is torch.float32, but the checkpoint has "
                                              r"'model.layers.0.self_attn.q_proj.weight_scale': expected float8"):
        load(src, dtype=torch.float32, progress=False)


def test_fp8_tensor_without_scale_is_named(tmp_path):
    """Regression: an FP8 weight without weight_scale (and no quantization_config) was cast to the model dtype,
    i.e. loaded without its scale: a silently wrong model."""
    src = _hf_dir(tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name] = (sd[name] / 0.01).to(torch.float8_e4m3fn)
    save_file(sd, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored as torch.float8_e4m3fn without a scale "
                                              rf"\('{name}_scale' is missing\)"):
        load(src, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("with_config", [True, False])
def test_compressed_tensors_int4_checkpoint_is_refused_by_name(tmp_path, with_config):
    """Regression: weight_packed + weight_scale (compressed-tensors pack-quantized int4) was taken for FP8."""
    src = _hf_dir(tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd.pop(k)
        base = k[: -len(".weight")]
        sd[base + ".weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
        sd[base + ".weight_scale"] = torch.ones(w.shape[0], w.shape[1] // 32, dtype=torch.bfloat16)
        sd[base + ".weight_shape"] = torch.tensor(list(w.shape))
    save_file(sd, os.path.join(src, "model.safetensors"))
    if with_config:
        edit_json(os.path.join(src, "config.json"), lambda c: c.update(quantization_config={
            "quant_method": "compressed-tensors", "format": "pack-quantized"}))
    with pytest.raises(CheckpointError, match=r"compressed-tensors 'pack-quantized' checkpoint \(int4/int8 weights "
                                              r"packed into int32 \(weight_packed\).*is not supported"):
        load(src, dtype=torch.float32, progress=False)


def test_quantize_command_round_trip_and_refusals(tmp_path):
    from fastdecode.cli import main

    src = _hf_dir(tmp_path)
    dst = str(tmp_path / "q")
    assert main(["quantize", src, dst, "--method", "fp8", "--dtype", "float32"]) == 0
    with open(os.path.join(dst, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fastdecode" and qc["format"] == FP8_FORMAT
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        assert f.metadata()["fastdecode_format"] == FP8_FORMAT
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").shape == (64, 1)
    # loading the written checkpoint == quantising at load: same FP8 bits, same logits
    a = load(dst, dtype=torch.float32, progress=False, max_seq_len=64).model
    b = load(src, dtype=torch.float32, progress=False, max_seq_len=64, quant="fp8").model
    assert a.quant == b.quant == "fp8"
    assert torch.equal(a.layers[1].feed_forward.w13.weight.view(torch.uint8),
                       b.layers[1].feed_forward.w13.weight.view(torch.uint8))
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(prefill(a, ids)[0], prefill(b, ids)[0], atol=0, rtol=0)
    # the recorded format refuses other kernels, and formats this version does not know
    with pytest.raises(CheckpointError, match="quantised as fp8-w8a8-channel; it cannot be loaded with quant='int4'"):
        load(dst, dtype=torch.float32, progress=False, quant="int4")
    edit_json(os.path.join(dst, "config.json"), lambda c: c["quantization_config"].update(format="int4-g128-awq-v9"))
    with pytest.raises(CheckpointError, match="format 'int4-g128-awq-v9', which this version cannot run"):
        load(dst, dtype=torch.float32, progress=False)


# ----------------------------------------------------------------------------- the embedded SmolLM2


@pytest.fixture(scope="module")
def smollm2_text_ids():
    smollm2_path()
    from fastdecode.engine.accuracy import accuracy_text

    ref = load(None, dtype=torch.float32, progress=False, max_seq_len=256)
    return ref, ref.tokenizer.encode(accuracy_text())


def test_smollm2_fp8_top1_agreement_and_quantize_round_trip(smollm2_text_ids, tmp_path):
    from fastdecode.engine.accuracy import compare
    from fastdecode.engine.export import save_checkpoint
    from fastdecode.engine.generate import Engine

    ref, ids = smollm2_text_ids
    q = load(None, dtype=torch.float32, progress=False, max_seq_len=256, quant="fp8")
    start = int(torch.randint(0, len(ids) - 130, ()))
    rows = {r["format"]: r for r in compare(ref.model, {"fp8": q.model}, ids[start:start + 128], window=128)}
    # measured on the whole text (1540 tokens): 0.91 agreement, perplexity +1.9%, KL 0.022 (docs/engine.md). Over
    # the 59 slices starting every 24 tokens (session 48, CPU): agreement 0.819 at the lowest, perplexity ratio
    # 1.017 median and 1.088 at the highest, KL 0.040 at most; the CPU CI's random slice at seed 858525917 gave
    # 1.103 (the bound was 1.1, agreement 0.82). A wrong FP8 path gives agreement far below one half
    assert rows["fp8"]["top1_agreement"] >= 0.78
    assert rows["fp8"]["perplexity"] < rows["reference"]["perplexity"] * 1.15
    assert rows["fp8"]["mean_kl"] < 0.1
    # written and read back: the same model (tokenizer included), the same greedy tokens
    d = str(tmp_path / "smol-fp8")
    save_checkpoint(q.model, q.tokenizer, d, FP8_FORMAT)
    back = load(d, dtype=torch.float32, progress=False, max_seq_len=256)
    text = "The lighthouse keeper wrote"
    assert back.tokenizer.encode(text) == q.tokenizer.encode(text)
    outs = [Engine(m.model, m.tokenizer, max_seq_len=64).generate(text, max_new_tokens=6, ignore_eos=True)[0].tokens
            for m in (q, back)]
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_eval_accuracy_command_on_tiny_model(tmp_path):
    """Rows per format; the reference perplexity recomputed by hand from the model's own logits."""
    from fastdecode.engine.accuracy import accuracy_text
    from fastdecode.cli import main

    d, tok = save_tiny_smollm2_vocab(tmp_path / "m")
    out = str(tmp_path / "acc.json")
    assert main(["eval-accuracy", "--model", d, "--device", "cpu", "--max-tokens", "40", "--window", "24",
                 "--quant", "fp8", "int4", "--fp8-a16", "--fp8-a16-all", "--out", out]) == 0
    with open(out) as f:
        rows = {r["format"]: r for r in json.load(f)}
    assert set(rows) == {"reference", FP8_FORMAT, FP8_FORMAT + "+a16", FP8_FORMAT + "+a16all", INT4_FORMAT}
    # W8A16 wo and w2 (their activations unquantised): another function, and not a worse one on this model; every
    # projection W8A16: no activation rounded to FP8 at all, closer still
    a16, a16all = rows[FP8_FORMAT + "+a16"], rows[FP8_FORMAT + "+a16all"]
    assert a16["mean_kl"] != rows[FP8_FORMAT]["mean_kl"] and a16["mean_kl"] < 2 * rows[FP8_FORMAT]["mean_kl"]
    assert a16all["mean_kl"] not in (a16["mean_kl"], rows[FP8_FORMAT]["mean_kl"])
    assert a16all["mean_kl"] < 2 * a16["mean_kl"]
    ref = rows["reference"]
    assert ref["top1_agreement"] == 1.0 and ref["mean_kl"] == 0.0 and ref["tokens"] == 23 + 15
    for fmt in (FP8_FORMAT, INT4_FORMAT):
        assert 0.0 <= rows[fmt]["top1_agreement"] <= 1.0 and rows[fmt]["mean_kl"] > 0
    m = load(d, dtype=torch.float32, progress=False, max_seq_len=64).model
    ids = tok.encode(accuracy_text())[:40]
    nll = 0.0
    for w in (ids[:24], ids[24:]):
        lp = torch.log_softmax(prefill(m, torch.tensor([w]))[0][0], -1)
        nll -= lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum().item()
    assert ref["perplexity"] == pytest.approx(float(torch.tensor(nll / 38).exp()), rel=1e-4)


def test_eval_accuracy_reference_is_not_loaded_as_native_int4(monkeypatch):
    """Regression: on CUDA a GGUF loads its Q4_0 / Q4_1 tensors as int4 by default (gguf_native=None), so the
    reference of eval-accuracy was the int4 model; it must ask for the dequantised weights explicitly."""
    from fastdecode.engine import accuracy, loader

    calls = []

    class Stop(Exception):
        pass

    def fake_load(path, **kw):
        calls.append(kw)
        raise Stop

    monkeypatch.setattr(loader, "load", fake_load)
    with pytest.raises(Stop):
        accuracy.eval_accuracy("model.gguf", ["int4"], device="cpu")
    assert calls[0].get("quant") is None and calls[0].get("gguf_native") is False


def test_bench_decode_quant_fp8_ablation_rows_cpu(tmp_path, capsys):
    from fastdecode.cli import main

    out = str(tmp_path / "d.json")
    assert main(["bench", "decode", "--preset", "tiny", "--quant", "fp8", "--output-len", "3", "--iters", "2",
                 "--warmup", "1", "--ablate", "--dtype", "float32", "--out", out,
                 "--device", "cpu"]) == 0  # the CPU rows, also on a GPU machine
    with open(out) as f:
        rows = {r["impl"]: r for r in json.load(f)}
    assert rows["torch-eager"]["shape"]["quant"] == "fp8" and rows["torch-eager"]["tokens_per_s"] > 0
    # embedding + lm head + norms in fp32; per layer 1-byte projections + one fp32 scale per output channel
    per_layer = (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 4 * (128 + 64 + 256 + 64) + 2 * 64 * 4
    # batch 1: the lm head whole, one row of the embedding
    assert rows["torch-eager"]["step_weight_bytes"] == (256 + 1) * 64 * 4 + 64 * 4 + 2 * per_layer
    err = capsys.readouterr().err  # skipped rows are reported, not written into the results file
    for k in ("fused_norm", "fused_act", "skinny_gemm", "fused_allreduce"):
        assert f"fastdecode-graph-no-{k}: skipped (needs CUDA)" in err and f"fastdecode-graph-no-{k}" not in rows
    assert "fastdecode-eager: skipped (needs CUDA)" in err and "fastdecode-eager" not in rows


# Whole-step bound of the Triton logits against the torch backend's (see "same FP8 decisions, op by op"): the
# differences every FP8 implementation pair has saturate at cosine 0.9926-0.9993 (CPU emulation, 2 layers of 8B
# shapes; 0.9969-0.9979 over 8 seeds with this GPU path's own differences emulated: bf16 P in attention, Hopper
# FP8 MMA accumulation in w2, fp32 summation order) and 0.9956 / 0.9960 on the H200; 0.98 allows 2.7x the
# largest measured 1 - cos. It catches gross breakage (a layer skipped, wrong positions) only: the tight test is
# the op-by-op one beside it.
WHOLE_STEP_COS = 0.98


@pytest.mark.gpu
def test_fp8_llama8b_shapes_triton_graph_equals_torch_gpu():
    """GPU: the FP8 prefill + decode step with fastdecode's kernels, 2 layers of Llama-3.1-8B shapes: every op
    against its reference on the same inputs (the FP8 decisions of each site), the whole step against the torch
    backend within WHOLE_STEP_COS, and CUDA-graph replay against eager."""
    from fastdecode.engine.cuda_graph import DecodeGraphRunner

    cfg = ModelConfig.from_preset("llama-3.1-8b").replace(n_layers=2)
    m = quantize_model_fp8(random_model(cfg, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                        seed=int(torch.randint(0, 1000, ()))))
    for norm in [m.norm] + [n for layer in m.layers for n in (layer.attention_norm, layer.ffn_norm)]:
        norm.weight.copy_(1 + 0.1 * torch.randn(cfg.dim))  # random_model's are all 1: the weight would go unchecked
    ids = torch.randint(0, cfg.vocab_size, (2, 9), device="cuda")
    nxt = torch.randint(0, cfg.vocab_size, (2,), device="cuda")
    pos = torch.tensor([9, 9], device="cuda")
    m.backend = "triton"
    cache = KVCache(m.config, 2, 128, dtype=torch.bfloat16, device="cuda")
    m.set_kernels(fp8_a16=False)  # every FP8 site of W8A8 at decode too (fp8_a16's W8A16: tests/test_w8a16.py)
    with shadowed_by_refs() as counts:
        m.prefill(ids, cache)
        m.decode(nxt, pos, cache)
    _assert_every_fp8_site_checked(counts, cfg.n_layers)
    assert counts["linear"] == 2  # the bf16 lm head: prefill, decode
    m.set_kernels(fp8_a16=True)  # the default decode step (W8A16 wqkv, wo, w2) from here on
    out = {}
    for be in ("torch", "triton"):
        m.backend = be
        cache = KVCache(m.config, 2, 128, dtype=torch.bfloat16, device="cuda")
        m.prefill(ids, cache)
        out[be] = m.decode(nxt, pos, cache)
    cos = torch.nn.functional.cosine_similarity(out["triton"], out["torch"], dim=-1)
    assert cos.min().item() > WHOLE_STEP_COS
    cache = KVCache(m.config, 2, 128, dtype=torch.bfloat16, device="cuda")
    m.prefill(ids, cache)
    g = DecodeGraphRunner(m, cache, buckets=[2])
    g.capture()
    m.prefill(ids, cache)  # capture warm-up wrote position 0
    # the same kernels on the same inputs: equal unless cuBLAS picks another algorithm under capture, which the
    # FP8 roundings would then amplify as above
    torch.testing.assert_close(g.run(nxt, pos), out["triton"], atol=1e-2, rtol=0)
