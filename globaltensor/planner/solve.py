"""Choosing one signature per call for a whole step: a min-sum problem over a graph.

Each node (a call) has options, each with a cost of its own (``unary``: boxing its
operands that no recorded call made, its compute); each edge (a tensor one call makes
and a later one uses) prices every pair of options (boxing the producer's output
layout into the consumer's input layout). The total of a choice is what the step's
layouts cost. Pure: no tensors, no processes.

``solve`` runs dynamic programming in call order, exact when every tensor has one
consumer (chains and trees: each message subtracts its minimum, so a producer shared
by several consumers is not counted over and over along diamonds), then improves it
and the per-op choice by moving one node at a time while the total falls (iterated
conditional modes), keeps the cheaper, and improves that by moves of one node with
the consumers that follow it: never worse than per-op choice.

>>> p = Problem([[0.0, 1.0], [0.0, 0.0]], [(0, 1, [[5.0, 0.0], [5.0, 0.0]])])
>>> solve(p, [0, 0])
[0, 1]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from heapq import nsmallest
from operator import itemgetter

import numpy as np

from .walks import Trails
from .walks import argmin as _argmin
from .walks import scores as _scores

MAX_SWEEPS = 20
# Options ``propagate`` tries per node (``_candidates``). A 12-layer GPT on 1x4, 2x2 and
# 2x4 plans to the same total with 4 as with 6, in 0.80x the solver's time; with 3 the
# 2x2 plan costs 0.5 % more.
TRIED = 4


@dataclass
class Problem:
    """``unary[v][o]``: node v in option o; ``edges``: (u, v, cost[ou][ov]) with u < v."""
    unary: list
    edges: list
    into: list = field(init=False)   # per node: indices of edges into it
    out_of: list = field(init=False)  # per node: indices of edges out of it
    _columns: dict = field(init=False, repr=False, compare=False)
    _arrays: dict = field(init=False, repr=False, compare=False)
    _transposed: dict = field(init=False, repr=False, compare=False)
    _by_edge: list = field(init=False, repr=False, compare=False)
    _cols_by_edge: list = field(init=False, repr=False, compare=False)
    _unaries: list = field(init=False, repr=False, compare=False)
    _neighbours: list = field(init=False, repr=False, compare=False)
    sums: list = field(init=False, repr=False, compare=False)
    before: list = field(init=False, repr=False, compare=False)
    after: list = field(init=False, repr=False, compare=False)
    seeing: list = field(init=False, repr=False, compare=False)
    kinds: list = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.into = [[] for _ in self.unary]
        self.out_of = [[] for _ in self.unary]
        for k, (u, v, _) in enumerate(self.edges):
            self.into[v].append(k)
            self.out_of[u].append(k)
        self._columns = {}   # id of an edge's matrix (edges may share one): its columns
        self._arrays = {}    # the same: the matrix as an array
        self._transposed = {}  # the same: its transpose, contiguous (``by_consumer``)
        self._by_edge = [None] * len(self.edges)       # per edge: its matrix's array
        self._cols_by_edge = [None] * len(self.edges)  # per edge: its matrix's columns
        self._unaries = [None] * len(self.unary)       # per node: unary as an array
        self._neighbours = [None] * len(self.unary)    # per node: ``neighbours``
        self.sums = [None] * len(self.unary)           # per node: ``summed``
        # per node: its producers and its consumers, each in call order, and what reads
        # the options of the nodes its scores depend on (``_follow``'s memo key)
        self.before = [sorted({self.edges[k][0] for k in ks}) for ks in self.into]
        self.after = [sorted({self.edges[k][1] for k in ks}) for ks in self.out_of]
        self.seeing = [_reader([self.edges[k][0] for k in self.into[v]]
                               + [self.edges[k][1] for k in self.out_of[v]])
                       for v in range(len(self.unary))]
        self.kinds = self._kinds()

    def _kinds(self) -> list:
        """Per node: a number shared by the nodes whose scores are the same function of
        their neighbours' options (equal costs of their own, the same matrices in the
        same order): the layers of a model repeat, so a move's picks (``walks.pick``)
        made in one layer serve the others."""
        numbers: dict = {}
        edges = self.edges
        return [numbers.setdefault((tuple(unary), tuple(id(edges[k][2]) for k in into),
                                    tuple(id(edges[k][2]) for k in out)), len(numbers))
                for unary, into, out in zip(self.unary, self.into, self.out_of)]

    def with_unary(self, unary: list) -> "Problem":
        """The same edges with other costs of their own: the graph and the edges'
        arrays and columns are shared, not made again."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.unary = unary
        other._unaries = [None] * len(unary)
        other.sums = [None] * len(unary)
        other.kinds = other._kinds()
        return other

    def know(self, cost: list, array: "np.ndarray") -> None:
        """A matrix of the edges (``cost``) is ``array``: no need to make it again."""
        self._arrays[id(cost)] = array

    def array(self, k: int) -> "np.ndarray":
        """Edge k's matrix as an array (edges may share one)."""
        found = self._by_edge[k]
        if found is None:
            cost = self.edges[k][2]
            found = self._arrays.get(id(cost))
            if found is None:
                found = self._arrays[id(cost)] = np.asarray(cost, dtype=np.float64)
            self._by_edge[k] = found
        return found

    def by_consumer(self, k: int) -> "np.ndarray":
        """Edge k's matrix transposed, [consumer option][producer option], contiguous:
        a consumer's option picks a row, which adds faster than a column."""
        cost = self.edges[k][2]
        found = self._transposed.get(id(cost))
        if found is None:
            found = self._transposed[id(cost)] = np.ascontiguousarray(self.array(k).T)
        return found

    def neighbours(self, v: int) -> tuple:
        """([(producer, edge's array)], [(consumer, edge's ``by_consumer`` array)]) of
        node v, in the order of ``into`` and ``out_of``."""
        found = self._neighbours[v]
        if found is None:
            found = self._neighbours[v] = (
                [(self.edges[k][0], self.array(k)) for k in self.into[v]],
                [(self.edges[k][1], self.by_consumer(k)) for k in self.out_of[v]])
        return found

    def summed(self, v: int) -> tuple:
        """(``unary_array(v)``, ``neighbours(v)``...), kept in ``sums[v]``: what
        ``walks.pick`` reads."""
        found = self.sums[v] = (self.unary_array(v), *self.neighbours(v))
        return found

    def unary_array(self, v: int) -> "np.ndarray":
        """Node v's costs of its own as an array."""
        found = self._unaries[v]
        if found is None:
            found = self._unaries[v] = np.asarray(self.unary[v], dtype=np.float64)
        return found

    def columns(self, k: int) -> list:
        """Edge k's matrix by consumer option: ``columns(k)[ov][ou] == cost[ou][ov]``."""
        found = self._cols_by_edge[k]
        if found is None:
            cost = self.edges[k][2]
            found = self._columns.get(id(cost))
            if found is None:
                found = self._columns[id(cost)] = list(zip(*cost))
            self._cols_by_edge[k] = found
        return found

    def total(self, choice: list) -> float:
        """What the step costs with option ``choice[v]`` at every node v."""
        return (sum(self.unary[v][o] for v, o in enumerate(choice))
                + sum(cost[choice[u]][choice[v]] for u, v, cost in self.edges))


