"""FP8 W8A8 engine path on the CPU (torch backend = the references): the FP8 model against the fp32 model,
the ops path against the plain-PyTorch ``ref`` path, FP8 checkpoints with ``weight_scale`` tensors,
``fastdecode quantize`` round trips and refused formats."""

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
from engine_helpers import prefill, rel_rms, save_hf_llama, save_tiny_smollm2_vocab, smollm2_path
from helpers import edit_json

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
    nxt = torch.randint(0, CFG.vocab_size, (2,))
    q.backend = "torch"
    step = q.decode(nxt, torch.tensor([13, 13]), cache)
    full, _ = prefill(q, torch.cat([ids, nxt[:, None]], 1))
    assert rel_rms(step, full[:, -1]) < 2e-2


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
    with pytest.raises(ValueError, match="unknown kernel switch 'fused_rope'"):
        m.set_kernels(fused_rope=False)
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model_fp8(m)
    with pytest.raises(ValueError, match=r"already quantised \('fp8'\)"):
        quantize_model(copy.deepcopy(m), "int4")


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
    from fastdecode.engine.cli import main

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
    # measured on the whole text (1540 tokens): 0.91 agreement, perplexity +1.9%, KL 0.022 (docs/engine.md);
    # a 127-token slice: binomial spread ~0.025
    assert rows["fp8"]["top1_agreement"] >= 0.82
    assert rows["fp8"]["perplexity"] < rows["reference"]["perplexity"] * 1.1
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
    from fastdecode.engine.cli import main

    d, tok = save_tiny_smollm2_vocab(tmp_path / "m")
    out = str(tmp_path / "acc.json")
    assert main(["eval-accuracy", "--model", d, "--device", "cpu", "--max-tokens", "40", "--window", "24",
                 "--quant", "fp8", "int4", "--out", out]) == 0
    with open(out) as f:
        rows = {r["format"]: r for r in json.load(f)}
    assert set(rows) == {"reference", FP8_FORMAT, INT4_FORMAT}
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
    from fastdecode.engine.cli import main

    out = str(tmp_path / "d.json")
    assert main(["bench", "decode", "--preset", "tiny", "--quant", "fp8", "--output-len", "3", "--iters", "2",
                 "--warmup", "1", "--ablate", "--dtype", "float32", "--out", out]) == 0
    with open(out) as f:
        rows = {r["impl"]: r for r in json.load(f)}
    assert rows["torch-eager"]["shape"]["quant"] == "fp8" and rows["torch-eager"]["tokens_per_s"] > 0
    # embedding + lm head + norms in fp32; per layer 1-byte projections + one fp32 scale per output channel
    per_layer = (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 4 * (128 + 64 + 256 + 64) + 2 * 64 * 4
    # batch 1: the lm head whole, one row of the embedding
    assert rows["torch-eager"]["step_weight_bytes"] == (256 + 1) * 64 * 4 + 64 * 4 + 2 * per_layer
    for k in ("fused_norm", "fused_act", "skinny_gemm"):
        assert rows[f"fastdecode-graph-no-{k}"]["skipped"] == "needs CUDA"
    assert rows["fastdecode-graph-no-fused_allreduce"]["skipped"] == "needs CUDA"
    assert rows["fastdecode-eager"]["skipped"] == "needs CUDA"


@pytest.mark.gpu
def test_fp8_llama8b_shapes_triton_graph_equals_torch_gpu():
    """GPU: the FP8 decode step with fastdecode's kernels (eager and CUDA-graph replay) against the torch
    backend (same FP8 decisions, fp32 references); 2 layers of Llama-3.1-8B shapes."""
    from fastdecode.engine.cuda_graph import DecodeGraphRunner

    cfg = ModelConfig.from_preset("llama-3.1-8b").replace(n_layers=2)
    m = quantize_model_fp8(random_model(cfg, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                        seed=int(torch.randint(0, 1000, ()))))
    ids = torch.randint(0, cfg.vocab_size, (2, 9), device="cuda")
    nxt = torch.randint(0, cfg.vocab_size, (2,), device="cuda")
    pos = torch.tensor([9, 9], device="cuda")
    out = {}
    for be in ("torch", "triton"):
        m.backend = be
        cache = KVCache(m.config, 2, 128, dtype=torch.bfloat16, device="cuda")
        m.prefill(ids, cache)
        out[be] = m.decode(nxt, pos, cache)
    cos = torch.nn.functional.cosine_similarity(out["triton"], out["torch"], dim=-1)
    assert cos.min().item() > 0.999
    cache = KVCache(m.config, 2, 128, dtype=torch.bfloat16, device="cuda")
    m.prefill(ids, cache)
    g = DecodeGraphRunner(m, cache, buckets=[2])
    g.capture()
    m.prefill(ids, cache)  # capture warm-up wrote position 0
    torch.testing.assert_close(g.run(nxt, pos), out["triton"], atol=1e-2, rtol=0)
