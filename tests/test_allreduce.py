"""All-reduce and fused all-reduce + add + RMSNorm, one process per rank.

CPU: 2 gloo processes through the fallback path (the API, its errors, the workspace life cycle).
GPU (2 GPUs, ``multigpu``): every symmetric-memory path against NCCL + the reference, eagerly and
under CUDA-graph replay, and a stress run of 10,000 replays with checked results.
"""


import pytest
import torch
import torch.distributed as dist

import fastdecode as fd
from helpers import assert_fp8_close, run_ranks
from fastdecode.ops.allreduce import CommWorkspace, all_reduce, all_reduce_add_rms_norm, all_reduce_ref


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
            torch.testing.assert_close(y, all_reduce_ref(parts), atol=0, rtol=0)
            x = parts[rank].clone()
            assert all_reduce(x, ws, inplace=True) is x
            torch.testing.assert_close(x, all_reduce_ref(parts), atol=0, rtol=0)
        # fused: equals fused_add_rms_norm(all_reduce(x)) on every rank
        H = 576
        parts = _partials(world, (5, H), torch.float16, "cpu", 99)
        res = _partials(1, (5, H), torch.float16, "cpu", 7)[0]
        w = _partials(1, (H,), torch.float16, "cpu", 8)[0]
        y_ref, r_ref = fd.fused_add_rms_norm_ref(all_reduce_ref(parts), res, w, 1e-6)
        r = res.clone()
        y = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws)
        torch.testing.assert_close(r, r_ref, atol=0, rtol=0)
        torch.testing.assert_close(y, y_ref, atol=1e-3, rtol=1e-3)
        r = res.clone()
        q, s = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws, fp8=True)
        q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(all_reduce_ref(parts), res, w, 1e-6)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
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


def test_gloo_fallback_two_processes():
    run_ranks(2, _cpu_checks, backend="gloo", timeout=600)


def test_workspace_needs_init():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        CommWorkspace()


# ----------------------------------------------------------------------------- GPU (NCCL + peers)


def _gpu_checks(rank, world):
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
                    assert torch.equal(y, ref), f"{path} M={M} H={H}"
                    torch.testing.assert_close(y, nccl, atol=1e-2, rtol=1e-2)
                    res = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
                    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
                    y_ref, r_ref = fd.fused_add_rms_norm_ref(ref, res, w, 1e-6)
                    r = res.clone()
                    out = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws)
                    assert torch.equal(r, r_ref), f"fused {path} M={M} H={H}"
                    torch.testing.assert_close(out, y_ref, atol=8e-3, rtol=8e-3)
                    r = res.clone()
                    q, s = all_reduce_add_rms_norm(parts[rank], r, w, 1e-6, ws, fp8=True)
                    q_ref, s_ref, _ = fd.fused_add_rms_norm_fp8_ref(ref, res, w, 1e-6)
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
def test_two_gpus_paths_graphs_and_stress():
    run_ranks(2, _gpu_checks, backend="nccl", timeout=600)
