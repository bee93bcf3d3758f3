"""The per-axis steps without communication: LocalSlice, ZeroNonRoot, Relabel,
PadToPartial."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...partials import identity_value
from ...sbp import Broadcast, Partial, Split
from .base import Handle, Locals, SbpChange


@dataclass(frozen=True)
class LocalSlice(SbpChange):
    """broadcast -> split(dim): keep this member's part; no communication."""

    sends = False
    dim: int

    takes = (Broadcast, Split)

    @staticmethod
    def fields(a, b):
        return (b.dim,)

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return k.gamma * bytes_out

    def start(self, x, rank, own=False):
        c = self.src.placement.coord(rank)[self.axis]
        offset, size = self.parts(x.shape[self.dim])[c]
        return Handle.ready(x.narrow(self.dim, offset, size))

    def simulate(self, locals_: Locals) -> Locals:
        def sl(ms, xs):
            parts = self.parts(xs[0].shape[self.dim])
            return [x.narrow(self.dim, o, s).clone() for x, (o, s) in zip(xs, parts)]
        return self.by_group(locals_, sl)


@dataclass(frozen=True)
class ZeroNonRoot(SbpChange):
    """broadcast -> partial_sum: the axis' first member keeps the value, others zeros."""

    sends = False

    takes = (Broadcast, Partial)

    @staticmethod
    def fields(a, b):
        return () if b.reduce == "sum" else None

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return k.gamma * bytes_out

    def start(self, x, rank, own=False):
        if self.src.placement.coord(rank)[self.axis] == 0:
            return Handle.ready(x)
        return Handle.ready(torch.zeros_like(x))

    def simulate(self, locals_: Locals) -> Locals:
        return self.by_group(locals_, lambda ms, xs: [x if k == 0 else torch.zeros_like(x)
                                                      for k, x in enumerate(xs)])


@dataclass(frozen=True)
class Relabel(SbpChange):
    """broadcast -> partial_max: every member keeps the value (max of equal values)."""

    sends = False

    takes = (Broadcast, Partial)

    @staticmethod
    def fields(a, b):
        return () if b.reduce == "max" else None

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return 0.0

    def start(self, x, rank, own=False):
        return Handle.ready(x)

    def simulate(self, locals_: Locals) -> Locals:
        return dict(locals_)


@dataclass(frozen=True)
class PadToPartial(SbpChange):
    """split(dim) -> partial: put the part into a tensor of the whole axis region
    filled with the reduction's identity; no communication."""

    sends = False
    dim: int
    reduce: str

    takes = (Split, Partial)

    @staticmethod
    def fields(a, b):
        return (a.dim, b.reduce)

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return k.gamma * bytes_out

    def _pad(self, x: torch.Tensor, rank: int, index: int) -> torch.Tensor:
        shape = self.dst.local_shape(rank)
        out = x.new_full(shape, identity_value(self.reduce, x.dtype))
        offset, size = self.parts(shape[self.dim])[index]
        out.narrow(self.dim, offset, size).copy_(x)
        return out

    def start(self, x, rank, own=False):
        return Handle.ready(self._pad(x, rank, self.src.placement.coord(rank)[self.axis]))

    def simulate(self, locals_: Locals) -> Locals:
        return self.by_group(locals_, lambda ms, xs: [self._pad(x, m, k) for k, (m, x)
                                                      in enumerate(zip(ms, xs))])
