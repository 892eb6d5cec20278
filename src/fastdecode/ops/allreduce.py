"""Low-latency all-reduce for tensor-parallel decode, and the fused all-reduce + add + RMSNorm.

``CommWorkspace`` owns what the kernels need: on CUDA, PyTorch symmetric memory (one buffer per rank,
mapped into every peer over NVLink/P2P; chosen over raw CUDA IPC handles because PyTorch does the
exchange, the mapping and the clean-up, and works for any world size on one host) holding barrier
flags, an input region and a result region. Create it once per process group, **before** any
CUDA-graph capture, and ``destroy()`` it when done (or use it as a context manager).

Paths, chosen per call by message size. The thresholds are data, per GPU and world size, in
``configs/allreduce_<gpu>.json``, written by ``fastdecode bench allreduce --world N --write-config``
from its own measurements (``bench.allreduce.crossovers_from_rows``); a world size not in the table starts from
``DEFAULT_PATH_BYTES`` with one warning:

* ``one_shot``: each rank pushes its partial into every peer's buffer and raises a flag there; each
  rank waits for all flags and sums the partials from its own memory (same order everywhere, so all
  ranks get identical bits). One exchange per call (kernels/allreduce.py explains why it is safe).
* ``two_shot``: reduce-scatter + all-gather over the same buffers (each rank sums 1/world).
* ``nccl``: ``torch.distributed.all_reduce`` above the crossover, or when peers are not reachable
  (ranks on several nodes: ``LOCAL_WORLD_SIZE`` < world size, as torchrun sets it; no P2P access; no
  symmetric memory), said in one warning when the workspace is made.
* ``torch``: CPU tensors (gloo): ``torch.distributed.all_reduce`` and the reference norm.

Each path a workspace takes is logged once (INFO), with the rule that chose it.

Stream contract: every call is enqueued on the current stream; all ranks must make the same
sequence of calls with the same shapes (as with NCCL). Barriers keep no host-side state, so graphs
may be replayed any number of times. With ``check=True`` (or ``FASTDECODE_COMM_CHECK=1``) eager
calls first compare shapes across ranks and raise on a mismatch instead of hanging or corrupting.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fastdecode.ops._registry import define_op
from fastdecode.ops._common import (
    out_mode,
    FP8_DTYPE, as_rows, check_eps, check_out, check_same_device, check_tensor, is_tracing, load_config_table,
    next_pow2, require_sm, resolve_backend, static_scale, warn_once,
)
from fastdecode.ops import _common

log = logging.getLogger("fastdecode")

# Largest message (bytes) for each symmetric-memory path when the GPU / world size has no measured
# crossovers in configs/allreduce_<gpu>.json (two-shot above one-shot's limit, NCCL above both).
DEFAULT_PATH_BYTES = {"one_shot": 512 << 10, "two_shot": 8 << 20}
ONE_SHOT_BLOCK = 2048  # elements per chunk of the flat one-shot / two-shot kernels
MAX_FUSED_H = 32768  # the fused kernel keeps a row in registers

_WORKSPACES: dict[int, "CommWorkspace"] = {}
_ids = itertools.count(1)


# ----------------------------------------------------------------------------- crossover data


def config_path(gpu_name: str) -> Path:
    return _common.config_path("allreduce", gpu_name)


def measured_path_bytes(gpu_name: str, world: int) -> Optional[dict]:
    """The measured ``{"one_shot": bytes, "two_shot": bytes}`` limits for ``world`` ranks, or None."""
    table = load_config_table(str(_common.table_path("allreduce", gpu_name)))
    entry = (table or {}).get("world", {}).get(str(world))
    return {"one_shot": int(entry["one_shot"]), "two_shot": int(entry["two_shot"])} if entry else None


def _spans_nodes(world: int) -> bool:
    """True when torchrun (or the launcher) says not every rank of the group is on this host."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return local is not None and local.isdigit() and int(local) < world


