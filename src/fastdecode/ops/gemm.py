"""Linear layers for decode, BF16/FP16 and FP8 W8A8, with a shape-aware dispatcher.

    linear:      out = x @ weight.T + bias                                  (fp32 accumulation)
    linear_fp8:  out = (x_fp8 * x_scale) @ (weight_fp8 * weight_scale).T + bias
                 computed as acc(x_fp8 @ weight_fp8.T) * x_scale[m] * weight_scale[n] + bias[n]

Scales are dequantisation scales (``real = fp8 * scale``, docs/architecture.md, "Numerical conventions"):
``x_scale`` per tensor (one element) or per token (``(..., 1)``, as the fused norm / activation kernels
return it); ``weight_scale`` per tensor (one element) or per output channel (``(N,)`` or ``(N, 1)``).

Dispatcher. For every call on a GPU the implementation is picked per (dtype, N, K, M): our skinny
Triton kernel (``fastdecode.kernels.gemm``) or cuBLAS (``torch.mm`` / ``torch._scaled_mm``), from
tuned data in ``fastdecode/configs/linear_<gpu>.json`` (written by ``fastdecode tune linear``):
the exact (N, K) entry, the tuned M nearest on a log scale (above the largest tuned M: cuBLAS; the
rule and the table machinery are shared with the int4 GEMMs, ``fastdecode.ops._tuned``).
Without a file for this GPU or an entry for the shape: a heuristic (Triton for M <= 16, else
cuBLAS) with one log warning (one for the missing file; one per missing (GPU, dtype, N, K) entry).
Nothing is timed at call time, so calls are safe in graph capture.
The choice happens inside the registered op, so ``torch.compile`` sees one opaque call.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from fastdecode.ops._registry import define_op
from fastdecode.constants import SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR
from fastdecode.ops import _common
from fastdecode.ops._common import (
    pdl_enabled,
    weight_prefetch_bytes,
    cdiv, next_pow2,
    FP8_DTYPE, as_rows, check_out, check_same_device, check_tensor,
    require_sm, resolve_backend, warn_once,
)
from fastdecode.ops._tuned import (  # noqa: F401  (clear_config_cache, DEFAULT_NUM_SMS: this module's API too)
    DEFAULT_NUM_SMS, SPLIT_K_LOCKS, clear_config_cache, device_info, load_table, lookup_cache, nearest_m,
    split_k_workspace,
)

IMPLS = (None, "triton", "cublas")
LINEAR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: CPU interpreter tests
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEURISTIC_MAX_TRITON_M = 16  # without tuned data: Triton up to here, cuBLAS above

# ----------------------------------------------------------------------------- configs


def config_path(gpu_name: str) -> Path:
    """The tuned table of the linear family on ``gpu_name``: ``configs/linear_<gpu>.json``."""
    return _common.config_path("linear", gpu_name)


def dtype_key(dtype: torch.dtype) -> str:
    """Tuned-table key of a weight dtype: 'bf16' (also used for fp16), 'fp8', 'fp32'."""
    return {torch.float8_e4m3fn: "fp8", torch.float32: "fp32"}.get(dtype, "bf16")


def fma_tile(M: int, elem: int, num_warps: int = 4, acc_regs: int = 64) -> dict:
    """FMA-path tile: BLOCK_K = 16 bytes x 32 lanes x num_warps elements, so every thread issues
    16-byte weight loads and the x row's layout is the weight tile's (no shared-memory shuffle);
    BLOCK_N so the fp32 accumulators take about ``acc_regs`` registers per thread."""
    vec = 16 // elem
    bm = next_pow2(max(M, 1))
    bn = max(acc_regs // (bm * vec), 1)
    return {"kind": "fma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": vec * 32 * num_warps,
            "num_warps": num_warps, "num_stages": 1}


def with_split_k(cfg: dict, M: int, N: int, K: int, num_sms: int, per_sm: float) -> dict:
    """Set SPLIT_K so about ``per_sm`` programs run per SM (weights streamed by every SM even when
    N is small), keeping >= 1 K block per split (FMA) or >= 2 (dot: its pipeline needs a run-up)."""
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    kb_total = cdiv(K, cfg["BLOCK_K"])
    min_blocks = 2 if cfg["kind"] == "dot" else 1
    split = max(1, min(cdiv(int(per_sm * num_sms), tiles), kb_total // min_blocks, 32))
    return {**cfg, "SPLIT_K": int(split)}


def heuristic_config(M: int, N: int, K: int, dkey: str, num_sms: int = DEFAULT_NUM_SMS) -> dict:
    """A reasonable Triton config without tuned data: 16-byte loads along K, ~4 programs per SM."""
    elem = {"fp8": 1, "fp32": 4}.get(dkey, 2)
    if M <= 2:
        cfg = fma_tile(M, elem)
    else:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        cfg = {"kind": "dot", "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 256 // elem if elem < 4 else 32,
               "num_warps": 4, "num_stages": 4, "DOT_FP8": dkey == "fp8"}
    return with_split_k(cfg, M, N, K, num_sms, 4)


@lookup_cache
def _lookup(gpu_name: str, num_sms: int, dkey: str, M: int, N: int, K: int,
            path: Optional[str] = None) -> tuple[str, dict]:
    """(impl, Triton config) for one call shape; cached, so the hot path is one dict lookup.

    The config is returned even where cuBLAS wins (the tuned best Triton config, or the heuristic)
    so that an explicit ``impl="triton"`` runs the best known one. Treat it as read-only.
    """
    table = load_table("linear", gpu_name, path)
    entry = None
    heuristic = heuristic_config(M, N, K, dkey, num_sms)
    if table is None:
        warn_once(f"fastdecode: no tuned linear configs for {gpu_name!r} "
                   f"({config_path(gpu_name).name}); using heuristics (run `fastdecode tune linear`)")
    else:
        shape = table.get("linear", {}).get(dkey, {}).get(f"{N},{K}")
        if shape is None:
            where = Path(path).name if path else _common.table_path("linear", gpu_name).name
            warn_once(f"fastdecode: no tuned linear config for {dkey} N={N}, K={K} on {gpu_name!r} ({where}); "
                      f"using heuristics (run `fastdecode tune linear --shapes {N}x{K}`)")
        else:
            entry = nearest_m(shape, M)
            if entry is None:  # above the largest tuned M: cuBLAS (the rule of ops._tuned)
                return "cublas", heuristic
    if entry is None:
        return ("cublas" if M > HEURISTIC_MAX_TRITON_M else "triton"), heuristic
    return ("cublas" if entry["impl"] == "cublas" else "triton"), (entry.get("config") or heuristic)


def _dispatch(M: int, N: int, K: int, dtype: torch.dtype, device, path: Optional[str] = None):
    """(impl, Triton config): the table for a CUDA device; the interpreter (CPU) has only Triton."""
    if device is None or device.type != "cuda":
        if path is None:
            return "triton", heuristic_config(M, N, K, dtype_key(dtype))
    name, sms = device_info(device)
    return _lookup(name, sms, dtype_key(dtype), int(M), int(N), int(K), path)


def get_linear_config(M: int, N: int, K: int, dtype: torch.dtype, device=None,
                      *, path: Optional[str] = None) -> tuple[str, Optional[dict]]:
    """The dispatcher's choice for one shape: ``("triton", config)`` or ``("cublas", None)``.

    ``device``: a CUDA device (its name selects the table); CPU (or None) means the interpreter,
    where only Triton exists. ``path`` overrides the table file (tests, tuning).
    """
    device = torch.device(device) if device is not None else None
    impl, cfg = _dispatch(M, N, K, dtype, device, path)
    return (impl, dict(cfg)) if impl == "triton" else ("cublas", None)


# ----------------------------------------------------------------------------- execution

_LOCKS = SPLIT_K_LOCKS  # the split-K counters (ops._tuned); tests/test_gemm*.py read them as gemm._LOCKS


def linear_with_config(x, weight, bias, x_scale, x_mode, w_scale, w_mode, out, config: dict,
                       glu: bool = False, norm_weight=None, eps: float = 0.0, accumulate: bool = False,
                       x_norm: bool = False) -> None:
    """Run the skinny kernel on 2-D views with an explicit config: the entry point of the tuner and the GEMM
    benchmark (``fastdecode.bench.gemm``). No validation and no dispatch: ``linear`` / ``linear_fp8`` are the
    checked ops. x (M, K), weight (N, K); ``x_mode`` / ``w_mode``: 0 no scale, 1 per tensor, 2 per row.
    ``glu``: x is (M, 2K) ``[gate | up]`` and the GEMM's input ``silu(gate) * up`` (``silu_and_mul_linear``).
    ``norm_weight`` / ``eps``: the input is ``rms_norm(x)`` (one-split FMA configs only; ``x_norm`` without
    ``norm_weight``: a norm without weight), ``accumulate``: out += (``fastdecode.ops.norm_linear``)."""
    from fastdecode.kernels.gemm import launch_skinny_linear, split_k_blocks

    M = x.shape[0]
    N, K = weight.shape
    _, split = split_k_blocks(K, config)
    config, part, locks = split_k_workspace(x.device, config, split, M, N, "linear")
    launch_skinny_linear(x, weight, bias, x_scale, x_mode, w_scale, w_mode, out, part, locks, config,
                         pdl=pdl_enabled(x), glu=glu, norm_weight=norm_weight, eps=eps, accumulate=accumulate,
                         x_norm=x_norm, l2_slab=weight_prefetch_bytes(x, weight))


def cublas_fp8_supported(M: int, N: int, K: int, x_mode: int, w_mode: int, out_dtype,
                         bias_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether torch._scaled_mm takes this call and rounds it as our kernel does: dims multiple of 16;
    row-wise scales need bf16 out; a bias only of out_dtype (bf16 / fp16), which _scaled_mm adds in
    its fp32 epilogue before the one rounding (a bias added to its rounded output rounds twice)."""
    if N % 16 or K % 16:
        return False
    if (x_mode == SCALE_VECTOR or w_mode == SCALE_VECTOR) and out_dtype != torch.bfloat16:
        return False
    if bias_dtype is not None and (bias_dtype != out_dtype or out_dtype == torch.float32):
        return False
    return True


