"""Benchmark: all-reduce and fused all-reduce + add + RMSNorm against NCCL (+ PyTorch), in CUDA graphs.

Run on a machine with >= 2 GPUs: ``fastdecode bench allreduce --world N`` (spawns one process per GPU,
N = 2, 4, 8, ...). Each timing is CUDA-graph replays of 20 back-to-back calls, after a ``dist.barrier``
so that ranks start together; rank 0 reports the median of 30 replays (the slowest rank's). Rows also
record which path ``auto`` took; they are merged into ``--out`` (a row of the same op, impl and
shape, world size included, is replaced; the others are kept). ``--write-config`` stores the
crossovers measured here (one-shot / two-shot / NCCL, ``crossovers_from_rows``) for this
GPU and world size in ``configs/allreduce_<gpu>.json``, the table the dispatcher reads.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastdecode.bench.harness import Timing, _stats, capture_graph, env_info, merge_rows, print_table
from fastdecode.ops._common import load_config_table
from fastdecode.ops.allreduce import config_path

CALLS = 20


def _time_graph(fn, reps=30) -> Timing:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def calls():
        for _ in range(CALLS):
            fn()

    g = capture_graph(calls)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / CALLS)
    del g
    # every rank's median; report the slowest rank (an all-reduce is as fast as its last rank)
    t = torch.tensor([_stats(ts).median_us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Timing(float(t), min(ts), max(ts), len(ts))


def _row(rows, rank, op, impl, shape, t, nbytes, **extra):
    if rank == 0:
        r = {"op": op, "impl": impl, "shape": shape, "median_us": round(t.median_us, 2), "bytes": nbytes,
             "algbw_gbps": round(nbytes / (t.median_us * 1e-6) / 1e9, 1), **extra, **env_info()}
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("op", "impl", "shape", "median_us")}), flush=True)


HIDDEN = (4096, 8192, 16384)


# ----------------------------------------------------------------------------- crossovers as data


def crossovers_from_rows(rows: list[dict], world: int) -> dict:
    """Path limits from the plain all-reduce rows of ``fastdecode bench allreduce`` at ``world`` ranks.

    One-shot keeps every size up to the largest one from which on, going up from the smallest, it
    was measured and no slower than both two-shot and NCCL; two-shot then keeps the sizes above that
    while it is no slower than NCCL; NCCL takes the rest. Sizes are those measured (no interpolation).
    """
    times: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("op") != "all_reduce" or r.get("shape", {}).get("world") != world or r.get("median_us") is None:
            continue
        impl = {"nccl": "nccl", "fastdecode_one_shot": "one_shot", "fastdecode_two_shot": "two_shot"}.get(r["impl"])
        if impl:
            times.setdefault(int(r["shape"]["bytes"]), {})[impl] = float(r["median_us"])
    sizes = sorted(b for b, t in times.items() if "nccl" in t)
    if not sizes:
        raise ValueError(f"no plain all-reduce rows with an NCCL baseline at world size {world}")
    inf = float("inf")
    one = 0
    for b in sizes:
        t = times[b]
        if t.get("one_shot", inf) <= min(t["nccl"], t.get("two_shot", inf)):
            one = b
        else:
            break
    two = one
    for b in (b for b in sizes if b > one):
        if times[b].get("two_shot", inf) <= times[b]["nccl"]:
            two = b
        else:
            break
    return {"one_shot": one, "two_shot": two}


def store_crossovers(gpu_name: str, world: int, path_bytes: dict, source: str, path: Optional[Path] = None) -> Path:
    """Store ``path_bytes`` for ``world`` ranks in the GPU's table (other world sizes are kept)."""
    path = Path(path) if path is not None else config_path(gpu_name)
    table = json.loads(path.read_text()) if path.is_file() else {"gpu": gpu_name, "world": {}}
    table.setdefault("world", {})[str(world)] = {
        "one_shot": int(path_bytes["one_shot"]), "two_shot": int(path_bytes["two_shot"]), "source": source}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    load_config_table.cache_clear()  # the dispatcher reads the new limits
    return path


# ----------------------------------------------------------------------------- the benchmark


