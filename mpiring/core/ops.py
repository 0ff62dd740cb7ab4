"""Reduction operators and the dtypes they are defined for.

An op is applied in place, ``dst = dst (op) src``, through the NumPy ufunc of the
same name. NumPy ufuncs dispatch to CuPy for CuPy arrays (``__array_ufunc__``),
so the same line reduces on the CPU or on the GPU.

``avg`` is ``sum`` followed by one division by K on the finished result (as
MPI users do it, and as NCCL's ncclAvg does for integers; for floats NCCL
multiplies each input by 1/K first, so a float16 sum that overflows gives
``inf`` here, not there); it is defined for floating dtypes only (an integer
mean would silently truncate). The bitwise ``band``, ``bor`` and ``bxor`` (torch's
``ReduceOp.BAND``/``BOR``/``BXOR``, MPI's ``MPI_BAND``...) are defined for
integer dtypes only: the bits of a float are not a number to combine.
"""

from __future__ import annotations

import functools

import numpy as np

# Codes travel in the argument check by position (mpiring.comm.agreement): append only.
OPS = ("sum", "avg", "max", "min", "prod", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")

# Reduction ufunc per op; avg reduces with add and divides once at the end.
_UFUNC = {
    "sum": np.add,
    "avg": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def check_op(op: str, dtype_name: str, floating: bool) -> None:
    """Raise a ValueError naming the fix if ``op`` is unknown or undefined for the dtype."""
    if not isinstance(op, str) or op not in _UFUNC:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(OPS)}")
    if op == "avg" and not floating:
        raise ValueError(
            f"op 'avg' is not defined for integer dtype {dtype_name} (the mean would "
            "be truncated): use op='sum' and divide yourself, or cast to a float dtype"
        )
    if op in BITWISE and floating:
        raise ValueError(
            f"op {op!r} is not defined for floating dtype {dtype_name} (it combines the "
            "bits of integers): use an integer dtype (int8, int32, int64, uint8), or "
            "op='max'/'min' for flags")


@functools.cache
def reducer(op: str):
    """Return ``f(dst, src)`` that reduces ``src`` into ``dst`` in place (one per op)."""
    ufunc = _UFUNC[op]

    def apply(dst, src):
        ufunc(dst, src, out=dst)

    return apply


def ufunc(op: str):
    """The NumPy ufunc that reduces ``op``: ``ufunc(a, b, out=...)`` computes ``a (op) b``.

    For an algorithm that must choose the operands' order itself: ``max``/``min``
    of ``0.0`` and ``-0.0``, or of two NaNs, return the first operand, so two ranks
    that combine the same pair in opposite orders end with different bits.
    """
    return _UFUNC[op]


def finish(op: str, x, size: int) -> None:
    """Final step of an op after the reduction: divide by K for ``avg``."""
    if op == "avg" and size > 1:
        np.divide(x, size, out=x, casting="unsafe")