def _check_cublas_fp8(M, N, K, x_per_tensor: bool, w_per_tensor: bool, out_dtype, bias_dtype=None) -> None:
    modes = (SCALE_TENSOR if x_per_tensor else SCALE_VECTOR, SCALE_TENSOR if w_per_tensor else SCALE_VECTOR)
    if not cublas_fp8_supported(M, N, K, *modes, out_dtype, bias_dtype):
        raise ValueError(
            f"impl='cublas': torch._scaled_mm cannot run N={N}, K={K} with these scales, out_dtype "
            f"{out_dtype} and bias dtype {bias_dtype} (it needs N and K multiples of 16, bf16 output with "
            "per-token or per-channel scales, and a bias of out_dtype bf16/fp16 if any, so that the bias is "
            "added before the one rounding); use impl=None or 'triton'"
        )


def _cublas_linear(x, weight, bias, out) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _cublas_linear_fp8(x, x_scale, x_mode, weight, w_scale, w_mode, bias, out) -> None:
    """``torch._scaled_mm`` with the bias in its epilogue: ``acc * x_scale * w_scale + bias`` in fp32,
    one rounding, as our kernel (cublas_fp8_supported admits only a bias of out's dtype). Adding the
    bias to the rounded output instead rounded twice: up to half an ulp of the pre-bias value off,
    0.0078 at |x @ w.T| in [2, 4) with the bias cancelling it (tests/test_gemm_gpu.py)."""
    M, N = out.shape
    if x_mode == SCALE_TENSOR and w_mode == SCALE_TENSOR:
        sa, sb = x_scale.reshape(()), w_scale.reshape(())
    else:  # row-wise scaling needs both scales as vectors (an expand costs a small copy)
        sa = x_scale.reshape(M, 1) if x_mode == SCALE_VECTOR else x_scale.reshape(1, 1).expand(M, 1).contiguous()
        sb = w_scale.reshape(1, N) if w_mode == SCALE_VECTOR else w_scale.reshape(1, 1).expand(1, N).contiguous()
    torch._scaled_mm(x if x.is_contiguous() else x.contiguous(), weight.t(), sa, sb,
                     bias=bias, out_dtype=out.dtype, out=out)


