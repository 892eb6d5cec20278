"""Integer helpers for the launchers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in triton 3.6: a call from
Python goes through their ``__call__`` and costs ~8 us on the H200 host (``benchmarks/NOTES.md``, session 8,
"eager overhead"), against ~0.1 us for the arithmetic. A GEMM launch called them ~10 times. Inside
``@triton.jit`` code ``tl.cdiv`` stays; these are for the host side only. No triton import here.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
