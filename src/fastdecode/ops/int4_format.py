"""The packed int4 weight: its kernel layout, format record, packing and dequantisation.

It is the argument type of ``fastdecode.ops.int4_linear``, so it lives in ops/ (below quant/,
whose importers - RTN, GPTQ, AWQ, GGUF - build it). The full format description is in
``fastdecode.quant.int4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LAYOUT = "int4.k256s32.v1"  # bump when the kernel layout changes; a packed weight records its layout
ZERO_MODES = ("sym", "zero", "min")
SCALE_DTYPES = (torch.bfloat16, torch.float16)
GROUP_SIZES = (32, 64, 128)  # plus per-channel (group_size == K)
KTILE, KSTRIDE = 256, 32  # layout: tiles of 256 columns, word j holds columns 32p + j
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble p of a word holds column 8c + AWQ_ORDER[p]


def packed_cols(K: int) -> int:
    """int32 words per row of the kernel layout for K columns: K rounded up to the 256-column layout tile
    (``KTILE``, padding the kernels never read), 8 nibbles per word. ``qweight`` is (N, packed_cols(K))."""
    return -(-int(K) // KTILE) * KTILE // 8


@dataclass
class Int4Weight:
    """A prepacked int4 weight of logical shape (N, K) in the kernel layout (module docstring).

    Build with :func:`quantize_int4`, :func:`prepack` or an importer; pass to ``fastdecode.int4_linear``.
    Built by hand from stored tensors: call :meth:`check_values` once (the ops check shapes only).
    """

    qweight: torch.Tensor  # int32 (N, Kp // 8), Kp = K rounded up to 256, stride-32 interleave
    scales: torch.Tensor  # bf16/fp16 (N, K // group_size)
    zeros: Optional[torch.Tensor]  # uint8 (N, G) in zero mode "zero", else None
    mins: Optional[torch.Tensor]  # scale dtype (N, G) in zero mode "min", else None
    group_size: int
    zero_mode: str
    perm: Optional[torch.Tensor] = None  # int64 (K,) act-order column permutation, else None
    k: int = -1  # logical K (-1: Kp, no padding)
    layout: str = LAYOUT

    def __post_init__(self):
        if self.k < 0:
            self.k = self.qweight.shape[1] * 8

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.k

    @property
    def N(self) -> int:
        return self.qweight.shape[0]

    @property
    def K(self) -> int:
        return self.k

    @property
    def symmetric(self) -> bool:
        return self.zero_mode == "sym"

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def format(self) -> str:
        """Short name of the format, e.g. 'int4.g128.sym', 'int4.gK.zero', as in file names."""
        g = "K" if self.group_size == self.K else str(self.group_size)
        return f"int4.g{g}.{self.zero_mode}" + (".actorder" if self.perm is not None else "")

    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: nibbles + scales (+ zeros or mins)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.mins)
                   if t is not None)

    def to(self, device) -> "Int4Weight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Int4Weight(mv(self.qweight), mv(self.scales), mv(self.zeros), mv(self.mins),
                          self.group_size, self.zero_mode, mv(self.perm), self.k, self.layout)

    def validate(self, what: str = "int4 weight") -> None:
        """Raise ValueError unless the record is self-consistent: a known zero mode, a group size that
        divides K, scales / zeros / mins / perm of the shapes and dtypes that mode and group size imply.
        Shapes and dtypes only (no pass over the data), so it is cheap enough for every call."""
        N, K, g = self.N, self.K, self.group_size
        if self.zero_mode not in ZERO_MODES:
            raise ValueError(f"{what}: zero_mode must be one of {ZERO_MODES}, got {self.zero_mode!r}")
        if not isinstance(g, int) or g <= 0 or K % g or (g % 32 and g != K):
            raise ValueError(f"{what}: group_size {g!r} must divide K={K} and be a multiple of 32 or K")
        G = K // g
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2 or self.qweight.shape[1] * 8 < K:
            raise ValueError(f"{what}: qweight must be int32 (N, >= K / 8), got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)} for K={K}")
        sc = self.scales
        if sc.dtype not in SCALE_DTYPES or tuple(sc.shape) != (N, G) or not sc.is_contiguous():
            raise ValueError(f"{what}: scales must be contiguous bf16/fp16 of shape {(N, G)} (group_size {g}), "
                             f"got {sc.dtype} {tuple(sc.shape)}")
        want_zeros, want_mins = self.zero_mode == "zero", self.zero_mode == "min"
        if (self.zeros is not None) != want_zeros or (self.mins is not None) != want_mins:
            raise ValueError(f"{what}: zero mode {self.zero_mode!r} needs "
                             + ("zeros" if want_zeros else "mins" if want_mins else "neither zeros nor mins")
                             + f", got zeros={'set' if self.zeros is not None else None}, "
                               f"mins={'set' if self.mins is not None else None}")
        if want_zeros and (self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != (N, G)
                           or not self.zeros.is_contiguous()):
            raise ValueError(f"{what}: zeros must be contiguous uint8 {(N, G)}, got {self.zeros.dtype} "
                             f"{tuple(self.zeros.shape)}")
        if want_mins and (self.mins.dtype != sc.dtype or tuple(self.mins.shape) != (N, G)
                          or not self.mins.is_contiguous()):
            raise ValueError(f"{what}: mins must be contiguous {sc.dtype} (the scales' dtype) {(N, G)}, got "
                             f"{self.mins.dtype} {tuple(self.mins.shape)}")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (K,)):
            raise ValueError(f"{what}: perm must be int64 ({K},), got {self.perm.dtype} {tuple(self.perm.shape)}")

    def check_values(self, what: str = "int4 weight") -> None:
        """:meth:`validate`, then the values no op checks: ``perm`` a permutation of 0..K-1 and ``zeros`` in
        [0, 15]. A pass over those small tensors (a host sync), so it runs once where a weight is built or
        loaded (:func:`prepack`, the importers, the checkpoint loader), never per call. Unchecked, a duplicate
        perm entry leaves columns of :func:`dequantize_int4` unwritten (uninitialised memory: values that
        change between calls) and an out-of-range one fails deep inside an op."""
        self.validate(what)
        if self.perm is not None:
            check_perm(self.perm, self.K, f"{what}: perm")
        if self.zeros is not None and self.zeros.numel():
            zmax = int(self.zeros.max())  # uint8 (validate): never below 0
            if zmax > 15:
                n = int((self.zeros > 15).sum())
                raise ValueError(f"{what}: zeros must hold 4-bit zero points in [0, 15], got {n} above 15 "
                                 f"(maximum {zmax})")

    def check_format(self, *, group_size: Optional[int] = None, zero_mode: Optional[str] = None,
                     K: Optional[int] = None, what: str = "int4 weight") -> None:
        """Raise ValueError unless this weight has the layout, K, group size and zero mode asked for
        (and is self-consistent, :meth:`validate`)."""
        if self.layout != LAYOUT:
            raise ValueError(f"{what}: packed layout {self.layout!r} is not this kernel's {LAYOUT!r}; prepack again")
        if K is not None and self.K != K:
            raise ValueError(f"{what}: the weight has K={self.K} but the input has K={K} (mismatched K)")
        if group_size is not None and self.group_size != group_size:
            raise ValueError(f"{what}: expected group_size {group_size}, the weight has {self.group_size}")
        if zero_mode is not None and self.zero_mode != zero_mode:
            raise ValueError(f"{what}: expected zero mode {zero_mode!r}, the weight has {self.zero_mode!r}")
        self.validate(what)

    def unpack(self) -> dict:
        """Integers and scales in the ORIGINAL column order: {'q': uint8 (N, K), 'scales', 'zeros', 'mins',
        'g_idx': int64 (K,) group of every original column}. Exact inverse of :func:`prepack`."""
        q = unpack_kernel_layout(self.qweight, self.K)
        g_idx = torch.arange(self.K, device=q.device) // self.group_size
        if self.perm is not None:
            inv = torch.empty_like(self.perm)
            inv[self.perm] = torch.arange(self.K, device=self.perm.device)
            q, g_idx = q[:, inv], g_idx[inv]
        return {"q": q, "scales": self.scales, "zeros": self.zeros, "mins": self.mins, "g_idx": g_idx}


# ----------------------------------------------------------------------------- nibble packing


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8/int (N, K) values 0..15, K % 8 == 0 -> int32 (N, K // 8), column 8j+p at bits 4p (natural)."""
    N, K = q.shape
    if K % 8:
        raise ValueError(f"K must be a multiple of 8 for int4 packing, got K={K}")
    v = q.reshape(N, K // 8, 8).to(torch.int32)
    w = v[..., 0].clone()
    for p in range(1, 8):  # int32 shifts wrap into the sign bit for p = 7: two's complement words
        w |= v[..., p] << (4 * p)
    return w.contiguous()


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> uint8 (R, 8 C): nibble p of word c becomes column 8c + p."""
    R, C = words.shape
    # nibble p of a word sits at bit 4p; made on the words' device, not copied from the host, so the
    # reference path (fp32 activations on CUDA) stays capturable in a CUDA graph
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF
    return nib.reshape(R, C * 8).to(torch.uint8)


def pack_kernel_layout(q: torch.Tensor) -> torch.Tensor:
    """(N, K) ints 0..15 -> int32 (N, Kp // 8) in the kernel layout (module docstring), zero-padded."""
    N, K = q.shape
    Kp = packed_cols(K) * 8
    if Kp != K:
        q = torch.cat([q, q.new_zeros(N, Kp - K)], dim=1)
    # (N, tile, p, j) -> (N, tile, j, p): word (tile, j) holds columns 256 tile + 32 p + j
    t = q.reshape(N, Kp // KTILE, 8, KSTRIDE).transpose(2, 3)
    return pack_nibbles(t.reshape(N, Kp))


def unpack_kernel_layout(words: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of :func:`pack_kernel_layout`: int32 (N, Kp // 8) -> uint8 (N, K)."""
    N, Kp8 = words.shape
    t = unpack_nibbles(words).reshape(N, Kp8 // KSTRIDE, KSTRIDE, 8).transpose(2, 3)
    return t.reshape(N, Kp8 * 8)[:, :K]


# ----------------------------------------------------------------------------- prepack / dequantise


def check_perm(perm: torch.Tensor, K: int, what: str = "perm") -> None:
    """Raise ValueError unless the int64 (K,) tensor ``perm`` is a permutation of 0..K-1 (range, then
    duplicates through one bincount)."""
    if not perm.numel():
        return
    lo, hi = int(perm.min()), int(perm.max())
    if lo < 0 or hi >= K:
        raise ValueError(f"{what} must be a permutation of 0..{K - 1}: value {lo if lo < 0 else hi} out of range")
    counts = torch.bincount(perm, minlength=K)
    extra = int((counts - 1).clamp(min=0).sum())
    if extra:
        first = int(torch.nonzero(counts > 1)[0, 0])
        raise ValueError(f"{what} must be a permutation of 0..{K - 1}: it has {extra} duplicate entries "
                         f"({first} appears {int(counts[first])} times)")


def _check_int(name, t, shape, lo=0, hi=15):
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or tuple(t.shape) != tuple(shape):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor of shape {tuple(shape)}, got {got}")
    if t.numel():
        tmin, tmax = (int(v) for v in torch.stack(torch.aminmax(t)).tolist())  # one host sync, not two
        if tmin < lo or tmax > hi:
            raise ValueError(f"{name} must hold values in [{lo}, {hi}], got [{tmin}, {tmax}]")


def prepack(q: torch.Tensor, scales: torch.Tensor, *, group_size: int, zeros: Optional[torch.Tensor] = None,
            mins: Optional[torch.Tensor] = None, g_idx: Optional[torch.Tensor] = None) -> Int4Weight:
    """Integers in (N, K) form -> the kernel layout.

    q: (N, K) ints 0..15; scales: (N, K // group_size) bf16/fp16; zeros: (N, G) ints 0..15 (zero mode
    "zero") or mins: (N, G) float (zero mode "min") or neither ("sym", implicit zero 8);
    g_idx: (K,) group of every column (GPTQ act-order), None for contiguous groups (k // group_size).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError(f"q must be a 2-D integer tensor (N, K), got {getattr(q, 'shape', type(q).__name__)}")
    N, K = q.shape
    if K % 8:
        raise ValueError(f"K must be a multiple of 8 for int4 packing, got K={K}")
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size or (group_size % 32 and group_size != K):
        raise ValueError(f"group_size must divide K={K} and be a multiple of 32 (32, 64, 128, ...) or K, "
                         f"got {group_size}")
    G = K // group_size
    _check_int("q", q, (N, K))
    if not isinstance(scales, torch.Tensor) or scales.dtype not in SCALE_DTYPES or tuple(scales.shape) != (N, G):
        got = f"{scales.dtype} {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"scales must be bf16 or fp16 of shape {(N, G)}, got {got}")
    if zeros is not None and mins is not None:
        raise ValueError("pass zeros (integer zero points) or mins (float minimums), not both")
    mode = "sym"
    if zeros is not None:
        _check_int("zeros", zeros, (N, G))
        zeros, mode = zeros.to(torch.uint8).contiguous(), "zero"
    if mins is not None:
        if not isinstance(mins, torch.Tensor) or tuple(mins.shape) != (N, G) or mins.dtype != scales.dtype:
            got = f"{mins.dtype} {tuple(mins.shape)}" if isinstance(mins, torch.Tensor) else type(mins).__name__
            raise ValueError(f"mins must be {scales.dtype} (the scales' dtype, so nothing is rounded) of shape "
                             f"{(N, G)}, got {got}")
        mins, mode = mins.contiguous(), "min"
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if tuple(g_idx.shape) != (K,) or (K and (int(g_idx.min()) < 0 or int(g_idx.max()) >= G)):
            raise ValueError(f"g_idx must be (K,)={K,} group indices in [0, {G}), got {tuple(g_idx.shape)}")
        if not torch.equal(g_idx, torch.arange(K, device=g_idx.device) // group_size):
            if not torch.all(torch.bincount(g_idx, minlength=G) == group_size):
                raise ValueError(f"g_idx must put exactly group_size={group_size} columns in every group")
            perm = torch.sort(g_idx, stable=True).indices
            q = q[:, perm]
    w = Int4Weight(pack_kernel_layout(q), scales.contiguous(), zeros, mins, group_size, mode, perm, K)
    w.check_values("prepack")
    return w


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.bfloat16, *, kernel_order: bool = False) -> torch.Tensor:
    """(N, K) weight in ``dtype``: fp32 maths of the module docstring, one rounding to ``dtype``.

    Columns in original order, or in kernel order (``perm`` applied) with ``kernel_order=True``.
    """
    N, K = w.shape
    q = unpack_kernel_layout(w.qweight, K).float().view(N, K // w.group_size, w.group_size)
    s = w.scales.float().unsqueeze(-1)
    if w.zero_mode == "sym":
        r = (q - 8.0) * s
    elif w.zero_mode == "zero":
        r = (q - w.zeros.float().unsqueeze(-1)) * s
    else:
        r = q * s + w.mins.float().unsqueeze(-1)
    r = r.reshape(N, K).to(dtype)
    if w.perm is not None and not kernel_order:
        out = torch.empty_like(r)
        out[:, w.perm] = r
        return out
    return r