def _choose(impl: str, x, weight, cublas_ok: bool) -> tuple[str, Optional[dict]]:
    M = x.shape[0]
    N, K = weight.shape
    which, cfg = _dispatch(M, N, K, weight.dtype, x.device)
    if impl == "cublas":
        return "cublas", None
    if impl == "triton" or x.device.type != "cuda" or not cublas_ok:
        return "triton", cfg
    return which, cfg


# ----------------------------------------------------------------------------- registered ops


@define_op("linear", mutates_args=("out",))
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               out: torch.Tensor, impl: str) -> None:
    """x (M, K) unit stride in K; weight (N, K) contiguous; out (M, N) contiguous.

    impl: "auto" | "triton" | "cublas" | "torch" (the reference).
    """
    if impl == "torch":
        out.copy_(linear_ref(x, weight, bias))
        return
    which, cfg = _choose(impl, x, weight, cublas_ok=True)
    if which == "cublas":
        _cublas_linear(x, weight, bias, out)
    else:
        linear_with_config(x, weight, bias, None, SCALE_NONE, None, SCALE_NONE, out, cfg)


@_linear_op.register_fake
def _(x, weight, bias, out, impl):
    return None


@define_op("linear_fp8", mutates_args=("out",))
def _linear_fp8_op(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                   weight_scale: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                   impl: str) -> None:
    """x (M, K) fp8; x_scale (1,) or (M,) fp32; weight (N, K) fp8; weight_scale (1,) or (N,) fp32."""
    M, N = out.shape
    # M == 1 per-token is the same as per-tensor
    x_mode = SCALE_TENSOR if x_scale.numel() == 1 else SCALE_VECTOR
    w_mode = SCALE_TENSOR if weight_scale.numel() == 1 else SCALE_VECTOR
    if impl == "torch":
        out.copy_(linear_fp8_ref(x, x_scale.reshape(-1, 1) if x_mode == SCALE_VECTOR else x_scale, weight,
                                 weight_scale, bias, out_dtype=out.dtype))
        return
    require_sm(x.device, 8, 9, "FP8 linear")
    bias_dtype = None if bias is None else bias.dtype
    ok = x.device.type == "cuda" and cublas_fp8_supported(M, N, x.shape[1], x_mode, w_mode, out.dtype, bias_dtype)
    if impl == "cublas":
        _check_cublas_fp8(M, N, x.shape[1], x_mode == SCALE_TENSOR, w_mode == SCALE_TENSOR, out.dtype, bias_dtype)
    which, cfg = _choose(impl, x, weight, cublas_ok=ok)
    if which == "cublas":
        _cublas_linear_fp8(x, x_scale, x_mode, weight, weight_scale, w_mode, bias, out)
    else:
        linear_with_config(x, weight, bias, x_scale, x_mode, weight_scale, w_mode, out, cfg)


