"""``fastdecode.bench.int4_fused``: the tuner of the fused int4 ops' table sections (session 33). Its checks and
table writing run on small shapes with a stand-in timer (the interpreter on a CPU, the kernels on a GPU)."""

import json

import pytest
import torch

from fastdecode.bench import int4_fused as F
from fastdecode.ops.int4 import FUSED_OPS, get_int4_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the name the tuner gives this machine (bench.harness): a table tuned here, which it writes into as it is
HERE = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def test_each_projection_runs_as_the_steps_fused_op():
    """qkv and gate_up take the norm inside, o the residual add, down SiLU-and-mul and the add up to the GLU
    kernel's K (8B's down, K = 14336, the add alone), as ``models.norm_gemm`` runs them."""
    ops = {name: F.op_of(name, SHAPES_K) for name, (_, SHAPES_K, _, _) in F.SHAPES.items()}
    assert ops["smollm2.qkv"] == ops["8b.gate_up"] == "int4_rms_norm_linear"
    assert ops["smollm2.o"] == ops["8b.o"] == ops["8b.down"] == "int4_add_linear"
    assert ops["smollm2.down"] == ops["8b.down_glu"] == "int4_add_linear_glu"  # 8B's w2 as GLU: by its own entry
    assert set(ops.values()) == set(FUSED_OPS)
    with pytest.raises(ValueError, match="no fused op"):
        F.op_of("8b.head", 4096)


def test_shape_names_and_aliases():
    assert F.parse_shapes("smollm2") == ["smollm2.qkv", "smollm2.o", "smollm2.gate_up", "smollm2.down"]
    assert F.parse_shapes("8b.o, smollm2.o,8b.o") == ["8b.o", "smollm2.o"]
    for bad in ("smollm2.head", ""):
        with pytest.raises(ValueError):
            F.parse_shapes(bad)


def test_the_norm_op_also_times_the_in_loop_norm_on_one_split_tiles():
    """NORM_LOOP variants on the norm op's one-split tiles only; the add ops get the plain fma list; the incumbent
    joins where missing, a tensor-core one too (the op as it runs now: the step's alternative); no fused tile above
    M = 8 (no fma candidates there)."""
    from fastdecode.bench.int4 import candidates
    from fastdecode.kernels.int4 import split_k_blocks

    N, K = 960, 576
    plain = candidates(1, N, K, quick=True, kinds=("fma",))
    norm = F.fused_candidates("int4_rms_norm_linear", 1, N, K, quick=True)
    loops = [c for c in norm if c.get("NORM_LOOP")]
    assert loops and norm[:len(plain)] == plain and len(norm) == len(plain) + len(loops)
    assert all(split_k_blocks(K, c)[1] == 1 for c in loops)
    assert all(c["kind"] == "fma" for c in norm)
    own = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 24, "BLOCK_K": 256, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1}
    add = F.fused_candidates("int4_add_linear", 1, N, K, quick=True, incumbent=own)
    assert add == plain + [own]
    mma = {"kind": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4}
    assert F.fused_candidates("int4_add_linear", 1, N, K, quick=True, incumbent=mma) == plain + [mma]
    with pytest.raises(ValueError, match="M = 8"):
        F.fused_candidates("int4_add_linear", 16, N, K)


def test_packed_tiles_are_candidates_where_packed_applies():
    """With the shape's group size, the 8B shapes (g128) get PACKED tiles with PREFETCH 1 and 2 (the norm op's one-split
    ones with NORM_LOOP too); the embedded model's g32 gets none; without a group size, none (the old list)."""
    from fastdecode.kernels.int4 import split_k_blocks

    N, K, group, _ = F.SHAPES["8b.qkv"]
    norm = F.fused_candidates("int4_rms_norm_linear", 1, N, K, quick=True, group_size=group)
    packed = [c for c in norm if c.get("PACKED")]
    assert {c["PREFETCH"] for c in packed} == {True, 2}
    assert {c["SPLIT_K"] for c in packed} == {1, 2, 4, 8}
    assert any(c.get("NORM_LOOP") for c in packed)
    assert all(split_k_blocks(K, c)[1] == 1 for c in packed if c.get("NORM_LOOP"))
    plain_pf1 = [c for c in packed if c["PREFETCH"] is True and not c.get("NORM_LOOP")]
    assert [c for c in packed if c["PREFETCH"] == 2 and not c.get("NORM_LOOP")] == [
        {**c, "PREFETCH": 2} for c in plain_pf1]
    add = F.fused_candidates("int4_add_linear", 1, *F.SHAPES["8b.o"][:2], quick=True, group_size=128)
    assert len([c for c in add if c.get("PACKED")]) == 2 * len(plain_pf1)
    assert not any(c.get("PACKED") for c in F.fused_candidates("int4_rms_norm_linear", 1, N, K, quick=True))
    Ns, Ks, gs, _ = F.SHAPES["smollm2.qkv"]
    assert not any(c.get("PACKED") for c in F.fused_candidates("int4_rms_norm_linear", 1, Ns, Ks, group_size=gs))
    # PACKED applies up to two token rows
    assert not any(c.get("PACKED") for c in F.fused_candidates("int4_add_linear", 4, N, K, group_size=group))


