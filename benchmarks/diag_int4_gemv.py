"""Where the int4 GEMV's time goes at decode sizes (issue 18), one H200, baselines in the same process.

    python benchmarks/diag_int4_gemv.py --out DIR/diag_int4_gemv.json            # the timing sweep
    ncu --profile-from-start off ... python benchmarks/diag_int4_gemv.py --ncu   # one launch of each case
    python benchmarks/diag_int4_gemv.py --ablate --out DIR/ablate_int4_mma.json  # the mma kind's ablations, M = 1

Timing rows (graph replays of 20 calls, rotated weights, median of 30; ``harness.time_cuda``), W4A16 group 128
in the engine's zero mode (``bench.int4.ZERO_MODE``, ``--zero-mode``), bf16, on 8B / 70B-TP2 projection shapes
at M = 1, 4, 16:

* ``dispatch``: ``int4_linear`` as the engine calls it (the tuned table);
* ``mma ...``: the tensor-core kind with an explicit config, the table's and variants of it (``MASK_X``: padding
  tokens as masked loads; ``TILES``: layout tiles a loop step; stages, rows, warps, splits);
* ``probe ...``: the same packed words streamed by a kernel that only XORs them (the access pattern's and the
  grid's ceiling, no conversion, no MMA);
* ``copy``: ``Tensor.copy_`` of the packed words (bytes read + written; the copy-rate floor);
* baselines: ``cublas_bf16`` (``torch.mm`` on the dequantised weight) and ``tinygemm`` (``aten._weight_int4pack_mm``,
  the gpt-fast / torchao kernel).

GB/s count the packed weight + scales + x + out (``bench.int4._Operands.bytes_int4``). Every Triton row is checked
against the fp32 reference before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fastdecode.bench.harness import make_row, print_table, time_cuda  # noqa: E402
from fastdecode.bench.int4 import ZERO_MODE, ZERO_MODES, _Operands, _ok  # noqa: E402
from fastdecode.bench.int4_scripts import baseline_rows, flush_rows, timed_configs  # noqa: E402
from fastdecode.ops import pdl_override  # noqa: E402
from fastdecode.ops.int4 import get_int4_config  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "70b_tp2.gate_up": (28672, 8192)}
MS = (1, 4, 16)


@triton.jit
def _probe_kernel(qw_ptr, out_ptr, N, KW, split_k, BLOCK_N: tl.constexpr, BW: tl.constexpr):
    """XOR of this program's words of BLOCK_N rows, BW words a row a step (the GEMV's loads without its maths)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)
    kb_total = KW // BW
    kb_per = tl.cdiv(kb_total, split_k)
    kb_start = pid_k * kb_per
    kb_end = tl.minimum(kb_start + kb_per, kb_total)
    ptrs = qw_ptr + rn[:, None] * KW + tl.arange(0, BW)[None, :]
    acc = tl.zeros((BLOCK_N, BW), dtype=tl.int32)
    for kb in range(kb_start, kb_end):
        acc ^= tl.load(ptrs + kb * BW)
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(acc, axis=1), mask=offs_n < N)


