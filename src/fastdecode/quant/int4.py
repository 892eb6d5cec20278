"""Int4 weights with group-wise scales: one kernel layout, RTN quantisation, GPTQ / AWQ / GGUF import.

Maths (``q`` an unsigned nibble 0..15, ``g`` the group of column k along K):

    zero mode "sym":  w[n, k] = (q[n, k] - 8)        * scale[n, g]     (implicit zero 8; GGUF Q4_0)
    zero mode "zero": w[n, k] = (q[n, k] - z[n, g])  * scale[n, g]     (integer zero points; GPTQ, AWQ)
    zero mode "min":  w[n, k] =  q[n, k] * scale[n, g] + mins[n, g]    (float minimums; GGUF Q4_1)

computed in fp32 and rounded once to the activation dtype (bf16 or fp16): :func:`dequantize_int4`
and the kernels (``fastdecode.kernels.int4``) make exactly this rounding decision, so
``int4_linear(x, w) ~= x @ dequantize_int4(w, x.dtype).T`` up to summation order.

Kernel layout (``LAYOUT``), whatever the source:

* ``qweight`` int32 ``(N, Kp // 8)``, row-major, ``Kp`` = K rounded up to a multiple of 256 (the
  padding columns are never read: the kernels mask them). K is cut into tiles of 256 columns; word
  ``j`` (0..31) of tile ``t`` holds columns ``256 t + 32 p + j`` in bits ``4p .. 4p+3`` for
  p = 0..7 ("stride-32 interleave"). So one shift ``(word >> 4p) & 0xF`` of a row of words gives 32
  *consecutive* columns of the tile, in the register layout of the words: the kernels process the
  8 shifts as 8 ``[BLOCK_N, 32 words]`` slices, each against a contiguous slice of x, with no
  3-D tensors, reshapes or layout conversions. A 16-byte load is 4 words = 4 x 8 columns. A thread
  turns a nibble into fp32 with one OR and one subtract (``as_float(0x4B000000 | q) = 2**23 + q``
  exactly), no int -> float conversion instruction.
* ``scales`` ``(N, K // group_size)`` bf16/fp16 and ``zeros`` (uint8, zero mode "zero") or ``mins``
  (scale dtype, zero mode "min") of the same shape, row-major: the scales of a weight tile are one
  short row segment next to it. Per-channel is ``group_size == K``.
* ``perm`` (GPTQ act-order only): int64 ``(K,)``; kernel column j is original column ``perm[j]``,
  chosen so that every group is contiguous. The op gathers ``x[:, perm]`` before the kernel.

Round trips are exact: :meth:`Int4Weight.unpack` returns the integer nibbles (and zeros) in the
original column order, bit for bit what the importer was given.

Fused and sharded projections (the engine): :func:`concat_n` stacks weights of one format along N
(q | k | v, gate | up), :func:`take_rows` / :func:`split_n` pick rows (a RoPE row permutation, a
column-parallel shard), :func:`slice_k` cuts K on group boundaries (a row-parallel shard); RTN picks
its group with :func:`rtn_group_size` (128 where it divides K).
"""

from __future__ import annotations

from typing import Optional

import torch

from fastdecode.ops.int4_format import (  # noqa: F401  (re-exported: the format lives with the op)
    AWQ_ORDER, GROUP_SIZES, LAYOUT, SCALE_DTYPES, ZERO_MODES, Int4Weight, check_perm, dequantize_int4,
    pack_kernel_layout, pack_nibbles, packed_cols, prepack, unpack_kernel_layout, unpack_nibbles,
)

GGUF_Q4_0_BYTES, GGUF_Q4_1_BYTES, GGUF_BLOCK = 18, 20, 32  # bytes per 32-value block


