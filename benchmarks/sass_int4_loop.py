"""Where the int4 FMA kernel's K loop issues its global loads, in the sm_90 SASS (CPU only: Triton bundles ptxas and
nvdisasm; no GPU needed).

At one token the FMA kernel is latency-bound: each K step waits on its loads, and a load issued late in the loop
body waits a whole memory latency on the critical path. This compiles ``kernels.int4._int4_linear_kernel`` for sm_90
with the embedded model's int4 format (Q4_1: group 32, "min", fp16 scales and mins, bf16 x) and a tile, disassembles
it, and prints each global load of the K loop (the body between the loop's label and its backward branch) with its
position as a fraction of the body: the weight words (``LDG.E.128``), x (``LDG.E.64`` and narrower vector loads) and
the scales and mins (``LDG.E.U16``). Session 31: the next step's words issue at 77 % of the body, so the double buffer
(PREFETCH) overlaps only the last quarter; half of the scale and min loads issue in the second half.

    PYTHONPATH=src python benchmarks/sass_int4_loop.py --block-n 16 --warps 4 [--norm] [--prefetch 0|1|2] \
        [--scale-pf] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastdecode.kernels.int4 import _int4_linear_kernel

_SIG = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "bias_ptr": "*bf16", "xs_ptr": "*fp32",
        "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "nw_ptr": "*bf16", "eps": "fp32", "M": "i32",
        "N": "i32", "K": "i32", "G": "i32", "KW": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_part": "i32",
        "split_k": "i32"}
# 16-byte aligned, as the launcher's tensors are (Triton specialises them so at launch)
_ALIGNED = {"x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "xs_ptr", "out_ptr", "part_ptr", "lock_ptr", "nw_ptr",
            "N", "K", "G", "KW", "stride_xm", "stride_om"}


def sass(block_n: int, warps: int, norm: bool, prefetch: int = 1, scale_pf: bool = False, even_k: bool = False,
         norm_loop: bool = False, fmt: str = "q4_1", packed: int = 0, pf_unroll: bool = False,
         sum16: bool = False) -> str:
    """The kernel's sm_90 SASS at one token (BLOCK_M 1, BLOCK_K 256, one split, PDL on): with ``norm`` the RMSNorm
    inside (qkv / gate_up of the norm_gemm step), else the residual add (o / down); ``prefetch``: the kernel's
    PREFETCH (0 none, 1 the next step's words, 2 two steps ahead); ``scale_pf``: SCALE_PF (the next step's scales
    and mins with its words); ``norm_loop``: NORM_LOOP (with ``norm``, the loop sums the rows' squares); ``fmt``: the
    weight format, "q4_1" (the embedded model's) or "g128" (the 8B int4 model's: group 128, uint8 zeros, bf16
    scales); ``packed``: the kernel's PACKED (``kernels.int4_packed``; g128 only): 1, or 2 with the groups' scales and
    zeros loaded in pairs (what ``packed_mode`` picks for the 8B's aligned weights); ``pf_unroll``: PF_UNROLL (with
    ``packed`` and ``prefetch`` 2: two buffers, the loop unrolled by two, so one iteration is two K steps); ``sum16``:
    SUM16 (with ``packed``: a thread's four words summed in 16-bit pairs before the fp32 fold)."""
    group, zero_mode, spg = (32, 2, 1) if fmt == "q4_1" else (128, 1, 4)
    consts = dict(GROUP=group, ZERO_MODE=zero_mode, HAS_BIAS=False, USE_DOT=False, UNIFORM=True, SPG=spg,
                  EVEN_K=even_k,
                  X_SCALE_MODE=0, FAST_CVT=False, PREFETCH=prefetch, SCALE_PF=scale_pf, NORM_LOOP=norm_loop,
                  LOP3_ASM=True, USE_PDL=True, PACKED=int(packed), PF_UNROLL=pf_unroll, SUM16=sum16,
                  L2_SLAB=0, PF_LANES=32 * warps, X_NORM=norm, NORM_AFFINE=norm, NORM_NB=2048, NORM_RM=1,
                  ACCUMULATE=not norm, X_GLU=False, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=256, SPLIT=False)
    sig = {**_SIG, **({} if fmt == "q4_1" else {"s_ptr": "*bf16", "z_ptr": "*u8"}), **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in _ALIGNED}
    cc = triton.compile(ASTSource(_int4_linear_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": 1})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def _loop(text: str) -> tuple[list[str], int, int]:
    """The SASS lines and the [start, end) of the K loop's body: the last backward-branch loop whose body holds a
    128-bit load."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln.strip()))}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    body = None
    for start, end in loops:
        if any("LDG.E.128" in ln for ln in lines[start:end]):
            body = (start, end)
    if body is None:
        raise ValueError("no K loop with a 128-bit load found in the SASS")
    return lines, body[0], body[1]


def loop_loads(text: str) -> list[tuple[float, str]]:
    """(position in the loop body, 0 to 1; the load's opcode) of each global load of the innermost backward-branch
    loop (the K loop: the last loop whose body holds a 128-bit load)."""
    lines, start, end = _loop(text)
    out = []
    for i in range(start, end):
        m = re.search(r"\b(LDG\.E[.\w]*)", lines[i])
        if m:
            out.append((round((i - start) / (end - start), 3), m.group(1)))
    return out


def loop_opcodes(text: str) -> Counter:
    """The K loop's SASS instructions by opcode (the mnemonic before its first dot)."""
    lines, start, end = _loop(text)
    ops = Counter()
    for ln in lines[start:end + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m and re.search(r"/\*[0-9a-f]{4}\*/", ln):
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, default=16)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--norm", action="store_true", help="the RMSNorm inside (else the residual add)")
    p.add_argument("--prefetch", type=int, default=1, choices=(0, 1, 2), help="the kernel's PREFETCH depth")
    p.add_argument("--scale-pf", action="store_true", help="SCALE_PF: the next step's scales with its words")
    p.add_argument("--norm-loop", action="store_true", help="NORM_LOOP: with --norm, the loop sums the squares")
    p.add_argument("--format", default="q4_1", choices=("q4_1", "g128"),
                   help="the embedded model's Q4_1 (group 32, mins) or the 8B's g128 (uint8 zeros, bf16 scales)")
    p.add_argument("--packed", type=int, nargs="?", const=2, default=0, choices=(1, 2),
                   help="PACKED (kernels.int4_packed; --format g128): 2 (the default) with the groups' parameters "
                        "loaded in pairs, 1 without")
    p.add_argument("--pf-unroll", action="store_true",
                   help="PF_UNROLL (with --packed and --prefetch 2): the loop unrolled by two, counted a K step")
    p.add_argument("--sum16", action="store_true",
                   help="SUM16 (with --packed): a thread's four words summed in 16-bit pairs before the fp32 fold")
    p.add_argument("--count", action="store_true", help="the loop's instructions per weight value, by opcode")
    p.add_argument("--even-k", action="store_true", help="EVEN_K (K a multiple of 256: no column masks)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    text = sass(a.block_n, a.warps, a.norm, prefetch=a.prefetch, scale_pf=a.scale_pf, norm_loop=a.norm_loop,
                even_k=a.even_k, fmt=a.format, packed=a.packed, pf_unroll=a.pf_unroll,
                sum16=a.sum16)
    if a.count:
        ops = loop_opcodes(text)
        steps = 2 if a.pf_unroll else 1  # K steps an iteration of the loop
        values = a.block_n * 256 // (32 * a.warps)  # weight values per thread and K step (one token row)
        total = sum(ops.values()) / steps
        if a.json:
            print(json.dumps({"instructions": total, "values": values, "steps": steps, "opcodes": dict(ops)}))
            return
        print(f"{total:g} instructions a K step, {values} values a thread: {total / values:.2f} a value"
              + (f" (an iteration of {steps} steps: counts below)" if steps > 1 else ""))
        print(", ".join(f"{k} {v}" for k, v in ops.most_common()))
        return
    loads = loop_loads(text)
    if a.json:
        print(json.dumps([{"at": at, "op": op} for at, op in loads]))
        return
    for at, op in loads:
        print(f"{at:6.3f}  {op}")


if __name__ == "__main__":
    main()