@_linear_fp8_op.register_fake
def _(x, x_scale, weight, weight_scale, bias, out, impl):
    return None


# ----------------------------------------------------------------------------- public API


def _resolve_impl(impl, backend, device, op: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    be = resolve_backend(backend, device, op)
    if be == "torch":
        if impl is not None:
            raise ValueError(f"impl={impl!r} needs the triton backend, but {op} resolved to the torch backend")
        return "torch"
    if impl == "cublas" and device.type != "cuda":
        raise RuntimeError(f"{op}: impl='cublas' needs CUDA tensors, got tensors on {device}")
    return impl or "auto"


def _check_weight(weight, K: int, dtypes, name: str = "weight", x_name: str = "x") -> int:
    check_tensor(name, weight, dtypes=dtypes, ndim=2)
    if weight.shape[1] != K:
        raise ValueError(f"{name} must have shape (N, {K}) to match the last dimension of {x_name}, "
                         f"got {tuple(weight.shape)} (mismatched K)")
    if not weight.is_contiguous():
        raise ValueError(f"{name} must be contiguous (N, K) row-major, got strides {weight.stride()}; "
                         "call .contiguous() once when preparing weights")
    return weight.shape[0]


def check_bias(bias, N: int, dtypes, weight_name: str = "weight"):
    """Validate an optional (N,) bias of one of ``dtypes`` for a GEMM whose weight (named ``weight_name`` in
    errors) has N rows; return it contiguous (the kernels and _scaled_mm read it at unit stride), or None."""
    if bias is None:
        return None
    check_tensor("bias", bias, dtypes=dtypes, ndim=1)
    if bias.shape[0] != N:
        raise ValueError(f"bias must have shape ({N},) (N, the rows of {weight_name}), got {tuple(bias.shape)}")
    return bias.contiguous()


def run_linear(op: str, name: str, x, K: int, N: int, bias, out, impl, backend, call) -> torch.Tensor:
    """The tail the checked linear ops share: ``out`` (..., N) in x's dtype checked (or made), the impl resolved
    for ``op``, then ``call(x_rows, out_rows, impl)`` on x's rows (``name`` in errors), unless nothing is left to
    compute: no rows or N = 0 (out as it is), K = 0 (out = bias, or 0)."""
    out_shape = (*x.shape[:-1], N)
    check_out("out", out, out_shape, x.dtype, x.device)
    impl_s = _resolve_impl(impl, backend, x.device, op)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device) if out is None else out
    x2 = as_rows(name, x)
    if x2.shape[0] == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(out_shape)) if bias is not None else out.zero_()
    call(x2, out.view(-1, N), impl_s)
    return out


