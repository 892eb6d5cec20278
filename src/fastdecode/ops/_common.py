"""What every op shares: backend choice, capability checks, argument validation.

Backends
--------
Each op has two backends:

* ``"triton"``: the Triton kernel. Runs on CUDA tensors, and on CPU tensors when the Triton
  interpreter is on (``TRITON_INTERPRET=1``), which is how CI tests kernels without a GPU.
* ``"torch"``: the plain-PyTorch reference; runs everywhere and is the CPU path of the engine.

The backend is chosen by the ``backend=`` argument of an op, else by the environment variable
``FASTDECODE_BACKEND`` (``auto`` | ``triton`` | ``torch``), else ``auto``. ``auto`` picks Triton when
it can run on the tensor's device and falls back to ``torch`` with one log line per reason. An
explicit request that cannot be met raises ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Optional

import torch

from fastdecode.constants import FP8_MAX, FP8_MIN_SCALE, OUT_FP8_DYNAMIC, OUT_FP8_STATIC, OUT_NATIVE  # noqa: F401
from fastdecode.kernels.host import cdiv, next_pow2  # noqa: F401  (the launchers' integer helpers; no triton import)

log = logging.getLogger("fastdecode")

BACKENDS = ("auto", "triton", "torch")
FP8_DTYPE = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- environment


def interpreter_on() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton is imported lazily, by the kernels on their first launch: TRITON_INTERPRET is read when
# triton is imported, so importing fastdecode must not import triton.
_TRITON_OK = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_OK


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device. One place, so tests can patch it."""
    return torch.cuda.get_device_capability(device)


def require_sm(device: torch.device, major: int, minor: int, what: str) -> None:
    """Raise RuntimeError when ``device`` is a CUDA GPU older than sm_{major}{minor}.

    CPU tensors pass: the reference path and the interpreter emulate every dtype.
    """
    if device.type != "cuda":
        return
    cap = device_capability(device)
    if cap < (major, minor):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"{what} needs a GPU with compute capability >= {major}.{minor} "
            f"(sm_{major}{minor}+); {name} has {cap[0]}.{cap[1]}"
        )


# ------------------------------------------------------------------------ launch policies (PDL, the slabs' L2 prefetch)


class LaunchPolicy:
    """A process-wide launch setting that the ops read at every launch (a CUDA graph keeps what was in force when it
    was captured): ``set`` True / False, or None for the default (the environment variable ``env``: on unless "0" or
    empty; ``default`` when unset, which may be None: the setting's own rule, as ``weight_prefetch_enabled``'s);
    ``override`` for a block; ``on`` the setting now."""

    def __init__(self, env: str, default: Optional[bool]):
        self.env, self.default, self.value = env, default, None

    def set(self, enabled: Optional[bool]) -> Optional[bool]:
        """Set it (None: back to the environment's); returns the previous setting (to restore)."""
        before, self.value = self.value, None if enabled is None else bool(enabled)
        return before

    @contextlib.contextmanager
    def override(self, enabled: bool):
        """``set(enabled)`` inside the block, the previous setting restored after it."""
        before = self.set(enabled)
        try:
            yield
        finally:
            self.set(before)

    def on(self) -> Optional[bool]:
        if self.value is not None:
            return self.value
        v = os.environ.get(self.env)
        return self.default if v is None else v not in ("", "0")


_PDL = LaunchPolicy("FASTDECODE_PDL", True)


def set_pdl(enabled: Optional[bool]) -> Optional[bool]:
    """Programmatic dependent launch (``fastdecode.kernels.pdl``) for the fastdecode kernels launched from
    now on: True / False, or None for the default (environment ``FASTDECODE_PDL``: on unless "0"). A CUDA
    graph keeps what was in force when it was captured. Returns the previous setting (to restore)."""
    return _PDL.set(enabled)


def pdl_override(enabled: bool):
    """``set_pdl(enabled)`` inside the block, the previous setting restored after it."""
    return _PDL.override(enabled)


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_switch() -> bool:
    """The switch alone: ``set_pdl``'s value, else ``FASTDECODE_PDL`` (on unless "0" or empty)."""
    return _PDL.on()


