"""``fastdecode selfcheck``: the single-device kernels against their references, on whatever machine this is.

Checked: RMSNorm and fused add + RMSNorm (native, FP8 dynamic and static output; the in-place
residual too), SiLU-and-mul (same three outputs), FP8 quantisation (per token, per tensor, static),
the skinny ``linear`` (also with the RMSNorm before it, ``rms_norm_linear``, and the residual add after it,
``add_linear_``), W8A8 ``linear_fp8`` and ``int4_linear``, decode attention and the RoPE + KV-cache
write, our Triton kernels forced; then the all-reduce and all-reduce + add + RMSNorm (native and FP8)
across two processes: gloo on a CPU, every peer-memory path (one-shot, two-shot) and NCCL on 2+ GPUs
(on one GPU it is skipped, and says so). ``--quick``: tiny sizes only.

On a CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by re-running this
command in a fresh process, since triton reads it at import); on a GPU they run natively.
"""

from __future__ import annotations

import os
import sys
import time
import unittest.mock

import torch


def _close(a, b, tol=1e-2):
    """Max error relative to the largest reference value (the outputs are O(1))."""
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
    return err <= tol, f"max rel err {err:.2e}"


def _fp8_close(q, q_ref, s, s_ref):
    """Scales equal up to fp32 summation order, and every FP8 value within one e4m3 step of the
    reference's. Under the interpreter the fp32 -> fp8 cast may drop the carry into the next power
    of two (docs/architecture.md, "The Triton interpreter"): a value p where the reference has 2p
    (within a step) is accepted there."""
    from fastdecode.ops._common import interpreter_on
    from fastdecode.quant.fp8 import fp8_mismatches

    s_err = ((s.float() - s_ref.float()).abs() / s_ref.float().abs()).max().item()
    bad, lost = fp8_mismatches(q, q_ref, lost_carry_ok=interpreter_on())
    detail = f"{bad} of {q.numel()} values off by > 1 e4m3 step"
    if lost:
        detail += f" ({lost_carry_note(lost)})"
    return bad == 0 and s_err <= 1e-4, f"{detail}, scale rel err {s_err:.1e}"


def lost_carry_note(n: int) -> str:
    """The selfcheck's words for values accepted as the interpreter's lost carries (``fp8_mismatches``)."""
    return (f"{n} more are half the reference: the Triton interpreter's FP8 cast, unlike the GPU's, drops the carry "
            "when a value rounds up to the next power of two; accepted")


def _fp8_pair(got, ref):
    """_fp8_close of two (q, scale) pairs."""
    return _fp8_close(got[0], ref[0], got[1], ref[1])


def _with_residual(result, r1, r_ref):
    """``result`` and the in-place residual update: bit for bit the reference's rounding."""
    ok, detail = result
    same = torch.equal(r1, r_ref)
    return ok and same, f"{detail}; residual {'exact' if same else 'DIFFERS from the reference'}"


