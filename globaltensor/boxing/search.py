"""The search behind same-placement boxing: nd-sbp states of one shape and placement,
the per-axis steps between them (one registered step each, ``steps/``), and Dijkstra
over them from one source, kept and resumed for the source's next target; for step
planning, the cheapest route between every two states of a shape at once, as arrays
(``all_pairs``).

A state changes one axis at a time (docs/DESIGN.md's table); an order is invalid when a
later axis splits the dim an axis works on, or when an outer partial axis would be
reduced before an inner partial of another kind (``_valid``).

>>> search_from(src, 4, False).reach(dst)      # doctest: +SKIP
(0.00031, (AllGather(axis=0: split(0) -> broadcast),))
"""
from __future__ import annotations

import heapq
import itertools
import threading
from functools import lru_cache

import numpy as np

from ..cost import costs_for
from ..layout import Layout
from ..sbp import Partial, SbpParallel, Split, broadcast
from .steps import AXIS_STEPS
from .steps.base import priced_by_bytes
from .transfer_price import transfer_table


def axis_step(src: Layout, dst: Layout, axis: int, itemsize: int):
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


def valid(nd_sbp: tuple, axis: int, new: SbpParallel) -> bool:
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


def candidates(ndim: int, ends: tuple) -> list[SbpParallel]:
    """The sbp an axis may pass through. A partial_max state is a detour unless an end
    holds one: entered from broadcast or split (free) and left by a reduction, it costs
    what the same detour through partial_sum costs, which stays a candidate."""
    partials = [Partial("sum")] + ([Partial("max")] if Partial("max") in ends else [])
    return [broadcast, *partials] + [Split(d) for d in range(ndim)]


@lru_cache(maxsize=16384)
def holds_max(layout: Layout) -> bool:
    """Whether an axis is partial_max (searches then pass through it, ``candidates``)."""
    return Partial("max") in layout.sbp


class Search:
    """The Dijkstra search over nd-sbp states from one source, kept between queries:
    a query settles states (in the order one search for that goal would, ties broken
    by push order) until its goal is settled, and later queries go on from there. So
    every goal gets the path and cost a search of its own would return, and a source
    priced against many targets (every option of a consumer, in step planning) is
    searched once. States are tuples of indices into ``Graph.sbps``."""

    __slots__ = ("graph", "heap", "best", "settled", "counter", "lock", "answers")

    def __init__(self, graph: "Graph", begin: tuple):
        self.graph = graph
        self.heap = [(0.0, 0, begin, None, None)]   # (cost, push order, state, parent, step)
        self.best = {begin: 0.0}
        self.settled: dict = {}   # state -> (cost, steps)
        self.counter = 1
        self.lock = threading.Lock()
        self.answers: dict = {}   # goal layout -> what reach gave

    def reach(self, goal: Layout):
        """(cost, steps) of the cheapest route to ``goal``'s nd-sbp, or None."""
        if goal in self.answers:
            return self.answers[goal]
        found = self.answers[goal] = self._settle(self.graph.state(goal.sbp))
        return found

    def _settle(self, goal: tuple):
        found = self.settled.get(goal)
        if found is not None:
            return found
        with self.lock:
            heap, best, settled, out = self.heap, self.best, self.settled, self.graph.out
            while heap and goal not in settled:
                cost, _, state, parent, step = heapq.heappop(heap)
                if state in settled:
                    continue   # an older, dearer entry (each push improves best)
                # the path pushed with it: its parent's when the parent was left
                settled[state] = (cost, () if parent is None else settled[parent][1] + (step,))
                for nxt, step, step_cost in out(state):
                    c = cost + step_cost
                    if c < best.get(nxt, float("inf")) - 1e-15:
                        best[nxt] = c
                        heapq.heappush(heap, (c, self.counter, nxt, state, step))
                        self.counter += 1
            return settled.get(goal)


@lru_cache(maxsize=4096)
def search_from(src: Layout, itemsize: int, with_max: bool) -> Search:
    graph = graph_of(src.shape, src.placement, itemsize, with_max)
    return Search(graph, graph.state(src.sbp))