@pytest.mark.parametrize("op", ["int4_rms_norm_linear", "int4_add_linear", "int4_add_linear_glu"])
def test_each_fused_op_is_right_on_packed_tiles(op):
    """Every fused op on PACKED tiles (PREFETCH 1 and 2, one split and two, the in-loop norm) passes the tuner's
    check against its fp32 reference, on the engine's RTN format at g128 and GGUF's mins; a wrong weight fails it."""
    base = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 2, "num_stages": 1,
            "PACKED": True}
    cfgs = [{**base, "SPLIT_K": sk, "PREFETCH": pf} for sk in (1, 2) for pf in (True, 2)]
    if op == "int4_rms_norm_linear":
        cfgs.append({**base, "SPLIT_K": 1, "PREFETCH": 2, "NORM_LOOP": True})
    for fmt in ("zero", "min"):
        ops = F.FusedOperands(op, 32, 512, 128, fmt, 1, DEV, rot=1)
        for cfg in cfgs:
            assert ops.check(cfg) is None, (fmt, cfg)
    ops.w[0].qweight.bitwise_xor_(0x11111111)
    assert "max error" in (ops.check(cfgs[-1]) or "")


DOT = {"kind": "dot", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2,
       "PREFETCH": True}


def _tensor_core_stand_in(monkeypatch):
    """The interpreter computes the dot kind in fp16 only (tests/test_int4.py): on a CPU a plain-PyTorch GEMM stands
    in for a tensor-core tile (given neither the norm nor the GLU, which stay out of such a tile); a GPU runs it."""
    import fastdecode.ops.int4 as I
    from fastdecode.ops.int4_format import dequantize_int4

    real = I.int4_linear_with_config

    def gemm(x, w, bias, out, cfg, warmup=False, norm_weight=None, eps=0.0, x_norm=False, accumulate=False,
             glu=False):
        if cfg["kind"] == "fma" or DEV == "cuda":
            return real(x, w, bias, out, cfg, warmup=warmup, norm_weight=norm_weight, eps=eps, x_norm=x_norm,
                        accumulate=accumulate, glu=glu)
        assert not (x_norm or glu or norm_weight is not None), "the norm and the GLU stay out of a tensor-core tile"
        y = x.float() @ dequantize_int4(w).float().T
        out.copy_((out.float() + y if accumulate else y).to(out.dtype))

    monkeypatch.setattr(I, "int4_linear_with_config", gemm)


def test_a_tensor_core_tile_runs_as_the_op_runs_it(monkeypatch):
    """On a tensor-core tile (the incumbent where the table gives the op one) the norm op runs the norm kernel then
    the GEMM, and the GLU op the SiLU-and-mul kernel then the GEMM with the add, as ``ops.int4_norm_linear`` runs
    them; on an fma tile neither kernel runs. Each matches the op's reference (``check``; on a CPU the dot tile's
    GEMM is a stand-in, ``_tensor_core_stand_in``)."""
    import fastdecode.ops.activation as A
    import fastdecode.ops.norm as N

    ran = []
    real_norm, real_silu = N.rms_norm, A.silu_and_mul
    monkeypatch.setattr(N, "rms_norm", lambda *a, **k: ran.append("norm") or real_norm(*a, **k))
    monkeypatch.setattr(A, "silu_and_mul", lambda *a, **k: ran.append("silu") or real_silu(*a, **k))
    _tensor_core_stand_in(monkeypatch)
    dot = DOT
    fma = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 1, "PREFETCH": True}
    for op, kernel in (("int4_rms_norm_linear", ["norm"]), ("int4_add_linear_glu", ["silu"]),
                       ("int4_add_linear", [])):
        ops = F.FusedOperands(op, 32, 256, 32, "min", 1, DEV, rot=1)
        ran.clear()
        assert ops.check(dot) is None and ran == kernel, (op, ran)
        ran.clear()
        assert ops.check(fma) is None and ran == [], (op, ran)
    # the check is not blind to a missing norm: the GEMM on the raw rows fails it
    ops = F.FusedOperands("int4_rms_norm_linear", 32, 256, 32, "min", 1, DEV, rot=1)
    monkeypatch.setattr(N, "rms_norm", lambda h, *a, **k: h)
    assert "max error" in (ops.check(DOT) or "")