def _worker(rank, world, port, out, quick, write_config):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import fastdecode as fd
    from fastdecode.ops.allreduce import CommWorkspace, all_reduce, all_reduce_add_rms_norm

    rows: list[dict] = []
    dev = torch.device("cuda", rank)
    ws = CommWorkspace(max_bytes=64 << 20)
    auto_paths = dict(ws.path_bytes)
    force = {"one_shot": {"one_shot": 1 << 40, "two_shot": 0},
             "two_shot": {"one_shot": 0, "two_shot": 1 << 40}}

    # 1. fused all-reduce + add + RMSNorm vs NCCL + PyTorch (and NCCL + our fused norm)
    for H in HIDDEN:
        w = torch.randn(H, device=dev, dtype=torch.bfloat16)
        for M in ((1, 32, 512) if quick else (1, 8, 32, 128, 512, 2048, 4096)):
            x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
            r = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
            shape = {"M": M, "H": H, "world": world}
            nb = M * H * 2

            def nccl_torch():
                dist.all_reduce(x)
                h = x + r
                r.copy_(h)
                return F.rms_norm(h, (H,), w, 1e-6)

            def nccl_fd():
                dist.all_reduce(x)
                return fd.fused_add_rms_norm(x, r, w, 1e-6)

            ws.path_bytes = auto_paths
            path = ws.path_for(M * H, 2, rows=M)
            _row(rows, rank, "all_reduce_add_rms_norm", "nccl+torch_eager", shape, _time_graph(nccl_torch), nb)
            _row(rows, rank, "all_reduce_add_rms_norm", "nccl+fastdecode_norm", shape, _time_graph(nccl_fd), nb)
            _row(rows, rank, "all_reduce_add_rms_norm", "fastdecode", shape,
                 _time_graph(lambda: all_reduce_add_rms_norm(x, r, w, 1e-6, ws)), nb, path=path)
            _row(rows, rank, "all_reduce_add_rms_norm_fp8", "fastdecode", shape,
                 _time_graph(lambda: all_reduce_add_rms_norm(x, r, w, 1e-6, ws, fp8=True)), nb, path=path)
            x = r = None  # release the buffers (the closures above still name x and r)
    # 2. plain all-reduce, 8 KB .. 64 MB: every path, and what auto picks
    sizes = [8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    if not quick:
        sizes += [16 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20]
    for nb in sorted(sizes):
        x = torch.randn(nb // 2, device=dev, dtype=torch.bfloat16)
        shape = {"bytes": nb, "world": world}
        _row(rows, rank, "all_reduce", "nccl", shape, _time_graph(lambda: dist.all_reduce(x)), nb)
        for path, pb in force.items():
            ws.path_bytes = pb
            if ws.path_for(nb // 2, 2) == path:
                _row(rows, rank, "all_reduce", f"fastdecode_{path}", shape,
                     _time_graph(lambda: all_reduce(x, ws, inplace=True)), nb)
        ws.path_bytes = auto_paths
        _row(rows, rank, "all_reduce", "fastdecode", shape,
             _time_graph(lambda: all_reduce(x, ws, inplace=True)), nb, path=ws.path_for(nb // 2, 2))
        x = None  # release the buffer (the closures above still name x)
    ws.destroy()
    if rank == 0:
        if out:  # rows of other world sizes (and sizes not run now) in the file are kept
            merge_rows(rows, out)
        print_table(rows, ("op", "impl", "shape", "median_us", "path"))
        if write_config:
            limits = crossovers_from_rows(rows, world)
            path = store_crossovers(torch.cuda.get_device_name(dev), world, limits,
                         f"fastdecode bench allreduce --world {world} (git {env_info()['git_sha']})")
            print(f"crossovers for {world} ranks: {limits} -> {path}")
    dist.destroy_process_group()


def run(world: int = 2, out=None, quick=False, write_config=False):
    if world < 2:
        raise ValueError(f"the all-reduce benchmark needs a world size >= 2, got {world}")
    if torch.cuda.device_count() < world:
        raise RuntimeError(f"the all-reduce benchmark needs {world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, out, quick, write_config), nprocs=world)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--write-config", action="store_true",
                   help="store the measured crossovers for this GPU and world size in configs/allreduce_<gpu>.json")
    a = p.parse_args(argv)
    run(a.world, a.out, a.quick, a.write_config)


if __name__ == "__main__":
    main()