class Graph:
    """The nd-sbp states of one shape and placement and the per-axis steps between
    them (``candidates``: partial_max only ``with_max``), each state's edges made
    when a search first leaves it, in the order axis, then candidate sbp."""

    def __init__(self, shape: tuple, placement, itemsize: int, with_max: bool):
        self.shape, self.placement, self.itemsize = shape, placement, itemsize
        self.sbps = candidates(len(shape), (Partial("max"),) if with_max else ())
        self.moves = len(self.sbps)   # the candidates; a source's other sbp come after
        self.index = {s: k for k, s in enumerate(self.sbps)}
        self.edges: dict = {}
        self.lock = threading.Lock()

    def state(self, nd_sbp: tuple) -> tuple:
        """``nd_sbp`` as a state; an sbp that is no candidate (no step enters it, but a
        source may hold it on an axis that stays) gets an index of its own."""
        out = []
        for s in nd_sbp:
            k = self.index.get(s)
            if k is None:
                with self.lock:
                    k = self.index.setdefault(s, len(self.sbps))
                    if k == len(self.sbps):
                        self.sbps.append(s)
            out.append(k)
        return tuple(out)

    def out(self, state: tuple) -> list:
        """[(next state, step, its cost)] leaving ``state``."""
        found = self.edges.get(state)
        if found is None:
            sbps = self.sbps
            nd_sbp = tuple(sbps[k] for k in state)
            found = []
            for axis in range(len(state)):
                for k in range(self.moves):
                    edge = edge_of(self.shape, self.placement, nd_sbp, axis, sbps[k],
                                 self.itemsize)
                    if edge is not None:
                        found.append((state[:axis] + (k,) + state[axis + 1:],) + edge[1:])
            self.edges[state] = found
        return found


@lru_cache(maxsize=1024)
def graph_of(shape: tuple, placement, itemsize: int, with_max: bool) -> Graph:
    return Graph(shape, placement, itemsize, with_max)


@lru_cache(maxsize=None)
def edge_of(shape: tuple, placement, state: tuple, axis: int, new: SbpParallel, itemsize: int):
    """(next state, step, its cost) changing ``axis`` of ``state`` to ``new``, or None.
    Cached: searches on one shape and placement (every signature an op weighs, every
    target of a partial output) walk the same edges."""
    if new == state[axis] or not valid(state, axis, new):
        return None
    nxt = state[:axis] + (new,) + state[axis + 1:]
    step = axis_step(Layout.interned(shape, placement, state), Layout.interned(shape, placement, nxt),
                      axis, itemsize)
    return None if step is None else (nxt, step, step.cost(itemsize))


# --- every route of a universe at once ------------------------------------------------
# Step planning prices nearly every pair of layouts of a shape and placement (its
# universe: every nd-sbp over ``candidates`` with partial_max, numbered as
# ``itertools.product`` numbers them; an sbp's code is its index: 0 broadcast,
# 1 partial_sum, 2 partial_max, 3 + d split(d)). Which axis changes are valid and which
# kinds serve them depends on the sbp alone (``skeleton``, one per number of dims and
# of axes); a kind priced by bytes (``priced_by_bytes``) costs what its group size and
# the bytes of its two ends say (``state_bytes``), priced once per (kinds, group size,
# bytes in, bytes out) for every universe; the cheapest route between every two states
# comes from Bellman-Ford rounds as arrays (``all_pairs``), each route summed from its
# source on, as a search sums it.

@lru_cache(maxsize=None)
def skeleton(ndim: int, pndim: int) -> tuple:
    """(the states as an array [state][axis] of codes; the valid moves as arrays:
    from state, to state, axis, new code)."""
    cands = candidates(ndim, (Partial("max"),))
    m = len(cands)
    states = list(itertools.product(range(m), repeat=pndim))
    moves = []
    for j, state in enumerate(states):
        nd_sbp = tuple(cands[c] for c in state)
        for axis in range(pndim):
            for c in range(m):
                if c != state[axis] and valid(nd_sbp, axis, cands[c]):
                    moves.append((j, j + (c - state[axis]) * m ** (pndim - 1 - axis), axis, c))
    table = np.array(moves, dtype=np.int64).reshape(-1, 4)
    return (np.array(states, dtype=np.int64).reshape(len(states), pndim),
            *(table[:, k] for k in range(4)))


