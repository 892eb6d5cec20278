"""Tensor parallelism: the distributed life cycle (like gpt-fast's ``apply_tp``, applied after construction).

The sharding rules themselves (which dimension each weight is split on, shard slicing, ``apply_tp_structure``)
are ``fastdecode.engine.sharding``, with no communication; this module adds the process group and the
``CommWorkspace``: ``init_distributed``, ``apply_tp`` (shard a whole model, attach a workspace), ``attach_comm``,
``load_tp``, ``agree`` and the ``torchrun`` helpers: ``under_torchrun``, ``maybe_relaunch`` / ``relaunch_tp`` (what
the CLI's ``--tp N`` does: the same command line again under torchrun) and ``torchrun_main``.

Every rank sees the same logits (identical bits), so greedy and seeded sampling agree across ranks.

Life cycle (``load_tp``): each rank loads only its shard (``loader.load(..., tp=(rank, world))`` slices
safetensors and GGUF tensors lazily, int4 ones included); then all ranks agree that loading succeeded (a
rank that failed makes every rank raise, instead of leaving the others blocked in a collective); then the
``CommWorkspace`` is created.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from fastdecode.engine import loader
from fastdecode.engine.sharding import apply_tp_structure

log = logging.getLogger("fastdecode")


class TPLoadError(RuntimeError):
    """Some rank failed to load its shard; raised on every rank."""


def attach_comm(model, comm) -> None:
    """Give the model its workspace: every norm after a row-parallel layer all-reduces its input first."""
    model.tp.comm, model.tp.group = comm, comm.group
    model.norm.comm = comm
    for i, layer in enumerate(model.layers):
        layer.ffn_norm.comm = comm  # after wo
        if i > 0:
            layer.attention_norm.comm = comm  # after the previous block's w2
    # the last block's w2 feeds model.norm (set above); layer 0's attention norm reads the embedding,
    # which _embed all-reduces itself


def apply_tp(model, group=None, comm=None):
    """Shard a model built or loaded whole, in place, over ``group`` (default: the world), and attach a
    ``CommWorkspace`` (created here unless given; collective: every rank calls it). Returns the model."""
    from fastdecode.ops.allreduce import CommWorkspace

    if not dist.is_initialized():
        raise RuntimeError("apply_tp needs torch.distributed to be initialised (init_process_group / torchrun)")
    group = group or dist.group.WORLD
    apply_tp_structure(model, dist.get_rank(group), dist.get_world_size(group))
    attach_comm(model, comm if comm is not None else CommWorkspace(group))
    return model


def agree(error: Optional[str], group=None) -> None:
    """Collective: raise ``TPLoadError`` on every rank if any rank passes an error message."""
    errs = [None] * dist.get_world_size(group)
    dist.all_gather_object(errs, error, group=group)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        by_msg: dict[str, list[int]] = {}
        for r, e in bad:  # the same error on several ranks is said once
            by_msg.setdefault(e, []).append(r)
        msg = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in by_msg.items())
        raise TPLoadError(f"loading failed on {len(bad)} of {len(errs)} ranks, stopping every rank: {msg}")


def load_tp(path, group=None, **kw):
    """``loader.load`` of rank's shard on every rank of ``group``, checked on all ranks, with a workspace."""
    from fastdecode.ops.allreduce import CommWorkspace

    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    loaded, err = None, None
    try:
        loaded = loader.load(path, tp=(rank, world), **kw)  # looked up when called (tests patch it)
    except Exception as e:  # every rank must reach agree(), whatever went wrong here
        err = f"{type(e).__name__}: {e}"
    agree(err, group)
    attach_comm(loaded.model, CommWorkspace(group))
    return loaded


def init_distributed(device=None) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's environment (NCCL on GPUs, gloo on the CPU).

    ``device``: "cuda" / "cpu" (or None: CUDA when there is a GPU). Returns (rank, world, device), one GPU
    per rank (LOCAL_RANK) on CUDA. (``fastdecode generate --device cpu --tp 2`` on a GPU machine used to
    take NCCL on the GPUs anyway: the --device was not passed here.)
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on 'cuda' or 'cpu' devices, got {device!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        # ranks on several nodes: the CommWorkspace says so once and takes NCCL (ops/allreduce.py)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, device


# the exit code of a rank that reported a user error (``error: ...`` on rank 0), as the CLI's commands return
USER_ERROR_EXIT = 2


def under_torchrun() -> bool:
    """This process is one rank of several (torchrun's ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def relaunch_tp(n: int, argv: Optional[list] = None) -> int:
    """Run ``python -m fastdecode <argv without --tp>`` under torchrun with ``n`` processes; its exit code."""
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    # torchrun without its failure report: the ranks print one ``error:`` line (rank 0) and exit 2 (torchrun_main)
    cmd = [sys.executable, "-c", "import sys; from fastdecode.engine.tp import torchrun_main; "
           "sys.exit(torchrun_main(sys.argv[1:]))", "--standalone", f"--nproc-per-node={n}",
           "-m", "fastdecode", *out]
    return subprocess.call(cmd)


def maybe_relaunch(tp: Optional[int], argv: Optional[list] = None) -> Optional[int]:
    """``--tp N`` (``tp``) outside torchrun: relaunch ``argv`` (default ``sys.argv[1:]``) under torchrun and return
    its exit code; inside torchrun, or without ``--tp``: None (carry on). ValueError for a ``tp`` that disagrees
    with the torchrun world, or is < 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp is not None and world > 1 and tp != world:
        raise ValueError(f"--tp {tp} under torchrun with {world} processes; drop --tp or make them equal")
    if tp is None or tp == 1 or world > 1:
        return None
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    return relaunch_tp(tp, argv)


def torchrun_main(argv: list) -> int:
    """``torchrun`` (``torch.distributed.run``) on ``argv``, without its own failure report: ranks that end on a
    user error exit with ``USER_ERROR_EXIT`` after rank 0 printed one ``error: ...`` line, and then this returns
    that code and prints nothing more (torchrun would add its logs and a ChildFailedError traceback). Any
    other failure (a crash, a signal) ends in one line naming the first rank that failed and its exit code.
    A signal to the launcher itself (Ctrl-C reaches every process of the terminal's group: the ranks stop on
    their own, ``serve`` rank 0 telling the others) returns 128 + the signal's number (130 for SIGINT, the CLI's
    code for Ctrl-C) without elastic's traceback."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):  # elastic's loggers set their own levels
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == USER_ERROR_EXIT:
            return code
        how = f"exit code {code}"
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                pass
        print(f"error: tensor-parallel rank {rank} failed ({how}); its output is above", file=sys.stderr)
        return 1
    return 0
