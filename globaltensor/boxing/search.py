"""The search behind same-placement boxing: nd-sbp states of one shape and placement,
the per-axis steps between them (one registered step each, ``steps/``), and Dijkstra
over them from one source, kept and resumed for the source's next target.

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

from ..layout import Layout
from ..sbp import Partial, SbpParallel, Split, broadcast
from .steps import AXIS_STEPS


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
        self.ids: dict = {}      # state -> its number (``_costs_to_all``'s states)
        self.states: list = []   # number -> state
        self.links: list = []    # number -> [(next state's number, step cost)], or None
        self.layouts: dict = {}  # id of a universe's layouts -> their states' numbers
        for state in itertools.product(range(self.moves), repeat=placement.ndim):
            self.number(state)   # the candidate states first (``plan._all_pairs``)

    def number(self, state: tuple) -> int:
        k = self.ids.get(state)
        if k is None:
            with self.lock:
                k = self.ids.setdefault(state, len(self.states))
                if k == len(self.states):
                    self.states.append(state)
                    self.links.append(None)
        return k

    def linked(self, k: int) -> list:
        """``out`` of state number k as [(next state's number, step cost)]."""
        found = self.links[k]
        if found is None:
            found = self.links[k] = [(self.number(nxt), cost)
                                     for nxt, _, cost in self.out(self.states[k])]
        return found

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