def state_bytes(shape: tuple, pshape: tuple, states: np.ndarray, itemsize: int) -> np.ndarray:
    """``cost.max_local_bytes`` of each state's layout: per dim, the largest part of
    nested balanced splits is ceil(length / the product of their group sizes)."""
    numel = np.ones(len(states), dtype=np.int64)
    groups = np.array(pshape, dtype=np.int64)
    for d, length in enumerate(shape):
        factor = np.where(states == 3 + d, groups, 1).prod(axis=1)
        numel *= -(-length // factor)
    return numel * itemsize


@lru_cache(maxsize=4096)
def _served(a, b) -> tuple:
    """The registered kinds that change an axis from ``a`` to ``b`` (all priced by
    bytes), in registration order."""
    return tuple(kind for kind in AXIS_STEPS if kind.serves(a, b))


@lru_cache(maxsize=4096)
def _served_change(ndim: int, change: int) -> tuple:
    """``_served`` of a change numbered (old code) * codes + (new code)."""
    cands = candidates(ndim, (Partial("max"),))
    return _served(cands[change // len(cands)], cands[change % len(cands)])


_prices: dict = {}   # constants -> {(kinds, group size, bytes in, bytes out): the cheapest}


def _price(known: dict, kinds: tuple, n: int, k, b_in: int, b_out: int) -> float:
    key = (kinds, n, b_in, b_out)
    found = known.get(key)
    if found is None:
        found = float("inf")   # the first cheapest, as ``axis_step`` takes it
        for kind in kinds:
            cost = kind.cost_for(n, k, b_in, b_out)
            if cost < found:
                found = cost
        known[key] = found
    return found


def move_costs(shape: tuple, placement, itemsize: int) -> np.ndarray:
    """Each of ``skeleton``'s moves' cost on this shape (``edge_of``'s), inf where no
    kind serves it."""
    states, src, dst, axis, new = skeleton(len(shape), placement.ndim)
    cands = candidates(len(shape), (Partial("max"),))
    if not all(priced_by_bytes(kind) for kind in AXIS_STEPS):   # a kind of its own
        out = []
        for j, a, c in zip(src.tolist(), axis.tolist(), new.tolist()):
            edge = edge_of(shape, placement, tuple(cands[x] for x in states[j]), a,
                           cands[c], itemsize)
            out.append(float("inf") if edge is None else edge[2])
        return np.array(out, dtype=np.float64)
    size = state_bytes(shape, placement.shape, states, itemsize)
    sizes, number = np.unique(size, return_inverse=True)
    m, p = len(cands), placement.ndim   # a move as one integer: change, axis, bytes
    code = ((states[src, axis] * m + new) * p + axis) * len(sizes) + number[src]
    code = code * len(sizes) + number[dst]
    unique, inverse = np.unique(code, return_inverse=True)
    k, pshape, priced, sizes = costs_for(placement.type), placement.shape, [], sizes.tolist()
    known = _prices.setdefault(k, {})
    for c in unique.tolist():
        c, b_out = divmod(c, len(sizes))
        c, b_in = divmod(c, len(sizes))
        pair, a = divmod(c, p)
        priced.append(_price(known, _served_change(len(shape), pair), pshape[a], k,
                             sizes[b_in], sizes[b_out]))
    return np.array(priced, dtype=np.float64)[inverse.reshape(-1)]


def _shortest(n: int, src: np.ndarray, dst: np.ndarray, cost: np.ndarray,
              costs: "np.ndarray | None" = None) -> np.ndarray:
    """[from][to] the cheapest route's cost over the moves (inf where none): rounds
    that extend every route by one move, over each state's moves into it, from
    ``costs`` (routes known already, each summed from its source on) or from none.
    Whatever it starts from, a round keeps each entry the sum of one route and the
    rounds end at the least of them."""
    keep = np.isfinite(cost)
    src, dst, cost = src[keep], dst[keep], cost[keep]
    order = np.argsort(dst, kind="stable")
    src, dst, cost = src[order], dst[order], cost[order]
    count = np.bincount(dst, minlength=n)
    width = max(int(count.max(initial=0)), 1)
    slot = np.arange(len(dst)) - np.repeat(np.cumsum(count) - count, count)
    before = np.zeros((n, width), dtype=np.int64)
    step = np.full((n, width), np.inf)
    before[dst, slot], step[dst, slot] = src, cost
    if costs is None:
        costs = np.full((n, n), np.inf)
        np.fill_diagonal(costs, 0.0)
    rows = np.arange(n)   # a row that did not change in a round does not change again
    chunk = max(1, (1 << 22) // (n * width))
    while len(rows):
        changed = []
        for begin in range(0, len(rows), chunk):
            some = rows[begin:begin + chunk]
            now = costs[some]
            longer = np.minimum(now, (now[:, before] + step).min(axis=2))
            moved = (longer != now).any(axis=1)
            costs[some[moved]] = longer[moved]
            changed.append(some[moved])
        rows = np.concatenate(changed)
    return costs


@lru_cache(maxsize=256)
def all_pairs(shape: tuple, placement, itemsize: int) -> tuple:
    """([from][to] over the universe's states: the cheapest route's cost searched
    without partial_max (inf where either end holds one), the same with it). Equal to
    a search's costs but where two routes cost within 1e-15 of each other (its tie
    margin)."""
    states, src, dst, _, _ = skeleton(len(shape), placement.ndim)
    cost = move_costs(shape, placement, itemsize)
    n = len(states)
    plain = np.flatnonzero(~(states == 2).any(axis=1))
    number = np.full(n, -1)
    number[plain] = np.arange(len(plain))
    inside = (number[src] >= 0) & (number[dst] >= 0)
    without = np.full((n, n), np.inf)
    without[np.ix_(plain, plain)] = _shortest(len(plain), number[src[inside]],
                                              number[dst[inside]], cost[inside])
    start = without.copy()   # the routes without partial_max are routes with it too
    np.fill_diagonal(start, 0.0)
    return without, _shortest(n, src, dst, cost, start)


# --- every layout of a shape and placement priced against every other at once ----------
# What ``plan.route_cost`` reads for step planning, per universe, as arrays: every route
# on one placement (``all_pairs``: without partial_max unless an end holds one, as
# ``plan._boxing`` searches), every general route from every reduced source
# (``transfer_price.transfer_table``), and the cheaper of the two, which is what
# ``plan._general``'s pruning returns (its floors are lower bounds of the transfers).
# Shapes that are the same up to the order of their dims share one table: a dim's
# place changes no cost.

_CODES = {broadcast: 0, Partial("sum"): 1, Partial("max"): 2}
_LARGEST = 512   # states of a universe priced as tables; larger ones pair by pair


@lru_cache(maxsize=1024)
def _sorted_dims(shape: tuple) -> tuple:
    """(the shape with its dims longest first, each dim's place in it)."""
    order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    place = [0] * len(shape)
    for k, d in enumerate(order):
        place[d] = k
    return tuple(shape[d] for d in order), tuple(place)


@lru_cache(maxsize=65536)
def state_of(shape: tuple, pndim: int, sbp: tuple):
    """(the universe's shape (``_sorted_dims``), the number of the state of ``sbp``
    there), or None: an sbp no state has, or a universe too large for a table."""
    shape, place = _sorted_dims(shape)
    m, number = 3 + len(shape), 0
    for s in sbp:
        code = 3 + place[s.dim] if type(s) is Split else _CODES.get(s)
        if code is None:
            return None
        number = number * m + code
    if m ** pndim > _LARGEST:
        return None
    return shape, number


@lru_cache(maxsize=256)
def route_table(shape: tuple, placement, itemsize: int) -> np.ndarray:
    """[source][target]: ``route_cost`` between every two states of the universe (NaN
    where no route is found)."""
    states = skeleton(len(shape), placement.ndim)[0]
    plain, with_max = all_pairs(shape, placement, itemsize)
    holds = (states == 2).any(axis=1)
    partial = (states == 1) | (states == 2)
    best = np.where(holds[:, None] | holds[None, :], with_max, plain)
    mids = np.flatnonzero(~partial.any(axis=1))
    moved = transfer_table(shape, placement, itemsize, states[mids], states)
    # the general routes: reduce to a mid (searched as ``_general`` searches), move
    pre = np.where(holds[:, None], with_max[:, mids], plain[:, mids])
    reduces = ((states[:, None, :] == states[None, mids, :]) | partial[:, None, :]).all(axis=2)
    pre[~reduces] = np.inf
    for j in range(len(mids)):
        rows = np.flatnonzero(np.isfinite(pre[:, j]))
        best[rows] = np.minimum(best[rows], pre[rows, j, None] + moved[j])
    ones = [a for a, n in enumerate(placement.shape) if n == 1]
    if ones:   # layouts that differ on axes of one rank hold the same parts
        others = [a for a in range(placement.ndim) if a not in ones]
        same = (states[:, None, others] == states[None, :, others]).all(axis=2)
        best[same] = 0.0
    best[best == np.inf] = np.nan   # no route: priced pair by pair, as a search would
    return best


def clear_caches() -> None:
    """Forget the searches, edges and tables (a new step kind was registered)."""
    for cached in (search_from, graph_of, holds_max, edge_of, _served, _served_change,
                   all_pairs, state_of, route_table):
        cached.cache_clear()
    _prices.clear()
