"""All-reduce and fused all-reduce + add + RMSNorm, one process per rank.

CPU: 2 and 4 gloo processes through the fallback path (the API, its errors, the workspace life
cycle); the crossover data, the path choice and its log line, the multi-node fallback rule.
GPU (``multigpu``, every world size from 2 up to the GPUs there are): every symmetric-memory path
against NCCL + the reference, eagerly and under CUDA-graph replay, and a stress run of 10,000
replays with checked results.
"""

import json
import logging

import pytest
import torch
import torch.distributed as dist

import fastdecode as fd
import fastdecode.bench.allreduce as bar
import fastdecode.ops.allreduce as ar
from helpers import assert_close, assert_fp8_close, run_ranks
from fastdecode.ops.allreduce import CommWorkspace, all_reduce, all_reduce_add_rms_norm, all_reduce_ref

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _same_sum(y, ref, exact, parts):
    """The symmetric-memory paths (and any path at 2 ranks) sum in rank order: bit for bit the
    reference. NCCL and gloo add in their own order above 2 ranks, and gloo in the input dtype: each
    of the world - 1 additions may round, by at most half an ulp of the largest partial sum."""
    if exact:
        torch.testing.assert_close(y, ref, atol=0, rtol=0)
    else:
        bound = len(parts) * torch.finfo(ref.dtype).eps * sum(p.float().abs() for p in parts)
        err = (y.float() - ref.float()).abs()
        assert (err <= bound).all(), f"sum off by {(err / bound).max():.2f} x the rounding bound"


