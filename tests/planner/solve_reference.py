"""The whole-step solver as first written (planner/solve.py before its fast paths:
plain loops, no memos, no arrays): the reference the fast one must choose exactly as
(test_solve.py). Same names, same sums in the same order."""
from globaltensor.planner.solve import MAX_SWEEPS, TRIED, Problem, fuse


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
    for v in range(n):
        if held[v]:
            continue
        table = list(problem.unary[v])
        for k in problem.into[v]:
            u, _, cost = problem.edges[k]
            if held[u]:
                row = cost[choice[u]]
                for o in range(len(table)):
                    table[o] += row[o]
                continue
            picks = []
            for o in range(len(table)):
                ou = min(range(len(best[u])), key=lambda a: best[u][a] + cost[a][o])
                table[o] += best[u][ou] + cost[ou][o]
                picks.append(ou)
            back[k] = picks
        for k in problem.out_of[v]:
            _, w, cost = problem.edges[k]
            if held[w]:
                for o in range(len(table)):
                    table[o] += cost[o][choice[w]]
        best[v] = table
    choice = list(choice)
    for v in range(n - 1, -1, -1):
        if held[v]:
            continue
        k = problem.out_of[v][0] if problem.out_of[v] else None
        if k is None or held[problem.edges[k][1]]:
            choice[v] = min(range(len(best[v])), key=best[v].__getitem__)
        else:
            choice[v] = back[k][choice[problem.edges[k][1]]]
    return choice


def forward_dp(problem: Problem) -> list:
    """Dynamic programming in node order (producers first), then choices from the last
    node back, each node taking its best option given its consumers' choices."""
    best = []
    for v, unary in enumerate(problem.unary):
        table = list(unary)
        for k in problem.into[v]:
            u, _, cost = problem.edges[k]
            floor = min(best[u])
            for o in range(len(table)):
                table[o] += min(b + cost[ou][o] for ou, b in enumerate(best[u])) - floor
        best.append(table)
    choice: list = [None] * len(best)
    for v in range(len(best) - 1, -1, -1):
        scores = list(best[v])
        for k in problem.out_of[v]:
            _, w, cost = problem.edges[k]
            for o in range(len(scores)):
                scores[o] += cost[o][choice[w]]
        choice[v] = min(range(len(scores)), key=scores.__getitem__)
    return choice


def _scores(problem: Problem, v: int, choice, consumers: bool = True) -> list:
    """Node v's cost in each of its options, its neighbours as ``choice`` has them
    (its producers only, unless ``consumers``)."""
    scores = list(problem.unary[v])
    for k in problem.into[v]:
        u, _, cost = problem.edges[k]
        row = cost[choice[u]]
        for o in range(len(scores)):
            scores[o] += row[o]
    if consumers:
        _add_consumers(problem, v, choice, scores)
    return scores


def _add_consumers(problem: Problem, v: int, choice, scores: list) -> list:
    for k in problem.out_of[v]:
        _, w, cost = problem.edges[k]
        cw = choice[w]
        for o in range(len(scores)):
            scores[o] += cost[o][cw]
    return scores


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
    for _ in range(sweeps):
        moved = set()
        for v in _near_costs(problem, choice):
            if touched is not None and v not in touched:
                continue
            scores = _scores(problem, v, choice)
            tried = sorted((o for o in range(len(scores)) if o != choice[v]),
                           key=scores.__getitem__)[:TRIED]
            for o in tried:
                if o == choice[v]:
                    continue
                best = None
                for way in ("consumers", "neighbours", "producers"):
                    gain, changed = _follow(problem, choice, v, o, window, way)
                    if gain > 1e-12 and (best is None or gain > best[0]):
                        best = (gain, changed)
                if best is not None:
                    for w, c in best[1].items():
                        choice[w] = c
                    moved |= best[1].keys()
        if not moved:
            break
        touched = moved | {problem.edges[k][end] for w in moved
                           for end, links in ((0, problem.into), (1, problem.out_of))
                           for k in links[w]}
    return choice


def _follow(problem: Problem, choice: list, v: int, o: int, window: int, way: str):
    """(how much the total falls, {node: option}) when node v takes option o and the
    nodes after it re-choose: its consumers onwards (``way`` "consumers": each given
    its producers; "neighbours": given all its neighbours) or its producers backwards
    ("producers"). ``choice`` is changed while trying and restored."""
    old = {v: choice[v]}
    scores = _scores(problem, v, choice)
    gain = scores[choice[v]] - scores[o]
    choice[v] = o
    up = way == "producers"
    end, links = (0, problem.into) if up else (1, problem.out_of)   # the neighbour's end
    todo = sorted({problem.edges[k][end] for k in links[v]}, reverse=up)
    seen = set(todo)
    while todo and len(old) < window:
        w = todo.pop(0)
        mine = _scores(problem, w, choice, consumers=False)
        full = _add_consumers(problem, w, choice, list(mine))
        pick = mine if way == "consumers" else full
        best, now = min(range(len(pick)), key=pick.__getitem__), choice[w]
        if best != now:
            gain += full[now] - full[best]
            old[w], choice[w] = now, best
            for k in links[w]:
                x = problem.edges[k][end]
                if x not in seen:
                    seen.add(x)
                    todo.append(x)
            todo.sort(reverse=up)
    changed = {w: choice[w] for w in old}
    for w, c in old.items():
        choice[w] = c
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
    lowers the total (at most ``MAX_SWEEPS`` sweeps)."""
    for _ in range(MAX_SWEEPS):
        moved = False
        for v, unary in enumerate(problem.unary):
            if len(unary) == 1:
                continue
            scores = list(unary)
            for k in problem.into[v]:
                u, _, cost = problem.edges[k]
                row = cost[choice[u]]
                for o in range(len(scores)):
                    scores[o] += row[o]
            for k in problem.out_of[v]:
                _, w, cost = problem.edges[k]
                for o in range(len(scores)):
                    scores[o] += cost[o][choice[w]]
            o = min(range(len(scores)), key=scores.__getitem__)
            if scores[o] < scores[choice[v]] - 1e-12:
                choice[v] = o
                moved = True
        if not moved:
            break
    return choice