@pytest.mark.parametrize("fmt", ["min", "zero"])
def test_operands_check_catches_a_wrong_output(fmt):
    """The check passes a right tile and reports a wrong result (the weight's values changed after the reference
    was taken), on each fused op."""
    cfg = {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 1, "PREFETCH": True}
    for op in FUSED_OPS:
        ops = F.FusedOperands(op, 32, 256, 32, fmt, 1, DEV, rot=1)
        assert ops.check(cfg) is None, op
        ops.w[0].qweight.bitwise_xor_(0x11111111)  # every nibble moved by one
        assert "max error" in (ops.check(cfg) or ""), op


def test_tuner_writes_the_fastest_tile_into_the_ops_section(tmp_path, monkeypatch):
    """A small run: each shape's fastest candidate (the stand-in timer's choice) lands in its fused op's section at
    M = 1 with its time, the table's other sections stay, and the dispatcher then gives the op that tile."""
    monkeypatch.setattr(F, "SHAPES", {"tiny.qkv": (32, 256, 32, "min"), "tiny.down": (16, 256, 32, "min")})
    path = tmp_path / "int4_linear_test.json"
    plain = {"int4_linear": {"32,256,32": {"1": {"impl": "triton", "config": {
        "kind": "fma", "BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1,
        "PREFETCH": True}}}}, "gpu": HERE}
    path.write_text(json.dumps(plain))
    timed = []

    def timer(calls):
        timed.append(calls)
        return 10.0 - len(timed)  # each later candidate faster: the last one timed wins

    got = F.tune_fused(path, shapes=["tiny.qkv", "tiny.down"], ms=[1], device=DEV, timer=timer, max_candidates=3,
                       rot=1)
    table = json.loads(path.read_text())
    assert table["int4_linear"] == plain["int4_linear"] and table["gpu"] == HERE and "based_on" not in table
    assert set(got) == {"int4_rms_norm_linear", "int4_add_linear_glu"}
    for op, key in (("int4_rms_norm_linear", "32,256,32"), ("int4_add_linear_glu", "16,256,32")):
        entry = table[op][key]["1"]
        assert entry == got[op][key]["1"] and entry["impl"] == "triton" and entry["us"] < 10
        assert op + "_env" in table
        assert get_int4_config(1, int(key.split(",")[0]), 256, 32, DEV, path=str(path), op=op) == (
            "triton", entry["config"])
    # each shape timed the tile the op took before (qkv: the plain GEMV's entry; down: the heuristic's, no entry)
    # beside the first three candidates; it was timed last, so it won here
    assert len(timed) == 2 * (3 + 1)
    assert table["int4_rms_norm_linear"]["32,256,32"]["1"]["config"] == plain["int4_linear"]["32,256,32"]["1"]["config"]


def test_a_tensor_core_incumbent_that_wins_keeps_the_model_unfused(tmp_path, monkeypatch):
    """Where the table gives the norm op a tensor-core tile (8B gate_up at M = 1 on the H200's table) the tuner times
    it too, as the op runs it (the norm kernel, then the tile); when it is the fastest, the op's section keeps that
    tile, so ``models.norm_gemm`` keeps the unfused step. Session 34's tuner left it out: every section got an fma
    tile, and on an H100 the 8B step they put on the fused path was 55-102 us slower."""
    _tensor_core_stand_in(monkeypatch)
    monkeypatch.setattr(F, "SHAPES", {"tiny.gate_up": (32, 256, 32, "min")})
    path = tmp_path / "int4_linear_test.json"
    path.write_text(json.dumps({"int4_linear": {"32,256,32": {"1": {"impl": "triton", "config": DOT}}},
                                "gpu": HERE}))
    timed = []

    def timer(calls):
        timed.append(calls)
        return 10.0 - len(timed)  # the last timed wins: the incumbent, appended after the fma candidates

    got = F.tune_fused(path, shapes=["tiny.gate_up"], ms=[1], device=DEV, timer=timer, max_candidates=2, rot=1)
    assert len(timed) == 3
    entry = json.loads(path.read_text())["int4_rms_norm_linear"]["32,256,32"]["1"]
    assert entry["config"] == DOT and got["int4_rms_norm_linear"]["32,256,32"]["1"] == entry
    assert get_int4_config(1, 32, 256, 32, DEV, path=str(path), op="int4_rms_norm_linear")[1]["kind"] == "dot"


def test_cli_refuses_bad_input_in_one_line(capsys):
    for argv, want in ((["--shapes", "nope", "--out", "x.json"], "unknown shape"),
                       (["--ms", "one", "--out", "x.json"], "invalid literal")):
        with pytest.raises(SystemExit) as e:
            F.main(argv)
        assert e.value.code == 2 and want in capsys.readouterr().err


