"""What the solver's moves read and walk (``solve.py``): a node's scores per option
given its neighbours' options (summed in one order, so equal options tie exactly),
and the walk of ``solve.propagate``'s moves: the nodes after a changed node
re-choosing, kept while the choice stays (``Trails``). Pure: no tensors, no processes.
"""
from __future__ import annotations

import heapq
from operator import add

import numpy as np


def argmin(xs) -> int:
    """The first index of the least element (what ``min(range(len(xs)), key=xs.
    __getitem__)`` gives, in C)."""
    return xs.index(min(xs))


def scores(problem, v: int, choice, consumers: bool = True) -> list:
    """Node v's cost in each of its options, its neighbours as ``choice`` has them
    (its producers only, unless ``consumers``); the sums in the order unary, edges
    in, edges out, so that equal options tie exactly. Not to be changed in place (it
    may be ``unary[v]`` itself)."""
    out = problem.unary[v]
    edges = problem.edges
    for k in problem.into[v]:
        u, _, cost = edges[k]
        out = list(map(add, out, cost[choice[u]]))
    return add_consumers(problem, v, choice, out) if consumers else out


def add_consumers(problem, v: int, choice, sums: list) -> list:
    """``sums`` plus node v's edges to its consumers as ``choice`` has them (a new
    list where there are any)."""
    edges = problem.edges
    for k in problem.out_of[v]:
        sums = list(map(add, sums, problem.columns(k)[choice[edges[k][1]]]))
    return sums


# Entries of propagate's memo of picks before it starts again (about 200 bytes each):
# a 12-layer GPT on 2 x 2 looks up two million, of 200,000 distinct.
MAX_PICKS = 200_000


class Trails:
    """What the nodes after a changed node re-choose (``solve._follow``), kept while the
    choice stays. A node that feeds one call (or, walking to producers, is fed by
    one) hands its change to that call alone, and the calls after that one read no
    node before it: so a try's trail is a chain of links (what that one call picks
    when the node takes an option), kept per node and option, up to a node with
    several such neighbours, from which a ``walk`` is kept per node and option (the
    longest a try may need: a shorter one is its beginning)."""

    def __init__(self, problem, window: int):
        self.problem, self.window = problem, window
        self.picks: dict = {}   # what a node picks, by the options it sees (``pick``)
        self.links: dict = {}   # (node, up) -> ``_links``
        self.walks: dict = {}   # (node, option, alone, up) -> ``walk``'s steps

    def moved(self) -> None:
        """The choice changed: forget what depended on it."""
        self.links.clear()
        self.walks.clear()
        if len(self.picks) > MAX_PICKS:
            self.picks.clear()

    def trail(self, choice: list, v: int, o: int, alone: int, up: bool) -> list:
        """[(how much the total falls, node, its option)] after v takes option o, in
        the order ``walk`` changes them (``choice`` is left as it is)."""
        next_to = self.problem.before if up else self.problem.after
        steps, z, p, count = [], v, o, 1
        while count < self.window:
            beside = next_to[z]
            if len(beside) != 1:
                if beside:
                    steps += self._walk(choice, z, p, alone, up)[:self.window - count]
                return steps
            links = self.links.get((z, up))
            if links is None:
                links = self.links[z, up] = self._links(choice, z, beside[0])
            link = links[alone >> 1][p]
            if link is None:
                return steps
            steps.append(link)
            z, p, count = link[1], link[2], count + 1
        return steps

    def _links(self, choice: list, z: int, x: int) -> tuple:
        """Per way of picking (given producers, given all neighbours), per option p
        of z: (how much the total falls, x, its pick) when z takes p and x, its one
        neighbour on the side followed, re-chooses, or None when x keeps its option.
        Every p at once: x's scores as rows, summed in ``scores``' order (equal
        floats), the first least of each row as ``argmin`` takes it."""
        problem = self.problem
        edges, now = problem.edges, choice[x]
        sums = np.asarray(problem.unary[x], dtype=np.float64)
        for k in problem.into[x]:
            u = edges[k][0]
            sums = sums + (problem.array(k) if u == z else
                           np.asarray(edges[k][2][choice[u]], dtype=np.float64))
        mine = sums
        for k in problem.out_of[x]:
            w = edges[k][1]
            sums = sums + (problem.array(k).T if w == z else problem.array(k)[:, choice[w]])
        rows = len(problem.unary[z])
        mine = np.broadcast_to(mine, (rows, mine.shape[-1]))
        full = np.broadcast_to(sums, (rows, sums.shape[-1]))
        out = []
        for picked in (mine.argmin(axis=1), full.argmin(axis=1)):
            falls = (full[:, now] - full[np.arange(rows), picked]).tolist()
            out.append([None if q == now else (fall, x, q)
                        for fall, q in zip(falls, picked.tolist())])
        return tuple(out)

    def _walk(self, choice: list, z: int, p: int, alone: int, up: bool) -> list:
        key = (z, p, alone, up)
        steps = self.walks.get(key)
        if steps is None:
            saved, choice[z] = choice[z], p
            steps = self.walks[key] = walk(self.problem, choice, z, self.window, alone, up,
                                           self.picks)
            choice[z] = saved
        return steps


def walk(problem, choice: list, v: int, window: int, alone: int, up: bool,
         picks: dict) -> list:
    """[(how much the total falls, node, its option)] as the nodes reached from v,
    which has changed, re-choose in call order (reverse for producers) while fewer
    than ``window`` have changed (v among them); ``alone``: where ``pick``'s
    answer is (0: given its producers, 2: given all its neighbours). A node's
    neighbours on the side followed come after it, so taking the least of a heap is
    taking the first of a sorted list. ``choice`` is restored."""
    next_to = problem.before if up else problem.after
    sign = -1 if up else 1
    todo = [sign * x for x in next_to[v]]
    heapq.heapify(todo)
    seen = set(next_to[v])
    seeing, steps, old, count = problem.seeing, [], [], 1
    while todo and count < window:
        w = sign * heapq.heappop(todo)
        now = choice[w]
        key = (w, now, seeing[w](choice))
        found = picks.get(key)
        if found is None:
            found = picks[key] = pick(problem, choice, w)
        best = found[alone]
        if best != now:
            steps.append((found[alone + 1], w, best))
            old.append((w, now))
            choice[w] = best
            count += 1
            for x in next_to[w]:
                if x not in seen:
                    seen.add(x)
                    heapq.heappush(todo, sign * x)
    for w, now in old:
        choice[w] = now
    return steps


def pick(problem, choice: list, w: int) -> tuple:
    """(the option node w takes given its producers, how much its scores with all
    neighbours fall from its option to that one; the same for the option it takes
    given all its neighbours): what ``walk`` looks up by w, its option and its
    neighbours' (``Problem.seeing``)."""
    now = choice[w]
    mine = scores(problem, w, choice, consumers=False)
    full = add_consumers(problem, w, choice, mine)
    first, best = argmin(mine), argmin(full)
    return first, full[now] - full[first], best, full[now] - full[best]
