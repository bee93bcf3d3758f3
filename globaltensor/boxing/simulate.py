"""The reference model: run a plan on per-rank tensors in one process.

``locals_`` maps each rank of the placement to its local tensor. ``materialize`` and
``scatter`` convert between a whole value and per-rank tensors by the layout's
definition alone, so tests can check plans (and the executor) against them.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from ..sbp import Partial, Split
from . import steps as S
from .plan import Plan

Locals = dict  # rank -> torch.Tensor


def simulate(plan: Plan, locals_: Locals) -> Locals:
    """Every rank's local tensor in ``plan.dst``, by running the plan's steps."""
    for step in plan.steps:
        locals_ = _SIM[type(step)](step, locals_)
    return locals_


def local_part(value: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s local tensor of the whole ``value``: its region, and on partial axes
    the value on the first member and the reduction's identity on the others."""
    region = layout.region(rank)
    local = value[region.slices()].clone()
    coord = layout.placement.coord(rank)
    for axis in layout.partial_axes:
        if coord[axis] != 0:
            local.fill_(S.identity_value(layout.sbp[axis].reduce, value.dtype))
            break
    return local


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
        if isinstance(s, Partial):
            return _reduce(subs, s.reduce)
        return subs[0]

    return value((), 0)


def _reduce(xs: list, reduce: str) -> torch.Tensor:
    """The sum or max of equal-shape tensors, in their dtype (a sum of bools is their
    "or", as torch adds bools; torch's own sum would widen integers to int64)."""
    stacked = torch.stack(xs)
    return (stacked.sum(0) if reduce == "sum" else stacked.amax(0)).to(xs[0].dtype)


def _by_group(step: S.Step, locals_: Locals, fn) -> Locals:
    """Apply ``fn(members, [their locals]) -> [new locals]`` to every sub-group."""
    out = {}
    for members in step.src.placement.groups(step.axis):
        for m, t in zip(members, fn(members, [locals_[m] for m in members])):
            out[m] = t
    return out


def _all_gather(step, locals_):
    return _by_group(step, locals_, lambda ms, xs: [torch.cat(xs, step.dim)] * len(ms))


def _all_reduce(step, locals_):
    def reduce(ms, xs):
        r = _reduce(xs, step.reduce)
        return [r.clone() for _ in ms]
    return _by_group(step, locals_, reduce)


def _reduce_scatter(step, locals_):
    def rs(ms, xs):
        parts = step.parts(xs[0].shape[step.dim])
        r = _reduce(xs, step.reduce)
        return [r.narrow(step.dim, o, s).clone() for o, s in parts]
    return _by_group(step, locals_, rs)


def _all_to_all(step, locals_):
    def a2a(ms, xs):
        parts = step.parts(xs[0].shape[step.dst_dim])
        return [torch.cat([x.narrow(step.dst_dim, o, s) for x in xs], step.src_dim)
                for o, s in parts]
    return _by_group(step, locals_, a2a)


def _local_slice(step, locals_):
    def sl(ms, xs):
        parts = step.parts(xs[0].shape[step.dim])
        return [x.narrow(step.dim, o, s).clone() for x, (o, s) in zip(xs, parts)]
    return _by_group(step, locals_, sl)


def _zero_non_root(step, locals_):
    return _by_group(step, locals_,
                     lambda ms, xs: [x if k == 0 else torch.zeros_like(x)
                                     for k, x in enumerate(xs)])


def _relabel(step, locals_):
    return dict(locals_)


def _pad_to_partial(step, locals_):
    def pad(ms, xs):
        out = []
        for m, x in zip(ms, xs):
            shape = step.dst.local_shape(m)
            full = x.new_full(shape, S.identity_value(step.reduce, x.dtype))
            o, s = step.parts(shape[step.dim])[ms.index(m)]
            full.narrow(step.dim, o, s).copy_(x)
            out.append(full)
        return out
    return _by_group(step, locals_, pad)


def _transfer(step: S.Transfer, locals_: Locals) -> Locals:
    out = {}
    for d in step.dst.placement:
        region = step.dst.region(d)
        fill = step.fill_of(d)
        any_local = next(iter(locals_.values()))
        out[d] = any_local.new_full(region.sizes, S.identity_value(fill or "sum", any_local.dtype))
    for m in step.moves:
        src_region, dst_region = step.src.region(m.src), step.dst.region(m.dst)
        out[m.dst][m.region.slices(dst_region)] = locals_[m.src][m.region.slices(src_region)]
    return out


_SIM = {
    S.AllGather: _all_gather, S.AllReduce: _all_reduce, S.ReduceScatter: _reduce_scatter,
    S.AllToAll: _all_to_all, S.LocalSlice: _local_slice, S.ZeroNonRoot: _zero_non_root,
    S.Relabel: _relabel, S.PadToPartial: _pad_to_partial, S.Transfer: _transfer,
}