def probe_calls(ops, cfg):
    bn, bw, split = cfg["BLOCK_N"], cfg["BW"], cfg["SPLIT_K"]
    fns = []
    for p in ops.packed:
        out = torch.empty(split, ops.N, dtype=torch.int32, device="cuda")
        KW = p.qweight.shape[1]
        grid = (split, triton.cdiv(ops.N, bn))
        fns.append(lambda p=p, out=out, KW=KW, grid=grid: _probe_kernel[grid](
            p.qweight, out, ops.N, KW, split, BLOCK_N=bn, BW=bw, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"]))
    return fns


def copy_calls(ops):
    dst = torch.empty_like(ops.packed[0].qweight)
    return [lambda p=p: dst.copy_(p.qweight) for p in ops.packed]


def mma_variants(M: int, base: dict, few: bool = False) -> list[tuple[str, dict]]:
    """The table's config and variants of it (name, config). ``few``: the 64-row 4-warp tile at splits 1 and 8
    only, as session 18's table ran it (no MASK_X, no CVT1) and as session 19's (both)."""
    out = [("mma table", base)] if base.get("kind") == "mma" else []
    bm = max(16, 1 << max(M - 1, 0).bit_length())
    if few:
        for sk in (1, 8):
            for mask, cvt1 in ((False, False), (True, True)):
                c = {"kind": "mma", "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": sk, "num_warps": 4,
                     "num_stages": 3, "MASK_X": mask, "CVT1": cvt1}
                out.append((f"mma bn64 w4 s3 sk{sk}" + (" mask cvt1" if cvt1 else ""), c))
        return out
    for bn, nw in ((64, 4), (128, 4), (64, 2)):
        for st in (3,):
            for mask, tiles in ((False, 1), (True, 1), (True, 2)):
                for sk in (1, 2, 4, 8):
                    c = {"kind": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256, "SPLIT_K": sk, "num_warps": nw,
                         "num_stages": st, "MASK_X": mask, "TILES": tiles}
                    out.append((f"mma bn{bn} w{nw} s{st} sk{sk}" + (" mask" if mask else "") + (" t2" if tiles > 1
                                                                                               else ""), c))
    return out


PROBES = [(f"probe bn{bn} bw{bw} s{st} sk{sk}", {"BLOCK_N": bn, "BW": bw, "SPLIT_K": sk, "num_warps": 4,
                                                  "num_stages": st})
          for bn, bw in ((64, 32), (128, 32), (16, 128), (32, 128)) for st in (1, 3) for sk in (1, 4)]


def sweep(out_path: Path | None, shapes, ms, few: bool = False, zero_mode: str = ZERO_MODE) -> list[dict]:
    rows = []
    for sname, (N, K) in shapes.items():
        ops = _Operands(N, K, 128, max(ms), zero_mode)
        for M in ms:
            shape = {"name": sname, "M": M, "N": N, "K": K, "group": 128}
            nbytes = ops.bytes_int4(M)
            rows += baseline_rows("int4_gemv_diag", ops, M, shape)
            err = _ok(ops, M, "dispatch")
            t = time_cuda(ops.calls(M, "dispatch"), graph=True)
            impl, cfg = get_int4_config(M, N, K, 128, torch.device("cuda"))
            rows.append(make_row("int4_gemv_diag", "dispatch", shape, t, bytes_moved=nbytes, config=cfg,
                                 **({"error": err} if err else {})))
            if M == 1:
                t = time_cuda(copy_calls(ops), graph=True)
                rows.append(make_row("int4_gemv_diag", "copy", shape, t, bytes_moved=2 * ops.packed[0].qweight.nbytes))
                for name, pc in (PROBES[:2] if few else PROBES):
                    t = time_cuda(probe_calls(ops, pc), graph=True)
                    rows.append(make_row("int4_gemv_diag", name, shape, t, bytes_moved=nbytes, config=pc))
            best = timed_configs("int4_gemv_diag", ops, M, shape, mma_variants(M, cfg, few), rows)
            if best is not None:
                rows.append(dict(best, impl="mma best of sweep", variant=best["impl"]))
            print_table([r for r in rows if r["shape"] == shape and not r["impl"].startswith(("mma bn", "probe"))]
                        + sorted([r for r in rows if r["shape"] == shape and r["impl"].startswith("probe")
                                  and r["median_us"]], key=lambda r: r["median_us"])[:2],
                        ("impl", "median_us", "tbps", "variant"))
        del ops
        flush_rows(rows, zero_mode, out_path)
    return rows


ABLATIONS = {0: "the kernel", 1: "no conversion", 2: "no mma", 3: "no conversion, no mma"}


def ablation_configs(N: int, K: int, cfg: dict) -> list[tuple[str, dict]]:
    """(name, config) of the mma kind's ablations (``kernels.int4_mma``'s ABLATE) on the table's mma config, or on the
    gate_up table's tile (64 rows, 4 warps, 3 stages, MASK_X) with split 4 below 64 M weights, split 1 above; then the
    same tile on 2 warps (``mma.sync``: no wgmma waits or fences) with and without its conversion."""
    if cfg.get("kind") != "mma":
        cfg = {"kind": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4 if N * K < 2 ** 26 else 1,
               "num_warps": 4, "num_stages": 3, "MASK_X": True}
    out = [(f"ablate {a}: {what}", {**cfg, "_ABLATE": a}) for a, what in ABLATIONS.items()]
    sync = {**cfg, "BLOCK_N": 64, "num_warps": 2}
    return out + [(f"mma.sync 64x2w ablate {a}: {ABLATIONS[a]}", {**sync, "_ABLATE": a}) for a in (0, 1)]


def _timed(rows: list, ops, shape: dict, nbytes: int, name: str, c: dict, impl: str = "triton", check: bool = False,
           **extra) -> None:
    """An ``ablate`` row: ``c`` timed at M = 1 on ``ops.packed`` as it is (``check``: its outputs against the
    reference first, an ``error`` key where they miss)."""
    err = _ok(ops, 1, impl, c) if check else None
    t = time_cuda(ops.calls(1, impl, c), graph=True)
    rows.append(make_row("int4_gemv_ablate", name, shape, t, bytes_moved=nbytes, config=c, **extra,
                         **({"error": err} if err else {})))


def ablate(out_path: Path | None, shapes, zero_mode: str = ZERO_MODE) -> list[dict]:
    """Where the mma kind's time goes at one token: the kernel against itself without the nibble conversion, without
    the MMAs (and their waits, fences and x loads), and without both, beside the probe (the words streamed, XOR-ed),
    the copy rate and the table's own choice; the kernel and the skeleton (ablate 3) without PDL, as the probe runs;
    the kernel at 2 and 4 stages; the kernel and the table's choice on one column of scales and zeros (their lines
    hot in L1 / L2: what their loads' latency costs). An ablation's outputs are not the product: only the kernel's
    rows are checked."""
    rows = []
    for sname, (N, K) in shapes.items():
        ops = _Operands(N, K, 128, 1, zero_mode)
        shape = {"name": sname, "M": 1, "N": N, "K": K, "group": 128}
        nbytes = ops.bytes_int4(1)
        timed = functools.partial(_timed, rows, ops, shape, nbytes)
        impl, cfg = get_int4_config(1, N, K, 128, torch.device("cuda"))
        timed("dispatch", cfg, "dispatch", check=True)
        t = time_cuda(copy_calls(ops), graph=True)
        rows.append(make_row("int4_gemv_ablate", "copy", shape, t, bytes_moved=2 * ops.packed[0].qweight.nbytes))
        for name, pc in PROBES[:4]:
            t = time_cuda(probe_calls(ops, pc), graph=True)
            rows.append(make_row("int4_gemv_ablate", name, shape, t, bytes_moved=nbytes, config=pc))
        for name, c in ablation_configs(N, K, cfg):  # only the kernel itself (ablate 0) is checked
            timed(name, c, check=c["_ABLATE"] == 0, ablate=c["_ABLATE"])
        base = ablation_configs(N, K, cfg)[0][1]
        with pdl_override(False):  # the skeleton and the kernel as the probe runs: no PDL, no first-tile prefetch
            for a in (0, 3):
                timed(f"ablate {a} no pdl", {**base, "_ABLATE": a}, ablate=a, pdl=False)
        for st in (2, 4):  # the pipeline's depth (words and x in flight: num_stages - 1 steps ahead)
            timed(f"stages {st}", {**base, "num_stages": st}, ablate=0)
        # the scales' and zeros' latency: one column of them (N, 1), so every step re-reads the lines of its first
        # (L1 / L2 hits, no DRAM after the first step); the words as before; the outputs are not the product
        ops.packed = [dataclasses.replace(p, scales=p.scales[:, :1].contiguous(),
                                          zeros=None if p.zeros is None else p.zeros[:, :1].contiguous())
                      for p in ops.packed]
        timed("hot params: the kernel", base, params="hot")
        timed("hot params: the table's choice", cfg, params="hot")
        print_table([r for r in rows if r["shape"] == shape], ("impl", "median_us", "tbps"))
        del ops, timed  # the partial holds the operands too: both go before flush_rows empties the cache
        flush_rows(rows, zero_mode, out_path)
    return rows


def ncu_cases():
    """One launch of each case between cudaProfilerStart / Stop (run under ``ncu --profile-from-start off``)."""
    cases = [("8b.qkv", 1, None), ("8b.gate_up", 1, None), ("8b.gate_up", 16, None), ("8b.down", 1, None),
             ("8b.gate_up", 1, {"kind": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1,
                                "num_warps": 4, "num_stages": 3, "MASK_X": True, "TILES": 1}),
             ("8b.gate_up", 1, {"kind": "mma", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1,
                                "num_warps": 2, "num_stages": 3, "MASK_X": True, "TILES": 1})]
    cudart = torch.cuda.cudart()
    for sname, M, cfg in cases:
        N, K = SHAPES[sname]
        ops = _Operands(N, K, 128, M)
        fn = ops.calls(M, "dispatch" if cfg is None else "triton", cfg)[0]
        for _ in range(3):
            fn()
        probe = probe_calls(ops, {"BLOCK_N": 64, "BW": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3})[0]
        probe()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        fn()
        if cfg is None and M == 1:
            probe()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        print(f"ncu case {sname} M={M} {cfg or get_int4_config(M, N, K, 128, torch.device('cuda'))}", flush=True)
        del ops
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--ncu", action="store_true", help="one launch of each ncu case, profiler start / stop around it")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--few", action="store_true", help="two probes and a few mma variants only (mma_variants)")
    p.add_argument("--zero-mode", default=ZERO_MODE, choices=ZERO_MODES, help="the weights' zero mode")
    p.add_argument("--ablate", action="store_true",
                   help="M = 1 only: the mma kind without its conversion and / or its MMAs (ablate)")
    a = p.parse_args(argv)
    with torch.no_grad():
        if a.ncu:
            ncu_cases()
            return 0
        shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
        if a.ablate:
            ablate(Path(a.out) if a.out else None, shapes, a.zero_mode)
            return 0
        sweep(Path(a.out) if a.out else None, shapes, tuple(int(m) for m in a.ms.split(",")), a.few, a.zero_mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