def _row_checks(dev, act, M, H):
    """Norm, SiLU-and-mul and quantisation, every output mode, at one (M, H)."""
    import fastdecode as fd

    x = torch.randn(M, H, device=dev, dtype=act)
    r = torch.randn(M, H, device=dev, dtype=act)
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(act)
    tag = f"M={M:<3} H={H}"

    yield f"rms_norm                    {tag}", _close(fd.rms_norm(x, w), fd.rms_norm_ref(x, w))
    q_ref, s_ref = fd.rms_norm_fp8_ref(x, w)
    yield f"rms_norm_fp8 dynamic        {tag}", _fp8_pair(fd.rms_norm_fp8(x, w), (q_ref, s_ref))
    static = s_ref.max().reshape(1)  # a realistic per-tensor scale: the largest per-token one
    yield f"rms_norm_fp8 static         {tag}", _fp8_pair(fd.rms_norm_fp8(x, w, scale=static),
                                                          fd.rms_norm_fp8_ref(x, w, scale=static))

    y_ref, r_ref = fd.fused_add_rms_norm_ref(x, r, w)
    r1 = r.clone()
    yield f"fused_add_rms_norm          {tag}", _with_residual(
        _close(fd.fused_add_rms_norm(x, r1, w), y_ref), r1, r_ref)
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w)
    r1 = r.clone()
    yield f"fused_add_rms_norm_fp8 dyn  {tag}", _with_residual(
        _fp8_pair(fd.fused_add_rms_norm_fp8(x, r1, w), (q_ref, s_ref)), r1, r_ref)
    static = s_ref.max().reshape(1)
    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(x, r, w, scale=static)
    r1 = r.clone()
    yield f"fused_add_rms_norm_fp8 stat {tag}", _with_residual(
        _fp8_pair(fd.fused_add_rms_norm_fp8(x, r1, w, scale=static), (q_ref, s_ref)), r1, r_ref)

    gu = torch.randn(M, 2 * H, device=dev, dtype=act)
    tag_i = f"M={M:<3} I={H}"
    yield f"silu_and_mul                {tag_i}", _close(fd.silu_and_mul(gu), fd.silu_and_mul_ref(gu))
    q_ref, s_ref = fd.silu_and_mul_fp8_ref(gu)
    yield f"silu_and_mul_fp8 dynamic    {tag_i}", _fp8_pair(fd.silu_and_mul_fp8(gu), (q_ref, s_ref))
    static = s_ref.max().reshape(1)
    yield f"silu_and_mul_fp8 static     {tag_i}", _fp8_pair(fd.silu_and_mul_fp8(gu, static),
                                                            fd.silu_and_mul_fp8_ref(gu, static))

    for mode, kw in (("per-token", {"per_token": True}), ("per-tensor", {}),
                     ("static", {"scale": x.float().abs().amax().reshape(1) / 448})):
        yield f"quantize_fp8 {mode:<14} {tag}", _fp8_pair(fd.quantize_fp8(x, **kw), fd.quantize_fp8_ref(x, **kw))


def _gemm_checks(dev, act, M, N, K):
    """The skinny linear (bf16 on a GPU; fp16 on the CPU, whose interpreter gets bf16 dots wrong),
    W8A8 linear_fp8 and the int4-weight linear, our Triton kernels forced (not cuBLAS)."""
    import fastdecode as fd
    from fastdecode.quant import quantize_activation_fp8, quantize_int4, quantize_weight_fp8

    x = torch.randn(M, K, device=dev, dtype=act)
    w = (torch.randn(N, K, device=dev) / K**0.5).to(act)  # outputs O(1)
    b = torch.randn(N, device=dev, dtype=act)
    tag = f"M={M:<3} N={N} K={K}"
    yield f"linear                      {tag}", _close(fd.linear(x, w, b, impl="triton"), fd.linear_ref(x, w, b))
    wq, ws = quantize_weight_fp8(w, "channel")
    xq, xs = quantize_activation_fp8(x)
    yield f"linear_fp8                  {tag}", _close(fd.linear_fp8(xq, xs, wq, ws, b, out_dtype=act, impl="triton"),
                                                       fd.linear_fp8_ref(xq, xs, wq, ws, b, out_dtype=act))
    # the RMSNorm inside the GEMM after it, the residual add inside the GEMM's epilogue (norm_gemm's ops)
    h, g = x * 3, (torch.rand(K, device=dev) + 0.5).to(act)
    yield f"rms_norm_linear             {tag}", _close(fd.rms_norm_linear(h, g, w, b, impl="triton"),
                                                       fd.rms_norm_linear_ref(h, g, w, b))
    r = torch.randn(M, N, device=dev, dtype=act)
    yield f"add_linear_                 {tag}", _close(fd.add_linear_(r.clone(), x, w, b, impl="triton"),
                                                       fd.add_linear_ref(r, x, w, b))
    packed = quantize_int4(w, 128, scale_dtype=act)
    yield f"int4_linear                 {tag}", _close(fd.int4_linear(x, packed, b, impl="triton"),
                                                       fd.int4_linear_ref(x, packed, b))