def _reader(nodes: list):
    """A function of a choice giving the options of ``nodes`` (a hashable value)."""
    return itemgetter(*nodes) if nodes else (lambda choice: ())


def solve(problem: Problem, start: list, seeds: tuple = ()) -> list:
    """The cheapest choice found: dynamic programming, ``start`` (the per-op choice)
    and ``seeds``, each improved by single moves; the best, improved by propagated
    moves."""
    found = [improve(problem, list(c)) for c in (start, forward_dp(problem), *seeds)]
    best = min(found, key=problem.total)
    for other in found:
        best = fuse(problem, best, other)
    return propagate(problem, refine(problem, best))


def refine(problem: Problem, choice: list) -> list:
    """``choice`` improved by ``tree_dp`` and single moves in turn while the total
    falls."""
    total = problem.total(choice)
    for _ in range(MAX_SWEEPS):
        choice = improve(problem, tree_dp(problem, choice))
        now = problem.total(choice)
        if now >= total - 1e-12:
            break
        total = now
    return choice


def tree_dp(problem: Problem, choice: list) -> list:
    """The best choice with every call whose output has several consumers held where
    ``choice`` has it: the other calls form trees (each feeds at most one), solved
    exactly by dynamic programming. A chain between two held calls flips as a whole
    (a tied weight's gradient computed replicated instead of split and gathered),
    which moves of single calls cannot cross. Never worse than ``choice``."""
    n = len(problem.unary)
    held = [len(problem.out_of[v]) > 1 for v in range(n)]
    best: list = [None] * n
    back: dict = {}   # edge from a free producer: its best option per consumer option
    edges = problem.edges
    for v in range(n):
        if held[v]:
            continue
        table = problem.unary_array(v)
        for k in problem.into[v]:
            u = edges[k][0]
            if held[u]:
                table = table + problem.array(k)[choice[u]]
                continue
            through = best[u][:, None] + problem.array(k)   # [producer][consumer option]
            first = through.argmin(axis=0)                   # the first cheapest
            back[k] = first.tolist()
            table = table + through[first, np.arange(len(first))]
        for k in problem.out_of[v]:
            w = edges[k][1]
            if held[w]:
                table = table + problem.by_consumer(k)[choice[w]]
        best[v] = table
    choice = list(choice)
    for v in range(n - 1, -1, -1):
        if held[v]:
            continue
        k = problem.out_of[v][0] if problem.out_of[v] else None
        if k is None or held[edges[k][1]]:
            choice[v] = int(best[v].argmin())
        else:
            choice[v] = back[k][choice[edges[k][1]]]
    return choice


