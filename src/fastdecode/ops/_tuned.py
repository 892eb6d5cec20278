"""Tuned-config machinery shared by the GEMM dispatchers: ``ops.gemm`` (BF16/FP16 ``linear``, FP8 W8A8
``linear_fp8``) and ``ops.int4`` (W4A16 ``int4_linear``, W4A8 ``int4_linear_fp8``).

Both pick an implementation and a Triton config per call shape from a JSON table written by a tuner
(``fastdecode tune linear``, ``fastdecode.bench.int4.tune``). What they share lives here:

* where a table lives: ``_common.config_path`` (``configs/<family>_<gpu>.json``, one per op family and GPU;
  ``FASTDECODE_CONFIG_DIR`` overrides it) and its cached load (:func:`load_table`);
* the cache of each op's per-shape lookups (:func:`lookup_cache`); :func:`clear_config_cache` forgets the
  tables and every op's lookups at once (after a tuner wrote a new file);
* the device-info cache (:func:`device_info`: GPU name and SM count, "cpu" for the interpreter);
* the choice of the tuned entry for a call's M (:func:`nearest_m`), the rule below;
* the split-K tile counters (:func:`split_k_locks`), one buffer per device shared by all split-K launches.

Choosing the entry for M
------------------------
A table holds, per shape, entries at a few tuned M (e.g. 1, 2, 4, ..., 256 or 4096). A call takes the entry
of the tuned M nearest on a log2 scale (a tie: the smaller M). **Above the largest tuned M the table is not
extrapolated**: the call takes the op's large-M path, cuBLAS where the op has one (``linear`` /
``linear_fp8``: ``torch.mm`` / ``torch._scaled_mm``; ``int4_linear``: dequantise + cuBLAS, on CUDA), else
(``int4_linear_fp8``, which has no cuBLAS path, and anything under the CPU interpreter) Triton with the
op's heuristic config, never a tile tuned for a smaller M.

Why this rule and not "the nearest entry, however far": the tuner times each shape only up to its largest
M, and larger M are prefill-sized, compute-bound GEMMs where cuBLAS runs near peak. The entry tuned at the
largest M may be a Triton tile and split-K factor chosen for a memory-bound problem; applying it at 10x or
100x that M has no measured bound on how slow it is, while cuBLAS's worst case there is small. The shipped
H200 tables agree: at their largest tuned M every bf16 / fp8 ``linear`` shape chose cuBLAS and every
W4A16 shape chose dequantise + cuBLAS. ``ops.gemm`` already followed this rule, and its test pins it
(tests/test_gemm.py ``test_dispatcher_nearest_m_on_log_scale``: ``get(4096) == ("cublas", None)``
"above the largest tuned M"); ``ops.int4`` used to take the nearest entry and now follows it too
(tests/test_tuned.py pins the rule for both).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from fastdecode.ops import _common
from fastdecode.ops._common import load_config_table

DEFAULT_NUM_SMS = 132  # H100 SXM / H200; the CPU interpreter has no SM count


# ----------------------------------------------------------------------------- tables


def load_table(family: str, gpu_name: str, path: Optional[str] = None) -> Optional[dict]:
    """The table at ``path`` (tests, tuning), else the family's table that ``gpu_name`` reads (its own, else a GPU's of
    the same architecture: ``_common.table_path``); None when there is none. Cached (:func:`clear_config_cache`)."""
    return load_config_table(path or str(_common.table_path(family, gpu_name)))


_LOOKUPS: list = []  # every op's cached lookup, cleared together with the tables


def lookup_cache(fn):
    """Decorator: an LRU-cached per-shape lookup (the hot path is then one dict lookup), registered so that
    :func:`clear_config_cache` forgets it. Treat what it returns as read-only."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    _LOOKUPS.append(cached)
    return cached


def clear_config_cache() -> None:
    """Forget the loaded tables and every op's cached lookups (after ``tune`` wrote a new file)."""
    load_config_table.cache_clear()
    for fn in _LOOKUPS:
        fn.cache_clear()


@functools.cache
def _cuda_device_info(index: int) -> tuple[str, int]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).multi_processor_count


def device_info(device: Optional[torch.device]) -> tuple[str, int]:
    """(GPU name, SM count) of a CUDA ``device`` (cached per index); ``("cpu", DEFAULT_NUM_SMS)`` for None or
    any other device (the interpreter)."""
    if device is None or device.type != "cuda":
        return "cpu", DEFAULT_NUM_SMS
    return _cuda_device_info(device.index if device.index is not None else torch.cuda.current_device())


