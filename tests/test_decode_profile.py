"""``fastdecode bench decode --profile``: kernels attributed to families (qkv, o, gate_up, down, head, attention,
norms, activation, sampling, gaps) and the bytes of each against the copy-rate floor (``fastdecode.bench.profile``).
The attribution is checked on the kernel names of the committed H200 profiles; the recording on the GPU."""

import json

import pytest
import torch

from fastdecode import cli
from fastdecode.bench.profile import (
    COPY_BW, attribute, copy_bandwidth, family_bytes, family_table, format_table, kernel_class,
)

# kernel names one 8B decode step launched on the H200 (benchmarks/results/archive/profile_*.json)
NORM, ROPE, ATTN = "_rms_norm_kernel", "_rope_kv_write_kernel", "_decode_attention_kernel"
SKINNY, INT4, MMA = "_skinny_linear_kernel", "_int4_linear_kernel", "_int4_mma_kernel"
SILU, QUANT = "_silu_and_mul_kernel", "_quant_kernel"
EMBED = "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>"
COPY = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>")
ARGMAX = ("_argmax_chunks_kernel", "_argmax_rows_kernel")


def _int4_step(n_layers):
    """The kernel order of an int4 step (gate_up on the mma kind, SiLU-and-mul apart, the head a bf16 GEMM)."""
    block = [NORM, INT4, ROPE, ATTN, INT4, NORM, MMA, SILU, INT4]
    return [EMBED] + block * n_layers + [NORM, SKINNY, *ARGMAX, "Memcpy DtoD (Device -> Device)"]


def test_kernel_classes_of_the_h200_names():
    assert [kernel_class(n) for n in (SKINNY, INT4, MMA, "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT")] == ["gemm"] * 4
    assert [kernel_class(n) for n in (NORM, ROPE, ATTN, SILU, QUANT, *ARGMAX, EMBED, COPY)] == [
        "norms", "attention", "attention", "activation", "activation", "sampling", "sampling", "other", "other"]
    assert kernel_class("_rope_decode_attention_kernel") == "attention"  # RoPE + KV write + attention in one
    assert kernel_class("_int4_dequant_kernel") == "other"  # the -no-int4_gemm ablation's weight dequantisation
    assert kernel_class("_allreduce_add_rms_norm_kernel") == "allreduce"
    # W4A8 (int4_a8): the dp4a GEMV, and the activation's quantisation where no producer emits int8
    assert kernel_class("_int4_a8_kernel") == "gemm" and kernel_class("_act_quant_kernel") == "activation"


@pytest.mark.parametrize("n_layers", [1, 3])
def test_gemms_attributed_by_position(n_layers):
    fams = attribute(_int4_step(n_layers), n_layers)
    gemms = [f for f, n in zip(fams, _int4_step(n_layers)) if kernel_class(n) == "gemm"]
    assert gemms == ["qkv", "o", "gate_up", "down"] * n_layers + ["head"]
    assert fams[0] == "other" and fams[-1] == "other" and fams.count("sampling") == 2
    assert fams.count("norms") == 2 * n_layers + 1 and fams.count("activation") == n_layers


def test_gemms_left_unattributed_when_the_count_does_not_match():
    """A step with one GEMM kernel more than 4 per layer + the head (a cuBLAS split-K reduction, say): no guess."""
    names = _int4_step(2) + ["cutlass_splitk_reduce"]
    fams = attribute(names, 2)
    assert "qkv" not in fams and fams.count("gemm") == 4 * 2 + 2