class CommWorkspace:
    """Peer-visible buffers + barrier flags for one process group (see the module docstring)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, max_bytes: int = 16 << 20,
                 max_blocks: int = 64, slab_bytes: int = 64 << 10, path_bytes: Optional[dict] = None,
                 check: Optional[bool] = None):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("create the CommWorkspace before CUDA-graph capture, not inside it")
        if not dist.is_initialized():
            raise RuntimeError("CommWorkspace needs torch.distributed to be initialised (init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.max_bytes = int(max_bytes)
        self.max_blocks = int(max_blocks)
        self.slab_bytes = int(slab_bytes)  # one-shot: bytes one program sends per call
        self.check = check if check is not None else os.environ.get("FASTDECODE_COMM_CHECK", "0") == "1"
        self.backend = dist.get_backend(self.group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.mode = "torch" if self.device.type == "cpu" else "symm"
        self.reason = "CPU process group" if self.mode == "torch" else ""
        self.path_bytes = dict(path_bytes) if path_bytes else self._measured_paths()
        self._logged_paths: set = set()
        self._buf = self._hdl = None
        if self.mode == "symm":
            # every rank must take the same path, or the first call hangs: agree before any setup
            self.reason = self._peer_problem()
            agree = torch.tensor([0 if self.reason else 1], dtype=torch.int32, device=self.device)
            dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=self.group)
            if not int(agree):
                self.mode = "nccl"
                self.reason = self.reason or "another rank cannot reach its peers' memory"
        if self.mode == "symm":
            try:
                self._setup_symm()
            except Exception as e:  # no symmetric memory: NCCL for everything
                self.mode, self.reason = "nccl", f"peer memory unavailable ({type(e).__name__}: {e})"
        if self.mode == "nccl" and self.rank == 0:
            warn_once(f"fastdecode: all-reduce on {self.world} ranks falls back to NCCL: {self.reason}")
        elif self.mode == "torch":
            log.info("fastdecode: all-reduce on %d ranks uses torch.distributed (%s)", self.world, self.reason)
        self.handle = next(_ids)
        _WORKSPACES[self.handle] = self

    def _measured_paths(self) -> dict:
        if self.mode != "symm":
            return dict(DEFAULT_PATH_BYTES)
        name = torch.cuda.get_device_name(self.device)
        measured = measured_path_bytes(name, self.world)
        if measured is None:
            warn_once(f"fastdecode: no measured all-reduce crossovers for {self.world} ranks of {name} "
                       f"({config_path(name).name}); using defaults {DEFAULT_PATH_BYTES} (measure them with "
                       f"`fastdecode bench allreduce --world {self.world} --write-config`)")
            return dict(DEFAULT_PATH_BYTES)
        return measured

    def _peer_problem(self) -> str:
        """Why this rank cannot use peer memory ('' when it can)."""
        if _spans_nodes(self.world):
            return (f"the {self.world} ranks span several nodes (LOCAL_WORLD_SIZE="
                    f"{os.environ['LOCAL_WORLD_SIZE']}): no peer memory across nodes")
        for peer in range(torch.cuda.device_count()):
            if peer != self.device.index and not torch.cuda.can_device_access_peer(self.device.index, peer):
                return f"GPU {self.device.index} cannot access GPU {peer} directly (no P2P)"
        return ""

    def _setup_symm(self):
        import torch.distributed._symmetric_memory as symm_mem

        def align(b):
            return (b + 255) // 256 * 256

        # [two-shot flags][one-shot epoch flags][one-shot push slabs][two-shot input][two-shot result]
        flag_bytes = align(2 * self.max_blocks * self.world * 4)
        eflag_bytes = align(self.max_blocks * self.world * 4)
        push_bytes = self.max_blocks * 2 * self.world * self.slab_bytes
        total = flag_bytes + eflag_bytes + push_bytes + 2 * self.max_bytes
        self._buf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        self._hdl = symm_mem.rendezvous(self._buf, self.group.group_name)
        self._buf[: flag_bytes + eflag_bytes].zero_()
        base = list(self._hdl.buffer_ptrs)
        mk = lambda off: torch.tensor([b + off for b in base], dtype=torch.int64, device=self.device)  # noqa: E731
        self.flag_ptrs = mk(0)
        self.eflag_ptrs = mk(flag_bytes)
        self.push_ptrs = mk(flag_bytes + eflag_bytes)
        self.buf_ptrs = mk(flag_bytes + eflag_bytes + push_bytes)
        self.res_ptrs = mk(flag_bytes + eflag_bytes + push_bytes + self.max_bytes)
        # one-shot call counters, one per program: local memory, advanced by the kernels themselves
        self.counters = torch.zeros(self.max_blocks, dtype=torch.int32, device=self.device)
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)  # every rank's flags are zero before anyone signals

    # -- life cycle
    def destroy(self) -> None:
        """Free the peer buffers (collective: call on every rank, outside graph capture)."""
        if self.handle in _WORKSPACES:
            del _WORKSPACES[self.handle]
            if self._buf is not None:
                torch.cuda.synchronize(self.device)
                dist.barrier(self.group)
            self._buf = self._hdl = None
            self.mode = "destroyed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return (f"CommWorkspace(rank={self.rank}, world={self.world}, mode={self.mode!r}, "
                f"max_bytes={self.max_bytes}, paths={self.path_bytes})")

    # -- policy
    def slab_elems(self, element_size: int) -> int:
        return self.slab_bytes // element_size

    def _one_shot_fits(self, numel: int, element_size: int, rows: Optional[int]) -> bool:
        if rows is None:  # flat: chunks of ONE_SHOT_BLOCK elements dealt round-robin to programs
            chunks = -(-numel // ONE_SHOT_BLOCK)
            per_prog = -(-chunks // min(chunks, self.max_blocks)) * ONE_SHOT_BLOCK
        else:  # fused: whole rows dealt round-robin
            H = numel // max(rows, 1)
            if next_pow2(H) > MAX_FUSED_H:
                return False
            per_prog = -(-rows // min(rows, self.max_blocks)) * H
        return per_prog * element_size <= self.slab_bytes

    def path_for(self, numel: int, element_size: int = 2, rows: Optional[int] = None) -> str:
        """Which path an all-reduce of ``numel`` elements takes (``rows``: the fused kernel's rows)."""
        return self._choose(numel, element_size, rows, explain=False)[0]

    def _choose(self, numel: int, element_size: int, rows: Optional[int],
                explain: bool = True) -> tuple[str, Optional[str]]:
        """(path, the rule that chose it); the rule's text only with ``explain`` (it is logged once)."""
        if self.mode != "symm":
            return self.mode, self.reason
        nbytes = numel * element_size
        one, two = self.path_bytes["one_shot"], min(self.path_bytes["two_shot"], self.max_bytes)
        if nbytes <= one and self._one_shot_fits(numel, element_size, rows):
            path = "one_shot"
        else:
            path = "two_shot" if nbytes <= two else "nccl"
        if not explain:
            return path, None
        if path == "one_shot":
            return path, f"<= {one} bytes (one-shot limit)"
        if path == "two_shot":
            return path, f"<= {two} bytes (two-shot limit)" + (
                " and too large for one program's slab" if nbytes <= one else "")
        return path, f"> {two} bytes (NCCL above the two-shot limit)"

    def _path_logged_once(self, numel: int, element_size: int, rows: Optional[int]) -> str:
        """The path of a call (``rows``: fused), logged with its rule the first time it is taken."""
        path = self.path_for(numel, element_size, rows)
        if (path, rows is not None) not in self._logged_paths:
            self._log_path(path, self._choose(numel, element_size, rows)[1], numel * element_size, rows is not None)
        return path

    def _log_path(self, path: str, why: str, nbytes: int, fused: bool) -> None:
        key = (path, fused)
        if key not in self._logged_paths:
            self._logged_paths.add(key)
            what = "all-reduce + add + RMSNorm" if fused else "all-reduce"
            log.info("fastdecode: %s of %d bytes on %d ranks takes %s: %s", what, nbytes, self.world, path, why)

    def _check_shapes(self, *tensors):
        if not self.check or is_tracing():
            return
        mine = [tuple(t.shape) + (str(t.dtype),) for t in tensors]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(e != mine for e in everyone):
            raise ValueError(f"all-reduce called with different shapes/dtypes across ranks: {everyone}")


def _get(handle: int) -> CommWorkspace:
    ws = _WORKSPACES.get(handle)
    if ws is None:
        raise RuntimeError("the CommWorkspace of this call was destroyed")
    return ws


def _check_ws(workspace) -> CommWorkspace:
    if not isinstance(workspace, CommWorkspace):
        raise ValueError(f"workspace must be a CommWorkspace, got {type(workspace).__name__}")
    if workspace.mode == "destroyed":
        raise ValueError("workspace has been destroyed")
    return workspace


# ----------------------------------------------------------------------------- registered ops


@define_op("all_reduce", mutates_args=("out",))
def _all_reduce_op(x: torch.Tensor, out: torch.Tensor, handle: int, path: str) -> None:
    ws = _get(handle)
    if path in ("one_shot", "two_shot"):
        from fastdecode.kernels.allreduce import launch_all_reduce

        launch_all_reduce(x, out, ws, path == "two_shot", {"BLOCK": ONE_SHOT_BLOCK, "num_warps": 8})
        return
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    dist.all_reduce(out, group=ws.group)


@_all_reduce_op.register_fake
def _(x, out, handle, path):
    return None


@define_op("all_reduce_add_rms_norm", mutates_args=("residual", "out", "scale_out"))
def _all_reduce_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
    scale_in: Optional[torch.Tensor], scale_out: Optional[torch.Tensor], eps: float, handle: int,
    path: str, backend: str,
) -> None:
    ws = _get(handle)
    if path == "one_shot":
        from fastdecode.kernels.allreduce import launch_all_reduce_add_rms_norm

        mode, scale = out_mode(out, scale_in, scale_out)
        num_warps = min(max(next_pow2(x.shape[1]) // 1024, 4), 16)
        launch_all_reduce_add_rms_norm(x, residual, weight, out, scale, eps, mode, ws, num_warps)
        return
    # unfused: all-reduce (two-shot, NCCL or gloo) into a temporary, then the fused add + RMSNorm
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if path == "two_shot":
        _all_reduce_op(x.contiguous(), s, handle, path)
    else:
        s.copy_(x)
        dist.all_reduce(s, group=ws.group)
    from fastdecode.ops.norm import _rms_norm_op

    _rms_norm_op(s, residual, weight, out, scale_in, scale_out, eps, backend)


@_all_reduce_add_rms_norm_op.register_fake
def _(x, residual, weight, out, scale_in, scale_out, eps, handle, path, backend):
    return None


# ----------------------------------------------------------------------------- public API


def all_reduce(x: torch.Tensor, workspace: CommWorkspace, *, out: Optional[torch.Tensor] = None,
               inplace: bool = False) -> torch.Tensor:
    """``out = sum over ranks of x``, rounded to x.dtype.

    The one-shot and two-shot paths accumulate in fp32 in rank order (bit for bit ``all_reduce_ref``,
    the same on every rank); NCCL and gloo add in their own order, so above 2 ranks their result may
    differ from it in the last bits.

    Returns a new tensor (or ``out``; ``inplace=True`` writes into x). The path (one-shot, two-shot,
    NCCL, gloo) is chosen by ``workspace.path_for(x.numel(), x.element_size())``.
    """
    ws = _check_ws(workspace)
    check_tensor("x", x)
    if x.device.type != ws.device.type:
        raise ValueError(f"x is on {x.device} but the workspace's process group works on {ws.device.type}")
    if inplace and out is not None:
        raise ValueError("pass either out= or inplace=True, not both")
    if inplace:
        out = x
    check_out("out", out, x.shape, x.dtype, x.device)
    path = ws._path_logged_once(x.numel(), x.element_size(), None)
    src = x if x.is_contiguous() or path in ("nccl", "torch") else x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif inplace and not x.is_contiguous():
        raise ValueError("inplace=True needs a contiguous x")
    ws._check_shapes(x)
    if x.numel():
        _all_reduce_op(src, out, ws.handle, path)
    return out


def all_reduce_add_rms_norm(x, residual, weight, eps: float, workspace: CommWorkspace, *,
                            fp8: bool = False, scale=None, out=None, backend: Optional[str] = None):
    """One kernel for small messages: ``s = all_reduce(x)``; ``residual <- s + residual`` (in place);
    ``out = rmsnorm(residual) * weight``, in x.dtype or, with ``fp8=True``, FP8 e4m3 with a static
    ``scale`` or dynamic per-token scales (returns ``(out, scale)``; ``real = fp8 * scale``).

    Bit for bit the same as ``fused_add_rms_norm(all_reduce(x), residual, weight, eps)``.
    """
    ws = _check_ws(workspace)
    check_tensor("x", x)
    check_tensor("residual", residual)
    check_tensor("weight", weight, ndim=1)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    H = x.shape[-1]
    if weight.shape[0] != H:
        raise ValueError(f"weight must have {H} elements (the last dimension of x), got {weight.shape[0]}")
    eps = check_eps(eps)
    check_same_device(x=x, residual=residual, weight=weight)
    if x.device.type != ws.device.type:
        raise ValueError(f"x is on {x.device} but the workspace's process group works on {ws.device.type}")
    if scale is not None and not fp8:
        raise ValueError("scale is only meaningful with fp8=True")
    scale_t = static_scale(scale, x.device) if scale is not None else None
    out_dtype = FP8_DTYPE if fp8 else x.dtype
    check_out("out", out, x.shape, out_dtype, x.device)
    be = resolve_backend(backend, x.device, "all_reduce_add_rms_norm")
    if fp8:
        require_sm(x.device, 8, 9, "FP8 output")
    x2 = as_rows("x", x)
    r2 = as_rows("residual", residual, inplace=True)
    path = ws._path_logged_once(x.numel(), x.element_size(), x2.shape[0])
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    dynamic = fp8 and scale_t is None
    scale_out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if dynamic else None
    ws._check_shapes(x, residual)
    if x2.shape[0] and H:
        _all_reduce_add_rms_norm_op(x2, r2, weight.contiguous(), out.view(-1, H), scale_t,
                                    scale_out.view(-1, 1) if dynamic else None, eps, ws.handle, path, be)
    if fp8:
        return out, (scale_out if dynamic else scale_t)
    return out


def all_reduce_ref(partials: list[torch.Tensor]) -> torch.Tensor:
    """Reference: fp32 sum of every rank's partial in rank order, rounded to the input dtype."""
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:
        acc += p.float()
    return acc.to(partials[0].dtype)