def _partials(world, shape, dtype, device, seed):
    """Every rank's partial, generated identically on every rank from a shared seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(world)]


# ----------------------------------------------------------------------------- CPU (gloo)


def _cpu_checks(rank, world):
    seed = 1234
    with CommWorkspace(check=True) as ws:
        assert ws.mode == "torch" and ws.path_for(100) == "torch"
        for shape, dtype in (((1, 576), torch.float32), ((7, 111), torch.bfloat16), ((3, 2, 64), torch.float16)):
            parts = _partials(world, shape, dtype, "cpu", seed)
            seed += 1
            y = all_reduce(parts[rank], ws)
            _same_sum(y, all_reduce_ref(parts), world == 2, parts)
            x = parts[rank].clone()
            assert all_reduce(x, ws, inplace=True) is x
            _same_sum(x, all_reduce_ref(parts), world == 2, parts)
            assert torch.equal(x, y)
        # fused: equals fused_add_rms_norm(all_reduce(x)) on every rank
        H = 576
        parts = _partials(world, (5, H), torch.float16, "cpu", 99)
        res = _partials(1, (5, H), torch.float16, "cpu", 7)[0]
        w = _partials(1, (H,), torch.float16, "cpu", 8)[0]
        y_ref, r_ref = fd.fused_add_rms_norm_ref(all_reduce_ref(parts), res, w, 1e-6)
        r = res.clone()
        y = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws)
        _same_sum(r, r_ref, world == 2, parts + [res])
        assert_close(y, y_ref, ulps=1 if world == 2 else 4)
        r = res.clone()
        q, s = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws, fp8=True)
        q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(all_reduce_ref(parts), res, w, 1e-6)
        # above 2 ranks a residual may differ by an fp16 ulp (gloo's order), and with it the amax
        torch.testing.assert_close(s, s_ref, rtol=1e-5 if world == 2 else 2e-3, atol=0)
        assert ((q.float() - q_ref.float()).abs() <= q_ref.float().abs() / 8 + 1e-3).float().mean() > 0.95
        # errors: named arguments, and nothing written to residual
        r0 = r.clone()
        with pytest.raises(ValueError, match="residual must have the shape"):
            all_reduce_add_rms_norm(parts[rank], r[:, :10], w, 1e-6, ws)
        with pytest.raises(ValueError, match="weight must have 576"):
            all_reduce_add_rms_norm(parts[rank], r, w[:5], 1e-6, ws)
        with pytest.raises(ValueError, match="workspace must be a CommWorkspace"):
            all_reduce(parts[rank], "nccl")
        with pytest.raises(ValueError, match="scale is only meaningful"):
            all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws, scale=1.0)
        assert torch.equal(r, r0)
        # a mismatched call is caught (check=True) instead of hanging
        bad = torch.randn(3 + rank, 8)
        with pytest.raises(ValueError, match="different shapes"):
            all_reduce(bad, ws)
    with pytest.raises(ValueError, match="workspace has been destroyed"):
        all_reduce(parts[rank], ws)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_fallback(world):
    run_ranks(world, _cpu_checks, backend="gloo", timeout=600)


def test_workspace_needs_init():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        CommWorkspace()


def test_workspace_refused_inside_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        CommWorkspace()


# ----------------------------------------------------------------------------- crossover data, policy


def _bench_rows(world, table):
    """Plain all-reduce rows as ``fastdecode bench allreduce`` writes them: {bytes: {impl: us}}."""
    impls = {"nccl": "nccl", "one": "fastdecode_one_shot", "two": "fastdecode_two_shot"}
    return [{"op": "all_reduce", "impl": impls[k], "shape": {"bytes": b, "world": world}, "median_us": us}
            for b, t in table.items() for k, us in t.items()]


def test_crossovers_from_rows():
    rows = _bench_rows(4, {8192: dict(nccl=11, one=6, two=9), 65536: dict(nccl=12, one=7, two=8),
                           1 << 20: dict(nccl=18, one=19, two=15), 4 << 20: dict(nccl=35, two=33),
                           8 << 20: dict(nccl=49, two=56), 16 << 20: dict(nccl=78, two=70)})
    rows += _bench_rows(2, {8192: dict(nccl=1, one=6, two=9)})  # another world size: ignored
    rows.append({"op": "all_reduce_add_rms_norm", "impl": "fastdecode", "shape": {"M": 1, "world": 4}})
    # one-shot up to 64 KB; two-shot while it beats NCCL (to 4 MB: 16 MB is not contiguous); NCCL above
    assert bar.crossovers_from_rows(rows, 4) == {"one_shot": 65536, "two_shot": 4 << 20}
    # NCCL fastest from the start: neither symmetric-memory path is used
    assert bar.crossovers_from_rows(rows, 2) == {"one_shot": 0, "two_shot": 0}
    with pytest.raises(ValueError, match="world size 8"):
        bar.crossovers_from_rows(rows, 8)


def test_committed_crossovers_are_those_of_the_committed_benchmark():
    """configs/allreduce_nvidia_h200.json is what crossovers_from_rows gives on allreduce.json."""
    from pathlib import Path

    rows = json.loads((Path(__file__).parent.parent / "benchmarks/results/allreduce.json").read_text())
    worlds = {r["shape"]["world"] for r in rows if r["op"] == "all_reduce"}
    assert worlds, "no plain all-reduce rows in the committed benchmark"
    for world in worlds:
        assert ar.measured_path_bytes("NVIDIA H200", world) == bar.crossovers_from_rows(rows, world)


def test_write_config_keeps_other_world_sizes(tmp_path):
    p = tmp_path / "allreduce_x.json"
    bar.store_crossovers("GPU X", 2, {"one_shot": 1, "two_shot": 2}, "test", path=p)
    bar.store_crossovers("GPU X", 8, {"one_shot": 3, "two_shot": 4}, "test", path=p)
    table = json.loads(p.read_text())
    assert table["gpu"] == "GPU X"
    assert {k: (v["one_shot"], v["two_shot"]) for k, v in table["world"].items()} == {"2": (1, 2), "8": (3, 4)}


def _symm_workspace(world=4, **paths):
    """A CommWorkspace in symmetric-memory mode, without buffers: for the path policy only."""
    ws = CommWorkspace.__new__(CommWorkspace)
    ws.mode, ws.world, ws.reason = "symm", world, ""
    ws.max_bytes, ws.max_blocks, ws.slab_bytes = 16 << 20, 64, 64 << 10
    ws.path_bytes = paths or {"one_shot": 512 << 10, "two_shot": 8 << 20}
    ws._logged_paths = set()
    return ws


def test_path_choice_and_its_log_line(caplog):
    ws = _symm_workspace()
    assert ws.path_for(4096, 2, rows=1) == "one_shot"
    assert ws.path_for(1 << 20, 2) == "two_shot"       # 2 MB
    assert ws.path_for(8 << 20, 2) == "nccl"           # 16 MB > the 8 MB two-shot limit
    assert ws.path_for(8192 * 40000, 2, rows=8192) == "nccl"
    # a row too wide for the fused kernel's registers goes two-shot even when small
    assert ws.path_for(40000, 2, rows=1) == "two_shot"
    with caplog.at_level(logging.INFO, logger="fastdecode"):
        for _ in range(3):
            ws._log_path(*ws._choose(4096, 2, 1), 8192, fused=True)
            ws._log_path(*ws._choose(8 << 20, 2, None), 16 << 20, fused=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "all-reduce + add + RMSNorm of 8192 bytes on 4 ranks takes one_shot: <= 524288 bytes" in lines[0]
    assert "takes nccl: > 8388608 bytes" in lines[1]


def test_ranks_on_several_nodes_use_nccl(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE < world size: no peer memory (every rank agrees before any setup)."""
    ws = _symm_workspace(world=16)
    ws.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ar._spans_nodes(16) and not ar._spans_nodes(8)
    assert "16 ranks span several nodes (LOCAL_WORLD_SIZE=8)" in ws._peer_problem()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not ar._spans_nodes(16) and ws._peer_problem() == ""


