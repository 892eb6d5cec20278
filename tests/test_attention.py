"""Decode attention: the Triton kernel (interpreter on CPU, or the GPU) against decode_attention_ref,
and the reference against a plain per-sequence softmax."""

import math

import pytest
import torch

from fastdecode.kernels.attention import launch_decode_attention, launch_rope_decode_attention
from fastdecode.ops.attention import (
    decode_attention, decode_attention_config, decode_attention_ref, rope_decode_attention, rope_decode_attention_ref,
    rope_kv_write, rope_kv_write_ref,
)
from helpers import TOLERANCES, assert_close, decode_positions_and_caches, poison_, precompile_calls

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: tl.dot on bf16 is wrong under the interpreter; the kernel uses its broadcast path there
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hkv, T, D, num_splits): MHA, GQA 3 (SmolLM2), GQA 4 (Llama 3), MQA, odd D, one split / many
SHAPES = [
    (1, 4, 4, 37, 64, 1),
    (3, 9, 3, 130, 64, None),
    (2, 8, 2, 300, 128, 4),
    (1, 8, 1, 70, 128, 3),
    (2, 6, 2, 99, 80, 2),
]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """On a GPU, the kernels of the two dtype x shape sweeps below compiled first in parallel threads
    (helpers.precompile_calls; ~1 s each one after another on the H200's host), from the same input builders, so
    with the same specialisations. Nothing happens under the interpreter."""
    if DEV != "cuda":
        return
    import fastdecode.kernels.attention as KA

    calls = []
    for (B, Hq, Hkv, T, D, splits), dtype in ((s, d) for s in SHAPES for d in DTYPES):
        q, k, v, seq_lens = _inputs(B, Hq, Hkv, T, D, dtype, strided=B > 1)
        calls.append(lambda a=(q, k, v, seq_lens), n=splits: decode_attention(*a, num_splits=n, backend="triton"))
    for (B, Hq, Hkv, T, D, splits), dtype in ((s, d) for s in FUSED_SHAPES for d in DTYPES):
        qkv, rope, pos, k, v = _fused_inputs(B, Hq, Hkv, T, D, dtype)
        calls.append(lambda a=(qkv, rope, pos, k, v, Hq), n=splits: rope_decode_attention(*a, num_splits=n,
                                                                                         backend="triton"))
    precompile_calls(calls, [(KA, "_decode_attention_kernel"), (KA, "_decode_attention_merge_kernel"),
                             (KA, "_rope_decode_attention_kernel")])


def _inputs(B, Hq, Hkv, T, D, dtype, strided=False):
    q = torch.randn(B, Hq, D, device=DEV).to(dtype)
    if strided:  # a cache with room for more sequences and positions: views, as the engine passes them
        k = torch.randn(B + 1, Hkv, T + 5, D, device=DEV).to(dtype)[:B, :, :T]
        v = torch.randn(B + 1, Hkv, T + 5, D, device=DEV).to(dtype)[:B, :, :T]
    else:
        k = torch.randn(B, Hkv, T, D, device=DEV).to(dtype)
        v = torch.randn(B, Hkv, T, D, device=DEV).to(dtype)
    seq_lens = torch.randint(1, T + 1, (B,), dtype=torch.int32, device=DEV)
    seq_lens[0] = T  # the full cache
    return q, k, v, seq_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_ref(shape, dtype):
    B, Hq, Hkv, T, D, splits = shape
    q, k, v, seq_lens = _inputs(B, Hq, Hkv, T, D, dtype, strided=shape[0] > 1)
    out = poison_(torch.empty_like(q))
    got = decode_attention(q, k, v, seq_lens, num_splits=splits, out=out, backend="triton")
    assert got is out
    assert_close(got, decode_attention_ref(q, k, v, seq_lens))


