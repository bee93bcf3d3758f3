"""Shared generators for boxing tests: random layouts and per-rank tensors that
represent a known value (used by the simulator tests and the multi-process tests)."""
from __future__ import annotations

import torch

from globaltensor.layout import Layout, balanced_split
from globaltensor.sbp import Broadcast, Split


def random_locals(value: torch.Tensor, layout: Layout, gen: torch.Generator) -> dict:
    """Per-rank tensors representing ``value`` under ``layout``, with random (but
    valid) addends on partial axes and identical copies on broadcast axes."""
    placement = layout.placement
    out = {}

    def fill(coord: tuple, axis: int, v: torch.Tensor) -> dict:
        if axis == placement.ndim:
            return {coord: v.clone()}
        n, s = placement.shape[axis], layout.sbp[axis]
        result = {}
        if isinstance(s, Split):
            for i, (o, size) in enumerate(balanced_split(v.shape[s.dim], n)):
                result.update(fill(coord + (i,), axis + 1, v.narrow(s.dim, o, size)))
        elif isinstance(s, Broadcast):
            first = fill(coord + (0,), axis + 1, v)
            for i in range(n):
                result.update({c[:axis] + (i,) + c[axis + 1:]: t for c, t in first.items()})
        elif s.reduce == "sum":
            addends = [torch.randn(v.shape, generator=gen).to(v.dtype) for _ in range(n - 1)]
            addends.insert(0, v - sum(addends) if addends else v)
            for i, a in enumerate(addends):
                result.update(fill(coord + (i,), axis + 1, a))
        else:
            owner = torch.randint(0, n, v.shape, generator=gen)
            for i in range(n):
                lower = v - torch.rand(v.shape, generator=gen).to(v.dtype) - 0.5
                result.update(fill(coord + (i,), axis + 1, torch.where(owner == i, v, lower)))
        return result

    for coord, t in fill((), 0, value).items():
        out[placement.rank_at(coord)] = t
    return out


def reference_locals(value: torch.Tensor, layout: Layout) -> dict:
    """The exact local slices of a non-partial layout."""
    return {r: value[layout.region(r).slices()] for r in layout.placement}