def linear(x, weight, bias=None, *, out=None, backend: Optional[str] = None,
           impl: Optional[str] = None) -> torch.Tensor:
    """``out = x @ weight.T + bias`` with fp32 accumulation, one rounding to x.dtype.

    x: (..., K) bf16/fp16 (fp32 accepted; rows may be strided); weight: (N, K) contiguous, same
    dtype; bias: (N,) same dtype or None. Returns (..., N) (or ``out``).
    impl: None (dispatch on tuned data) | "triton" (our skinny kernel) | "cublas" (torch.mm).
    """
    check_tensor("x", x, dtypes=LINEAR_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., K), got a scalar")
    K = x.shape[-1]
    N = _check_weight(weight, K, LINEAR_DTYPES)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have the dtype of x ({x.dtype}), got {weight.dtype}")
    bias = check_bias(bias, N, (x.dtype,))
    check_same_device(x=x, weight=weight, bias=bias)
    return run_linear("linear", "x", x, K, N, bias, out, impl, backend,
                      lambda x2, out2, impl_s: _linear_op(x2, weight, bias, out2, impl_s))


def x_scale_rows(x_scale, lead: tuple, M: int, device) -> torch.Tensor:
    """Validate the float32 dequantisation scale of an FP8 activation with leading dims ``lead`` (M rows)
    on ``device``: per tensor ((1,) / ()) -> (1,), per token ((*lead, 1) or (M, 1)) -> contiguous (M,)."""
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,))
    if x_scale.device != device:
        raise ValueError(f"x_scale is on {x_scale.device} but x_fp8 is on {device}")
    if x_scale.numel() == 1 and x_scale.dim() <= 1:
        return x_scale.reshape(1)
    if tuple(x_scale.shape) in ((M, 1), (*lead, 1)) and x_scale.numel() == M:
        return x_scale.reshape(M).contiguous()
    raise ValueError(f"x_scale must be per-tensor (shape (1,) or ()) or per-token (shape {(*lead, 1)}), "
                     f"got {tuple(x_scale.shape)}")


def _w_scale_vec(weight_scale, N: int, device) -> torch.Tensor:
    check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,))
    if weight_scale.device != device:
        raise ValueError(f"weight_scale is on {weight_scale.device} but x_fp8 is on {device}")
    if weight_scale.numel() == 1 and weight_scale.dim() <= 1:
        return weight_scale.reshape(1)
    if tuple(weight_scale.shape) in ((N,), (N, 1)):
        return weight_scale.reshape(N).contiguous()
    raise ValueError(f"weight_scale must be per-tensor (shape (1,) or ()) or per-channel (shape ({N},) "
                     f"or ({N}, 1)), got {tuple(weight_scale.shape)}")