# fp32 tl.dot runs as TF32 on GPUs (the dispatcher never takes the dot path for fp32; this test forces it). The
# tensor cores read the top 19 bits of each fp32 operand (q, k, then p, v): truncation, not rounding. Emulated on
# the CPU at this test's shapes over 300 seeds, max |err| / (1 + |ref|) was 1.49e-3 with truncation (0.81e-3 with
# round-to-nearest); the H200 gave 1.07e-3 once (1 of 1,024 values, 6be8360), over the fp16 bound of 1e-3 this
# case had. Twice the emulated maximum:
TF32 = dict(atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dot_and_broadcast_paths_agree(dtype):
    """Both inner products of the kernel (tl.dot with the head group padded to 16, and broadcast-sum)."""
    B, Hq, Hkv, T, D = 2, 8, 2, 90, 64
    q, k, v, seq_lens = _inputs(B, Hq, Hkv, T, D, dtype)
    ref = decode_attention_ref(q, k, v, seq_lens)
    for use_dot in (True, False):
        cfg = decode_attention_config(B, Hq, Hkv, T, D, dtype, q.device, num_splits=3)
        cfg.update(USE_DOT=use_dot, BLOCK_G=16 if use_dot else 4, BLOCK_N=32)
        out = poison_(torch.empty_like(q))
        o_part = torch.empty(B, Hq, 3, cfg["BLOCK_D"], dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, 3, dtype=torch.float32, device=q.device)
        launch_decode_attention(q, k, v, seq_lens, out, o_part, lse, 1 / math.sqrt(D), cfg)
        tol = TF32 if (use_dot and dtype == torch.float32 and DEV == "cuda") else TOLERANCES[dtype]
        torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_splits_longer_than_sequence():
    """More splits than BLOCK_N-tiles in a short sequence: empty splits must weigh nothing."""
    q, k, v, _ = _inputs(2, 4, 2, 200, 64, torch.float32)
    seq_lens = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    got = decode_attention(q, k, v, seq_lens, num_splits=16, backend="triton")
    assert_close(got, decode_attention_ref(q, k, v, seq_lens))
    # seq_len 1: the output is exactly v at position 0
    torch.testing.assert_close(got[0], v[0, :, 0].repeat_interleave(2, 0), atol=1e-6, rtol=0)


def test_ref_against_explicit_softmax():
    B, Hq, Hkv, T, D = 3, 6, 3, 20, 16
    q, k, v, seq_lens = _inputs(B, Hq, Hkv, T, D, torch.float32)
    scale = 0.3
    ref = decode_attention_ref(q, k, v, seq_lens, scale)
    for b in range(B):
        L = int(seq_lens[b])
        for h in range(Hq):
            kh, vh = k[b, h // 2, :L], v[b, h // 2, :L]
            p = torch.softmax((kh @ q[b, h]) * scale, 0)
            torch.testing.assert_close(ref[b, h], p @ vh, atol=1e-5, rtol=1e-5)


def test_torch_backend_equals_ref():
    q, k, v, seq_lens = _inputs(2, 8, 2, 50, 32, torch.bfloat16)
    got = decode_attention(q, k, v, seq_lens, backend="torch")
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, seq_lens), atol=0, rtol=0)


def test_argument_errors():
    q, k, v, seq_lens = _inputs(2, 8, 2, 50, 32, torch.float32)
    with pytest.raises(ValueError, match=r"q heads \(8\) must be a multiple of the cache's kv heads \(3\)"):
        decode_attention(q, k[:, :1].expand(2, 3, 50, 32), v[:, :1].expand(2, 3, 50, 32), seq_lens)
    with pytest.raises(ValueError, match="seq_lens must have dtype in \\(int32\\), got int64"):
        decode_attention(q, k, v, seq_lens.long())
    with pytest.raises(ValueError, match="v_cache must have the shape of k_cache"):
        decode_attention(q, k, v[:, :, :40], seq_lens)
    with pytest.raises(ValueError, match="k_cache and v_cache must have q's dtype"):
        decode_attention(q, k.half(), v.half(), seq_lens)
    with pytest.raises(ValueError, match="num_splits must be an integer in"):
        decode_attention(q, k, v, seq_lens, num_splits=0)
    with pytest.raises(ValueError, match="k_cache must have unit stride in its last dimension"):
        kt = k.transpose(2, 3).contiguous().transpose(2, 3)
        decode_attention(q, kt, v, seq_lens)
    if DEV == "cpu":
        with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 50\]"):
            decode_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4096, 32768])
