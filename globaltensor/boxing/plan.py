"""Planning: the cheapest sequence of steps from one layout to another.

On one placement, each step changes the sbp of one axis (DESIGN.md's table). A search
over nd-sbp states (Dijkstra, alpha-beta cost per step) finds the cheapest valid order;
an order is invalid when a later axis splits the dim an axis works on, or when an
outer partial axis would be reduced before an inner partial of another kind. Plans are
cached by (src layout, dst layout, element size).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from ..layout import Layout
from ..sbp import Broadcast, Partial, SbpParallel, Split, broadcast
from . import steps as S

# Alpha-beta model of one collective: seconds per message and per byte. The absolute
# numbers matter less than their ratio; these fit gloo on loopback TCP.
ALPHA = 30e-6
BETA = 1.0 / 1.5e9
# Local copies cost memory bandwidth only; keep them cheap but not free so a route
# with fewer copies wins a tie.
GAMMA = BETA / 20


@dataclass(frozen=True, repr=False)
class Plan:
    src: Layout
    dst: Layout
    steps: tuple = ()
    cost: float = 0.0
    itemsize: int = 4
    route: str = "same-placement"

    def __str__(self) -> str:
        from .explain import format_plan
        return format_plan(self)

    __repr__ = __str__


def max_local_bytes(layout: Layout, itemsize: int) -> int:
    return _max_local_numel(layout) * itemsize


@lru_cache(maxsize=4096)
def _max_local_numel(layout: Layout) -> int:
    return max(layout.region_at(c).numel for c in _coords(layout.placement.shape))


def _coords(shape):
    import itertools
    return itertools.product(*map(range, shape))


def step_cost(step: S.Step, itemsize: int) -> float:
    n = step.src.placement.shape[step.axis]
    b_in = max_local_bytes(step.src, itemsize)
    b_out = max_local_bytes(step.dst, itemsize)
    if isinstance(step, S.AllGather):
        return ALPHA * (n - 1) + BETA * b_out * (n - 1) / n
    if isinstance(step, S.AllReduce):
        return 2 * ALPHA * (n - 1) + 2 * BETA * b_in * (n - 1) / n
    if isinstance(step, (S.ReduceScatter, S.AllToAll)):
        return ALPHA * (n - 1) + BETA * b_in * (n - 1) / n + GAMMA * b_in
    if isinstance(step, S.Relabel):
        return 0.0
    return GAMMA * b_out


def _direct_step(src: Layout, dst: Layout, axis: int):
    """The one step that changes ``axis`` from src's sbp to dst's, or None."""
    a, b = src.sbp[axis], dst.sbp[axis]
    if isinstance(a, Split):
        if isinstance(b, Broadcast):
            return S.AllGather(axis, src, dst, a.dim)
        if isinstance(b, Split):
            return S.AllToAll(axis, src, dst, a.dim, b.dim)
        return S.PadToPartial(axis, src, dst, a.dim, b.reduce)
    if isinstance(a, Broadcast):
        if isinstance(b, Split):
            return S.LocalSlice(axis, src, dst, b.dim)
        return S.ZeroNonRoot(axis, src, dst) if b.reduce == "sum" else S.Relabel(axis, src, dst)
    if isinstance(b, Broadcast):
        return S.AllReduce(axis, src, dst, a.reduce)
    if isinstance(b, Split):
        return S.ReduceScatter(axis, src, dst, b.dim, a.reduce)
    return None  # partial_sum <-> partial_max goes through broadcast


def _valid(nd_sbp: tuple, axis: int, new: SbpParallel) -> bool:
    """Can ``axis`` change from nd_sbp[axis] to ``new`` with one collective inside
    its sub-groups, given the other axes as they are?"""
    old = nd_sbp[axis]
    dims = {s.dim for s in (old, new) if isinstance(s, Split)}
    later = nd_sbp[axis + 1:]
    if any(isinstance(s, Split) and s.dim in dims for s in later):
        return False  # later axes cut the parts this axis moves into pieces
    if isinstance(old, Partial) and not isinstance(new, Partial):
        # Reducing an outer partial first is only right if inner partials commute.
        if any(isinstance(s, Partial) and s.reduce != old.reduce for s in later):
            return False
    return True


def _candidates(ndim: int) -> list[SbpParallel]:
    return [broadcast, Partial("sum"), Partial("max")] + [Split(d) for d in range(ndim)]


@lru_cache(maxsize=2048)
def plan_boxing(src: Layout, dst: Layout, itemsize: int = 4) -> Plan | None:
    """The cheapest same-placement plan from ``src`` to ``dst``, or None when the
    per-axis steps cannot get there (the caller then uses the general route).

    >>> # doctest: +SKIP
    >>> plan_boxing(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))
    """
    if src.placement != dst.placement or src.shape != dst.shape:
        return None
    if src.sbp == dst.sbp:
        return Plan(src, dst, (), 0.0, itemsize)
    cands = _candidates(len(src.shape))
    start, goal = src.sbp, dst.sbp
    best = {start: 0.0}
    heap = [(0.0, 0, start, ())]
    counter = 1
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == goal:
            return Plan(src, dst, path, cost, itemsize)
        if cost > best.get(state, float("inf")):
            continue
        here = Layout(src.shape, src.placement, state)
        for axis in range(len(state)):
            for new in cands:
                if new == state[axis] or not _valid(state, axis, new):
                    continue
                nxt = state[:axis] + (new,) + state[axis + 1:]
                there = Layout(src.shape, src.placement, nxt)
                step = _direct_step(here, there, axis)
                if step is None:
                    continue
                c = cost + step_cost(step, itemsize)
                if c < best.get(nxt, float("inf")) - 1e-15:
                    best[nxt] = c
                    heapq.heappush(heap, (c, counter, nxt, path + (step,)))
                    counter += 1
    return None
