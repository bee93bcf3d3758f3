"""Planning: the cheapest sequence of boxing steps from one layout to another.

``plan_route`` is the entry point. On one placement, each step changes the sbp of one
axis (docs/DESIGN.md's table); a search over nd-sbp states (Dijkstra, each step priced by
its own ``cost``) finds the cheapest valid order (``plan_boxing``). An order is invalid
when a later axis splits the dim an axis works on, or when an outer partial axis would
be reduced before an inner partial of another kind. The general route (``general_plan``)
reduces the source's partial axes on the source placement (to a split when possible,
so less is sent), then moves regions with one ``Transfer``; it works between any two
placements and is the fallback on one. A strided split is boxed on the refined view
where it is plain (``Layout.refined``, between two ``ViewAs``), or through broadcast
when the two layouts share no refined view. Plans are cached by (src, dst, element size).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..layout import Layout
from ..sbp import Partial, SbpParallel, Split, StridedSplit, broadcast
from .execute import start
from .explain import format_plan
from .steps import AXIS_STEPS, Handle
from .steps.reshape import ViewAs
from .steps.transfer import Transfer


@dataclass(frozen=True, repr=False)
class Plan:
    """Steps from layout ``src`` to ``dst`` with their estimated cost (seconds).

    >>> plan = plan_route(src, dst, itemsize=4)     # doctest: +SKIP
    >>> out = plan.start(x_local).wait()
    """
    src: Layout
    dst: Layout
    steps: tuple = ()
    cost: float = 0.0
    itemsize: int = 4
    route: str = "same-placement"

    def start(self, local: torch.Tensor, rank: int | None = None,
              donate: bool = False) -> Handle:
        """Start boxing this rank's ``local`` part (``execute.start``); ``wait()`` on
        the handle gives its part of ``dst``."""
        return start(self, local, rank, donate)

    def __str__(self) -> str:
        return format_plan(self)

    __repr__ = __str__


@lru_cache(maxsize=2048)
def plan_route(src: Layout, dst: Layout, itemsize: int = 4) -> Plan:
    """The cheapest plan from ``src`` to ``dst``: per-axis steps when both are on one
    placement, or the general point-to-point route, whichever costs less.

    >>> plan_route(Layout.make((8,), p, split(0)), Layout.make((8,), q, broadcast))  # doctest: +SKIP
    """
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst:
        return Plan(src, dst, (), 0.0, itemsize)
    if src.strided or dst.strided:
        return _strided_route(src, dst, itemsize)
    same = plan_boxing(src, dst, itemsize)
    # the general route only where it is cheaper (ties go to the collectives)
    general = general_plan(src, dst, itemsize, same.cost if same is not None else float("inf"))
    return same if general is None else general


def _strided_route(src: Layout, dst: Layout, itemsize: int) -> Plan:
    """Box on the refined view both layouts share, or else through broadcast on the
    source's placement (each half then has one)."""
    blocks: dict = {}
    for s in src.sbp + dst.sbp:
        if isinstance(s, StridedSplit):
            blocks.setdefault(s.dim, set()).add(s.blocks)
    if all(len(k) == 1 for k in blocks.values()):
        view = {d: k.pop() for d, k in blocks.items()}
        fine_src, fine_dst = src.refined(view), dst.refined(view)
        if fine_src is not None and fine_dst is not None:
            inner = plan_route(fine_src, fine_dst, itemsize)
            steps = (ViewAs(src, fine_src),) + inner.steps + (ViewAs(fine_dst, dst),)
            return Plan(src, dst, steps, inner.cost, itemsize, inner.route)
    whole = Layout.make(src.shape, src.placement, (broadcast,) * src.placement.ndim)
    first, second = plan_route(src, whole, itemsize), plan_route(whole, dst, itemsize)
    return Plan(src, dst, first.steps + second.steps, first.cost + second.cost, itemsize,
                "through broadcast")