def _attention_checks(dev, act, B, Hq, Hkv, T, D):
    """Decode attention over ragged cache lengths, the RoPE + KV-cache write that precedes it, and the two in one
    kernel (what the engine's decode step runs)."""
    from fastdecode.ops.attention import (
        decode_attention, decode_attention_ref, rope_decode_attention, rope_decode_attention_ref, rope_kv_write,
        rope_kv_write_ref,
    )

    tag = f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D}"
    q = torch.randn(B, Hq, D, device=dev, dtype=act)
    k, v = (torch.randn(B, Hkv, T, D, device=dev, dtype=act) for _ in range(2))
    seq_lens = torch.randint(1, T + 1, (B,), device=dev, dtype=torch.int32)
    seq_lens[0] = T  # the full cache and a one-token sequence, whatever the draw
    seq_lens[-1] = 1
    yield f"decode_attention            {tag}", _close(decode_attention(q, k, v, seq_lens),
                                                       decode_attention_ref(q, k, v, seq_lens))
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=dev, dtype=act)
    ang = torch.rand(T, D // 2, device=dev) * 6.3
    rope = torch.stack([ang.cos(), ang.sin()], dim=-1)
    pos = torch.randint(0, T, (B,), device=dev)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    got = rope_kv_write(qkv, rope, pos, k1, v1, Hq)
    ref = rope_kv_write_ref(qkv, rope, pos, k2, v2, Hq)
    ok, detail = _close(got, ref)
    same = torch.equal(k1, k2) and torch.equal(v1, v2)
    yield f"rope_kv_write               {tag}", (ok and same, f"{detail}; caches {'exact' if same else 'DIFFER'}")
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    got = rope_decode_attention(qkv, rope, pos, k1, v1, Hq)
    ok, detail = _close(got, rope_decode_attention_ref(qkv, rope, pos, k2, v2, Hq))
    ok_k, _ = _close(k1, k2)  # RoPE's rounding of the new k may differ by an ulp
    same = ok_k and torch.equal(v1, v2)
    yield f"rope_decode_attention       {tag}", (ok and same, f"{detail}; caches {'match' if same else 'DIFFER'}")


def _allreduce_rank(rank, world, port, backend, act_name, quick, results):
    """One rank of the all-reduce checks: every path against the reference, lines into ``results``."""
    import torch.distributed as dist

    import fastdecode as fd
    from fastdecode.ops.allreduce import CommWorkspace, all_reduce, all_reduce_add_rms_norm, all_reduce_ref

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    act = getattr(torch, act_name)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
            dev = f"cuda:{rank}"
            # path limits that force each path: everything one-shot, everything two-shot, everything NCCL
            paths = {"one_shot": {"one_shot": 1 << 30, "two_shot": 1 << 30},
                     "two_shot": {"one_shot": 0, "two_shot": 1 << 30},
                     "nccl": {"one_shot": 0, "two_shot": 0}}
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            dev, paths = "cpu", {"gloo": None}
        shapes = ((1, 256), (3, 111)) if quick else ((1, 4096), (5, 8192), (64, 4096))
        for name, limits in paths.items():
            with CommWorkspace(path_bytes=limits) as ws:
                for M, H in shapes:
                    g = torch.Generator().manual_seed(1000 * M + H)  # the same partials on every rank
                    parts = [torch.randn(M, H, generator=g).to(act).to(dev) for _ in range(world)]
                    res = torch.randn(M, H, generator=g).to(act).to(dev)
                    w = (1 + 0.1 * torch.randn(H, generator=g)).to(act).to(dev)
                    tag = f"{name:<8} world={world} M={M:<3} H={H}"
                    total = all_reduce_ref(parts)
                    # at 2 ranks every path sums in rank order: bit for bit; above, NCCL/gloo round their own way
                    got = all_reduce(parts[rank], ws)
                    if torch.equal(got, total):
                        ok, detail = True, "exact"
                    elif world == 2:
                        ok, detail = False, f"differs from the rank-order sum ({_close(got, total)[1]})"
                    else:
                        ok, detail = _close(got, total)
                    results.put((rank, f"all_reduce                  {tag}", ok, detail))
                    r1 = res.clone()
                    y = all_reduce_add_rms_norm(parts[rank], r1, w, 1e-6, ws)
                    y_ref, r_ref = fd.fused_add_rms_norm_ref(total, res, w, 1e-6)
                    check = _close(y, y_ref)
                    results.put((rank, f"all_reduce_add_rms_norm     {tag}",
                                 *(_with_residual(check, r1, r_ref) if world == 2 else check)))
                    if dev != "cpu" and torch.cuda.get_device_capability(dev) < (8, 9):
                        continue
                    r1 = res.clone()
                    q, s = all_reduce_add_rms_norm(parts[rank], r1, w, 1e-6, ws, fp8=True)
                    q_ref, s_ref, r_ref = fd.fused_add_rms_norm_fp8_ref(total, res, w, 1e-6)
                    check = _fp8_close(q, q_ref, s, s_ref)
                    results.put((rank, f"all_reduce_add_rms_norm_fp8 {tag}",
                                 *(_with_residual(check, r1, r_ref) if world == 2 else check)))
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported as a failed check, never a hang
        results.put((rank, f"all-reduce rank {rank}", False, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        results.put((rank, None, True, "done"))


def _allreduce_checks(dev: str, quick: bool, timeout: float = 300.0):
    """The all-reduce across processes: two gloo ranks on a CPU, one NCCL rank per GPU (2+) on GPUs."""
    import socket

    import torch.multiprocessing as mp

    n_gpu = torch.cuda.device_count() if dev == "cuda" else 0
    if dev == "cuda" and n_gpu < 2:
        print("  skip  all-reduce: needs two or more GPUs, this machine has one", flush=True)
        return
    world, backend = (n_gpu, "nccl") if dev == "cuda" else (2, "gloo")
    act = "bfloat16" if dev == "cuda" else "float16"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, backend, act, quick, results))
             for r in range(world)]
    for p in procs:
        p.start()
    done, t_end = 0, time.time() + timeout
    while done < world:
        try:
            rank, name, ok, detail = results.get(timeout=max(1.0, t_end - time.time()))
        except Exception:  # queue.Empty: a rank hangs or died without a word
            yield "all-reduce", (False, f"ranks silent for {timeout:.0f} s (hang or crash)")
            break
        if name is None:
            done += 1
        elif rank == 0 or not ok:  # rank 0 speaks for all; any rank's failure is shown
            yield name + (f" (rank {rank})" if rank else ""), (ok, detail)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        if p.exitcode not in (0, None):
            yield f"all-reduce rank process {procs.index(p)}", (False, f"exit code {p.exitcode}")