def fuse(problem: Problem, choice: list, other: list) -> list:
    """``choice`` with every connected region where ``other`` differs from it taken
    from ``other`` when that lowers the total (a fusion move): two solutions, each
    better in a different part of the step (the residual stream in one, a tied
    weight's gradient in the other), combine, which no move of one node or one chain
    reaches."""
    differ = [v for v, (a, b) in enumerate(zip(choice, other)) if a != b]
    region = {v: v for v in differ}

    def root(v):
        while region[v] != v:
            region[v] = region[region[v]]
            v = region[v]
        return v
    for u, v, _ in problem.edges:
        if u in region and v in region:
            region[root(u)] = root(v)
    groups: dict = {}
    for v in differ:
        groups.setdefault(root(v), []).append(v)
    choice = list(choice)
    for nodes in groups.values():
        edges = {k for v in nodes for k in problem.into[v] + problem.out_of[v]}
        before = _region_cost(problem, choice, nodes, edges)
        old = [choice[v] for v in nodes]
        for v in nodes:
            choice[v] = other[v]
        if _region_cost(problem, choice, nodes, edges) >= before - 1e-12:
            for v, o in zip(nodes, old):
                choice[v] = o
    return choice


def _region_cost(problem: Problem, choice: list, nodes: list, edges: set) -> float:
    return (sum(problem.unary[v][choice[v]] for v in nodes)
            + sum(problem.edges[k][2][choice[problem.edges[k][0]]][choice[problem.edges[k][1]]]
                  for k in edges))


def forward_dp(problem: Problem) -> list:
    """Dynamic programming in node order (producers first), then choices from the last
    node back, each node taking its best option given its consumers' choices."""
    best, least = [], []   # per node: its cheapest subtotal per option, and the least
    smallest = np.minimum.reduce   # = ndarray.min, without its Python wrapper
    for v in range(len(problem.unary)):
        table = problem.unary_array(v)
        for k in problem.into[v]:
            u = problem.edges[k][0]
            table = table + (smallest(best[u][:, None] + problem.array(k)) - least[u])
        best.append(table)
        least.append(smallest(table))
    choice: list = [None] * len(best)
    for v in range(len(best) - 1, -1, -1):
        scores = best[v]
        for k in problem.out_of[v]:
            scores = scores + problem.by_consumer(k)[choice[problem.edges[k][1]]]
        choice[v] = int(scores.argmin())
    return choice


