"""Int4Weight values checked once, where a weight is built or loaded (``Int4Weight.check_values``): the
act-order ``perm`` must be a permutation of 0..K-1 (a duplicate made ``dequantize_int4`` return
uninitialised memory, an out-of-range entry failed deep inside an op) and ``zeros`` must lie in [0, 15]."""

import os

import pytest
import torch

from fastdecode.quant import int4 as Q
from helpers import gptq_qweight

N, K, G = 16, 256, 32


def _act_order_g_idx(K, g):
    perm = torch.randperm(K)  # GPTQ act-order: columns quantised in a permuted order, g per group
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // g
    return g_idx


def _weight(act_order=True):
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = (torch.rand(N, K // G) * 0.02 + 0.005).half()
    z = torch.randint(0, 16, (N, K // G), dtype=torch.uint8)
    return Q.prepack(q, s, group_size=G, zeros=z, g_idx=_act_order_g_idx(K, G) if act_order else None)


def _with(w, **kw):
    parts = dict(qweight=w.qweight, scales=w.scales, zeros=w.zeros, mins=w.mins, group_size=w.group_size,
                 zero_mode=w.zero_mode, perm=w.perm, k=w.k, layout=w.layout)
    parts.update(kw)
    return Q.Int4Weight(**parts)


def test_valid_act_order_weights_load():
    w = _weight()
    assert w.perm is not None and torch.equal(torch.sort(w.perm).values, torch.arange(K))
    w.check_values()
    # GPTQ act-order checkpoint tensors (v1 zeros: stored 7 for 8), int32 g_idx as stored
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = (torch.rand(N, K // G) * 0.02 + 0.005).half()
    g_idx = _act_order_g_idx(K, G)
    qzeros = torch.full((K // G, N // 8), 0x77777777, dtype=torch.int32)
    wg = Q.from_gptq(gptq_qweight(q), qzeros, s.t().contiguous(), g_idx.to(torch.int32))
    assert wg.format == "int4.g32.sym.actorder"
    wg.check_values()
    assert torch.equal(wg.unpack()["g_idx"], g_idx)


@pytest.mark.parametrize("bad, match", [
    (K + 3, rf"perm must be a permutation of 0..{K - 1}: value {K + 3} out of range"),
    (-1, rf"perm must be a permutation of 0..{K - 1}: value -1 out of range"),
])
def test_out_of_range_perm_raises(bad, match):
    w = _weight()
    perm = w.perm.clone()
    perm[5] = bad
    with pytest.raises(ValueError, match=match):
        _with(w, perm=perm).check_values("layers.0.wqkv")
    with pytest.raises(ValueError, match="^layers.0.wqkv: perm"):
        _with(w, perm=perm).check_values("layers.0.wqkv")


def test_duplicate_perm_raises():
    w = _weight()
    perm = w.perm.clone()
    perm[[1, 2, 3]] = int(perm[0])  # 3 duplicates of one value, 3 values missing
    with pytest.raises(ValueError, match=rf"perm must be a permutation of 0..{K - 1}: it has 3 duplicate entries "
                                         rf"\({int(perm[0])} appears 4 times\)"):
        _with(w, perm=perm).check_values()
    perm = torch.arange(K)
    perm[10], perm[200] = 7, 7  # two values missing, one appearing three times
    with pytest.raises(ValueError, match="it has 2 duplicate entries"):
        _with(w, perm=perm).check_values()


def test_zeros_above_15_raise():
    w = _weight(act_order=False)
    z = w.zeros.clone()
    z[3, 1], z[0, 0] = 16, 200
    with pytest.raises(ValueError, match=r"zeros must hold 4-bit zero points in \[0, 15\], got 2 above 15 "
                                         r"\(maximum 200\)"):
        _with(w, zeros=z).check_values()
    # prepack checks the integers it is given, before they become uint8
    z16 = torch.zeros(N, K // G, dtype=torch.int32)
    z16[2, 2] = 16
    with pytest.raises(ValueError, match=r"zeros must hold values in \[0, 15\], got \[0, 16\]"):
        Q.prepack(torch.zeros(N, K, dtype=torch.uint8), w.scales, group_size=G, zeros=z16)


def test_not_checked_per_call(monkeypatch):
    """The value check runs at build / load time only: a forward call does not pass over perm or zeros."""
    import fastdecode as fd
    import fastdecode.ops.int4_format as F

    w = _weight()
    calls = []
    monkeypatch.setattr(F, "check_perm", lambda *a, **k: calls.append(a))
    x = torch.randn(3, K, dtype=torch.float16)
    fd.int4_linear(x, w, backend="torch")
    assert calls == []


def test_shape_errors_still_come_first():
    w = _weight()
    with pytest.raises(ValueError, match=r"perm must be int64 \(256,\)"):
        _with(w, perm=w.perm[:-1]).check_values()


def _fastdecode_checkpoint(tmp_path):
    from fastdecode.cli import main
    from engine_helpers import save_hf_llama

    src = save_hf_llama(tmp_path / "src")
    dst = str(tmp_path / "q")
    assert main(["quantize", src, dst, "--method", "int4", "--dtype", "float32"]) == 0
    return dst


def test_loader_checks_stored_perm_and_zeros_once(tmp_path):
    """A ``fastdecode quantize`` checkpoint whose stored zeros or act-order perm are corrupt is refused at
    load, naming the tensor; the intact one loads."""
    from safetensors.torch import load_file, save_file

    from fastdecode.engine.loader import CheckpointError, load

    dst = _fastdecode_checkpoint(tmp_path)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    base = "model.layers.1.mlp.down_proj"
    load(dst, dtype=torch.float32, progress=False)  # intact

    bad = dict(sd)
    z = bad[f"{base}.zeros"].clone()
    z[0, 0] = 17
    bad[f"{base}.zeros"] = z
    save_file(bad, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{base}: zeros must hold 4-bit zero points in \[0, 15\]"):
        load(dst, dtype=torch.float32, progress=False)

    K = _k_of(dst, base)
    for perm, match in ((torch.zeros(K, dtype=torch.int64), f"{K - 1} duplicate entries"),
                        (torch.arange(K) + 1, f"value {K} out of range")):
        bad = dict(sd)
        bad[f"{base}.perm"] = perm
        save_file(bad, path, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=rf"{base}: perm must be a permutation of 0..{K - 1}: .*{match}"):
            load(dst, dtype=torch.float32, progress=False)


def _k_of(dst, base):
    import json

    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    return cfg["intermediate_size"] if base.endswith("down_proj") else cfg["hidden_size"]