def quantize_int4(weight: torch.Tensor, group_size: int = 128, *, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """Round-to-nearest int4 quantisation of a float (N, K) weight, group-wise along K.

    symmetric: ``scale = amax / 7``, ``q = clamp(round(w / scale) + 8, 0, 15)`` (zero mode "sym");
    else ``scale = (max - min) / 15``, ``z = clamp(round(-min / scale), 0, 15)``,
    ``q = clamp(round(w / scale) + z, 0, 15)`` (zero mode "zero"). ``group_size=None`` or K: per channel.
    The scale is rounded to ``scale_dtype`` before q is computed, so q is optimal for the stored scale.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor (N, K), got {getattr(weight, 'shape', weight)}")
    N, K = weight.shape
    g = K if group_size is None else group_size
    if not isinstance(g, int) or g <= 0 or K % g or K % 8 or (g % 32 and g != K):
        raise ValueError(f"group_size must divide K={K} (a multiple of 8) and be a multiple of 32 or K, "
                         f"got {group_size}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be bf16 or fp16, got {scale_dtype}")
    w = weight.float().view(N, K // g, g)
    tiny = torch.finfo(torch.float16).tiny
    if symmetric:
        s = (w.abs().amax(-1) / 7).clamp(min=tiny).to(scale_dtype)
        q = torch.clamp(torch.round(w / s.float().unsqueeze(-1)) + 8, 0, 15)
        return prepack(q.reshape(N, K).to(torch.uint8), s, group_size=g)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=tiny).to(scale_dtype)
    z = torch.clamp(torch.round(-lo / s.float()), 0, 15)
    q = torch.clamp(torch.round(w / s.float().unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
    return prepack(q.reshape(N, K).to(torch.uint8), s, group_size=g, zeros=z.to(torch.uint8))


# ----------------------------------------------------------------------------- importers


def _unpack_int32_cols(t: torch.Tensor, order=None) -> torch.Tensor:
    """int32 (R, C) packing 8 values per word along the columns -> ints (R, 8C); column 8c + order[p]
    is nibble p (natural order when ``order`` is None)."""
    nib = unpack_nibbles(t.to(torch.int32)).view(t.shape[0], t.shape[1], 8)
    if order is not None:
        out = torch.empty_like(nib)
        out[:, :, list(order)] = nib  # nibble p -> column order[p]
        nib = out
    return nib.reshape(t.shape[0], t.shape[1] * 8)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *, group_size: Optional[int] = None,
              zero_offset: int = 1, symmetric: Optional[bool] = None) -> Int4Weight:
    """GPTQ 4-bit checkpoint tensors -> :class:`Int4Weight`.

    GPTQ layout (AutoGPTQ / GPTQModel, 4 bits): ``qweight`` int32 (K // 8, N), nibble p of word
    [r, n] is the weight of input column 8r + p (natural order along K); ``qzeros`` int32 (G, N // 8),
    nibble p of word [g, c] is the zero of output column 8c + p; ``scales`` fp16 (G, N); ``g_idx`` (K,)
    group of each input column (act-order checkpoints store a permutation-based g_idx; None means
    k // group_size). ``w = (q - zero) * scale``.

    ``zero_offset``: AutoGPTQ's v1 format (the ``checkpoint_format: gptq`` of existing checkpoints)
    stores ``zero - 1`` in qzeros, so the true zero is the stored value + 1 (``zero_offset=1``, the
    default); GPTQModel's "gptq_v2" stores the zero itself (``zero_offset=0``). A true zero outside
    0..15 raises. ``symmetric``: True turns zeros that are all 8 into zero mode "sym" (None: auto).
    """
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    K8, N = qweight.shape
    K = K8 * 8
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[1] != N:
        raise ValueError(f"scales must be (G, N={N}), got {getattr(scales, 'shape', scales)}")
    G = scales.shape[0]
    if tuple(qzeros.shape) != (G, (N + 7) // 8):
        raise ValueError(f"qzeros must be int32 (G, N // 8) = {(G, (N + 7) // 8)}, got {tuple(qzeros.shape)}")
    if group_size is None:
        group_size = K // G
    if G * group_size != K:
        raise ValueError(f"scales have {G} groups, which does not match K={K} with group_size={group_size}")
    q = _unpack_int32_cols(qweight.t().contiguous())  # (N, K): nibbles of the transposed words along K
    z = _unpack_int32_cols(qzeros)[:, :N].to(torch.int16) + zero_offset  # (G, N)
    if int(z.min()) < 0 or int(z.max()) > 15:
        raise ValueError(f"GPTQ zeros + zero_offset={zero_offset} fall outside 0..15 "
                         f"([{int(z.min())}, {int(z.max())}]); is this a gptq_v2 checkpoint (zero_offset=0)?")
    sc = _scales_16bit(scales.t().contiguous(), "from_gptq")
    z = z.t().contiguous()
    sym = bool(torch.all(z == 8)) if symmetric is None else symmetric
    if sym and not torch.all(z == 8):
        raise ValueError("symmetric=True but the GPTQ zeros are not all 8")
    return prepack(q, sc, group_size=group_size, zeros=None if sym else z, g_idx=g_idx)


def _scales_16bit(sc: torch.Tensor, what: str) -> torch.Tensor:
    """Checkpoint scales as the kernels take them: fp16 / bf16 as stored; other float dtypes (fp32)
    rounded to fp16, or to bf16 where a scale is beyond fp16's range (never to inf)."""
    if sc.dtype in SCALE_DTYPES:
        return sc
    if not sc.is_floating_point():
        raise ValueError(f"{what}: scales must be a float tensor, got {sc.dtype}")
    if not bool(torch.isfinite(sc).all()):
        raise ValueError(f"{what}: scales hold inf or NaN")
    big = sc.numel() and float(sc.abs().max()) > torch.finfo(torch.float16).max
    return sc.to(torch.bfloat16 if big else torch.float16)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
             group_size: Optional[int] = None) -> Int4Weight:
    """AWQ (GEMM packing) 4-bit tensors -> :class:`Int4Weight`.

    AWQ layout: ``qweight`` int32 (K, N // 8) packed along N with the interleaved order
    ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (nibble p of word [k, c] is output column
    8c + AWQ_ORDER[p]); ``qzeros`` int32 (G, N // 8), same order; ``scales`` fp16 (G, N).
    ``w = (q - zero) * scale`` (zeros stored as is, no offset).
    """
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    K, N8 = qweight.shape
    N = N8 * 8
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape[1:]) != (N,) or scales.dim() != 2:
        raise ValueError(f"scales must be (G, N={N}), got {getattr(scales, 'shape', scales)}")
    G = scales.shape[0]
    if tuple(qzeros.shape) != (G, N8):
        raise ValueError(f"qzeros must be int32 (G, N // 8) = {(G, N8)}, got {tuple(qzeros.shape)}")
    if group_size is None:
        group_size = K // G
    if G * group_size != K:
        raise ValueError(f"scales have {G} groups, which does not match K={K} with group_size={group_size}")
    q = _unpack_int32_cols(qweight, AWQ_ORDER).t().contiguous()  # (N, K)
    z = _unpack_int32_cols(qzeros, AWQ_ORDER).t().contiguous()  # (N, G)
    sc = _scales_16bit(scales.t().contiguous(), "from_awq")
    return prepack(q, sc, group_size=group_size, zeros=z)


def _gguf_blocks(data: torch.Tensor, N: int, K: int, block_bytes: int, name: str) -> torch.Tensor:
    if K % GGUF_BLOCK:
        raise ValueError(f"{name}: K must be a multiple of {GGUF_BLOCK}, got {K}")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = getattr(data, "dtype", type(data).__name__)
        raise ValueError(f"{name}: data must be a uint8 tensor of raw blocks, got {got}")
    nb = K // GGUF_BLOCK
    if data.numel() != N * nb * block_bytes:
        raise ValueError(f"{name}: expected {N * nb * block_bytes} bytes for shape ({N}, {K}), got {data.numel()}")
    return data.reshape(N, nb, block_bytes)


def _gguf_nibbles(qs: torch.Tensor) -> torch.Tensor:
    # (N, nb, 16) bytes -> (N, nb * 32): low nibbles are elements 0..15, high nibbles 16..31
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(qs.shape[0], -1)


def _f16(b: torch.Tensor) -> torch.Tensor:  # (..., 2) little-endian bytes -> fp16
    return b.contiguous().view(torch.float16).squeeze(-1)


def from_gguf_q4_0(data: torch.Tensor, shape) -> Int4Weight:
    """GGUF Q4_0 -> :class:`Int4Weight` (group 32, zero mode "sym").

    ``data``: uint8 raw blocks of the (N, K) tensor (row-major, 18 bytes per 32 values: fp16 ``d``
    then 16 bytes of nibbles, low nibbles = elements 0..15, high = 16..31); ``w = (q - 8) * d``.
    ``shape``: (N, K) in PyTorch order (GGUF lists dims as (K, N)).
    """
    N, K = (int(v) for v in shape)
    b = _gguf_blocks(data, N, K, GGUF_Q4_0_BYTES, "from_gguf_q4_0")
    d = _f16(b[..., 0:2])
    return prepack(_gguf_nibbles(b[..., 2:]), d, group_size=GGUF_BLOCK)


def from_gguf_q4_1(data: torch.Tensor, shape) -> Int4Weight:
    """GGUF Q4_1 -> :class:`Int4Weight` (group 32, zero mode "min").

    20 bytes per 32 values: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles (as Q4_0); ``w = q * d + m``.
    """
    N, K = (int(v) for v in shape)
    b = _gguf_blocks(data, N, K, GGUF_Q4_1_BYTES, "from_gguf_q4_1")
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return prepack(_gguf_nibbles(b[..., 4:]), d, group_size=GGUF_BLOCK, mins=m)


# ----------------------------------------------------------------------------- rows, columns, fusion

RTN_GROUP_SIZES = (128, 64, 32)


def rtn_group_size(K: int, preferred: int = 128) -> int:
    """The group size RTN uses for a K-column weight: ``preferred`` when it divides K, else the largest of
    64 / 32 (not above ``preferred``) that does, else per channel (K). SmolLM2's K=576 gets 64."""
    if K % 8:
        raise ValueError(f"int4 weights need K to be a multiple of 8, got K={K}")
    for g in (preferred, *(g for g in RTN_GROUP_SIZES if g < preferred)):
        if K % g == 0:
            return g
    return K


def take_rows(w: Int4Weight, rows) -> Int4Weight:
    """The output rows ``rows`` (a slice or an int64 index) of ``w``: groups run along K, so every row's
    nibbles, scales and zeros / mins move together (a q/k RoPE permutation, a column-parallel shard)."""
    pick = lambda t: None if t is None else t[rows].contiguous()  # noqa: E731
    return Int4Weight(pick(w.qweight), pick(w.scales), pick(w.zeros), pick(w.mins), w.group_size, w.zero_mode,
                      w.perm, w.k, w.layout)


def split_n(w: Int4Weight, sizes) -> list[Int4Weight]:
    """Split ``w`` along N into consecutive row blocks of ``sizes`` (e.g. fused q | k | v)."""
    if sum(sizes) != w.N:
        raise ValueError(f"split sizes {list(sizes)} do not add up to the weight's N={w.N}")
    out, start = [], 0
    for n in sizes:
        out.append(take_rows(w, slice(start, start + n)))
        start += n
    return out


def concat_n(ws, names=None) -> Int4Weight:
    """One weight whose rows are those of ``ws`` in order (fused q | k | v, gate | up).

    All parts must share K, layout, group size, zero mode, scale dtype and act-order permutation (one
    kernel call reads one format); ``names`` (one per part) name the offending part in the error.
    """
    ws = list(ws)
    if not ws:
        raise ValueError("concat_n needs at least one int4 weight")
    names = list(names) if names is not None else [f"part {i}" for i in range(len(ws))]
    a = ws[0]
    for w, name in zip(ws[1:], names[1:]):
        for what, x, y in (("K", w.K, a.K), ("layout", w.layout, a.layout), ("group size", w.group_size, a.group_size),
                           ("zero mode", w.zero_mode, a.zero_mode), ("scale dtype", w.scales.dtype, a.scales.dtype)):
            if x != y:
                raise ValueError(f"cannot fuse int4 weights: {name} has {what} {x!r} but {names[0]} has {y!r}")
        if (w.perm is None) != (a.perm is None) or (w.perm is not None and not torch.equal(w.perm, a.perm)):
            raise ValueError(f"cannot fuse int4 weights: {name} has a different act-order permutation (g_idx) than "
                             f"{names[0]}; a fused projection runs one column order")
    if len(ws) == 1:
        return a
    cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
    return Int4Weight(cat([w.qweight for w in ws]), cat([w.scales for w in ws]), cat([w.zeros for w in ws]),
                      cat([w.mins for w in ws]), a.group_size, a.zero_mode, a.perm, a.k, a.layout)


def slice_k(w: Int4Weight, start: int, stop: int) -> Int4Weight:
    """Columns ``[start, stop)`` of ``w`` (a row-parallel shard), repacked; both ends must fall on group
    boundaries (per-channel weights: any multiple of 8 columns). Not for act-order weights, whose groups
    are scattered over K."""
    g = w.group_size
    w.check_format(what="slice_k")  # repacking assumes this version's layout
    if not 0 <= start < stop <= w.K:
        raise ValueError(f"column range [{start}, {stop}) is not inside K={w.K}")
    if w.perm is not None:
        raise ValueError("an act-order (g_idx) int4 weight cannot be split along K: its groups are scattered "
                         "over the columns")
    q = unpack_kernel_layout(w.qweight, w.K)[:, start:stop]
    if g == w.K:  # per channel: one scale per row whatever the columns
        if (stop - start) % 8:
            raise ValueError(f"column range [{start}, {stop}) must hold a multiple of 8 columns")
        g, gs = stop - start, slice(0, 1)
    elif start % g or stop % g:
        raise ValueError(f"column range [{start}, {stop}) must start and end on group boundaries (group size {g})")
    else:
        gs = slice(start // g, stop // g)
    pick = lambda t: None if t is None else t[:, gs].contiguous()  # noqa: E731
    return Int4Weight(pack_kernel_layout(q), pick(w.scales), pick(w.zeros), pick(w.mins), g, w.zero_mode, None,
                      stop - start, w.layout)