def _compiled_sm90(t: torch.Tensor) -> bool:
    """``t`` on a CUDA GPU of sm_90+ and the kernels compiled (not the interpreter): where Hopper's PTX runs."""
    if t.device.type != "cuda" or interpreter_on():
        return False
    return _sm_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Launch with PDL: switched on (``pdl_switch``) and ``t`` on a CUDA GPU of sm_90+, compiled (the
    interpreter has no grid dependency control)."""
    return pdl_switch() and _compiled_sm90(t)


def check_prefetch(prefetch: Optional[torch.Tensor], device: torch.device) -> None:
    """An op's ``prefetch`` argument (``kernels.prefetch``): None, or a tensor on ``device``, contiguous and 16-byte
    aligned (a weight, or a slice of its bytes starting at a multiple of 16)."""
    if prefetch is None:
        return
    if not isinstance(prefetch, torch.Tensor):
        raise TypeError(f"prefetch must be a tensor or None, got {type(prefetch).__name__}")
    if prefetch.device != device:
        raise ValueError(f"prefetch must be on {device}, got {prefetch.device}")
    if not prefetch.is_contiguous() or (not is_tracing() and prefetch.data_ptr() % 16):
        raise ValueError("prefetch must be contiguous and 16-byte aligned (a weight tensor, or a slice of its "
                         "bytes starting at a multiple of 16)")


def l2_prefetch_bytes(prefetch: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A kernel's L2 prefetch range (``kernels.prefetch``): ``prefetch``'s bytes as a 1-D uint8 view, or None when
    there is none or the kernel runs where the prefetch cannot (a CPU, the interpreter, a GPU below sm_90). It is a
    hint and changes no result."""
    if prefetch is None or not _compiled_sm90(prefetch):
        return None
    return prefetch.reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- the GEMV weight slabs' L2 prefetch

# None: the measured rule of weight_prefetch_enabled (small bf16 / fp16 weights); True / False: every GEMV / none
_WEIGHT_PREFETCH = LaunchPolicy("FASTDECODE_WEIGHT_PREFETCH", None)
# the default rule's bound: a bf16 / fp16 GEMV weight of at most this many bytes takes its slab prefetch
WEIGHT_PREFETCH_AUTO_BYTES = 8 << 20


def set_weight_prefetch(enabled: Optional[bool]) -> Optional[bool]:
    """The GEMV kernels' L2 prefetch of their own weight slab before their PDL wait (``kernels.prefetch``), for the
    kernels launched from now on: True (every GEMV that can) / False (none), or None for the default (environment
    ``FASTDECODE_WEIGHT_PREFETCH``: "0" or empty none, anything else every GEMV; unset: the rule of
    ``weight_prefetch_enabled``). A launch policy like PDL, and only with it: a CUDA graph keeps what was in force
    when it was captured. Returns the previous setting."""
    return _WEIGHT_PREFETCH.set(enabled)


def weight_prefetch_override(enabled: Optional[bool]):
    """``set_weight_prefetch(enabled)`` inside the block, the previous setting restored after it."""
    return _WEIGHT_PREFETCH.override(enabled)


def weight_prefetch_enabled(t: torch.Tensor, weight: Optional[torch.Tensor] = None) -> bool:
    """Prefetch a GEMV's weight slabs into L2: PDL on for ``t`` (sm_90+, compiled: ``pdl_enabled``) and the policy
    on (``set_weight_prefetch``, else the environment). By default (neither set) only at one token (``t`` (1, K))
    and on the skinny GEMM's ``weight`` (it passes it; the int4 kernels do not) in bf16 / fp16 of at most
    ``WEIGHT_PREFETCH_AUTO_BYTES``: what was measured to gain. On one H100 (session 29, ``benchmarks/NOTES.md``,
    batch 1) the prefetch took the SmolLM2-shaped bf16 step from 478 to 456 us and cost every 8B step (bf16
    +361 us, int4 +349) and the SmolLM2-shaped int4 step (+33 us)."""
    mode = _WEIGHT_PREFETCH.on()
    if mode is None:
        mode = (weight is not None and t.shape[0] == 1 and weight.dtype in (torch.bfloat16, torch.float16)
                and weight.numel() * weight.element_size() <= WEIGHT_PREFETCH_AUTO_BYTES)
    return mode and pdl_enabled(t)


WEIGHT_PREFETCH_KB = 64  # a GEMV program's slab prefetch, at most (FASTDECODE_WEIGHT_PREFETCH_KB: KB, or "all")