def test_tuner_names_a_siblings_copy_this_gpus_and_refuses_another_gpus(tmp_path):
    """``benchmarks/gpu.py`` copies the tables in use, an H100's the H200's: the tuner's table is then the H100's,
    ``based_on`` the H200; a table of an unrelated GPU is not written into; a missing one starts from the base."""
    h200 = tmp_path / "h200.json"
    h200.write_text(json.dumps({"gpu": "NVIDIA H200", "int4_linear": {"1,256,32": {}}}))
    mine = tmp_path / "int4_linear_h100.json"
    F._claim(mine, h200, "NVIDIA H100 80GB HBM3")
    t = json.loads(mine.read_text())
    assert t == {"gpu": "NVIDIA H100 80GB HBM3", "based_on": "NVIDIA H200", "int4_linear": {"1,256,32": {}}}
    F._claim(mine, h200, "NVIDIA H100 80GB HBM3")  # already this GPU's: unchanged
    assert json.loads(mine.read_text()) == t
    with pytest.raises(ValueError, match="tuned on 'NVIDIA H200', not on this 'NVIDIA A100'"):
        F._claim(tmp_path / "a100.json", h200, "NVIDIA A100")
    F._claim(tmp_path / "new.json", tmp_path / "none.json", "cpu")
    assert json.loads((tmp_path / "new.json").read_text()) == {}


@pytest.mark.parametrize("glu_wins", [False, True])
def test_a_glu_entry_above_the_limit_must_beat_w2_without_it(tmp_path, monkeypatch, glu_wins):
    """Above ``INT4_GLU_MAX_K`` a GLU entry turns the GLU on in the step (``models.norm_gemm._int4_glu``), so the
    tuner writes it only where its fastest tile beats w2 without the GLU: the SiLU-and-mul kernel, then the add op's
    tile, timed last. Session 46's H100 run wrote the 8B's GLU entry although it lost (23.17 against 15.96 us) and the
    step on it ran 152-194 us slower. An entry an earlier run wrote is removed where the GLU loses."""
    import fastdecode.ops.activation as A
    from fastdecode.models import norm_gemm

    monkeypatch.setattr(norm_gemm, "INT4_GLU_MAX_K", 128)  # the tiny w2's K = 256 lies above it
    monkeypatch.setattr(F, "SHAPES", {"tiny.down_glu": (16, 256, 32, "min")})
    silu = []
    real_silu = A.silu_and_mul
    monkeypatch.setattr(A, "silu_and_mul", lambda *a, **k: silu.append(1) or real_silu(*a, **k))
    path = tmp_path / "int4_linear_test.json"
    old = {"impl": "triton", "config": {"kind": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1,
                                        "num_warps": 4, "num_stages": 1, "PREFETCH": True}, "us": 1.0}
    path.write_text(json.dumps({"gpu": HERE, "int4_add_linear_glu": {"16,256,32": {"1": old}}}))
    timed = []

    def timer(calls):
        before = len(silu)
        calls[0]()
        timed.append(len(silu) - before)  # whether the timed call ran the SiLU-and-mul kernel
        # three candidates and the table's tile 5 us each; w2 without the GLU (timed last) 6 us where the GLU wins,
        # else 4
        return 5.0 if len(timed) < 5 else (6.0 if glu_wins else 4.0)

    got = F.tune_fused(path, shapes=["tiny.down_glu"], ms=[1], device=DEV, timer=timer, max_candidates=3, rot=1)
    assert timed == [0, 0, 0, 0, 1]  # the GLU inside each candidate's kernel; the SiLU-and-mul kernel for the last
    section = json.loads(path.read_text()).get("int4_add_linear_glu", {})
    if glu_wins:
        assert section["16,256,32"]["1"] == got["int4_add_linear_glu"]["16,256,32"]["1"]
        assert section["16,256,32"]["1"]["us"] == 5.0
    else:
        assert got == {} and "16,256,32" not in section
        assert norm_gemm.INT4_GLU_MAX_K == 128 and F.op_of("tiny.down", 256) == "int4_add_linear"


def test_a_glu_op_at_or_under_the_limit_is_not_compared(tmp_path, monkeypatch):
    """At or under ``INT4_GLU_MAX_K`` the switch alone turns the GLU on (the entry only picks its tile): no timing of
    w2 without it."""
    monkeypatch.setattr(F, "SHAPES", {"tiny.down": (16, 256, 32, "min")})
    path = tmp_path / "int4_linear_test.json"
    path.write_text(json.dumps({"gpu": HERE}))
    timed = []
    got = F.tune_fused(path, shapes=["tiny.down"], ms=[1], device=DEV, timer=lambda c: timed.append(1) or 1.0,
                       max_candidates=2, rot=1)
    assert len(timed) == 3 and "16,256,32" in got["int4_add_linear_glu"]