def _axis_step(src: Layout, dst: Layout, axis: int, itemsize: int):
    """The cheapest registered step that changes ``axis`` from src's sbp to dst's, or
    None (partial_sum <-> partial_max goes through broadcast). Every kind that serves
    the change is priced: a new kind competes with the existing ones on cost alone."""
    best, best_cost = None, float("inf")
    for kind in AXIS_STEPS:
        step = kind.for_axis(axis, src, dst)
        if step is not None:
            cost = step.cost(itemsize)
            if cost < best_cost:
                best, best_cost = step, cost
    return best


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


def _candidates(ndim: int, ends: tuple) -> list[SbpParallel]:
    """The sbp an axis may pass through. A partial_max state is a detour unless an end
    holds one: entered from broadcast or split (free) and left by a reduction, it costs
    what the same detour through partial_sum costs, which stays a candidate."""
    partials = [Partial("sum")] + ([Partial("max")] if Partial("max") in ends else [])
    return [broadcast, *partials] + [Split(d) for d in range(ndim)]


@lru_cache(maxsize=2048)
def plan_boxing(src: Layout, dst: Layout, itemsize: int = 4) -> Plan | None:
    """The cheapest same-placement plan from ``src`` to ``dst``, or None when the
    per-axis steps cannot get there (the caller then uses the general route).

    >>> plan_boxing(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    if src.placement != dst.placement or src.shape != dst.shape:
        return None
    if src.sbp == dst.sbp:
        return Plan(src, dst, (), 0.0, itemsize)
    cands = _candidates(len(src.shape), src.sbp + dst.sbp)
    begin, goal = src.sbp, dst.sbp
    best = {begin: 0.0}
    heap = [(0.0, 0, begin, ())]
    counter = 1
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == goal:
            return Plan(src, dst, path, cost, itemsize)
        if cost > best.get(state, float("inf")):
            continue
        for axis in range(len(state)):
            for new in cands:
                edge = _edge(src.shape, src.placement, state, axis, new, itemsize)
                if edge is None:
                    continue
                nxt, step, step_cost = edge
                c = cost + step_cost
                if c < best.get(nxt, float("inf")) - 1e-15:
                    best[nxt] = c
                    heapq.heappush(heap, (c, counter, nxt, path + (step,)))
                    counter += 1
    return None


@lru_cache(maxsize=8192)
def _edge(shape: tuple, placement, state: tuple, axis: int, new: SbpParallel, itemsize: int):
    """(next state, step, its cost) changing ``axis`` of ``state`` to ``new``, or None.
    Cached: searches on one shape and placement (every signature an op weighs, every
    target of a partial output) walk the same edges."""
    if new == state[axis] or not _valid(state, axis, new):
        return None
    nxt = state[:axis] + (new,) + state[axis + 1:]
    step = _axis_step(Layout.interned(shape, placement, state), Layout.interned(shape, placement, nxt),
                      axis, itemsize)
    return None if step is None else (nxt, step, step.cost(itemsize))


def clear_caches() -> None:
    """Forget every plan and search edge (a new step kind was registered, or a test
    counts the layouts still held)."""
    for cached in (plan_route, plan_boxing, _edge):
        cached.cache_clear()


def _reduced_sources(src: Layout):
    """Source layouts without partial axes that the source can reach by itself."""
    options = []
    for s in src.sbp:
        if isinstance(s, Partial):
            options.append([broadcast] + [Split(d) for d in range(src.ndim)])
        else:
            options.append([s])
    for combo in itertools.product(*options):
        yield Layout(src.shape, src.placement, tuple(combo))


def general_plan(src: Layout, dst: Layout, itemsize: int,
                 bound: float = float("inf")) -> Plan | None:
    """The general route: reduce the source's partials, then one ``Transfer``; None
    when every such route costs ``bound`` or more (the caller has one that cheap).
    The transfer is priced first: a reduction is planned only where it could still win."""
    best, best_cost = None, bound
    for mid in _reduced_sources(src):
        transfer = Transfer.between(mid, dst)
        moved = transfer.cost(itemsize)
        if moved >= best_cost:
            continue
        pre = plan_boxing(src, mid, itemsize) if mid != src else Plan(src, src, (), 0.0, itemsize)
        if pre is None or pre.cost + moved >= best_cost:
            continue
        best_cost = pre.cost + moved
        best = Plan(src, dst, pre.steps + (transfer,), best_cost, itemsize, "general (p2p)")
    return best
