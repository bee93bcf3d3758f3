"""Maxima of floating-point values that keep NaN, as ``torch.amax`` does.

gloo's and NCCL's MAX of floats keeps whichever operand their comparison favours, and
every comparison with NaN is false: a NaN on one rank was dropped or kept by the order
of the ranks (``x.amax()`` of a split tensor gave 3.0 where torch gives nan when the
NaN was on rank 1, so a non-finite check on a maximum, or an inf-norm of gradients,
missed it). So floats are reduced as integer keys that order as the floats do, with
every NaN made one positive NaN, whose bits sit above +inf: the MAX of the keys is the
key of the float maximum, NaN if any member holds one. The keys take the float's own
width (16-bit floats widen to int32: not every backend reduces int16).
"""
from __future__ import annotations

import torch

_KEYS = {torch.float64: torch.int64, torch.float32: torch.int32,
         torch.float16: torch.int16, torch.bfloat16: torch.int16}


def has_keys(t: torch.Tensor) -> bool:
    """Whether a MAX reduction of ``t`` goes by keys (a floating dtype)."""
    return t.dtype in _KEYS


def to_keys(t: torch.Tensor) -> torch.Tensor:
    """Integer keys of ``t`` (same shape) whose order is ``t``'s, NaN the greatest.

    >>> to_keys(torch.tensor([1.0, float("nan")])).argmax()       # doctest: +SKIP
    tensor(1)
    """
    kind = _KEYS[t.dtype]
    bits = torch.where(torch.isnan(t), float("nan"), t).view(kind)
    # a negative float's magnitude bits count down: flipping them (all but the sign)
    # turns its order around; positive floats keep theirs
    keys = bits ^ ((bits >> (bits.element_size() * 8 - 1)) & torch.iinfo(kind).max)
    return keys.to(torch.int32) if kind is torch.int16 else keys


def from_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``dtype`` whose keys are ``keys`` (``to_keys`` undone)."""
    kind = _KEYS[dtype]
    bits = keys.to(kind)
    return (bits ^ ((bits >> (bits.element_size() * 8 - 1)) & torch.iinfo(kind).max)).view(dtype)
