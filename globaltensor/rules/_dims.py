"""Dim arguments as rules read them: one wrap of a negative dim, as torch's.

>>> normalize_dim(-1, 3)
2
"""
from __future__ import annotations


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` of a tensor of ``ndim`` dims as a non-negative index, wrapped as torch
    wraps it: ``-ndim <= dim < ndim``, and a 0-d tensor takes 0 or -1 (torch treats a
    scalar as having one dim for this). Out of range raises ``IndexError`` with torch's
    message; the meta run has normally refused such a dim already, so this only guards
    a rule reading a dim torch did not check.

    >>> normalize_dim(-2, 2), normalize_dim(0, 0), normalize_dim(-1, 0)
    (0, 0, 0)
    >>> normalize_dim(2, 2)
    Traceback (most recent call last):
    ...
    IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)
    """
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-size}, {size - 1}], but got {dim})")
    return dim % size
