"""SBP: how a global tensor is laid out across the ranks of one placement axis.

``split(dim)`` cuts the tensor along ``dim`` (balanced split), ``broadcast`` gives every
rank the whole value, ``partial_sum`` / ``partial_max`` give every rank a full-shape
addend whose sum / max is the value.

>>> import globaltensor as gt
>>> gt.sbp.split(0) == gt.sbp.split(dim=0)
True
>>> gt.sbp.broadcast, gt.sbp.partial_sum
(broadcast, partial_sum)

An nd-sbp is a tuple with one sbp per placement axis; ``normalize`` turns what a user
passes into that tuple and checks it against the tensor.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence, Union

__all__ = ["SbpParallel", "Split", "Broadcast", "Partial", "split", "broadcast",
           "partial_sum", "partial_max", "normalize"]


class SbpParallel:
    """Base of the sbp values; instances are immutable and compare by value."""

    __slots__ = ()


@dataclass(frozen=True, repr=False)
class Split(SbpParallel):
    dim: int

    def __repr__(self) -> str:
        return f"split(dim={self.dim})"


@dataclass(frozen=True, repr=False)
class Broadcast(SbpParallel):
    def __repr__(self) -> str:
        return "broadcast"


@dataclass(frozen=True, repr=False)
class Partial(SbpParallel):
    """A full-shape addend on each rank; ``reduce`` is "sum" or "max"."""

    reduce: str

    def __repr__(self) -> str:
        return f"partial_{self.reduce}"


def split(dim: int) -> Split:
    """Split along ``dim`` (negative dims are normalised against the tensor later).

    >>> split(1)
    split(dim=1)
    """
    try:
        if isinstance(dim, bool):
            raise TypeError
        dim = operator.index(dim)
    except TypeError:
        raise ValueError(f"split dim must be an int, got {dim!r}") from None
    return Split(dim)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")

SbpLike = Union[SbpParallel, Sequence[SbpParallel]]


def normalize(sbp: SbpLike, placement_ndim: int, tensor_ndim: int) -> tuple:
    """Return ``sbp`` as a tuple of one sbp per placement axis, split dims made
    non-negative; raise ``ValueError`` when it does not fit.

    >>> normalize(split(-1), 1, 2)
    (split(dim=1),)
    """
    if isinstance(sbp, SbpParallel):
        sbp = (sbp,)
    elif isinstance(sbp, (tuple, list)):
        sbp = tuple(sbp)
    else:
        raise ValueError(
            f"sbp must be an sbp (e.g. gt.sbp.split(0)) or a tuple of them, got {sbp!r}")
    if len(sbp) != placement_ndim:
        raise ValueError(
            f"sbp {sbp} has {len(sbp)} entries but the placement has {placement_ndim} "
            f"axis(es): give one sbp per placement axis")
    out = []
    for s in sbp:
        if callable(s) and s is split:
            raise ValueError("gt.sbp.split needs a dim: write gt.sbp.split(0)")
        if not isinstance(s, SbpParallel):
            raise ValueError(f"{s!r} is not an sbp (use gt.sbp.split(d), broadcast, "
                             f"partial_sum or partial_max)")
        if isinstance(s, Split):
            d = s.dim
            if not -tensor_ndim <= d < tensor_ndim:
                raise ValueError(f"{s} is out of range for a tensor with {tensor_ndim} "
                                 f"dim(s)")
            s = Split(d % tensor_ndim)
        out.append(s)
    return tuple(out)
