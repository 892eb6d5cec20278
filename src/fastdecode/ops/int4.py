"""Int4-weight linear (W4A16) on prepacked weights, with a shape-aware config dispatcher.

    int4_linear:  out = x @ dequantize_int4(w, x.dtype).T + bias       (fp32 accumulation, one rounding)

``w`` is a :class:`fastdecode.quant.int4.Int4Weight` (group 32/64/128 or per channel; zero mode
"sym", "zero" or "min"; see that module for the maths and the layout). The weight is dequantised in
registers exactly as ``dequantize_int4`` does (fp32 maths, one rounding to x.dtype), so the
reference is ``x.float() @ dequantize_int4(w, x.dtype).float().T``.

Dispatcher. Three Triton paths: "fma" (weight streaming with split-K, small M), "mma" (few tokens: the
weight as the register operand of the tensor cores, ``kernels.int4_mma``; W4A16 with bf16 / fp16
activations and groups that tile 256 columns, else the heuristic's config) and "dot" (tensor-core
``tl.dot``, larger M); ``impl="dequant"`` dequantises the whole weight with a Triton kernel into a
scratch buffer and calls cuBLAS (large M, where the GEMM is compute bound and the conversion is
amortised). The choice per (N, K, group, M) comes from tuned data in
``fastdecode/configs/int4_linear_<gpu>.json`` (written by ``fastdecode.bench.int4.tune``): the
exact (N, K, group) entry, the tuned M nearest on a log scale; above the largest tuned M, dequant +
cuBLAS (W4A8, which has no cuBLAS path: the heuristic Triton config), as ``ops.gemm`` falls back to
cuBLAS there (the shared rule and table machinery: ``fastdecode.ops._tuned``). Without an entry: a
heuristic (fma for M <= 4, dot up to M = 1024, dequant + cuBLAS above on CUDA) and, without a table
for the GPU, one log warning. Nothing is timed at call time (safe under CUDA-graph capture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.ops import _common
from fastdecode.ops._common import (
    pdl_enabled,
    weight_prefetch_bytes,
    as_rows, cdiv, check_out, check_same_device, check_tensor, next_pow2, resolve_backend, warn_once,
)
from fastdecode.ops._tuned import (  # noqa: F401  (clear_config_cache, DEFAULT_NUM_SMS: this module's API too)
    DEFAULT_NUM_SMS, clear_config_cache, device_info, load_table, lookup_cache, nearest_key, nearest_m,
    split_k_workspace,
)
from fastdecode.ops.gemm import check_bias
from fastdecode.ops.int4_format import LAYOUT, Int4Weight, dequantize_int4, packed_cols

IMPLS = (None, "triton", "dequant")
X_DTYPES = (torch.bfloat16, torch.float16)
HEURISTIC_MAX_FMA_M = 4
HEURISTIC_MAX_DOT_M = 1024  # dequant + cuBLAS above: its N*K*2-byte write is amortised there


# ----------------------------------------------------------------------------- configs


def config_path(gpu_name: str) -> Path:
    """The tuned table of the int4 family on ``gpu_name``: ``configs/int4_linear_<gpu>.json``."""
    return _common.config_path("int4_linear", gpu_name)


def heuristic_config(M: int, N: int, K: int, group_size: int, num_sms: int = DEFAULT_NUM_SMS,
                     cuda: bool = True) -> tuple[str, dict]:
    """(impl, config) without tuned data: fma tiles of 16-byte word loads for tiny M, else dot;
    split-K so that about 4 programs run per SM (every SM streams weights even when N is small)."""
    if M <= HEURISTIC_MAX_FMA_M:
        # BLOCK_K = 256 (one layout tile: 8 threads x 16 bytes per row, one scale per row and shift);
        # BLOCK_N rows so that every thread has 64 bytes of weights in flight per step
        bm = next_pow2(M)
        cfg = {"kind": "fma", "BLOCK_M": bm, "BLOCK_N": 64 if bm <= 2 else 32, "BLOCK_K": 256,
               "num_warps": 4, "num_stages": 1, "PREFETCH": True}
    else:
        bm = 16 if M <= 16 else (32 if M <= 32 else (64 if M <= 64 else 128))
        # 128 x 128 x 256 tiles at 3 stages asked for 237,568 bytes of shared memory on the H200
        # (limit 232,448; M=257, 6144x4096): 2 stages there (ran on the H200: tests/test_int4_gpu.py, M=257)
        cfg = {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": 64 if bm < 128 else 128, "BLOCK_K": 256,
               "num_warps": 4 if bm < 128 else 8, "num_stages": 3 if bm < 128 else 2}
    cfg["BLOCK_K"] = max(256, min(cfg["BLOCK_K"], next_pow2(K)))  # whole 256-column layout tiles
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    kb_total = cdiv(packed_cols(K) * 8, cfg["BLOCK_K"])
    min_blocks = 2 if cfg["kind"] == "dot" else 1
    cfg["SPLIT_K"] = int(max(1, min(cdiv(4 * num_sms, tiles), kb_total // min_blocks, 16)))
    impl = "dequant" if (cuda and M > HEURISTIC_MAX_DOT_M) else "triton"
    return impl, cfg


def smem_bytes(config: dict, x_bytes: int = 2) -> int:
    """Shared memory a launch of ``config`` asks for, an estimate meant to be an upper bound (bytes).

    dot: ``num_stages * (BLOCK_M*BLOCK_K*x_bytes + BLOCK_N*BLOCK_K/2) + BLOCK_N*BLOCK_K*2``: pipeline
    buffers of the x tile and of the packed int4 words, plus the dequantised 16-bit weight tile staged
    for the MMA. Calibrated on triton 3.6's sm_90 compile of ``_int4_linear_kernel``: it allocates
    ``stages`` x buffers, ``stages - 1`` word buffers and, for BLOCK_M >= 64 (wgmma), the whole
    dequantised tile, i.e. this estimate minus one word buffer (64 x 128 x 256 at 4 stages: 245,760
    bytes, as the H200 reported; tests/test_int4_gpu.py holds the compiled sizes it was checked on).
    The scales and zeros are read from global memory, not staged. fma: no pipeline; the bound of the
    cross-thread reduction of its ``[BLOCK_N, BLOCK_K/8]`` accumulators (compiled: at most 4 KB).
    """
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if config["kind"] == "mma":  # pipeline buffers of the x tiles and the words (compiled: at most this)
        return config.get("num_stages", 2) * (bm * bk * x_bytes + bn * bk // 2)
    if config["kind"] != "dot":
        return bm * bn * (bk // 8) * 4
    return config.get("num_stages", 3) * (bm * bk * x_bytes + bn * bk // 2) + bn * bk * 2


def smem_limit(device) -> Optional[int]:
    """Shared memory one program may opt into on a CUDA ``device`` (bytes; 232,448 on the H200), the
    limit Triton checks a launch against; None elsewhere (the interpreter has no limit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    if limit is None:  # a torch without the field: Triton's driver, the number its launch check uses
        from triton.runtime import driver

        limit = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def table_key(N: int, K: int, group_size: int) -> str:
    return f"{N},{K},{'K' if group_size == K else group_size}"


# table sections of the fused W4A16 ops, as the decode step runs them (the norm inside, the residual add, SiLU-and-mul
# inside too): their entries override the plain GEMV's ("int4_linear") for the same shape and M, and a shape or M
# they lack takes the plain GEMV's. In session 32 (H100) a tile timed with the norm inside one way ran the embedded
# step 46 us slower the other way (benchmarks/NOTES.md): the fused ops may want their own tiles.
FUSED_OPS = ("int4_rms_norm_linear", "int4_add_linear", "int4_add_linear_glu")
OPS = ("int4_linear", "int4_linear_fp8") + FUSED_OPS


@lookup_cache
def _lookup(gpu_name: str, num_sms: int, M: int, N: int, K: int, group_size: int,
            path: Optional[str] = None, op: str = "int4_linear") -> tuple[str, dict]:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    impl, heuristic = heuristic_config(M, N, K, group_size, num_sms, cuda=gpu_name != "cpu")
    if op == "int4_linear_fp8":
        impl = "triton"  # W4A8 has no dequant + cuBLAS path
    table = load_table("int4_linear", gpu_name, path)
    if table is None:
        if gpu_name != "cpu":
            warn_once(f"fastdecode: no tuned int4_linear configs for {gpu_name!r} "
                       f"({config_path(gpu_name).name}); using heuristics")
        return impl, heuristic
    entries, _ = _op_entries(table, op, table_key(N, K, group_size))
    if not entries:  # no entry for the shape: the heuristic
        return impl, heuristic
    entry = nearest_m(entries, M)
    if entry is None:  # above the largest tuned M: the large-M path (the rule of ops._tuned)
        return ("triton" if op == "int4_linear_fp8" else "dequant"), heuristic
    cfg = dict(entry.get("config") or heuristic)
    diagnostic = [k for k in cfg if k.startswith("_")]
    if diagnostic:  # e.g. kernels.int4_mma's _ABLATE: its outputs are not the product
        raise ValueError(f"the int4 table's entry for {op} (M={M}, N={N}, K={K}, group {group_size}) holds the "
                         f"diagnostic key(s) {diagnostic}, which benchmarks pass explicitly and a table never does")
    return entry["impl"], cfg


def _op_entries(table: Optional[dict], op: str, key: str) -> tuple[dict, dict]:
    """(the entries ``op``'s dispatch chooses from for the shape ``key``, those of the op's own section): for one of
    ``FUSED_OPS`` its own entries over the plain GEMV's."""
    own = (table or {}).get(op, {}).get(key) or {}
    if op in FUSED_OPS:
        return {**(table or {}).get("int4_linear", {}).get(key, {}), **own}, own
    return own, own


@lookup_cache
def _own_entry(gpu_name: str, M: int, N: int, K: int, group_size: int, op: str) -> Optional[bool]:
    entries, own = _op_entries(load_table("int4_linear", gpu_name), op, table_key(N, K, group_size))
    if not entries:
        return None  # no table, or no entry for the shape: the heuristics, never timed
    return nearest_key(entries, M) in own


def fused_entry_is_own(M: int, N: int, K: int, group_size: int, device=None, *, op: str) -> Optional[bool]:
    """For one of ``FUSED_OPS``: whether the entry its dispatch takes at M (``get_int4_config``) is the op's own
    section's, i.e. a tile timed as the fused op at those rows, rather than the plain GEMV's (timed without the
    norm, the add or SiLU-and-mul inside); None where the dispatch has no entry for the shape (no table, or the
    shape not in it: the heuristics). ``models.norm_gemm`` fuses only on the fused ops' own entries."""
    if op not in FUSED_OPS:
        raise ValueError(f"op must be one of {FUSED_OPS}, got {op!r}")
    name, _ = device_info(torch.device(device) if device is not None else None)
    return _own_entry(name, int(M), int(N), int(K), int(group_size), op)


def get_int4_config(M: int, N: int, K: int, group_size: int, device=None, *,
                    path: Optional[str] = None, op: str = "int4_linear") -> tuple[str, dict]:
    """The dispatcher's choice: ``(impl, Triton config)`` with impl "triton" or "dequant".

    ``op``: "int4_linear" (W4A16), "int4_linear_fp8" (W4A8; its own table section, always "triton"), or one of
    ``FUSED_OPS``, the W4A16 GEMV with the norm inside, the residual add, or SiLU-and-mul and the add: their own
    sections' entries where the table has them, else the plain GEMV's.
    CPU (or None) means the interpreter: heuristics (or ``path``), never "dequant"."""
    name, sms = device_info(torch.device(device) if device is not None else None)
    impl, cfg = _lookup(name, sms, int(M), int(N), int(K), int(group_size), path, op)
    if name == "cpu" and impl == "dequant":
        impl = "triton"
    cfg = dict(cfg)
    uniform = cfg["BLOCK_K"] == 256 or group_size % cfg["BLOCK_K"] == 0
    if op == "int4_linear_fp8" and cfg["kind"] == "dot" and not uniform:
        cfg["BLOCK_K"] = 256  # the FP8 dot scales each 32-column slice by one group's scale
    return impl, cfg


# ----------------------------------------------------------------------------- execution


def _zm(w: Int4Weight) -> Optional[torch.Tensor]:
    return w.zeros if w.zero_mode == "zero" else (w.mins if w.zero_mode == "min" else None)


def int4_linear_with_config(x, w: Int4Weight, bias, out, config: dict, x_scale=None, warmup: bool = False,
                            norm_weight=None, eps: float = 0.0, x_norm: bool = False, accumulate: bool = False,
                            glu: bool = False) -> None:
    """Run the kernel on 2-D views (x already in kernel column order) with an explicit config: the entry point of
    the int4 tuner and benchmark (``fastdecode.bench.int4``); no validation and no dispatch (``int4_linear`` /
    ``int4_linear_fp8`` are the checked ops). ``warmup``: compile only, see ``kernels.precompile``.
    ``norm_weight``, ``eps``, ``x_norm``, ``accumulate``: the RMSNorm of x inside and the residual add into out
    (``ops.int4_norm_linear``; ``kernels.int4.launch_int4_linear``). ``glu``: x is (M, 2K) ``[gate | up]`` and the
    input ``silu(gate) * up`` (the fma kind only)."""
    from fastdecode.kernels.int4 import launch_int4_linear, split_k_blocks
    from fastdecode.kernels.int4_mma import mma_supported

    M, K = x.shape[0], x.shape[1] // (2 if glu else 1)
    if glu and (config["kind"] != "fma" or x_norm or x_scale is not None):
        raise ValueError(f"x_glu runs on the fma kind with 16-bit x and no x_norm, got kind {config['kind']!r}, "
                         f"x_norm={x_norm}, x_scale {'given' if x_scale is not None else 'None'}")
    N = w.N
    if config["kind"] == "mma" and (x_scale is not None
                                    or not mma_supported(x.dtype, w.scales.dtype, w.zero_mode, w.group_size, K)):
        # a weight the mma kind does not compute (e.g. GGUF's fp16 scales under bf16 activations): the
        # heuristic's choice for the shape (the table was tuned on bf16 scales, "sym")
        config = heuristic_config(M, N, K, w.group_size, device_info(x.device)[1])[1]
    _, split = split_k_blocks(K, config)
    config, part, locks = split_k_workspace(x.device, config, split, M, N, "int4_linear")
    xs_mode = 0 if x_scale is None else (1 if x_scale.numel() == 1 else 2)
    launch_int4_linear(x, w.qweight, w.scales, _zm(w), w.group_size, w.zero_mode, bias, out, part, locks, config,
                       x_scale, xs_mode, warmup=warmup, pdl=pdl_enabled(x), norm_weight=norm_weight, eps=eps,
                       x_norm=x_norm, accumulate=accumulate, l2_slab=weight_prefetch_bytes(x), x_glu=glu)


def op_weight(qweight, scales, zm, perm, group_size: int, zero_mode: str, K: int) -> Int4Weight:
    """The :class:`Int4Weight` a registered int4 op receives as tensors (``zm``: zeros or mins, by zero mode)."""
    return Int4Weight(qweight, scales, zm if zero_mode == "zero" else None, zm if zero_mode == "min" else None,
                      group_size, zero_mode, perm, K)


def dispatch(impl: str, x, w: Int4Weight, op: str = "int4_linear") -> tuple[str, Optional[dict]]:
    """("triton" | "dequant", config) for x (M, K) in kernel column order: the table's choice for ``op``
    (``get_int4_config``), overridden by ``impl`` ("triton", "dequant"); Triton only off CUDA."""
    M, K = x.shape
    which, cfg = get_int4_config(M, w.N, K, w.group_size, x.device, op=op)
    if impl == "triton" or x.device.type != "cuda":
        which = "triton"
    elif impl == "dequant":
        which = "dequant"
    return which, cfg


def resolve_impl(impl: Optional[str], backend: Optional[str], device, op: str) -> str:
    """A W4A16 op's impl string for its registered op: "torch" (the reference) or impl ("auto" for None),
    refusing impls the resolved backend or the device cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    be = resolve_backend(backend, device, op)
    if be == "torch" and impl is not None:
        raise ValueError(f"impl={impl!r} needs the triton backend, but {op} resolved to the torch backend")
    if impl == "dequant" and device.type != "cuda":
        raise RuntimeError(f"{op}: impl='dequant' needs CUDA tensors (cuBLAS), got tensors on {device}")
    return "torch" if be == "torch" else (impl or "auto")


def int4_linear_dequant_cublas(x, w: Int4Weight, bias, out) -> None:
    """Large M: dequantise into a scratch (N, K) buffer with the Triton kernel, then cuBLAS (the dispatcher's
    ``impl="dequant"``; the int4 benchmark times it on its own)."""
    from fastdecode.kernels.int4_dequant import launch_int4_dequant

    wd = torch.empty(w.N, w.K, dtype=x.dtype, device=x.device)
    launch_int4_dequant(w.qweight, w.scales, _zm(w), w.group_size, w.zero_mode, wd)
    if bias is None:
        torch.mm(x, wd.t(), out=out)
    else:
        torch.addmm(bias, x, wd.t(), out=out)


@define_op("int4_linear", mutates_args=("out",))
def _int4_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zm: Optional[torch.Tensor], perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    out: torch.Tensor, group_size: int, zero_mode: str, impl: str) -> None:
    """x (M, K) original column order; the weight's tensors in the kernel layout; out (M, N)."""
    w = op_weight(qweight, scales, zm, perm, group_size, zero_mode, x.shape[1])
    if impl == "torch":
        out.copy_(int4_linear_ref(x, w, bias))
        return
    if perm is not None:
        x = x.index_select(1, perm)
    which, cfg = dispatch(impl, x, w)
    if which == "dequant":
        int4_linear_dequant_cublas(x, w, bias, out)
    else:
        int4_linear_with_config(x, w, bias, out, cfg)


@_int4_linear_op.register_fake
def _(x, qweight, scales, zm, perm, bias, out, group_size, zero_mode, impl):
    return None


@define_op("int4_linear_fp8", mutates_args=("out",))
def _int4_linear_fp8_op(x: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zm: Optional[torch.Tensor], perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        out: torch.Tensor, group_size: int, zero_mode: str, impl: str) -> None:
    """x (M, K) fp8 original column order; x_scale (1,) or (M,) fp32; out (M, N)."""
    w = op_weight(qweight, scales, zm, perm, group_size, zero_mode, x.shape[1])
    if impl == "torch":
        xs = x_scale if x_scale.numel() == 1 else x_scale.reshape(-1, 1)
        out.copy_(int4_linear_fp8_ref(x, xs, w, bias, out_dtype=out.dtype))
        return
    if perm is not None:  # index_select has no FP8 kernel everywhere: gather the bytes
        x = x.view(torch.uint8).index_select(1, perm).view(x.dtype)
    M, K = x.shape
    _, cfg = get_int4_config(M, w.N, K, group_size, x.device, op="int4_linear_fp8")
    int4_linear_with_config(x, w, bias, out, cfg, x_scale)


@_int4_linear_fp8_op.register_fake
def _(x, x_scale, qweight, scales, zm, perm, bias, out, group_size, zero_mode, impl):
    return None


# ----------------------------------------------------------------------------- public API


def _check_packed(packed, K: int) -> None:
    if not isinstance(packed, Int4Weight):
        raise ValueError(f"packed must be a fastdecode.quant.int4.Int4Weight (see quantize_int4, prepack, "
                         f"from_gptq, from_awq, from_gguf_q4_0/1), got {type(packed).__name__}")
    packed.check_format(K=K, what="int4_linear")
    kp8 = packed_cols(K)
    if packed.qweight.dtype != torch.int32 or not packed.qweight.is_contiguous() or packed.qweight.shape[1] != kp8:
        raise ValueError(f"packed.qweight must be contiguous int32 (N, {kp8}) for K={K}, got "
                         f"{packed.qweight.dtype} {tuple(packed.qweight.shape)}")


def check_x(name: str, x, packed) -> int:
    """A W4A16 op's 16-bit activation (..., K) and its packed weight checked together; returns K."""
    check_tensor(name, x, dtypes=X_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least 1 dimension (..., K), got a scalar")
    K = x.shape[-1]
    _check_packed(packed, K)
    return K


def int4_linear(x, packed: Int4Weight, bias=None, *, out=None, backend: Optional[str] = None,
                impl: Optional[str] = None) -> torch.Tensor:
    """``out = x @ dequantize_int4(packed, x.dtype).T + bias``: fp32 accumulation, one rounding to x.dtype.

    x: (..., K) bf16/fp16 (rows may be strided); packed: an :class:`Int4Weight` of shape (N, K) (any
    group size and zero mode; refused when its layout or K does not match); bias: (N,) of x.dtype or
    None. Returns (..., N) in x.dtype (or ``out``). impl: None (dispatcher) | "triton" (our kernel,
    fma or dot as tuned) | "dequant" (dequantise + cuBLAS; CUDA only).
    """
    check_x("x", x, packed)
    N = packed.N
    bias = check_bias(bias, N, (x.dtype,), "the weight")  # contiguous: the kernel reads it at unit stride
    check_same_device(x=x, qweight=packed.qweight, scales=packed.scales, bias=bias)
    out_shape = (*x.shape[:-1], N)
    check_out("out", out, out_shape, x.dtype, x.device)
    impl_s = resolve_impl(impl, backend, x.device, "int4_linear")
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device) if out is None else out
    x2 = as_rows("x", x)
    if x2.shape[0] == 0 or N == 0:
        return out
    _int4_linear_op(x2, packed.qweight, packed.scales, _zm(packed), packed.perm, bias, out.view(-1, N),
                    packed.group_size, packed.zero_mode, impl_s)
    return out


def int4_linear_fp8(x_fp8, x_scale, packed: Int4Weight, bias=None, *, out_dtype=torch.bfloat16, out=None,
                    backend: Optional[str] = None) -> torch.Tensor:
    """W4A8: ``out = (x_fp8 * x_scale) @ dequantize_int4(packed, float32).T + bias`` (fp32 maths, one rounding).

    x_scale is a dequantisation scale (``real = fp8 * scale``), float32: (1,)/() per tensor or
    (..., 1) per token (as the fused norm / activation kernels return it). The int4 integers
    (``q - zero``, or ``q`` for GGUF-style minimums) are exact in e4m3, so on the GPU the large-M
    path runs the FP8 tensor cores and applies the group scales to each 32-column partial product.
    x_fp8: (..., K) float8_e4m3fn; bias: (N,) float or None. Returns (..., N) in ``out_dtype``.
    """
    from fastdecode.ops._common import require_sm
    from fastdecode.ops.gemm import check_fp8_activation, x_scale_rows

    K, lead, M = check_fp8_activation(x_fp8, out_dtype)
    _check_packed(packed, K)
    N = packed.N
    bias = check_bias(bias, N, (torch.bfloat16, torch.float16, torch.float32), "the weight")
    check_same_device(x_fp8=x_fp8, qweight=packed.qweight, scales=packed.scales, bias=bias)
    xs = x_scale_rows(x_scale, lead, M, x_fp8.device)
    out_shape = (*lead, N)
    check_out("out", out, out_shape, out_dtype, x_fp8.device)
    be = resolve_backend(backend, x_fp8.device, "int4_linear_fp8")
    if be != "torch" and not torch.compiler.is_compiling():
        require_sm(x_fp8.device, 8, 9, "W4A8 int4_linear_fp8")
    out = torch.empty(out_shape, dtype=out_dtype, device=x_fp8.device) if out is None else out
    if M == 0 or N == 0:
        return out
    _int4_linear_fp8_op(as_rows("x_fp8", x_fp8), xs, packed.qweight, packed.scales, _zm(packed), packed.perm,
                        bias, out.view(-1, N), packed.group_size, packed.zero_mode, be)
    return out


# ----------------------------------------------------------------------------- reference


def int4_linear_ref(x, packed: Int4Weight, bias=None) -> torch.Tensor:
    """Reference of :func:`int4_linear`: weight dequantised as the kernel does (fp32 maths, one
    rounding to x.dtype), fp32 matmul, one rounding to x.dtype."""
    w = dequantize_int4(packed, x.dtype).float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int4_linear_fp8_ref(x_fp8, x_scale, packed: Int4Weight, bias=None, *, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Reference of :func:`int4_linear_fp8`: fp32 matmul of the dequantised operands, one rounding.

    x_scale: one element or (..., 1)."""
    xs = x_scale.float()
    xs = xs.reshape(()) if xs.numel() == 1 and xs.dim() <= 1 else xs.reshape(*x_fp8.shape[:-1], 1)
    y = (x_fp8.float() * xs) @ dequantize_int4(packed, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


__all__ = ["LAYOUT", "get_int4_config", "int4_linear", "int4_linear_fp8", "int4_linear_fp8_ref", "int4_linear_ref"]