def propagate(problem: Problem, choice: list, window: int = 24, sweeps: int = 2) -> list:
    """Moves that change one node and let its neighbours follow: node v takes option
    o, then each consumer reached (in call order, at most ``window`` of them) takes its
    best option (given its producers only, as per-op choice would, or given all its
    neighbours), or each producer reached (in reverse call order) takes its best
    option given all its neighbours; the best of the three is kept when the total
    falls. Single moves cannot cross a chain of views whose links must change together
    (a residual stream going from batch-split to broadcast), nor change two branches
    that meet in one call (a tied weight's two gradients); these can. Moves are tried
    near the edges that cost something (``_near_costs``): elsewhere nothing is boxed."""
    touched = None   # after the first sweep: where the last one moved something
    trails = Trails(problem, window)
    for _ in range(sweeps):
        moved = set()
        for v in _near_costs(problem, choice):
            if touched is not None and v not in touched:
                continue
            here = _scores(problem, v, choice)   # while the choice stays (tries restore it)
            for o in _candidates(here, choice[v]):
                if o == choice[v]:
                    continue
                if here is None:
                    here = _scores(problem, v, choice)
                start, best = float(here[choice[v]] - here[o]), None
                for alone, up in ((0, False), (2, False), (2, True)):   # the three ways
                    gain, steps = start, trails.trail(choice, v, o, alone, up)
                    for fall, _, _ in steps:   # in the order the nodes change: equal sums
                        gain += fall
                    if gain > 1e-12 and (best is None or gain > best[0]):
                        best = (gain, steps)
                if best is not None:
                    choice[v] = o
                    moved.add(v)
                    for _, w, c in best[1]:
                        choice[w] = c
                        moved.add(w)
                    here = None
                    trails.moved()
        if not moved:
            break
        touched = moved | {problem.edges[k][end] for w in moved
                           for end, links in ((0, problem.into), (1, problem.out_of))
                           for k in links[w]}
    return choice


def _candidates(scores, now: int) -> list:
    """The ``TRIED`` options other than ``now`` that cost least where they stand (ties:
    the lower option first), cheapest first: a move's followers recover what its first
    node loses, and on a 2-D placement (up to 109 options a call) the options far above
    the current one are never worth their trails. Best first also moves to the better
    of two improving options first (a 12-layer GPT on 2 x 4 plans 13 % cheaper than
    trying every option in order, in a third of the time). ``scores``: a list or an
    array (``walks.scores``), ordered alike."""
    if isinstance(scores, list):
        order = nsmallest(TRIED + 1, range(len(scores)), key=scores.__getitem__)   # = sorted()[:]
    else:
        order = np.argsort(scores, kind="stable")[:TRIED + 1].tolist()
    return [o for o in order if o != now][:TRIED]


def _follow(problem: Problem, choice: list, v: int, o: int, window: int, way: str):
    """(how much the total falls, {node: option}) when node v takes option o and the
    nodes after it re-choose: its consumers onwards (``way`` "consumers": each given
    its producers; "neighbours": given all its neighbours) or its producers backwards
    ("producers"), at most ``window`` nodes changed (what ``propagate`` tries)."""
    scores = _scores(problem, v, choice)
    gain, changed = float(scores[choice[v]] - scores[o]), {v: o}
    for fall, w, c in Trails(problem, window).trail(
            choice, v, o, 0 if way == "consumers" else 2, way == "producers"):
        gain += fall
        changed[w] = c
    return gain, changed


def _near_costs(problem: Problem, choice: list, up: int = 3) -> list:
    """Nodes at a costly edge or in a costlier option than they have, and up to ``up``
    producers above them, in order."""
    sites = {v for u, v, cost in problem.edges if cost[choice[u]][choice[v]] > 0}
    sites |= {v for v, unary in enumerate(problem.unary) if unary[choice[v]] > min(unary)}
    near, frontier = set(), sites
    for _ in range(up + 1):
        near |= frontier
        frontier = {problem.edges[k][0] for w in frontier for k in problem.into[w]} - near
    return sorted(v for v in near if len(problem.unary[v]) > 1)


def improve(problem: Problem, choice: list) -> list:
    """Move single nodes to their best option given their neighbours' while that
    lowers the total (at most ``MAX_SWEEPS`` sweeps). A node none of whose neighbours
    moved since it was last looked at would stay: it is not looked at again."""
    dirty = [len(unary) > 1 for unary in problem.unary]
    for _ in range(MAX_SWEEPS):
        moved = False
        for v in range(len(dirty)):
            if not dirty[v]:
                continue
            dirty[v] = False
            scores = _scores(problem, v, choice)
            o = _argmin(scores)
            if scores[o] < scores[choice[v]] - 1e-12:
                choice[v] = o
                moved = True
                for w in problem.before[v]:
                    dirty[w] = len(problem.unary[w]) > 1
                for w in problem.after[v]:
                    dirty[w] = len(problem.unary[w]) > 1
        if not moved:
            break
    return choice
