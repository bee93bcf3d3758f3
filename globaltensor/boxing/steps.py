"""The step vocabulary of a boxing plan.

A step changes the sbp of one placement axis; it acts inside each sub-group along that
axis (``placement.groups(axis)``), and every member's local tensor moves from the
``src`` layout to the ``dst`` layout. Steps are pure descriptions: ``execute`` runs them
with collectives, ``simulate`` runs them on a list of per-rank tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Layout, balanced_split


def identity_value(reduce: str, dtype: torch.dtype):
    """The element that leaves a partial reduction unchanged (0 for sum, lowest for max)."""
    if reduce == "sum":
        return 0
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return float("-inf")
    return torch.iinfo(dtype).min


@dataclass(frozen=True)
class Step:
    axis: int
    src: Layout
    dst: Layout

    @property
    def kind(self) -> str:
        return type(self).__name__

    def members(self, rank: int) -> tuple[int, ...]:
        return self.src.placement.group(rank, self.axis)

    def parts(self, length: int) -> tuple[tuple[int, int], ...]:
        """Balanced (offset, size) parts of ``length`` over this axis' group."""
        return balanced_split(length, self.src.placement.shape[self.axis])

    def __str__(self) -> str:
        return (f"{self.kind}(axis={self.axis}: {self.src.sbp[self.axis]} -> "
                f"{self.dst.sbp[self.axis]})")


@dataclass(frozen=True)
class AllGather(Step):
    """split(dim) -> broadcast: concatenate the members' parts along ``dim``."""
    dim: int


@dataclass(frozen=True)
class AllReduce(Step):
    """partial -> broadcast: reduce the members' addends."""
    reduce: str


@dataclass(frozen=True)
class ReduceScatter(Step):
    """partial -> split(dim): member k gets the reduction of everyone's part k."""
    dim: int
    reduce: str


@dataclass(frozen=True)
class AllToAll(Step):
    """split(src_dim) -> split(dst_dim): member k gets part k along ``dst_dim`` of
    every member's local, concatenated along ``src_dim``."""
    src_dim: int
    dst_dim: int


@dataclass(frozen=True)
class LocalSlice(Step):
    """broadcast -> split(dim): keep this member's part; no communication."""
    dim: int


@dataclass(frozen=True)
class ZeroNonRoot(Step):
    """broadcast -> partial_sum: the axis' first member keeps the value, others zeros."""


@dataclass(frozen=True)
class Relabel(Step):
    """broadcast -> partial_max: every member keeps the value (max of equal values)."""


@dataclass(frozen=True)
class PadToPartial(Step):
    """split(dim) -> partial: put the part into a tensor of the whole axis region
    filled with the reduction's identity; no communication."""
    dim: int
    reduce: str


@dataclass(frozen=True)
class Move:
    """One piece of a transfer: global ``region`` goes from rank ``src`` to rank ``dst``."""
    src: int
    dst: int
    region: object  # layout.Region


@dataclass(frozen=True)
class Transfer:
    """Point-to-point redistribution between any two placements.

    ``src`` has no partial axis. Every destination rank that holds data (the first
    member along each partial axis) receives exactly its region, piece by piece, from
    one holder each (``moves``, in one global order that both sides follow); the other
    destination ranks fill the identity of the outermost partial axis they are not
    first on.
    """
    src: Layout
    dst: Layout
    moves: tuple

    kind = "Transfer"

    def __str__(self) -> str:
        return f"Transfer({self.src.placement} {self.src.sbp} -> {self.dst.placement} {self.dst.sbp})"

    def fill_of(self, rank: int):
        """None when ``rank`` receives data, else the reduce whose identity it holds."""
        coord = self.dst.placement.coord(rank)
        for axis in self.dst.partial_axes:
            if coord[axis] != 0:
                return self.dst.sbp[axis].reduce
        return None

    def detail(self) -> list[str]:
        sent = {}
        for m in self.moves:
            if m.src != m.dst:
                sent[m.src] = sent.get(m.src, 0) + m.region.numel
        msgs = sum(1 for m in self.moves if m.src != m.dst)
        return [f"{msgs} message(s), {len(self.moves) - msgs} local copy(ies)",
                "elements sent per rank: " + (", ".join(f"{r}: {n}" for r, n in sorted(sent.items()))
                                              or "none")]