def weight_prefetch_bytes(t: torch.Tensor, weight: Optional[torch.Tensor] = None) -> int:
    """The bytes of its weight slab a GEMV program prefetches into L2 before its PDL wait: 0 where
    ``weight_prefetch_enabled(t, weight)`` is not, else ``FASTDECODE_WEIGHT_PREFETCH_KB`` KB (default
    ``WEIGHT_PREFETCH_KB``; "all": the whole slab; 0: none). The resident programs' prefetches must stay in L2
    (60 MB on the H200) until they read them, while the kernel before them still streams: the cap keeps them to
    a few MB. Read at every launch, so a CUDA graph keeps what was in force when it was captured."""
    if not weight_prefetch_enabled(t, weight):
        return 0
    kb = os.environ.get("FASTDECODE_WEIGHT_PREFETCH_KB", "").strip().lower()
    if kb == "all":
        return 2**31 - 1
    try:
        n = int(float(kb) * 1024) if kb else WEIGHT_PREFETCH_KB * 1024
        return 0 if n <= 0 else max(16, n)
    except ValueError:
        raise ValueError(f"FASTDECODE_WEIGHT_PREFETCH_KB must be a number of KB or 'all', got {kb!r}") from None


_logged_once: set[str] = set()
_log_lock = threading.Lock()


def log_once(msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time it comes in this process (fallbacks, missing tuned data).

    Nothing while torch.compile traces (Dynamo cannot enter the lock: a fullgraph compile of an op on the
    ``auto`` backend's CPU fallback failed there); the eager calls before or after log it."""
    if msg in _logged_once or torch.compiler.is_compiling():
        return
    with _log_lock:
        if msg in _logged_once:
            return
        _logged_once.add(msg)
    log.log(level, msg)


def warn_once(msg: str) -> None:
    log_once(msg, logging.WARNING)


# ----------------------------------------------------------------------------- tuned data (configs/*.json)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def gpu_key(name: str) -> str:
    """File-name form of a GPU name: 'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def config_path(kind: str, gpu_name: str) -> Path:
    """``configs/<kind>_<gpu>.json``: the tuned or measured table of one op family on one GPU.

    ``FASTDECODE_CONFIG_DIR`` points at tables of your own (as ``fastdecode tune ... --out
    DIR/<kind>_<gpu>.json`` writes them): a table found there is read instead of the package's; a
    family it has no table for still reads the package's.
    """
    name = f"{kind}_{gpu_key(gpu_name)}.json"
    override = os.environ.get("FASTDECODE_CONFIG_DIR")
    if override and (Path(override) / name).is_file():
        return Path(override) / name
    return CONFIG_DIR / name


# A GPU without tables of its own reads those of a GPU of the same architecture where the package has them: every
# tile there compiles and runs on it, tuned on the other GPU. Hopper (sm_90: H100 SXM / PCIe / NVL, H800, H20, GH200)
# reads the H200's. Measured on an H100 (session 33, benchmarks/NOTES.md): the embedded model's decode step ran
# 619 us on the H200's tables against 668 us on the heuristics the H100 had before.
# The all-reduce table is not shared: its crossovers depend on the interconnect (NVLink or PCIe), not the SMs.
SIBLING_TABLES = ((re.compile(r"\b(h100|h800|h20|gh200)\b", re.IGNORECASE), "NVIDIA H200"),)
SIBLING_KINDS = ("linear", "int4_linear")


def sibling_gpu(gpu_name: str) -> Optional[str]:
    """The GPU whose tables ``gpu_name`` reads when it has none of its own (``SIBLING_TABLES``), or None."""
    return next((other for pattern, other in SIBLING_TABLES if pattern.search(gpu_name)), None)


def table_path(kind: str, gpu_name: str) -> Path:
    """The table of ``kind`` that ops on ``gpu_name`` read: its own (``config_path``) where there is one, else (the
    GEMM tables, ``SIBLING_KINDS``) that of its ``sibling_gpu`` (same architecture; one info line naming both, as
    ``fastdecode info`` does; not a warning: every generate would print it), else its own path, absent (the ops then
    use heuristics, with a warning). Tuners write to ``config_path``, never to a sibling's table."""
    own = config_path(kind, gpu_name)
    other = sibling_gpu(gpu_name) if kind in SIBLING_KINDS else None
    if own.is_file() or other is None:
        return own
    theirs = config_path(kind, other)
    if not theirs.is_file():
        return own
    log_once(f"fastdecode: no {kind} table for {gpu_name!r}; reading the {other}'s ({theirs.name}: the same "
             f"architecture, tuned there, not on this GPU)")
    return theirs


@functools.cache
def load_config_table(path: str) -> Optional[dict]:
    """The JSON table at ``path``, or None when there is none (cached; ``cache_clear()`` after writing)."""
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def resolve_backend(backend: Optional[str], device: torch.device, op: str) -> str:
    """Return ``"triton"`` or ``"torch"`` for an op running on ``device``."""
    requested = backend if backend is not None else os.environ.get("FASTDECODE_BACKEND", "auto")
    requested = requested.lower()
    if requested not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS} (argument or FASTDECODE_BACKEND), got {requested!r}"
        )
    if requested == "torch":
        return "torch"
    reason = None
    if not triton_available():
        reason = "triton is not importable"
    elif device.type == "cpu" and not interpreter_on():
        reason = "tensors are on the CPU and TRITON_INTERPRET is not set"
    elif device.type not in ("cpu", "cuda"):
        reason = f"device type {device.type!r} has no Triton backend"
    if reason is None:
        return "triton"
    if requested == "triton":
        raise RuntimeError(f"{op}: backend='triton' was requested but {reason}")
    log_once(f"fastdecode: {op} uses the torch backend because {reason}")
    return "torch"


