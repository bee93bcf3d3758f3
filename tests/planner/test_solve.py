"""The whole-step solver (planner/solve.py) on small problems with known optima, and
against brute force on random ones (no processes)."""
import itertools
import random

import pytest

from globaltensor.planner.solve import Problem, forward_dp, fuse, improve, propagate, solve, tree_dp


def brute_force(problem: Problem) -> float:
    return min(problem.total(list(c))
               for c in itertools.product(*(range(len(u)) for u in problem.unary)))


def test_chain_needs_two_nodes_to_move_together():
    # a -> b: each option 1 costs 1 alone but saves 10 on the edge; per-node moves
    # from (0, 0) cannot find (1, 1), dynamic programming does
    p = Problem([[0.0, 1.0], [0.0, 1.0]], [(0, 1, [[10.0, 10.0], [10.0, 0.0]])])
    assert improve(p, [0, 0]) == [0, 0]
    assert forward_dp(p) == [1, 1]
    assert solve(p, [0, 0]) == [1, 1] and p.total([1, 1]) == 2.0


def test_fan_out_diamond_is_not_double_counted():
    # 0 feeds 1 and 2, both feed 3: the residual-stream shape
    edge = [[0.0, 5.0], [5.0, 0.0]]
    p = Problem([[0.0, 3.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]],
                [(0, 1, edge), (0, 2, edge), (1, 3, edge), (2, 3, edge)])
    assert p.total(solve(p, [0, 0, 0, 0])) == brute_force(p) == 2.0


def test_propagated_move_crosses_a_chain_of_views():
    # a long chain whose links must all switch to reach the cheap end
    n, edge = 4, [[0.0, 6.0], [6.0, 0.0]]   # the cheap end within _near_costs reach
    unary = [[0.0, 0.1] for _ in range(n - 1)] + [[5.0, 0.0]]
    p = Problem(unary, [(v, v + 1, edge) for v in range(n - 1)])
    start = [0] * n
    assert improve(p, list(start)) == start
    assert p.total(propagate(p, list(start))) < p.total(start)


def test_propagated_move_changes_two_branches_that_meet():
    # a and b both feed c (a tied weight's two gradients summed): c's cheap option
    # needs both producers changed, which no single move and no move following
    # consumers does; following producers does
    edge = [[0.0, 6.0], [6.0, 0.0]]
    p = Problem([[0.0, 1.0], [0.0, 1.0], [5.0, 0.0]], [(0, 2, edge), (1, 2, edge)])
    start = [0, 0, 0]
    assert improve(p, list(start)) == start
    assert propagate(p, list(start)) == [1, 1, 1] and p.total([1, 1, 1]) == 2.0


def _tied_head(n: int = 6) -> Problem:
    """A held node 0 (it feeds two calls: node 1 and the last) starts a chain 1..n whose
    end is a gradient's sink (a tied weight's). Option 0: replicated (compute 0.4,
    free sink); option 1: split (compute 0.2); going from split to replicated costs 3
    (a gather), at a link or at the sink."""
    gather = [[0.0, 0.0], [3.0, 0.0]]
    unary = [[0.0]] + [[0.4, 0.2] for _ in range(n - 1)] + [[0.4, 3.2], [0.0]]
    edges = [(0, 1, [[0.0, 0.0]]), (0, n + 1, [[0.0]])]
    edges += [(v, v + 1, gather) for v in range(1, n)]
    return Problem(unary, edges)


def test_tree_dp_flips_a_chain_between_held_calls():
    # all split: every move of one node only shifts the gather (a tie); the chain is a
    # tree below the held node, solved exactly
    p = _tied_head()
    split = [0] + [1] * 6 + [0]
    assert improve(p, list(split)) == split
    assert tree_dp(p, split) == [0] * 8
    assert p.total([0] * 8) == brute_force(p) < p.total(split)
    assert solve(p, split) == [0] * 8


def test_tree_dp_never_worse_than_its_start_on_random_graphs():
    rng = random.Random(3)
    for trial in range(60):
        n = rng.randint(2, 7)
        unary = [[rng.random() for _ in range(rng.randint(1, 3))] for _ in range(n)]
        edges = [(u, v, [[rng.random() * 2 for _ in unary[v]] for _ in unary[u]])
                 for v in range(1, n) for u in rng.sample(range(v), rng.randint(1, min(2, v)))]
        p = Problem(unary, edges)
        start = [rng.randrange(len(u)) for u in unary]
        assert p.total(tree_dp(p, start)) <= p.total(start) + 1e-12, trial