# ----------------------------------------------------------------------------- GPU (NCCL + peers)


def _gpu_checks(rank, world):
    exact_nccl = world == 2  # NCCL sums in its own order above 2 ranks
    dev = torch.device("cuda", rank)
    with CommWorkspace(max_bytes=16 << 20, check=True) as ws:
        assert ws.mode == "symm", ws.reason
        seed = 0
        ran = {}
        for path in ("one_shot", "two_shot", "nccl"):
            ws.path_bytes = {"one_shot": 1 << 40, "two_shot": 0} if path == "one_shot" else (
                {"one_shot": 0, "two_shot": 1 << 40} if path == "two_shot" else {"one_shot": 0, "two_shot": 0})
            for M in (1, 7, 32, 128, 1024, 4096):
                for H in (4096, 8192, 4099):
                    if ws.path_for(M * H, 2, rows=M) != path or ws.path_for(M * H, 2) != path:
                        continue  # too large for this path's buffers
                    seed += 1
                    ran[path] = ran.get(path, 0) + 1
                    parts = _partials(world, (M, H), torch.bfloat16, dev, seed)
                    y = all_reduce(parts[rank], ws)
                    nccl = parts[rank].clone()
                    dist.all_reduce(nccl)
                    ref = all_reduce_ref(parts)
                    # the sum this path must give bit for bit: rank order, or NCCL's own order
                    summed = ref if path != "nccl" or exact_nccl else nccl
                    assert torch.equal(y, summed), f"{path} M={M} H={H}"
                    assert_close(y, ref)
                    assert_close(y, nccl)
                    res = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
                    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
                    y_ref, r_ref = fd.fused_add_rms_norm_ref(summed, res, w, 1e-6)
                    r = res.clone()
                    out = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws)
                    assert torch.equal(r, r_ref), f"fused {path} M={M} H={H}"
                    assert_close(out, y_ref)
                    r = res.clone()
                    q, s = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws, fp8=True)
                    q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(summed, res, w, 1e-6)
                    assert_fp8_close(q, q_ref, s, s_ref)
        assert all(ran.get(p, 0) >= 6 for p in ("one_shot", "two_shot", "nccl")), ran
        # graph capture + many replays with fresh inputs: one-shot fused and plain, two-shot plain
        ws.path_bytes = {"one_shot": 512 << 10, "two_shot": 8 << 20}
        M, H = 4, 8192
        x = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
        xb = torch.empty(512, 4096, device=dev, dtype=torch.bfloat16)  # 4 MB: two-shot
        res = torch.zeros(M, H, device=dev, dtype=torch.bfloat16)
        w = torch.randn(H, device=dev, dtype=torch.bfloat16)
        for t in (x, xb):
            t.normal_()
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            all_reduce(xb, ws)
            all_reduce_add_rms_norm(x, res.clone(), w, 1e-6, ws)
        torch.cuda.current_stream().wait_stream(s)
        ws.check = False  # no host-side collectives inside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yb = all_reduce(xb, ws)
            out = all_reduce_add_rms_norm(x, res, w, 1e-6, ws)
        for it in range(10000):
            check = it % 1000 == 0 or it > 9990
            if check:
                gen = torch.Generator(device=dev).manual_seed(it * world + rank)
                x.normal_(generator=gen)
                xb.normal_(generator=gen)
                res.normal_(generator=gen)
                r0 = res.clone()
                xs = [torch.empty_like(x) for _ in range(world)]
                xbs = [torch.empty_like(xb) for _ in range(world)]
                dist.all_gather(xs, x)
                dist.all_gather(xbs, xb)
            g.replay()
            if check:
                torch.cuda.synchronize()
                assert torch.equal(yb, all_reduce_ref(xbs)), f"replay {it}: two-shot"
                y_ref, r_ref = fd.fused_add_rms_norm_ref(all_reduce_ref(xs), r0, w, 1e-6)
                assert torch.equal(res, r_ref), f"replay {it}: residual"
                torch.testing.assert_close(out, y_ref, atol=8e-3, rtol=8e-3)
        torch.cuda.synchronize()
        del g


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpus_paths_graphs_and_stress(world):
    if N_GPU and N_GPU < world:
        pytest.skip(f"needs {world} GPUs, this machine has {N_GPU}")
    run_ranks(world, _gpu_checks, backend="nccl", timeout=600)
