"""How the ops are registered with PyTorch: ``torch.library.Library`` definitions (the C++ dispatcher), not
``torch.library.custom_op``.

Both give an op that ``torch.compile(fullgraph=True)`` traces as one call (its fake implementation gives the
shapes) and that CUDA graphs capture. They differ in what every eager call pays on the host:
``custom_op`` wraps an op that mutates its arguments in Python autograd and in-place kernels, ~30 us a call
on the CPU machine (a no-op; ~115 us under load), where a ``Library`` definition with the same schema costs
~3 us (``torch.add``: ~2 us). An eager transformers model patched with three fastdecode ops a layer, or the
engine's prefill, pays that on every call (``benchmarks/NOTES.md``, session 8). ``custom_op`` also imports
``torch._dynamo`` on its first call (~1 s of start-up).

Every fastdecode op mutates output buffers its wrapper allocated and returns nothing; one implementation
(``CompositeExplicitAutograd``: every device) chooses the backend from its ``backend`` argument. There is no
autograd formula: these are inference kernels.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

_LIB = torch.library.Library("fastdecode", "DEF")


class Op:
    """A registered op: call it like the function it was defined from; ``register_fake`` as for ``custom_op``."""

    def __init__(self, name: str, fn: Callable, mutates_args: Sequence[str]):
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self.name = f"fastdecode::{name}"
        self.default = getattr(torch.ops.fastdecode, name).default  # the OpOverload
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return self.default(*args)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.name, fn, lib=_LIB)
        return fn


def define_op(name: str, mutates_args: Sequence[str]) -> Callable[[Callable], Op]:
    """Decorator: register ``fn`` (type-annotated, returning None) as ``torch.ops.fastdecode.<name>``."""
    return lambda fn: Op(name, fn, mutates_args)
