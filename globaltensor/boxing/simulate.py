"""The reference model: run a plan on per-rank tensors in one process.

``locals_`` maps each rank of the placement to its local tensor. ``materialize`` and
``scatter`` convert between a whole value and per-rank tensors by the layout's
definition alone, so tests can check plans (and the executor) against them.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from ..partials import local_part, reduce_values
from ..sbp import Partial, Split, StridedSplit

Locals = dict  # rank -> torch.Tensor


def simulate(plan, locals_: Locals) -> Locals:
    """Every rank's local tensor in ``plan.dst``, by running the plan's steps.

    >>> simulate(plan, scatter(value, plan.src))    # doctest: +SKIP
    """
    for step in plan.steps:
        locals_ = step.simulate(locals_)
    return locals_


def scatter(value: torch.Tensor, layout: Layout) -> Locals:
    """Each rank's local tensor of ``value`` (partial axes: first member holds it)."""
    return {rank: local_part(value, layout, rank) for rank in layout.placement}


def materialize(locals_: Locals, layout: Layout) -> torch.Tensor:
    """The global value the per-rank tensors represent, by the nd-sbp's definition:
    axis 0 outermost (concatenate splits, take broadcasts, reduce partials)."""
    placement = layout.placement

    def value(coord: tuple, axis: int) -> torch.Tensor:
        if axis == placement.ndim:
            return locals_[placement.rank_at(coord)]
        subs = [value(coord + (i,), axis + 1) for i in range(placement.shape[axis])]
        s = layout.sbp[axis]
        if isinstance(s, Split):
            return torch.cat(subs, dim=s.dim)
        if isinstance(s, StridedSplit):  # block j is every member's j-th piece in turn
            pieces = [sub.chunk(s.blocks, s.dim) if sub.shape[s.dim] else
                      [sub] * s.blocks for sub in subs]
            return torch.cat([p[j] for j in range(s.blocks) for p in pieces], dim=s.dim)
        if isinstance(s, Partial):
            return reduce_values(subs, s.reduce)
        return subs[0]

    return value((), 0)
