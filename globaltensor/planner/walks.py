"""What the solver's moves read and walk (``solve.py``): a node's scores per option
given its neighbours' options (summed in one order, so equal options tie exactly),
and the walk of ``solve.propagate``'s moves: the nodes after a changed node
re-choosing, kept while the choice stays (``Trails``). Pure: no tensors, no processes.
"""
from __future__ import annotations

from heapq import heapify, heappop, heappush
from operator import add

# Options above which a node's scores are summed as arrays (fewer: as lists, which add
# a few numbers faster); both sum in the same order, so the floats are equal.
SHORT = 24


def argmin(xs) -> int:
    """The first index of the least element (of a list or an array)."""
    return xs.index(min(xs)) if isinstance(xs, list) else int(xs.argmin())


def scores(problem, v: int, choice, consumers: bool = True):
    """Node v's cost in each of its options, its neighbours as ``choice`` has them
    (its producers only, unless ``consumers``); the sums in the order unary, edges
    in, edges out, so that equal options tie exactly. A list, or an array for a node
    of more than ``SHORT`` options. Not to be changed in place (it may be ``unary[v]``
    itself)."""
    edges = problem.edges
    if len(problem.unary[v]) > SHORT:
        out = problem.unary_array(v)
        for k in problem.into[v]:
            out = out + problem.array(k)[choice[edges[k][0]]]
    else:
        out = problem.unary[v]
        for k in problem.into[v]:
            u, _, cost = edges[k]
            out = list(map(add, out, cost[choice[u]]))
    return add_consumers(problem, v, choice, out) if consumers else out


def add_consumers(problem, v: int, choice, sums):
    """``sums`` (from ``scores``) plus node v's edges to its consumers as ``choice``
    has them (a new list or array where there are any)."""
    edges = problem.edges
    if isinstance(sums, list):
        for k in problem.out_of[v]:
            sums = list(map(add, sums, problem.columns(k)[choice[edges[k][1]]]))
    else:
        for k in problem.out_of[v]:
            sums = sums + problem.by_consumer(k)[choice[edges[k][1]]]
    return sums


# Entries of propagate's memo of picks before it starts again (about 200 bytes each):
# a 12-layer GPT on 2 x 2 looks up two million, of 200,000 distinct.
MAX_PICKS = 200_000


class Trails:
    """What the nodes after a changed node re-choose (``solve._follow``), kept while the
    choice stays. A node that feeds one call (or, walking to producers, is fed by
    one) hands its change to that call alone, and the calls after that one read no
    node before it: so a try's trail is a chain of links (what that one call picks
    when the node takes an option: a ``pick`` with the node at that option, kept by
    what the call sees, as a walk keeps its picks), up to a node with several such
    neighbours, from which a ``walk`` is kept per node and option (the longest a try
    may need: a shorter one is its beginning)."""

    def __init__(self, problem, window: int):
        self.problem, self.window = problem, window
        # what a node picks (``pick``), by its kind (``Problem.kinds``: equal nodes of
        # repeated layers share one), its option and the options it sees
        self.picks: dict = {}
        self.walks: dict = {}   # (node, option, alone, up) -> ``walk``'s steps

    def moved(self) -> None:
        """The choice changed: forget what depended on it (picks are kept by every
        option they read)."""
        self.walks.clear()
        if len(self.picks) > MAX_PICKS:
            self.picks.clear()

    def trail(self, choice: list, v: int, o: int, alone: int, up: bool) -> list:
        """[(how much the total falls, node, its option)] after v takes option o, in
        the order ``walk`` changes them (``choice`` is left as it is)."""
        problem = self.problem
        next_to = problem.before if up else problem.after
        seeing, kinds, picks, window = problem.seeing, problem.kinds, self.picks, self.window
        steps, z, p, count = [], v, o, 1
        while count < window:
            beside = next_to[z]
            if len(beside) != 1:
                if beside:
                    steps += self._walk(choice, z, p, alone, up)[:window - count]
                return steps
            x = beside[0]
            saved, choice[z] = choice[z], p
            now = choice[x]
            key = (kinds[x], now, seeing[x](choice))
            found = picks.get(key)
            if found is None:
                found = picks[key] = pick(problem, choice, x)
            choice[z] = saved
            q = found[alone]
            if q == now:
                return steps
            steps.append((found[alone + 1], x, q))
            z, p, count = x, q, count + 1
        return steps

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
    todo = [-x for x in next_to[v]] if up else list(next_to[v])
    heapify(todo)
    seen = set(next_to[v])
    seeing, kinds, steps, old, count = problem.seeing, problem.kinds, [], [], 1
    known = picks.get
    while todo and count < window:
        w = -heappop(todo) if up else heappop(todo)
        now = choice[w]
        key = (kinds[w], now, seeing[w](choice))
        found = known(key)
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
                    heappush(todo, -x if up else x)
    for w, now in old:
        choice[w] = now
    return steps


def pick(problem, choice: list, w: int) -> tuple:
    """(the option node w takes given its producers, how much its scores with all
    neighbours fall from its option to that one; the same for the option it takes
    given all its neighbours): what ``walk`` looks up by w, its option and its
    neighbours' (``Problem.seeing``)."""
    now = choice[w]
    if len(problem.unary[w]) > SHORT:   # ``scores`` as arrays, inline: the hot path
        mine, ins, outs = problem.sums[w] or problem.summed(w)
        for u, cost in ins:
            mine = mine + cost[choice[u]]
        full = mine
        for x, cost in outs:
            full = full + cost[choice[x]]
        first, best = int(mine.argmin()), int(full.argmin())
        return first, float(full[now] - full[first]), best, float(full[now] - full[best])
    mine = scores(problem, w, choice, consumers=False)
    full = add_consumers(problem, w, choice, mine)
    first, best = argmin(mine), argmin(full)
    return first, full[now] - full[first], best, full[now] - full[best]