def check_fp8_activation(x_fp8, out_dtype) -> tuple[int, tuple, int]:
    """Validate an FP8 activation (..., K) and the output dtype of a W8A8 / W4A8 GEMM: (K, lead, M)."""
    check_tensor("x_fp8", x_fp8, dtypes=(FP8_DTYPE,))
    if x_fp8.dim() == 0:
        raise ValueError("x_fp8 must have at least 1 dimension (..., K), got a scalar")
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FP8_OUT_DTYPES}, got {out_dtype}")
    lead = tuple(x_fp8.shape[:-1])
    return x_fp8.shape[-1], lead, math.prod(lead)


def linear_fp8(x_fp8, x_scale, weight_fp8, weight_scale, bias=None, *, out_dtype=torch.bfloat16,
               out=None, backend: Optional[str] = None, impl: Optional[str] = None) -> torch.Tensor:
    """W8A8: ``out = (x_fp8 @ weight_fp8.T) * x_scale * weight_scale + bias`` (fp32 math, one rounding).

    Scales are dequantisation scales (``real = fp8 * scale``), float32:
    x_scale (1,)/() per tensor (static) or (..., 1) per token (dynamic, as the fused norm returns);
    weight_scale (1,)/() per tensor or (N,)/(N, 1) per output channel.
    x_fp8: (..., K) float8_e4m3fn; weight_fp8: (N, K) float8_e4m3fn, contiguous; bias: (N,) float or
    None. Returns (..., N) in ``out_dtype`` (or ``out``). Scales are not read back to check their
    sign (that would sync the host on every call). impl: None | "triton" | "cublas" (_scaled_mm).
    """
    K, lead, M = check_fp8_activation(x_fp8, out_dtype)
    N = _check_weight(weight_fp8, K, (FP8_DTYPE,), "weight_fp8", "x_fp8")
    bias = check_bias(bias, N, (torch.bfloat16, torch.float16, torch.float32), "weight_fp8")
    check_same_device(x_fp8=x_fp8, weight_fp8=weight_fp8, bias=bias)
    xs = x_scale_rows(x_scale, lead, M, x_fp8.device)
    ws = _w_scale_vec(weight_scale, N, x_fp8.device)
    out_shape = (*lead, N)
    check_out("out", out, out_shape, out_dtype, x_fp8.device)
    impl_s = _resolve_impl(impl, backend, x_fp8.device, "linear_fp8")
    if impl_s != "torch" and not torch.compiler.is_compiling():  # compiled: checked in the op
        require_sm(x_fp8.device, 8, 9, "FP8 linear")
    if impl_s == "cublas":
        _check_cublas_fp8(M, N, K, xs.numel() == 1, ws.numel() == 1, out_dtype, None if bias is None else bias.dtype)
    out = torch.empty(out_shape, dtype=out_dtype, device=x_fp8.device) if out is None else out
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.to(out_dtype).expand(out_shape)) if bias is not None else out.zero_()
    _linear_fp8_op(as_rows("x_fp8", x_fp8), xs, weight_fp8, ws, bias, out.view(-1, N), impl_s)
    return out


# ----------------------------------------------------------------------------- references


def linear_ref(x, weight, bias=None) -> torch.Tensor:
    """Reference of :func:`linear`: fp32 matmul, one rounding to x.dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_fp8_ref(x_fp8, x_scale, weight_fp8, weight_scale, bias=None, *,
                   out_dtype=torch.bfloat16) -> torch.Tensor:
    """Reference of :func:`linear_fp8`, with the kernel's recipe: ``acc * x_scale * weight_scale + bias``
    in fp32 (acc the fp32 product of the FP8 values), then one rounding to out_dtype.

    x_scale: one element or (..., 1); weight_scale: one element, (N,) or (N, 1).
    """
    xs = x_scale.float()
    xs = xs.reshape(()) if xs.numel() == 1 and xs.dim() <= 1 else xs.reshape(*x_fp8.shape[:-1], 1)
    ws = weight_scale.float()
    ws = ws.reshape(()) if ws.numel() == 1 and ws.dim() <= 1 else ws.reshape(-1)
    y = (x_fp8.float() @ weight_fp8.float().t()) * xs * ws
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