def test_llama8b_shapes_gpu(T):
    """Llama-3.1-8B heads (32 q / 8 kv, D 128), bf16, short to long contexts, GPU only."""
    B = 4
    q, k, v, seq_lens = _inputs(B, 32, 8, T, 128, torch.bfloat16)
    got = decode_attention(q, k, v, seq_lens, backend="triton")
    assert_close(got, decode_attention_ref(q, k, v, seq_lens))


# ----------------------------------------------------------------------------- RoPE + KV-cache write


def _rope_inputs(B, Hq, Hkv, T, D, dtype):
    from fastdecode.models.config import ModelConfig
    from fastdecode.models.llama import rope_cache

    cfg = ModelConfig(dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hkv, vocab_size=8, intermediate_size=8,
                      rope_theta=10000.0, max_seq_len=T)
    rope = rope_cache(cfg, T, device=DEV)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=DEV).to(dtype)
    pos = torch.randperm(T, device=DEV)[:B]
    k = poison_(torch.empty(B + 1, Hkv, T, D, device=DEV, dtype=dtype))[:B]
    v = poison_(torch.empty(B + 1, Hkv, T, D, device=DEV, dtype=dtype))[:B]
    return qkv, rope, pos, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,D", [(1, 4, 4, 64), (3, 9, 3, 64), (2, 32, 8, 128), (2, 6, 2, 80)])
def test_rope_kv_write_matches_ref(B, Hq, Hkv, D, dtype):
    qkv, rope, pos, k, v = _rope_inputs(B, Hq, Hkv, 40, D, dtype)
    k2, v2 = k.clone(), v.clone()
    q = rope_kv_write(qkv, rope, pos, k, v, Hq, backend="triton")
    q_ref = rope_kv_write_ref(qkv, rope, pos, k2, v2, Hq)
    assert_close(q, q_ref)
    rows = torch.arange(B, device=DEV)
    assert_close(k[rows, :, pos], k2[rows, :, pos])
    torch.testing.assert_close(v[rows, :, pos], v2[rows, :, pos], atol=0, rtol=0)
    # nothing else in the caches was touched (still NaN)
    k[rows, :, pos] = float("nan")
    assert torch.isnan(k.float()).all()


