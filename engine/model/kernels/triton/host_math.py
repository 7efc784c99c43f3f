"""Launch-shape arithmetic for the host side of the Triton wrappers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: each host
call unwraps its arguments through Triton's frontend, a few µs that every eager launch paid
several times (``scripts/bench_dispatch.py``). Inside kernels, ``tl.cdiv`` stays.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