def nearest_key(entries: Optional[dict], M: int) -> Optional[str]:
    """The key of the tuned M nearest to M on a log2 scale (a tie: the smaller M); None when there are no
    entries or M is above the largest tuned M (the module docstring's rule: the op's large-M path then)."""
    ms = sorted(int(m) for m in entries or ())
    if not ms or M > ms[-1]:
        return None
    return str(min(ms, key=lambda m: (abs(math.log2(m) - math.log2(max(M, 1))), m)))


def nearest_m(entries: Optional[dict], M: int) -> Optional[dict]:
    """The entry of :func:`nearest_key` (None where it is None)."""
    key = nearest_key(entries, M)
    return None if key is None else entries[key]


# ----------------------------------------------------------------------------- split-K tile counters

#: (device type, index) -> zeroed int32 tile counters shared by all split-K launches on that device
SPLIT_K_LOCKS: dict = {}
_LOCKS_RETIRED: list = []  # outgrown buffers stay alive: captured graphs may still point at them
_LOCKS_MIN = 1 << 16


def split_k_locks(device: torch.device, n: int) -> Optional[torch.Tensor]:
    """At least ``n`` tile counters for the split-K fix-up of a launch on ``device``; they return to 0 after
    every launch. None when none are allocated yet and a CUDA graph is being captured (the caller then
    runs without split-K).

    Allocated on first use outside graph capture (a buffer born inside a capture would belong to the
    graph's private pool). Launches on one stream never overlap; do not run split-K GEMMs concurrently
    on two streams of one device.
    """
    key = (device.type, device.index)
    buf = SPLIT_K_LOCKS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if key in SPLIT_K_LOCKS:
        _LOCKS_RETIRED.append(SPLIT_K_LOCKS[key])
    buf = torch.zeros(max(n, _LOCKS_MIN), dtype=torch.int32, device=device)
    SPLIT_K_LOCKS[key] = buf
    return buf


#: (device type, index) -> fp32 workspace for the split-K partials, shared like the counters
SPLIT_K_PARTIALS: dict = {}


def split_k_partials(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` fp32 elements for the partial sums of one split-K launch on ``device``.

    One workspace per device instead of a ``torch.empty`` per call (on the H200's host an allocation took
    8-35 us of an eager GEMM's host time, ``benchmarks/results/eager_overhead.json``). Sharing it is safe for the
    reason sharing the counters is: launches on one stream run one after the other (under programmatic dependent
    launch too: a kernel writes its partials only after ``griddepcontrol.wait``, i.e. after the kernel before it
    has finished); the same caveat holds, no split-K GEMMs on two streams of one device at once. Grown outside
    graph capture; during a capture a too-small workspace is not replaced: that call allocates its own buffer,
    from the graph's pool, as every call did before.
    """
    key = (device.type, device.index)
    buf = SPLIT_K_PARTIALS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(n, dtype=torch.float32, device=device)
    if buf is not None:
        _LOCKS_RETIRED.append(buf)  # captured graphs may still point at it
    buf = torch.empty(max(n, _LOCKS_MIN), dtype=torch.float32, device=device)
    SPLIT_K_PARTIALS[key] = buf
    return buf


def split_k_workspace(device: torch.device, config: dict, split: int, M: int, N: int, op: str):
    """``(config, part, locks)`` of a split-K launch of ``config`` (``split`` > 1 effective splits) over an (M, N)
    output: the shared tile counters and partials of ``device``. During a CUDA-graph capture with no counters
    allocated yet (``split_k_locks``), the launch runs without split-K: ``config`` with SPLIT_K 1, a log warning
    naming ``op`` once. ``split`` <= 1: ``(config, None, None)``."""
    if split <= 1:
        return config, None, None
    locks = split_k_locks(device, -(-M // config["BLOCK_M"]) * -(-N // config["BLOCK_N"]))
    if locks is None:
        _common.warn_once(f"fastdecode: {op} split-K counters were not allocated before CUDA-graph capture; this "
                          f"capture runs without split-K (call {op} once before capturing)")
        return {**config, "SPLIT_K": 1}, None, None
    return config, split_k_partials(device, split * M * N), locks


__all__ = ["DEFAULT_NUM_SMS", "SPLIT_K_LOCKS", "SPLIT_K_PARTIALS", "clear_config_cache", "device_info", "load_table",
           "lookup_cache", "nearest_m", "split_k_locks", "split_k_partials", "split_k_workspace"]
