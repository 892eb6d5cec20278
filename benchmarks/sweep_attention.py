"""Development sweep: the decode step's attention at Llama-3.1-8B heads (32 q / 8 kv, D 128, bf16), batch 1 (GPU).

RoPE + KV write + attention as one kernel (``rope_decode_attention``) in several launch configs (tile rows, warps,
splits merged by a kernel or by the last split to arrive), against the two kernels it replaces (``rope_kv_write``
then ``decode_attention``), each call on its own layer's cache (32 caches, as the 32 layers of a step), timed in a
CUDA graph without PDL (``bench.harness.time_cuda``): the per-call latency the PDL-off decode profile attributes to
the ``attention`` family. The 32 caches of a short context (T 129: 17 MB)
stay in L2 here, where a decode step's GEMMs evict them: the profile's calls take longer.

    PYTHONPATH=src python benchmarks/sweep_attention.py --out rows.json
"""

from __future__ import annotations

import argparse
import math

import torch

from fastdecode.bench.harness import make_row, time_cuda, write_rows
from fastdecode.kernels.attention import launch_rope_decode_attention
from fastdecode.ops.attention import (
    decode_attention, decode_attention_config, rope_decode_attention, rope_decode_attention_ref, rope_kv_write,
)

HQ, HKV, D, LAYERS = 32, 8, 128, 32


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="129:1,129:64,129:128,4096:2048",
                    help="T:pos pairs (cache length: position of the new token)")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for case in a.cases.split(","):
        T, pos = map(int, case.split(":"))
        shape = {"model": "llama-3.1-8b", "batch": 1, "cache_len": T, "pos": pos, "dtype": "bfloat16"}
        ang = torch.rand(T, D // 2, device=dev) * 6.3
        rope = torch.stack([ang.cos(), ang.sin()], dim=-1)
        ip = torch.full((1,), pos, dtype=torch.int64, device=dev)
        seq = (ip + 1).to(torch.int32)
        qkv = [torch.randn(1, (HQ + 2 * HKV) * D, device=dev, dtype=dt) for _ in range(LAYERS)]
        kc = [torch.randn(1, HKV, T, D, device=dev, dtype=dt) for _ in range(LAYERS)]
        vc = [torch.randn(1, HKV, T, D, device=dev, dtype=dt) for _ in range(LAYERS)]
        out = torch.empty(1, HQ, D, device=dev, dtype=dt)
        q = torch.empty(1, HQ, D, device=dev, dtype=dt)
        ref = rope_decode_attention_ref(qkv[0], rope, ip, kc[0].clone(), vc[0].clone(), HQ).float()

        def two(i):
            rope_kv_write(qkv[i], rope, ip, kc[i], vc[i], HQ, out=q)
            decode_attention(q, kc[i], vc[i], seq, out=out)

        base = decode_attention_config(1, HQ, HKV, T, D, dt, dev)
        o_part = torch.empty(1, HQ, 64, base["BLOCK_D"], dtype=torch.float32, device=dev)
        lse = torch.empty(1, HQ, 64, dtype=torch.float32, device=dev)
        locks = torch.zeros(HKV, dtype=torch.int32, device=dev)
        variants = [("two_kernels", None), ("fused_default", base)]
        for bn in (16, 32, 64, 128):
            for w in (4, 8):
                variants.append((f"fused_n{bn}_w{w}", {**base, "BLOCK_N": bn, "num_warps": w}))
        # more programs per sequence, the last split of each kv head merging (no merge kernel)
        if base["NUM_SPLITS"] > 1:
            variants.append(("fused_default_merge_in", {**base, "MERGE_IN_KERNEL": True}))
        for S in (2, 4, 8):
            for bn in (16, 32):
                variants.append((f"fused_s{S}_n{bn}_merge_in", {**base, "NUM_SPLITS": S, "BLOCK_N": bn,
                                                                 "MERGE_IN_KERNEL": True}))
        for tag, cfg in variants:
            if cfg is None:
                calls = [lambda i=i: two(i) for i in range(LAYERS)]
            elif tag == "fused_default":
                calls = [lambda i=i: rope_decode_attention(qkv[i], rope, ip, kc[i], vc[i], HQ, out=out)
                         for i in range(LAYERS)]
            else:
                calls = [lambda i=i, c=cfg: launch_rope_decode_attention(qkv[i], rope, ip, kc[i], vc[i], out, o_part,
                                                                         lse, HQ, 1 / math.sqrt(D), c, locks=locks)
                         for i in range(LAYERS)]
            try:
                calls[0]()
                err = (out.float() - ref).abs().max().item()
                t = time_cuda(calls, graph=True, calls_per_graph=LAYERS)
            except Exception as e:  # a config that does not launch (resources): recorded
                rows.append(make_row("sweep_decode_attention", tag, shape, None, error=e, config=cfg))
                print(f"T={T:<5} pos={pos:<5} {tag:<16} failed: {e}", flush=True)
                continue
            rows.append(make_row("sweep_decode_attention", tag, shape, t, config=cfg, max_abs_err=err))
            print(f"T={T:<5} pos={pos:<5} {tag:<16} {t.median_us:6.2f} us  err {err:.1e}  {cfg}", flush=True)
    if a.out:
        write_rows(rows, a.out)


if __name__ == "__main__":
    main()
