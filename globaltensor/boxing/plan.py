"""Planning: the cheapest sequence of boxing steps from one layout to another.

``plan_route`` is the entry point. On one placement, each step changes the sbp of one
axis; a search over nd-sbp states (``search.py``: Dijkstra, each step priced by its own
``cost``) finds the cheapest valid order (``plan_boxing``). The general route (``general_plan``)
reduces the source's partial axes on the source placement (to a split when possible,
so less is sent), then moves regions with one ``Transfer``; it works between any two
placements and is the fallback on one. A strided split is boxed on the refined view
where it is plain (``Layout.refined``, between two ``ViewAs``), or through broadcast
when the two layouts share no refined view. Plans are cached by (src, dst, element size).

Step planning prices tens of thousands of pairs on a 2-D placement, so nothing is
priced twice: the search from a source is kept and resumed for its next target (it
settles states in the order a search of its own would: the same path and cost), a
general route is skipped where a lower bound of its transfer cannot win
(``transfer_price.py``) and priced without making its moves, and ``route_cost`` gives
a plan's cost without making the plan: per source, against every layout of its shape
and placement at once (``_routes_from``: every source's routes on the graph as arrays,
``_all_pairs``; the general routes' transfers as arrays; the same costs as pair by
pair).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..layout import Layout
from ..sbp import Partial, Split, StridedSplit, broadcast
from . import transfer_price
from .execute import start
from .explain import format_plan
from .search import Graph, candidates, edge_of, graph_of, holds_max, search_from
from .steps import Handle
from .steps.reshape import ViewAs
from .steps.transfer import Transfer
from .transfer_price import transfer_cost, transfer_floor


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

    @property
    def sends(self) -> bool:
        """Whether running it sends data between ranks (a local slice or a view does not:
        explicit mode allows those, and they need no meeting)."""
        return any(step.sends for step in self.steps)

    def sent_bytes(self) -> int:
        """Bytes the busiest rank sends, counted as ``gt.debug.comm_stats`` counts them."""
        return sum(step.sent_bytes(self.itemsize) for step in self.steps)

    def __str__(self) -> str:
        return format_plan(self)

    __repr__ = __str__


@lru_cache(maxsize=4096)
def plan_route(src: Layout, dst: Layout, itemsize: int = 4) -> Plan:
    """The cheapest plan from ``src`` to ``dst``: per-axis steps when both are on one
    placement, or the general point-to-point route, whichever costs less.

    >>> plan_route(Layout.make((8,), p, split(0)), Layout.make((8,), q, broadcast))  # doctest: +SKIP
    """
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst or src.same_parts(dst):
        return Plan(src, dst, (), 0.0, itemsize)
    if src.strided or dst.strided:
        return _strided_route(src, dst, itemsize)
    same = plan_boxing(src, dst, itemsize)
    # the general route only where it is cheaper (ties go to the collectives)
    general = general_plan(src, dst, itemsize, same.cost if same is not None else float("inf"))
    return same if general is None else general


@lru_cache(maxsize=65536)
def route_cost(src: Layout, dst: Layout, itemsize: int = 4) -> float:
    """``plan_route(src, dst, itemsize).cost``, without making the plan: step
    planning prices every pair of layouts two calls may hold (tens of thousands on
    a 2-D placement) and runs none of them.

    >>> route_cost(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst or src.same_parts(dst):
        return 0.0
    if _strided(src) or _strided(dst):
        fine = _refined_pair(src, dst)
        if fine is not None:
            return route_cost(fine[0], fine[1], itemsize)
        whole = _whole(src)
        return route_cost(src, whole, itemsize) + route_cost(whole, dst, itemsize)
    if src.placement == dst.placement:
        found = _routes_from(src, itemsize, holds_max(src) or holds_max(dst))
        j = found[1].get(dst.sbp)
        if j is not None and found[0][j] < float("inf"):
            return found[0][j].item()
    same = _boxing_cost(src, dst, itemsize)
    general = _general(src, dst, itemsize, same if same is not None else float("inf"))
    return same if general is None else general[0]


# --- a source priced against every layout of its shape and placement at once ------------
# Step planning prices nearly every pair of layouts of a shape (tens of thousands on a
# 2-D placement). Per source: one Dijkstra search run to its end (every state's cost, in
# the order and with the sums the kept search gives), and the general routes of every
# target from the source's reductions as arrays (``transfer_price.transfer_costs``): the
# cost of each target is min(same placement, cheapest general route), which is what
# ``_general``'s pruning returns (its floors are lower bounds of the transfers).

@lru_cache(maxsize=1024)
def _universe(shape: tuple, placement) -> tuple:
    """(every layout of the shape and placement over the per-axis candidates, with
    partial_max, as ``transfer_price.Targets`` (``plain``: those without partial_max);
    {nd-sbp: index}; whether each holds partial_max)."""
    cands = candidates(len(shape), (Partial("max"),))
    sbps = list(itertools.product(cands, repeat=placement.ndim))
    layouts = tuple(Layout.interned(shape, placement, nd) for nd in sbps)
    targets = transfer_price.Targets(layouts)
    maxes = np.array([Partial("max") in nd for nd in sbps], dtype=bool)
    targets.plain = tuple(l for l, m in zip(layouts, maxes) if not m)
    return targets, {nd: j for j, nd in enumerate(sbps)}, maxes


@lru_cache(maxsize=16384)
def _costs_to_all(src: Layout, itemsize: int, with_max: bool):
    """The cost of the cheapest route from ``src`` to each state of its graph, by state
    number (inf where none; a sequence, or a dict for a source off the candidates)."""
    graph = graph_of(src.shape, src.placement, itemsize, with_max)
    begin = graph.number(graph.state(src.sbp))
    table = _all_pairs(graph)
    if begin < len(table):
        return table[begin]
    return _searched_to_all(graph, begin)


@lru_cache(maxsize=1024)
def _all_pairs(graph: "Graph") -> np.ndarray:
    """[source state][state]: the cheapest route's cost between every two states made of
    candidate sbp (inf where none), numbered first: every source of a universe at once,
    by Bellman-Ford rounds as arrays (a round extends every route by one step; each
    route summed from its source on, as a search sums it). Equal to a search's costs
    but where two routes cost within 1e-15 of each other (its tie margin)."""
    n = graph.moves ** graph.placement.ndim
    step = np.full((n, n), np.inf)
    for k in range(n):
        for nxt, cost in graph.linked(k):
            step[k, nxt] = min(step[k, nxt], cost)
    costs = np.full((n, n), np.inf)
    np.fill_diagonal(costs, 0.0)
    for _ in range(n):
        longer = np.minimum(costs, (costs[:, :, None] + step[None, :, :]).min(axis=1))
        if np.array_equal(longer, costs):
            break
        costs = longer
    return costs


def _looked_up(reached, numbers: list) -> np.ndarray:
    """``_costs_to_all``'s costs of the states ``numbers`` (inf: not reached)."""
    if isinstance(reached, np.ndarray):
        return reached[numbers]
    inf = float("inf")
    return np.array([reached.get(k, inf) for k in numbers])


def _searched_to_all(graph: "Graph", begin: int) -> dict:
    """{state number: cost} of every state the search from state ``begin`` reaches."""
    heap, best, settled, linked, counter = [(0.0, 0, begin)], {begin: 0.0}, {}, graph.linked, 1
    pop, push, inf, get = heapq.heappop, heapq.heappush, float("inf"), best.get
    while heap:
        cost, _, state = pop(heap)
        if state in settled:
            continue
        settled[state] = cost
        for nxt, step_cost in linked(state):
            c = cost + step_cost
            if c < get(nxt, inf) - 1e-15:
                best[nxt] = c
                push(heap, (c, counter, nxt))
                counter += 1
    return settled


def _numbers(graph: "Graph", layouts: tuple) -> list:
    """The state numbers of ``layouts`` (one universe) on ``graph``."""
    found = graph.layouts.get(id(layouts))
    if found is None or found[0] is not layouts:
        found = graph.layouts[id(layouts)] = (layouts, [graph.number(graph.state(l.sbp))
                                                         for l in layouts])
    return found[1]


@lru_cache(maxsize=16384)
def _routes_from(src: Layout, itemsize: int, with_max: bool) -> tuple:
    """(route_cost from ``src`` (no strided split) to every layout of its universe that
    is searched ``with_max`` (``_boxing``: when either end holds partial_max), as an
    array, NaN or inf elsewhere (priced alone); the universe's {nd-sbp: index})."""
    targets, index, maxes = _universe(src.shape, src.placement)
    holds = holds_max(src)
    graph = graph_of(src.shape, src.placement, itemsize, with_max)
    reached = _costs_to_all(src, itemsize, with_max)
    if holds or with_max:
        same = _looked_up(reached, _numbers(graph, targets.layouts))
        if not holds:
            same[~maxes] = np.nan
    else:   # no partial_max anywhere: searched without it
        same = np.full(len(targets.layouts), np.nan)
        same[~maxes] = _looked_up(reached, _numbers(graph, targets.plain))
    graph = graph_of(src.shape, src.placement, itemsize, holds)
    reached = _costs_to_all(src, itemsize, holds)   # the reductions: searched as _general's
    best = same
    for mid in _reduced_sources(src):
        pre = 0.0 if mid == src else \
            _looked_up(reached, [graph.number(graph.state(mid.sbp))])[0]
        if pre == float("inf"):
            continue
        best = np.minimum(best, pre + _transfers_from(mid, itemsize))
    return best, index


@lru_cache(maxsize=16384)
def _transfers_from(mid: Layout, itemsize: int) -> np.ndarray:
    """``transfer_cost(mid, t, itemsize)`` per layout t of mid's universe (a reduced
    source: every source that reduces to it shares them)."""
    return transfer_price.transfer_costs(mid, _universe(mid.shape, mid.placement)[0],
                                         itemsize)


def _strided_route(src: Layout, dst: Layout, itemsize: int) -> Plan:
    """Box on the refined view both layouts share, or else through broadcast on the
    source's placement (each half then has one)."""
    fine = _refined_pair(src, dst)
    if fine is not None:
        fine_src, fine_dst = fine
        inner = plan_route(fine_src, fine_dst, itemsize)
        steps = (ViewAs(src, fine_src),) + inner.steps + (ViewAs(fine_dst, dst),)
        return Plan(src, dst, steps, inner.cost, itemsize, inner.route)
    whole = _whole(src)
    first, second = plan_route(src, whole, itemsize), plan_route(whole, dst, itemsize)
    return Plan(src, dst, first.steps + second.steps, first.cost + second.cost, itemsize,
                "through broadcast")


@lru_cache(maxsize=16384)
def _refined_pair(src: Layout, dst: Layout):
    """(src, dst) on the refined view both share (``Layout.refined``), or None."""
    blocks: dict = {}
    for s in src.sbp + dst.sbp:
        if isinstance(s, StridedSplit):
            blocks.setdefault(s.dim, set()).add(s.blocks)
    if all(len(k) == 1 for k in blocks.values()):
        view = tuple(sorted((d, k.pop()) for d, k in blocks.items()))
        fine_src, fine_dst = _refined(src, view), _refined(dst, view)
        if fine_src is not None and fine_dst is not None:
            return fine_src, fine_dst
    return None


@lru_cache(maxsize=4096)
def _refined(layout: Layout, view: tuple):
    return layout.refined(dict(view))


@lru_cache(maxsize=16384)
def _strided(layout: Layout) -> bool:
    return layout.strided


def _whole(layout: Layout) -> Layout:
    return Layout.make(layout.shape, layout.placement, (broadcast,) * layout.placement.ndim)


@lru_cache(maxsize=8192)
def plan_boxing(src: Layout, dst: Layout, itemsize: int = 4) -> Plan | None:
    """The cheapest same-placement plan from ``src`` to ``dst``, or None when the
    per-axis steps cannot get there (the caller then uses the general route).

    >>> plan_boxing(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    found = _boxing(src, dst, itemsize)
    return None if found is None else Plan(src, dst, found[1], found[0], itemsize)


def _boxing(src: Layout, dst: Layout, itemsize: int):
    """(cost, steps) of ``plan_boxing``, or None."""
    if src.placement != dst.placement or src.shape != dst.shape:
        return None
    if src.sbp == dst.sbp:
        return 0.0, ()
    return search_from(src, itemsize, holds_max(src) or holds_max(dst)).reach(dst)


def _boxing_cost(src: Layout, dst: Layout, itemsize: int) -> float | None:
    found = _boxing(src, dst, itemsize)
    return None if found is None else found[0]


def clear_caches() -> None:
    """Forget every plan and search edge (a new step kind was registered, or a test
    counts the layouts still held)."""
    for cached in (plan_route, plan_boxing, _transfer):
        cached.cache_clear()
    forget_searches()


def forget_searches() -> None:
    """Forget the searches and prices kept for pricing many pairs, not the plans
    (step planning's working set: a 12-layer GPT on 2 x 4 keeps about 150 MiB of them;
    what runs later needs only its plans)."""
    for cached in (route_cost, _refined_pair, _refined, _strided, search_from, graph_of,
                   holds_max, edge_of, _reduced_sources, _routes_from, _transfers_from, _costs_to_all,
                   _all_pairs,
                   _universe):
        cached.cache_clear()
    transfer_price.clear_caches()


@lru_cache(maxsize=16384)
def _reduced_sources(src: Layout) -> tuple:
    """Source layouts without partial axes that the source can reach by itself."""
    options = []
    for s in src.sbp:
        if isinstance(s, Partial):
            options.append([broadcast] + [Split(d) for d in range(src.ndim)])
        else:
            options.append([s])
    return tuple(Layout.interned(src.shape, src.placement, tuple(combo))
                 for combo in itertools.product(*options))


def general_plan(src: Layout, dst: Layout, itemsize: int,
                 bound: float = float("inf")) -> Plan | None:
    """The general route: reduce the source's partials, then one ``Transfer``; None
    when every such route costs ``bound`` or more (the caller has one that cheap)."""
    found = _general(src, dst, itemsize, bound)
    if found is None:
        return None
    cost, mid = found
    pre = () if mid == src else plan_boxing(src, mid, itemsize).steps
    return Plan(src, dst, pre + (_transfer(mid, dst),), cost, itemsize, "general (p2p)")


def _general(src: Layout, dst: Layout, itemsize: int, bound: float):
    """(cost, the reduced source it sends from) of the cheapest general route under
    ``bound``, or None. A route is priced only where a lower bound of its transfer
    (``transfer_floor``) leaves it a chance, and its transfer without its moves."""
    best, best_cost = None, bound
    for mid in _reduced_sources(src):
        floor = transfer_floor(mid, dst, itemsize)
        if floor >= best_cost:
            continue
        pre = 0.0
        if mid != src:
            pre = _boxing_cost(src, mid, itemsize)
            if pre is None or pre + floor >= best_cost:
                continue
        moved = transfer_cost(mid, dst, itemsize)
        if moved >= best_cost or pre + moved >= best_cost:
            continue
        best, best_cost = mid, pre + moved
    return None if best is None else (best_cost, best)


@lru_cache(maxsize=1024)
def _transfer(mid: Layout, dst: Layout) -> Transfer:
    return Transfer.between(mid, dst)