def is_tracing() -> bool:
    """True under torch.compile tracing or CUDA-graph capture: no host syncs allowed then."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- validation


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, ndim: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_same_device(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(f"{name} is on {t.device} but {name0} is on {t0.device}; put them on one device")


def as_rows(name: str, t: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """View ``t`` (..., H) as rows (M, H) with unit stride along H.

    A row stride is kept (no copy). A tensor whose last dimension is strided is copied, unless it is
    written in place (``inplace``), which raises instead since a copy would lose the write; so do
    in-place rows that overlap (row stride < H, e.g. stride 0 from ``expand``).
    """
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a scalar")
    H = t.shape[-1]
    if t.dim() == 1:
        t = t.unsqueeze(0)
    elif t.dim() > 2:
        try:
            t = t.view(-1, H)
        except RuntimeError:
            if inplace:
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
                    f"rows (M, {H}); it is updated in place, so it must be"
                ) from None
            t = t.reshape(-1, H)
    if H > 1 and t.stride(1) != 1:
        if inplace:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
        t = t.contiguous()
    if inplace and t.shape[0] > 1 and H > 0 and t.stride(0) < H:
        # an expanded (stride 0) or overlapping view: several rows share memory, so the kernel would
        # write one element from several rows (and torch's copy_ refuses it): refuse it here instead
        raise ValueError(
            f"{name} has rows that overlap in memory (row stride {t.stride(0)} < {H} elements per row, "
            f"e.g. an expanded tensor); it is updated in place, so each row needs its own memory "
            f"(pass {name}.clone())"
        )
    return t


def check_out(name: str, out: Optional[torch.Tensor], shape, dtype, device) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a tensor of shape {tuple(shape)}, dtype {dtype} on {device}; "
            f"got shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {out.stride()}")


def static_scale(scale, device: torch.device, name: str = "scale") -> torch.Tensor:
    """Validate a static per-tensor FP8 scale (``real = fp8 * scale``) and return a 1-element fp32 tensor.

    A Python number becomes a new tensor (an allocation per call: pass a tensor in hot loops).
    Positivity of a tensor is checked unless we are tracing or capturing a graph, where reading
    the value back would force a host sync.
    """
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not scale > 0 or scale != scale or scale == float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {scale}")
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be a positive float or a 1-element float32 tensor, got {type(scale).__name__}")
    if scale.numel() != 1:
        raise ValueError(f"{name} must hold one element (a per-tensor scale), got shape {tuple(scale.shape)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the input is on {device}")
    if not is_tracing():
        v = float(scale.reshape(()).item())
        if not (v > 0 and v != float("inf")):
            raise ValueError(f"{name} must be positive and finite, got {v}")
    return scale.reshape(1)


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


def out_mode(out: torch.Tensor, scale_in, scale_out):
    """(OUT_MODE, scale tensor) of a row kernel writing ``out``: native, FP8 static, FP8 dynamic."""
    if out.dtype != FP8_DTYPE:
        return OUT_NATIVE, None
    if scale_in is not None:
        return OUT_FP8_STATIC, scale_in
    return OUT_FP8_DYNAMIC, scale_out