def _checks(dev: str, quick: bool = False):
    act = torch.bfloat16 if dev == "cuda" else torch.float16
    rows = ((1, 256), (3, 111)) if quick else ((1, 4096), (7, 4099), (64, 8192))
    gemms = ((1, 64, 256), (3, 40, 256)) if quick else ((1, 256, 1024), (16, 200, 1024))
    for M, H in rows:
        yield from _row_checks(dev, act, M, H)
    for M, N, K in gemms:
        yield from _gemm_checks(dev, act, M, N, K)
    attn = ((2, 4, 2, 16, 32),) if quick else ((3, 32, 8, 300, 128), (1, 8, 8, 1024, 64))
    for B, Hq, Hkv, T, D in attn:
        yield from _attention_checks(dev, act, B, Hq, Hkv, T, D)
    yield from _allreduce_checks(dev, quick)


def main(argv=None) -> int:
    argv = list(argv or [])
    quick = "--quick" in argv
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "fastdecode", "selfcheck", *argv], env)
    where = "GPU " + torch.cuda.get_device_name() if dev == "cuda" else "CPU, Triton interpreter"
    print(f"fastdecode selfcheck: Triton kernels against their PyTorch references ({where})")
    failed = 0
    t0 = time.time()
    # the kernels, never a silent fallback to the references
    with unittest.mock.patch.dict(os.environ, FASTDECODE_BACKEND="triton"):
        for name, (ok, detail) in _checks(dev, quick):
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    print(f"{'all kernels match their references' if not failed else f'{failed} checks FAILED'}"
          f" ({time.time() - t0:.1f} s)")
    if dev == "cuda" and not failed:
        print("GPU found: benchmark them with `fastdecode bench kernels`, `bench linear` and `bench int4`")
    return 1 if failed else 0