def test_family_table_sums_floors_and_gaps():
    n_layers = 2
    names = _int4_step(n_layers)
    dur = {n: i + 1.0 for i, n in enumerate(dict.fromkeys(names))}  # one duration per kernel name
    steps = []
    for s in range(3):  # three steps, 1 us idle between kernels, starts given out of order
        t, kern = 1000.0 * s, []
        for n in names:
            kern.append((n, t, dur[n]))
            t += dur[n] + 1.0
        steps.append(list(reversed(kern)))
    fb = {"qkv": 4_240_000, "head": 8_480_000}
    rec = family_table(steps, n_layers, fb)
    rows = {r["family"]: r for r in rec["families"]}
    ksum = sum(dur[n] for n in names)
    span = ksum + len(names) - 1
    assert rec["kernel_us_per_step"] == pytest.approx(ksum) and rec["span_us_per_step"] == pytest.approx(span)
    assert rec["kernels_per_step"] == len(names)
    assert rows["qkv"]["us_per_step"] == pytest.approx(n_layers * dur[INT4])
    assert rows["gate_up"]["us_per_step"] == pytest.approx(n_layers * dur[MMA])
    assert rows["head"]["calls_per_step"] == 1 and rows["head"]["us_per_step"] == pytest.approx(dur[SKINNY])
    assert rows["qkv"]["floor_us"] == pytest.approx(4_240_000 / COPY_BW * 1e6)  # 1 us
    assert rows["qkv"]["x_floor"] == pytest.approx(n_layers * dur[INT4], rel=1e-2)
    assert "floor_us" not in rows["o"]  # no bytes given for it
    assert rows["gaps"]["us_per_step"] == pytest.approx(len(names) - 1)
    assert sum(r["us_per_step"] for r in rec["families"]) == pytest.approx(span)
    assert [r["family"] for r in rec["families"]][-1] == "gaps"
    text = format_table({**rec, "impl": "x", "shape": {"model": "m", "quant": "int4", "batch": 1}})
    assert "qkv" in text and "gaps" in text and "overlap" not in text


def test_floors_follow_the_copy_rate_given():
    """The floors are the bytes over the copy rate the record names (the card's, measured by ``copy_bandwidth`` in
    ``profile_decode``; the H200's 4.24 TB/s by default): on a card copying at 3.0 TB/s the same bytes' floor is
    4.24 / 3.0 times longer, and the table says which rate it used."""
    steps = [[(n, 1000.0 * i, 200.0) for i, n in enumerate(_int4_step(1))]]
    h200 = family_table(steps, 1, {"qkv": 424_000_000})  # 100 us at 4.24 TB/s
    slower = family_table(steps, 1, {"qkv": 424_000_000}, copy_bw=3.0e12)
    assert h200["copy_tbps"] == 4.24 and slower["copy_tbps"] == 3.0
    (a,), (b,) = ([r for r in t["families"] if r["family"] == "qkv"] for t in (h200, slower))
    assert b["floor_us"] == pytest.approx(a["floor_us"] * 4.24 / 3.0, rel=1e-3)
    assert b["x_floor"] == pytest.approx(a["x_floor"] * 3.0 / 4.24, rel=1e-2)
    assert "copy rate of 3.00 TB/s" in format_table({**slower, "impl": "x", "shape": {}})
    with pytest.raises(ValueError, match="copy_bw"):
        family_table(steps, 1, {"qkv": 1}, copy_bw=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device's copy; the CPU has none")
def test_copy_bandwidth_on_the_gpu():
    """A 256 MiB copy on the GPU: between 0.5 and 6 TB/s counted read plus written (an H100 or H200)."""
    bw = copy_bandwidth(nbytes=256 << 20, reps=5)
    assert 0.5e12 < bw < 6e12


def test_copy_bandwidth_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="CUDA"):
        copy_bandwidth("cpu")
    with pytest.raises(ValueError, match=">= 1"):
        copy_bandwidth("cpu", nbytes=0)


def test_family_table_says_when_kernels_overlap():
    steps = [[(SKINNY, 0.0, 10.0), (NORM, 2.0, 10.0)]]  # PDL: the second starts before the first ends
    rec = family_table(steps, 0)
    assert rec["families"][-1]["us_per_step"] < 0
    assert "overlap" in format_table({**rec, "impl": "fastdecode-graph", "shape": {}})
    # a row profiled with PDL off for the whole process (FASTDECODE_PDL=0) says so beside its impl
    assert "fastdecode-graph (PDL off) batch" in format_table({**rec, "impl": "fastdecode-graph", "pdl": False,
                                                               "shape": {}})
    assert "(PDL off)" not in format_table({**rec, "impl": "fastdecode-graph-no-pdl", "pdl": False, "shape": {}})
    with pytest.raises(ValueError, match="no kernels"):
        family_table([[]], 1)