def test_rope_kv_write_ref_matches_model_rope():
    """The fused reference against the model's prefill path (apply_rope + slicing): same rotation."""
    from fastdecode.models.llama import apply_rope

    B, Hq, Hkv, D = 2, 4, 2, 16
    qkv, rope, pos, k, v = _rope_inputs(B, Hq, Hkv, 30, D, torch.float32)
    q = rope_kv_write_ref(qkv, rope, pos, k, v, Hq)
    x = qkv.view(B, 1, -1, D)
    cs = rope[pos].unsqueeze(1)  # [B, 1, D/2, 2]
    torch.testing.assert_close(q, apply_rope(x[:, :, :Hq], cs)[:, 0], atol=1e-6, rtol=0)
    rows = torch.arange(B, device=DEV)
    torch.testing.assert_close(k[rows, :, pos], apply_rope(x[:, :, Hq:Hq + Hkv], cs)[:, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("op", [rope_kv_write, rope_decode_attention], ids=["rope_kv_write", "rope_decode_attention"])
def test_rope_argument_errors(op):
    """The checks both RoPE ops share (ops.attention._check_rope_args)."""
    qkv, rope, pos, k, v = _rope_inputs(2, 4, 2, 30, 16, torch.float32)
    with pytest.raises(ValueError, match=r"qkv must have \(n_q_heads \+ 2 \* Hkv\) \* D = 128 columns, got 80"):
        op(qkv[:, :80], rope, pos, k, v, 4)
    with pytest.raises(ValueError, match="n_q_heads must be a positive multiple of the kv heads"):
        op(qkv, rope, pos, k, v, 3)
    with pytest.raises(ValueError, match=r"rope must have shape \(T, 8, 2\)"):
        op(qkv, rope[:, :4], pos, k, v, 4)
    with pytest.raises(ValueError, match="v_cache must match k_cache"):
        op(qkv, rope, pos, k, v[:, :, :20], 4)
    with pytest.raises(ValueError, match="k_cache must hold 2 sequences"):
        op(qkv, rope, pos, k[:1], v[:1], 4)
    if DEV == "cpu":
        with pytest.raises(ValueError, match=r"input_pos must lie in \[0, 29\]"):
            op(qkv, rope, torch.tensor([3, 30]), k, v, 4)


# ----------------------------------------------------------------------------- RoPE + KV write + attention, one op


def _fused_inputs(B, Hq, Hkv, T, D, dtype):
    """qkv, rope, positions (0 and T - 1 among them), and random caches with one spare sequence and spare
    positions (views, as the engine passes them)."""
    qkv, rope, _, _, _ = _rope_inputs(B, Hq, Hkv, T, D, dtype)
    return (qkv, rope, *decode_positions_and_caches(B, Hkv, T, D, dtype, DEV))


# (B, Hq, Hkv, T, D, num_splits): MHA, GQA 3 over 4 splits, Llama-3 heads in one split, MQA, odd half (D 80),
# D 16 (the half padded to 16 for tl.dot), more splits than tiles
FUSED_SHAPES = [
    (1, 4, 4, 40, 64, None),
    (3, 9, 3, 300, 64, 4),
    (2, 32, 8, 70, 128, 1),
    (1, 8, 1, 130, 128, 3),
    (2, 6, 2, 99, 80, 2),
    (2, 4, 2, 30, 16, None),
    (2, 4, 2, 20, 32, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_rope_decode_attention_matches_ref(shape, dtype):
    """The fused kernel against rope_kv_write_ref + decode_attention_ref (seq_lens = pos + 1): the output, the
    new K / V written at pos, every other cache entry untouched; out poisoned."""
    B, Hq, Hkv, T, D, splits = shape
    qkv, rope, pos, k, v = _fused_inputs(B, Hq, Hkv, T, D, dtype)
    k2, v2 = k.clone(), v.clone()
    out = poison_(torch.empty(B, Hq, D, device=DEV, dtype=dtype))
    got = rope_decode_attention(qkv, rope, pos, k, v, Hq, num_splits=splits, out=out, backend="triton")
    assert got is out
    ref = rope_decode_attention_ref(qkv, rope, pos, k2, v2, Hq)
    assert_close(got, ref)
    rows = torch.arange(B, device=DEV)
    assert_close(k[rows, :, pos], k2[rows, :, pos])  # RoPE in fp32 either way; the rounding may differ by 1 ulp
    torch.testing.assert_close(v, v2, atol=0, rtol=0)
    k[rows, :, pos] = k2[rows, :, pos]
    torch.testing.assert_close(k, k2, atol=0, rtol=0)


def test_rope_decode_attention_equals_the_two_kernels():
    """The fused op computes what rope_kv_write then decode_attention compute (fp32: the same numbers up to the
    summation order)."""
    B, Hq, Hkv, T, D = 3, 8, 2, 90, 64
    qkv, rope, pos, k, v = _fused_inputs(B, Hq, Hkv, T, D, torch.float32)
    k2, v2 = k.clone(), v.clone()
    got = rope_decode_attention(qkv, rope, pos, k, v, Hq, num_splits=3, backend="triton")
    q = rope_kv_write(qkv, rope, pos, k2, v2, Hq, backend="triton")
    want = decode_attention(q, k2, v2, (pos + 1).to(torch.int32), num_splits=3, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k2, atol=0, rtol=0)
    torch.testing.assert_close(v, v2, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_decode_attention_dot_and_broadcast_paths_agree(dtype):
    B, Hq, Hkv, T, D = 2, 8, 2, 90, 64
    qkv, rope, pos, k0, v0 = _fused_inputs(B, Hq, Hkv, T, D, dtype)
    ref = rope_decode_attention_ref(qkv, rope, pos, k0.clone(), v0.clone(), Hq)
    for use_dot in (True, False):
        k, v = k0.clone(), v0.clone()
        cfg = decode_attention_config(B, Hq, Hkv, T, D, dtype, qkv.device, num_splits=3)
        cfg.update(USE_DOT=use_dot, BLOCK_G=16 if use_dot else 4, BLOCK_N=32)
        out = poison_(torch.empty(B, Hq, D, device=DEV, dtype=dtype))
        o_part = torch.empty(B, Hq, 3, cfg["BLOCK_D"], dtype=torch.float32, device=DEV)
        lse = torch.empty(B, Hq, 3, dtype=torch.float32, device=DEV)
        launch_rope_decode_attention(qkv, rope, pos, k, v, out, o_part, lse, Hq, 1 / math.sqrt(D), cfg)
        tol = TF32 if (use_dot and dtype == torch.float32 and DEV == "cuda") else TOLERANCES[dtype]
        torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("splits", [1, 3])
def test_rope_decode_attention_ignores_what_lies_past_pos(splits):
    """Cache rows at and past each sequence's position hold NaN (stale or never written): nothing of them reaches
    the output. With one split the kernel reads the first tile before it knows pos, and masks those rows at use."""
    B, Hq, Hkv, T, D = 3, 8, 2, 70, 32
    qkv, rope, pos, k, v = _fused_inputs(B, Hq, Hkv, T, D, torch.float32)
    pos = torch.tensor([0, 5, 40], device=DEV)
    for b in range(B):
        k[b, :, int(pos[b]):] = float("nan")
        v[b, :, int(pos[b]):] = float("nan")
    k2, v2 = k.clone(), v.clone()
    got = rope_decode_attention(qkv, rope, pos, k, v, Hq, num_splits=splits, backend="triton")
    assert not got.isnan().any()
    assert_close(got, rope_decode_attention_ref(qkv, rope, pos, k2, v2, Hq))


@pytest.mark.parametrize("splits,block_n", [(2, 16), (4, 16), (3, 32)])
def test_rope_decode_attention_merge_in_kernel(splits, block_n):
    """MERGE_IN_KERNEL (not the ops' default yet; benchmarks/sweep_attention.py times it): the last split of each
    (sequence, kv head) to arrive merges the splits, no merge kernel; the counters end at 0, so a second launch on
    the same counters is right too."""
    B, Hq, Hkv, T, D = 3, 8, 2, 70, 32
    qkv, rope, pos, k0, v0 = _fused_inputs(B, Hq, Hkv, T, D, torch.float32)
    ref = rope_decode_attention_ref(qkv, rope, pos, k0.clone(), v0.clone(), Hq)
    cfg = decode_attention_config(B, Hq, Hkv, T, D, torch.float32, qkv.device, num_splits=splits)
    cfg.update(BLOCK_N=block_n, MERGE_IN_KERNEL=True)
    locks = torch.zeros(B * Hkv + 5, dtype=torch.int32, device=DEV)
    o_part = torch.empty(B, Hq, splits, cfg["BLOCK_D"], dtype=torch.float32, device=DEV)
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=DEV)
    for _ in range(2):
        k, v = k0.clone(), v0.clone()
        out = poison_(torch.empty(B, Hq, D, device=DEV))
        launch_rope_decode_attention(qkv, rope, pos, k, v, out, o_part, lse, Hq, 1 / math.sqrt(D), cfg, locks=locks)
        assert_close(out, ref)
        assert not locks.any()
    with pytest.raises(ValueError, match="MERGE_IN_KERNEL needs 6 zeroed int32 counters"):
        launch_rope_decode_attention(qkv, rope, pos, k, v, out, o_part, lse, Hq, 1 / math.sqrt(D), cfg)


def test_rope_decode_attention_first_position_returns_v():
    """pos 0: the only key is the new one, so the output is the new v (from registers, not the cache)."""
    B, Hq, Hkv, T, D = 2, 4, 2, 16, 32
    qkv, rope, _, k, v = _fused_inputs(B, Hq, Hkv, T, D, torch.float32)
    pos = torch.zeros(B, dtype=torch.int64, device=DEV)
    got = rope_decode_attention(qkv, rope, pos, k, v, Hq, num_splits=2, backend="triton")
    v_new = qkv.view(B, -1, D)[:, Hq + Hkv:]  # [B, Hkv, D]
    torch.testing.assert_close(got, v_new.repeat_interleave(Hq // Hkv, 1), atol=0, rtol=0)
    torch.testing.assert_close(v[:, :, 0], v_new, atol=0, rtol=0)


def test_rope_decode_attention_torch_backend_equals_ref():
    qkv, rope, pos, k, v = _fused_inputs(2, 8, 2, 50, 32, torch.bfloat16)
    k2, v2 = k.clone(), v.clone()
    got = rope_decode_attention(qkv, rope, pos, k, v, 8, backend="torch")
    torch.testing.assert_close(got, rope_decode_attention_ref(qkv, rope, pos, k2, v2, 8), atol=0, rtol=0)
    torch.testing.assert_close(k, k2, atol=0, rtol=0)


def test_rope_decode_attention_argument_errors():
    """Its own checks (the shared ones: test_rope_argument_errors)."""
    qkv, rope, pos, k, v = _fused_inputs(2, 4, 2, 30, 16, torch.float32)
    with pytest.raises(ValueError, match="k_cache and v_cache must have qkv's dtype"):
        rope_decode_attention(qkv, rope, pos, k.half(), v.half(), 4)
    with pytest.raises(ValueError, match="num_splits must be an integer in"):
        rope_decode_attention(qkv, rope, pos, k, v, 4, num_splits=65)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 4096, 32768])
def test_rope_decode_attention_llama8b_shapes_gpu(T):
    """Llama-3.1-8B heads (32 q / 8 kv, D 128), bf16, short to long caches (one split to many), GPU only."""
    B = 4
    qkv, rope, pos, k, v = _fused_inputs(B, 32, 8, T, 128, torch.bfloat16)
    k2, v2 = k.clone(), v.clone()
    got = rope_decode_attention(qkv, rope, pos, k, v, 32, backend="triton")
    assert_close(got, rope_decode_attention_ref(qkv, rope, pos, k2, v2, 32))
    torch.testing.assert_close(v, v2, atol=0, rtol=0)


# ----------------------------------------------------------------------------- the L2 prefetch of the next weight


def test_rope_decode_attention_prefetch_changes_nothing():
    """``prefetch`` (the next projection's weight, warmed into L2 on sm_90+; ignored by the interpreter and CPUs)
    leaves the output and the caches exactly as without it; a byte slice at a multiple of 16 is accepted too."""
    B, Hq, Hkv, T, D = 2, 8, 2, 70, 64
    qkv, rope, pos, k, v = _fused_inputs(B, Hq, Hkv, T, D, torch.float16)
    k2, v2 = k.clone(), v.clone()
    w = torch.randn(96, 40, device=DEV).to(torch.float16)  # 7680 bytes: not a multiple of 16 lanes' chunks
    want = rope_decode_attention(qkv, rope, pos, k2, v2, Hq, num_splits=2, backend="triton")
    for pf in (w, w.view(-1).view(torch.uint8)[16:4016]):
        k3, v3 = k.clone(), v.clone()
        got = rope_decode_attention(qkv, rope, pos, k3, v3, Hq, num_splits=2, prefetch=pf, backend="triton")
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(k3, k2, atol=0, rtol=0)
        torch.testing.assert_close(v3, v2, atol=0, rtol=0)
    torch_be = [rope_decode_attention(qkv, rope, pos, k.clone(), v.clone(), Hq, prefetch=pf, backend="torch")
                for pf in (None, w)]
    torch.testing.assert_close(torch_be[1], torch_be[0], atol=0, rtol=0)


def test_rope_decode_attention_prefetch_argument_errors():
    qkv, rope, pos, k, v = _fused_inputs(1, 4, 2, 30, 16, torch.float32)
    w = torch.randn(64, 64, device=DEV)
    with pytest.raises(ValueError, match="prefetch must be contiguous and 16-byte aligned"):
        rope_decode_attention(qkv, rope, pos, k, v, 4, prefetch=w.t())
    with pytest.raises(ValueError, match="prefetch must be contiguous and 16-byte aligned"):
        rope_decode_attention(qkv, rope, pos, k, v, 4, prefetch=w.view(-1)[1:])  # 4 bytes in
    with pytest.raises(TypeError, match="prefetch must be a tensor or None"):
        rope_decode_attention(qkv, rope, pos, k, v, 4, prefetch=[w])
    with pytest.raises(ValueError, match="prefetch must be on"):
        rope_decode_attention(qkv, rope, pos, k, v, 4, prefetch=torch.empty(64, device="meta"))


def test_prefetch_plan_covers_the_range_in_16_byte_chunks():
    from fastdecode.kernels.prefetch import prefetch_plan

    for nbytes, threads in ((16 * 2**20, 1024), (7680, 256), (7690, 256), (48, 1024), (0, 128)):
        n, chunk = prefetch_plan(nbytes, threads)
        assert n == nbytes // 16 * 16 and chunk % 16 == 0 and chunk >= 16
        assert chunk * threads >= n and (chunk - 16) * threads < max(n, 16)  # covered, the chunk no larger


def _attn_ptx_job(pf: bool) -> tuple:
    """The fused attention kernel at Llama-3.1-8B's heads (32 q / 8 kv, D 128, bf16), PDL, with or without
    L2_PF."""
    from helpers import kernel_ptx_job

    ptrs = {"qkv_ptr": "*bf16", "rope_ptr": "*fp32", "pos_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "o_ptr": "*bf16", "o_part_ptr": "*fp32", "lse_ptr": "*fp32", "lock_ptr": "*i32", "q8_ptr": "*bf16",
            "s8_ptr": "*bf16", "sum8_ptr": "*bf16"}
    ints = ["stride_qkv", "stride_rope_t", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh",
            "stride_vt", "stride_ob", "stride_oh", "stride_q8", "stride_s8", "T"]
    sig = {**ptrs, "scale": "fp32", **{n: "i32" for n in ints}, "pf_ptr": "*u8", "pf_bytes": "i64",
           "pf_chunk": "i32"}
    consts = dict(HQ=32, HKV=8, GROUP=4, BLOCK_G=16, HALF=64, BLOCK_HALF=64, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=1,
                  MERGE_IN_KERNEL=False, USE_DOT=True, LOG2E=1.4426950408889634, OUT_INT8=False, USE_PDL=True,
                  L2_PF=pf, PF_LANES=128)
    return kernel_ptx_job("fastdecode.kernels.attention", "_rope_decode_attention_kernel", sig, consts)


@pytest.fixture(scope="module")
def attention_ptx_ahead():
    """Both L2_PF compiles at once (``helpers.sm90_ptx_ahead``)."""
    from helpers import sm90_ptx_ahead

    sm90_ptx_ahead([_attn_ptx_job(pf) for pf in (True, False)])


@pytest.mark.parametrize("pf", [True, False])
def test_sm90_attention_prefetches_before_the_pdl_wait(attention_ptx_ahead, pf):
    """Compiled ahead of time for sm_90 (8B heads, PDL): with L2_PF every thread issues one bulk L2 prefetch
    (``cp.async.bulk.prefetch.L2.global``) before ``griddepcontrol.wait``, so it runs while the qkv GEMV drains;
    without it there is none."""
    from helpers import bulk_prefetches, sm90_ptx

    assert bulk_prefetches(sm90_ptx(*_attn_ptx_job(pf))) == ((1, 1) if pf else (0, 0))
