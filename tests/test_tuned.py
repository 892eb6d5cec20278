"""The tuned-config machinery shared by the GEMM dispatchers (fastdecode.ops._tuned), on the CPU.

Pins the rule above the largest tuned M for both op families: the table is not extrapolated; the op's
large-M path runs (cuBLAS for linear, dequant + cuBLAS for int4_linear, the heuristic Triton config for
W4A8 and under the interpreter).
"""

from __future__ import annotations

import json

import torch

import fastdecode.ops.gemm as L
import fastdecode.ops.int4 as I
from fastdecode.ops import _tuned

FMA = dict(kind="fma", BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2)
DOT = dict(kind="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=2)


def test_nearest_m_log_scale_ties_and_above_the_largest():
    entries = {"1": "one", "16": "sixteen"}
    assert _tuned.nearest_m(entries, 1) == "one"
    assert _tuned.nearest_m(entries, 0) == "one"  # M = 0 counts as 1
    assert _tuned.nearest_m(entries, 4) == "one"  # log2 distance 2 to both: the smaller M
    assert _tuned.nearest_m(entries, 5) == "sixteen"
    assert _tuned.nearest_m(entries, 16) == "sixteen"
    assert _tuned.nearest_m(entries, 17) is None  # above the largest tuned M: no entry
    assert _tuned.nearest_m({}, 1) is None and _tuned.nearest_m(None, 1) is None


def test_linear_above_the_largest_tuned_m_is_cublas(tmp_path):
    p = tmp_path / "linear_rule.json"
    p.write_text(json.dumps({"linear": {"bf16": {"64,64": {"1": {"impl": "triton", "config": FMA},
                                                           "8": {"impl": "triton", "config": DOT}}}}}))
    L.clear_config_cache()
    get = lambda M: L.get_linear_config(M, 64, 64, torch.bfloat16, "cpu", path=str(p))  # noqa: E731
    assert get(8) == ("triton", DOT)
    # the largest entry is Triton and the heuristic would say Triton (M <= 16): still cuBLAS
    assert get(9) == ("cublas", None)
    assert get(4096) == ("cublas", None)
    L.clear_config_cache()


def test_int4_above_the_largest_tuned_m_is_the_large_m_path(tmp_path):
    entries = {"1": {"impl": "triton", "config": FMA}, "16": {"impl": "triton", "config": DOT}}
    p = tmp_path / "int4_rule.json"
    p.write_text(json.dumps({"int4_linear": {"64,256,128": entries}, "int4_linear_fp8": {"64,256,128": entries}}))
    path = str(p)
    I.clear_config_cache()
    assert I.get_int4_config(16, 64, 256, 128, path=path) == ("triton", DOT)
    heuristic = I.heuristic_config(17, 64, 256, 128, cuda=False)[1]
    # on a GPU: dequant + cuBLAS with the heuristic config (for impl="triton"), not the M=16 tile
    assert I._lookup("NVIDIA test", 132, 17, 64, 256, 128, path) == ("dequant", I.heuristic_config(17, 64, 256, 128)[1])
    # the interpreter has no cuBLAS: Triton with the heuristic config
    assert I.get_int4_config(17, 64, 256, 128, path=path) == ("triton", heuristic)
    # W4A8 has no cuBLAS path: the heuristic Triton config
    assert I.get_int4_config(4096, 64, 256, 128, path=path, op="int4_linear_fp8") == (
        "triton", I.heuristic_config(4096, 64, 256, 128, cuda=False)[1])
    I.clear_config_cache()


def test_one_clear_forgets_both_families(tmp_path):
    p = tmp_path / "both.json"
    p.write_text(json.dumps({"int4_linear": {"64,256,128": {"16": {"impl": "triton", "config": DOT}}},
                             "linear": {"bf16": {"64,64": {"8": {"impl": "triton", "config": DOT}}}}}))
    I.clear_config_cache()
    assert I.get_int4_config(16, 64, 256, 128, path=str(p)) == ("triton", DOT)
    assert L.get_linear_config(8, 64, 64, torch.bfloat16, "cpu", path=str(p)) == ("triton", DOT)
    p.write_text(json.dumps({"int4_linear": {"64,256,128": {"16": {"impl": "triton", "config": FMA}}},
                             "linear": {"bf16": {"64,64": {"8": {"impl": "triton", "config": FMA}}}}}))
    assert L.clear_config_cache is I.clear_config_cache is _tuned.clear_config_cache
    L.clear_config_cache()
    assert I.get_int4_config(16, 64, 256, 128, path=str(p)) == ("triton", FMA)
    assert L.get_linear_config(8, 64, 64, torch.bfloat16, "cpu", path=str(p)) == ("triton", FMA)
    L.clear_config_cache()


def test_split_k_locks_are_one_buffer_per_device():
    a = _tuned.split_k_locks(torch.device("cpu"), 8)
    assert a is _tuned.split_k_locks(torch.device("cpu"), 16) and a.numel() >= 16 and a.dtype == torch.int32
    assert L._LOCKS is _tuned.SPLIT_K_LOCKS and _tuned.SPLIT_K_LOCKS[("cpu", None)] is a
    assert _tuned.device_info(None) == ("cpu", _tuned.DEFAULT_NUM_SMS)
    assert _tuned.device_info(torch.device("cpu")) == ("cpu", _tuned.DEFAULT_NUM_SMS)


def test_split_k_partials_are_one_growing_buffer_per_device():
    """One fp32 workspace per device: reused while large enough, replaced (the old one kept alive for graphs that
    captured it) when a launch needs more; both GEMM families take their partials from it."""
    dev = torch.device("cpu")
    _tuned.SPLIT_K_PARTIALS.pop(("cpu", None), None)
    a = _tuned.split_k_partials(dev, 10)
    assert a.dtype == torch.float32 and a.numel() >= 10 and _tuned.split_k_partials(dev, a.numel()) is a
    retired = len(_tuned._LOCKS_RETIRED)
    b = _tuned.split_k_partials(dev, a.numel() + 1)
    assert b is not a and b.numel() > a.numel() and _tuned.SPLIT_K_PARTIALS[("cpu", None)] is b
    assert _tuned._LOCKS_RETIRED[retired] is a
    # every split-K launcher (linear, int4_linear, int4_linear_a8) takes them through split_k_workspace
    cfg = {"BLOCK_M": 1, "BLOCK_N": 4, "SPLIT_K": 3}
    config, part, locks = _tuned.split_k_workspace(dev, cfg, 3, 2, 9, "linear")
    assert config is cfg and part is b and locks.numel() >= 2 * 3
    assert _tuned.split_k_workspace(dev, cfg, 1, 2, 9, "linear") == (cfg, None, None)


def test_hopper_gpus_without_tables_read_the_h200s(monkeypatch, caplog, tmp_path):
    """Session 33: an H100 (or another sm_90 GPU) had no tables and ran the heuristics (the embedded step 668 us on an
    H100 against 619 us on the H200's tables). Such a GPU now reads the H200's GEMM tables, with one info line naming
    both; a GPU with its own table (here under FASTDECODE_CONFIG_DIR) reads its own; other GPUs, families the H200
    has no table of, and the all-reduce crossovers keep the heuristics / defaults. Tuners write to ``config_path``,
    never to the sibling's file."""
    import logging

    from fastdecode.ops import _common
    from fastdecode.ops import allreduce as AR

    h100, h200 = "NVIDIA H100 PCIe", "NVIDIA H200"  # a GPU the package has no table of
    for name in (h100, "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H800", "NVIDIA H20", "NVIDIA GH200 480GB"):
        assert _common.sibling_gpu(name) == h200, name
    for name in (h200, "NVIDIA A100-SXM4-80GB", "NVIDIA B200", "cpu"):
        assert _common.sibling_gpu(name) is None, name
    monkeypatch.setenv("FASTDECODE_CONFIG_DIR", str(tmp_path))
    _tuned.clear_config_cache()
    _common._logged_once.clear()
    try:
        with caplog.at_level(logging.INFO, logger="fastdecode"):
            for family in ("linear", "int4_linear"):
                assert _common.table_path(family, h100) == _common.CONFIG_DIR / f"{family}_nvidia_h200.json"
                assert _common.config_path(family, h100).name == f"{family}_nvidia_h100_pcie.json"
            assert _common.table_path("linear", h100).is_file()
        said = [r for r in caplog.records if "reading the NVIDIA H200's" in r.getMessage()]
        assert len(said) == 2 and h100 in said[0].getMessage() and {r.levelno for r in said} == {logging.INFO}
        # the all-reduce crossovers depend on the interconnect (a PCIe H100 has no NVLink): not shared
        assert _common.table_path("allreduce", h100) == _common.config_path("allreduce", h100)
        assert (_common.CONFIG_DIR / "allreduce_nvidia_h200.json").is_file()
        assert AR.measured_path_bytes(h100, 2) is None and AR.measured_path_bytes(h200, 2) is not None
        assert _common.table_path("nothing", h100) == _common.config_path("nothing", h100)  # no H200 table either
        assert not _common.table_path("linear", "NVIDIA A100-SXM4-80GB").is_file()
        # the dispatchers: the H200's entries on the H100
        assert _tuned.load_table("int4_linear", h100) == _tuned.load_table("int4_linear", h200) is not None
        assert L._lookup(h100, 132, "bf16", 1, 960, 576) == L._lookup(h200, 132, "bf16", 1, 960, 576)
        assert I._lookup(h100, 132, 1, 960, 576, 32) == I._lookup(h200, 132, 1, 960, 576, 32)
        # a table of its own wins
        own = json.loads((_common.CONFIG_DIR / "int4_linear_nvidia_h200.json").read_text())
        own["gpu"] = h100
        own["int4_linear"]["960,576,32"]["1"] = {"impl": "triton", "config": FMA}
        (tmp_path / "int4_linear_nvidia_h100_pcie.json").write_text(json.dumps(own))
        _tuned.clear_config_cache()
        assert _common.table_path("int4_linear", h100) == tmp_path / "int4_linear_nvidia_h100_pcie.json"
        assert I._lookup(h100, 132, 1, 960, 576, 32) == ("triton", FMA)
    finally:
        _tuned.clear_config_cache()
