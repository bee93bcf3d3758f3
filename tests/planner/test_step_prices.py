"""Step planning's prices (planner/problem.py) are made once and shared (a layer's
calls price like the layer before), priced with ``route_cost`` instead of plans: the
problem equals the one priced pair by pair with ``plan_route`` (no processes)."""
import itertools
import random
from types import SimpleNamespace as NS

import pytest
import torch

from globaltensor import sbp as S
from globaltensor.boxing import plan as planning
from globaltensor.layout import Layout
from globaltensor.placement import Placement
from globaltensor.planner.problem import Node, _compute_seconds, _problem

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def _layouts(shape, p):
    sbps = [S.broadcast, S.partial_sum, S.split(0), S.split(1), S.split(2, blocks=2)]
    out = []
    for nd in itertools.product(sbps, repeat=p.ndim):
        try:
            out.append(Layout.make(shape, p, nd))
        except ValueError:
            pass
    return out


def _record(p, rng, layers=3):
    """Calls of ``layers`` equal layers, each an add of the last layer's output and a
    tensor made before the step (a parameter), then an in-place add into it."""
    every = _layouts((4, 6, 8), p)
    sigs = tuple((tuple(rng.sample(every, 2)), (rng.choice(every),)) for _ in range(12))
    start = rng.choice(every)
    record, made = [], None
    for layer in range(layers):
        for func, inplace in ((aten.add.Tensor, False), (aten.add_.Tensor, True)):
            opts = NS(signatures=tuple((t, o) for t, o in sigs), greedy=layer % 3)
            greedy = NS(targets=sigs[0][0], out_layouts=sigs[0][1], inplace=inplace,
                        gidx=(0, 1))
            producers = [made, None]
            inputs = [(start, 4, 1.0), (rng.choice(every), 4, 2.0)]
            record.append(Node(func, None, greedy, opts, producers, inputs, ()))
            made = (len(record) - 1, 0)
    return record


def _plain_price(src, dst, size):
    return 0.0 if src == dst else planning.plan_route(src, dst, size).cost + 1e-9


@pytest.mark.parametrize("mesh", [[[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]]], ids=str)
def test_shared_prices_equal_prices_pair_by_pair(mesh):
    p = Placement("cpu", mesh)
    rng = random.Random(len(mesh[0]))
    record = _record(p, rng)
    problem, compute, _, _ = _problem(record)
    for v, node in enumerate(record):
        sigs = node.signatures()
        want = [_compute_seconds(node.func, *sig) for sig in sigs]
        assert compute[v] == want
        for i, (producer, (layout, size, weight)) in enumerate(zip(node.producers,
                                                                   node.inputs)):
            if producer is None:
                want = [c + _plain_price(layout, t[i], size) * weight for c, (t, _) in
                        zip(want, sigs)]
        assert problem.unary[v] == want, v
    for u, v, matrix in problem.edges:
        node, i = record[v], 0
        outs = [o for _, o in record[u].signatures()]
        want = [[_plain_price(src[0], t[i], 4) * 1.0
                 + (1e9 if node.greedy.inplace and src[0] != o[0] else 0.0) + 0.0
                 for t, o in node.signatures()] for src in outs]
        assert matrix == want, (u, v)
    # the layers' equal edges share one matrix
    assert problem.edges[2][2] is problem.edges[4][2]


def test_an_inplace_fallback_takes_its_operands_as_they_come():
    """An in-place op with no sbp rule (``decide``: no targets, it gathers and writes
    back itself) in a recorded step: planned with its operands' layouts as recorded
    and its output the first operand's (the problem could not be made before: a step
    holding ``index_put_``'s fallback ran op by op)."""
    p = Placement("cpu", [[0, 1], [2, 3]])
    split, whole = (Layout.make((4, 6), p, nd) for nd in ((S.split(0), S.split(1)),
                                                          (S.broadcast, S.broadcast)))
    made = NS(targets=(whole,), out_layouts=(split,), inplace=False, gidx=(0,))
    first = Node(aten.relu.default, None, made, NS(signatures=(((whole,), (split,)),
                                                                 ((whole,), (whole,))),
                                                   greedy=0), [None], [(whole, 4, 1.0)], ())
    fallback = NS(targets=(), out_layouts=(), inplace=True, fallback=True, gidx=(0, 1))
    node = Node(aten.index_put_.default, None, fallback, None, [(0, 0), None],
                [(split, 4, 1.0), (whole, 8, 1.0)], ())
    assert node.signatures() == (((split, whole), (split,)),)
    problem, *_ = _problem([first, node])
    (u, v, matrix), = problem.edges
    assert (u, v) == (0, 1) and matrix[0][0] == 0 and matrix[1][0] > 0