def test_fuse_takes_each_cheaper_region_of_the_other_solution():
    # two independent chains: a is better on the first, b on the second; the fusion
    # has both, which neither solution nor one node's move has
    edge = [[0.0, 5.0], [5.0, 0.0]]
    p = Problem([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]],
                [(0, 1, edge), (2, 3, edge)])
    a, b = [0, 0, 0, 0], [1, 1, 1, 1]
    assert p.total(a) == p.total(b) == 2.0
    assert fuse(p, a, b) == [0, 0, 1, 1] and p.total([0, 0, 1, 1]) == 0.0
    assert fuse(p, [0, 0, 1, 1], [1, 1, 0, 0]) == [0, 0, 1, 1]   # nothing better to take


def test_never_worse_than_the_start_and_optimal_on_random_trees():
    rng = random.Random(0)
    for trial in range(40):
        n = rng.randint(2, 7)
        unary = [[rng.random() for _ in range(rng.randint(1, 3))] for _ in range(n)]
        edges = []
        for v in range(1, n):   # a tree: each node has one consumer at most
            u = rng.randrange(v)
            if any(e[0] == u for e in edges):
                continue
            edges.append((u, v, [[rng.random() * 3 for _ in unary[v]] for _ in unary[u]]))
        p = Problem(unary, edges)
        start = [rng.randrange(len(u)) for u in unary]
        found = solve(p, start)
        assert p.total(found) <= p.total(start) + 1e-12
        assert abs(p.total(forward_dp(p)) - brute_force(p)) < 1e-9, trial


def test_random_graphs_close_to_brute_force():
    rng = random.Random(1)
    worse = 0
    for _ in range(40):
        n = rng.randint(3, 7)
        unary = [[rng.random() for _ in range(rng.randint(1, 3))] for _ in range(n)]
        edges = [(u, v, [[rng.random() * 3 for _ in unary[v]] for _ in unary[u]])
                 for v in range(n) for u in range(v) if rng.random() < 0.4]
        p = Problem(unary, edges)
        found = p.total(solve(p, [0] * n))
        worse += found > brute_force(p) + 1e-9
    assert worse <= 4


def test_views_written_in_place_are_found_through_view_chains():
    # x = mm(...); v = x.view(...); s = v.select(...); s.copy_(...) writes through both
    # views; w = x.view(...) is only read: the plan may box at w, not at v or s
    from types import SimpleNamespace as NS

    import torch

    from globaltensor.planner.problem import _written_views
    aten = torch.ops.aten
    call = lambda func, producers, inplace=False: NS(
        func=func, producers=producers, greedy=NS(inplace=inplace))
    record = [call(aten.mm.default, [None, None]),
              call(aten.view.default, [(0, 0)]),
              call(aten.select.int, [(1, 0)]),
              call(aten.copy_.default, [(2, 0), None], inplace=True),
              call(aten.view.default, [(0, 0)])]
    assert _written_views(record) == {1, 2}


def test_planning_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    # full collections of a large heap doubled a 12-layer GPT's planning time
    import gc

    import pytest

    from globaltensor.planner import problem as step_plan
    seen = []

    def plan(record, sinks, pin_grads, reuse):
        seen.append(gc.isenabled())
        if record == "fail":
            raise ValueError("no plan")
        return "plan"
    monkeypatch.setattr(step_plan, "_plan", plan)
    was = gc.isenabled()
    try:
        gc.enable()
        assert step_plan.plan_step([]) == "plan" and gc.isenabled()
        with pytest.raises(ValueError):
            step_plan.plan_step("fail")
        assert gc.isenabled()
        gc.disable()     # a program that runs without the collector keeps it off
        step_plan.plan_step([])
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False, False]


def _tied_problem(rng: random.Random) -> tuple:
    """A random step-shaped problem whose costs tie often (a few small integers, or a
    few fixed floats, 1e9 among them as infeasible options are), some edges sharing
    one matrix (a call taking one tensor twice), chains of one-consumer calls; and a
    start."""
    n = rng.randint(2, 40)
    sizes = [rng.choice([1, 1, 2, 3, 5, 8]) for _ in range(n)]
    if rng.random() < 0.5:
        value = lambda: float(rng.randint(0, 3))   # noqa: E731
    else:
        value = lambda: rng.choice([0.0, 0.1, 0.2, 0.30000000000000004, 1e-9, 1e9])  # noqa: E731
    edges = []
    for v in range(1, n):
        for u in rng.sample(range(v), min(v, rng.choice([0, 1, 1, 1, 2, 3]))):
            matrix = [[value() for _ in range(sizes[v])] for _ in range(sizes[u])]
            edges.append((u, v, matrix))
            if rng.random() < 0.1:
                edges.append((u, v, matrix))
    p = Problem([[value() for _ in range(s)] for s in sizes], edges)
    return p, [rng.randrange(s) for s in sizes]