@pytest.mark.parametrize("quant", [None, "int4", "fp8"])
def test_family_bytes_are_the_projection_weights(quant):
    from fastdecode.engine.loader import random_model
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.int4 import Int4Linear
    from fastdecode.models.llama import unique_param_bytes

    model = random_model(ModelConfig.from_preset("tiny"), device="cpu", dtype=torch.float32, max_seq_len=16)
    if quant:
        from fastdecode.models.quantize import quantize_model

        quantize_model(model, quant)
    fb = family_bytes(model, 1, kv_bytes=1000)

    def nbytes(m):
        return m.weight_bytes() if isinstance(m, Int4Linear) else unique_param_bytes(m.parameters())

    assert fb["qkv"] == sum(nbytes(b.attention.wqkv) for b in model.layers)
    assert fb["down"] == sum(nbytes(b.feed_forward.w2) for b in model.layers)
    assert fb["head"] == nbytes(model.output)
    # the projections and the head are the model's weight bytes but the embedding table and the norms' weights
    norms = sum(unique_param_bytes(m.parameters()) for m in model.modules() if type(m).__name__ == "RMSNorm")
    assert sum(fb[f] for f in ("qkv", "o", "gate_up", "down", "head")) == (
        model.weight_bytes() - model.tok_embeddings.weight.numel() * 4 - norms)
    assert fb["attention"] > 1000 and fb["norms"] > norms
    if quant == "int4":
        assert fb["qkv"] < sum(b.attention.wqkv.out_features * b.attention.wqkv.in_features for b in model.layers)


def test_profile_needs_cuda(capsys):
    rc = cli.main(["bench", "decode", "--preset", "tiny", "--profile", "--device", "cpu"])
    assert rc == 2
    assert "--profile needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("extra, msg", [(["--ablate"], "--ablate does not apply"),
                                        (["--plot"], "--plot does not apply"),
                                        (["--batch", "1", "2"], "--profile takes one --batch")])
def test_profile_refuses_the_options_of_the_timed_run(extra, msg, capsys):
    assert cli.main(["bench", "decode", "--preset", "tiny", "--profile", *extra]) == 2
    assert msg in capsys.readouterr().err


def test_profile_refuses_the_peers(capsys):
    rc = cli.main(["bench", "decode", "--preset", "tiny", "--profile", "--impl", "peer-compile"])
    assert rc == 2
    assert "the peers (peer-compile) are not profiled" in capsys.readouterr().err


@pytest.mark.gpu
def test_profile_tiny_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = cli.main(["bench", "decode", "--preset", "tiny", "--profile", "--quant", "int4", "--output-len", "8",
                   "--profile-steps", "3", "--impl", "fastdecode-graph-no-pdl", "fastdecode-graph", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    assert [r["impl"] for r in recs] == ["fastdecode-graph-no-pdl", "fastdecode-graph"]
    assert [r["pdl"] for r in recs] == [False, torch.cuda.get_device_capability() >= (9, 0)]
    for r in recs:
        fams = {f["family"]: f for f in r["families"]}
        assert {"qkv", "o", "gate_up", "down", "head", "attention", "norms", "sampling", "gaps"} <= set(fams)
        assert "gemm" not in fams  # every GEMM attributed
        assert fams["qkv"]["calls_per_step"] == 2 and fams["head"]["calls_per_step"] == 1
        assert all(f["us_per_step"] > 0 for f in r["families"] if f["family"] != "gaps")
        assert r["span_us_per_step"] > 0 and r["shape"]["quant"] == "int4" and r["gpu"] != "cpu"
    # without PDL the kernels run one after another: the gaps are idle time, not overlap
    assert recs[0]["families"][-1]["us_per_step"] >= 0
    assert text.count("family") == 2
