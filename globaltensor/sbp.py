"""SBP: how a global tensor is laid out across the ranks of one placement axis.

``split(dim)`` cuts the tensor along ``dim`` (balanced split), ``broadcast`` gives every
rank the whole value, ``partial_sum`` / ``partial_max`` give every rank a full-shape
addend whose sum / max is the value. ``split(dim, blocks=k)`` views ``dim`` as ``k``
equal blocks and splits each block (a strided split): what merging ``(B, H)`` into
``B * H`` makes of a split on ``H``, so attention heads stay where they are.

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

__all__ = ["SbpParallel", "Split", "StridedSplit", "Broadcast", "Partial", "split", "broadcast",
           "partial_sum", "partial_max", "normalize", "candidates"]


class SbpParallel:
    """Base of the sbp values; instances are immutable and compare by value."""

    __slots__ = ()


@dataclass(frozen=True, repr=False)
class Split(SbpParallel):
    dim: int

    def __repr__(self) -> str:
        return f"split(dim={self.dim})"


@dataclass(frozen=True, repr=False)
class StridedSplit(SbpParallel):
    """``dim`` seen as ``blocks`` equal blocks, each split as ``Split`` splits: a rank
    holds its balanced part of every block, in block order (DTensor's
    ``_StridedShard(dim, split_factor=blocks)``). Not a ``Split``: an op accepts it
    only where its rule says the op runs on such parts as they are."""

    dim: int
    blocks: int

    def __repr__(self) -> str:
        return f"split(dim={self.dim}, blocks={self.blocks})"


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


def split(dim: int, blocks: int = 1) -> "Split | StridedSplit":
    """Split along ``dim`` (negative dims are normalised against the tensor later);
    with ``blocks=k``, split each of ``k`` equal blocks of ``dim`` (a strided split).

    >>> split(1)
    split(dim=1)
    >>> split(0, blocks=4)
    split(dim=0, blocks=4)
    """
    dim, blocks = _int("split dim", dim), _int("split blocks", blocks)
    if blocks < 1:
        raise ValueError(f"split blocks must be >= 1, got {blocks}")
    return Split(dim) if blocks == 1 else StridedSplit(dim, blocks)


def _int(what: str, value) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None


def split_dim(s: SbpParallel) -> "int | None":
    """The dim a plain or strided split cuts, else None."""
    return s.dim if isinstance(s, (Split, StridedSplit)) else None


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")

SbpLike = Union[SbpParallel, Sequence[SbpParallel]]


def candidates(ndim: int, partials: Sequence[Partial] = ()) -> list:
    """The sbp a tensor of ``ndim`` dims may take on one placement axis: broadcast, the
    ``partials`` asked for (in their order), then ``split(0)`` ... ``split(ndim - 1)``.
    Rules list their signatures in this order and dispatch breaks cost ties by it, so
    the order is part of the answer.

    >>> candidates(2)
    [broadcast, split(dim=0), split(dim=1)]
    >>> candidates(1, partials=(partial_sum, partial_max))
    [broadcast, partial_sum, partial_max, split(dim=0)]
    """
    ndim = _int("candidates ndim", ndim)
    if ndim < 0:
        raise ValueError(f"candidates ndim must be >= 0, got {ndim}")
    for p in partials:
        if not isinstance(p, Partial):
            raise ValueError(f"candidates partials must be partial sbps (partial_sum, "
                             f"partial_max), got {p!r}")
    return [broadcast, *partials, *(Split(d) for d in range(ndim))]


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
        if isinstance(s, (Split, StridedSplit)):
            d = s.dim
            if not -tensor_ndim <= d < tensor_ndim:
                raise ValueError(f"{s} is out of range for a tensor with {tensor_ndim} "
                                 f"dim(s)")
            s = Split(d % tensor_ndim) if isinstance(s, Split) \
                else StridedSplit(d % tensor_ndim, s.blocks)
        out.append(s)
    strided = {s.dim for s in out if isinstance(s, StridedSplit)}
    if strided and any(split_dim(s) in strided for s in out if not isinstance(s, StridedSplit)) \
            or len([s for s in out if isinstance(s, StridedSplit)]) > len(strided):
        raise ValueError(f"sbp {tuple(out)}: a dim with a strided split is split by no "
                         f"other placement axis")
    return tuple(out)