def _layered_problem(rng: random.Random, layers: int) -> tuple:
    """``_tied_problem``'s graph as one layer, repeated: each layer's nodes cost the
    same and share its matrices, and a layer's first node takes the last one's output
    (a model's blocks); and a start."""
    block, start = _tied_problem(rng)
    n, unary, edges = len(block.unary), [], []
    between = [[float((a + b) % 3) for b in range(len(block.unary[0]))]
               for a in range(len(block.unary[-1]))]
    for layer in range(layers):
        unary += [list(u) for u in block.unary]
        edges += [(u + layer * n, v + layer * n, cost) for u, v, cost in block.edges]
        if layer:
            edges.append((layer * n - 1, layer * n, between))
    return Problem(unary, edges), start * layers


@pytest.mark.parametrize("short", [None, 0], ids=["lists", "arrays"])
def test_fast_solver_chooses_as_the_plain_one(short, monkeypatch):
    # planner/solve.py keeps what a node picks for the options it sees, walks chains
    # of one-consumer calls as picks, sums options as arrays (nodes of many options)
    # and in C: every choice equals that of the plain loops it replaced
    # (solve_reference.py), ties included (equal sums in the same order)
    import solve_reference as plain

    from globaltensor.planner import solve as fast
    from globaltensor.planner import walks
    if short is not None:   # every node's scores as arrays
        monkeypatch.setattr(walks, "SHORT", short)
    rng = random.Random(5)
    for trial in range(400 if short is None else 200):
        p, start = _tied_problem(rng) if trial % 4 else _layered_problem(rng, 2)
        if trial % 2:   # a problem sharing another's edges and arrays
            p = Problem([list(u) for u in p.unary], p.edges).with_unary(
                [[c + 1.0 * (o % 2) for o, c in enumerate(u)] for u in p.unary])
        assert fast.forward_dp(p) == plain.forward_dp(p), trial
        assert fast.tree_dp(p, start) == plain.tree_dp(p, start), trial
        assert fast.improve(p, list(start)) == plain.improve(p, list(start)), trial
        for window, sweeps in ((24, 2), (3, 1)):
            assert fast.propagate(p, list(start), window, sweeps) == \
                plain.propagate(p, list(start), window, sweeps), trial
        seeds = (plain.forward_dp(p),)
        assert fast.solve(p, start, seeds) == plain.solve(p, start, seeds), trial
        for v in range(len(start)):
            for o in range(len(p.unary[v])):
                for way in ("consumers", "neighbours", "producers"):
                    assert fast._follow(p, list(start), v, o, 5, way) == \
                        plain._follow(p, list(start), v, o, 5, way), (trial, v, o, way)


def test_equal_layers_share_what_their_nodes_pick(monkeypatch):
    # a node's pick is a function of its costs, its matrices and its neighbours'
    # options: the nodes of repeated layers ask it once for all layers, and choose as
    # they would each asking for itself
    from globaltensor.planner import solve as fast
    from globaltensor.planner import walks
    rng = random.Random(11)
    calls = []
    counted = walks.pick
    monkeypatch.setattr(walks, "pick", lambda *a: calls.append(1) or counted(*a))
    shared = alone = 0
    for _ in range(30):
        p, start = _layered_problem(rng, 4)
        n = len(p.unary) // 4
        assert p.kinds[n:2 * n] == p.kinds[2 * n:3 * n]   # inner layers: the same numbers
        calls.clear()
        chosen = fast.propagate(p, list(start))
        shared += len(calls)
        monkeypatch.setattr(Problem, "_kinds", lambda self: list(range(len(self.unary))))
        q = Problem(p.unary, p.edges)   # each node a kind of its own
        calls.clear()
        assert fast.propagate(q, list(start)) == chosen
        alone += len(calls)
        monkeypatch.undo()
        monkeypatch.setattr(walks, "pick", lambda *a: calls.append(1) or counted(*a))
    assert shared < 0.6 * alone, (shared, alone)
