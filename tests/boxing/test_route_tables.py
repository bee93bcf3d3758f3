"""Step planning's route tables (boxing/search.py, transfer_price.py, plan.py) price a
shape's whole universe at once and share what they can: a step kind priced once per
(kinds, group size, bytes), transfers once per pair of split patterns (across shapes),
shapes that differ in the order of their dims in one table. Each shared price equals
the one priced directly, to the last bit."""
import itertools
import random

import numpy as np
import pytest

from globaltensor import sbp as S
from globaltensor.boxing import plan as planning
from globaltensor.boxing import search, transfer_price
from globaltensor.boxing.steps import AXIS_STEPS
from globaltensor.boxing.steps.base import priced_by_bytes
from globaltensor.cost import max_local_bytes
from globaltensor.layout import Layout
from globaltensor.placement import Placement

MESHES = [[[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[3, 1], [0, 2]], [0, 1, 2],
          [[5, 6, 7, 4], [0, 2, 3, 1]], [[0, 1, 2, 3]]]
SHAPES = [(5, 3), (4, 8), (1, 6, 2), (8, 1, 3, 4), (0, 3), (), (7,), (4, 4, 2)]


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def _layouts(shape, p, states):
    cands = search.candidates(len(shape), (S.partial_max,))
    return [Layout.make(shape, p, tuple(cands[c] for c in st)) for st in states]


def test_the_built_in_kinds_are_priced_by_bytes():
    assert all(priced_by_bytes(kind) for kind in AXIS_STEPS)


@pytest.mark.parametrize("mesh", MESHES[:2] + MESHES[3:4], ids=str)
def test_state_bytes_and_move_costs_are_the_steps(mesh):
    # a state's bytes are its layout's largest local tensor; a move costs what the
    # cheapest step of the search costs (inf where none serves it)
    p = Placement("cpu", mesh)
    planning.clear_caches()
    for shape in SHAPES:
        states, src, dst, axis, new = search.skeleton(len(shape), p.ndim)
        layouts = _layouts(shape, p, states)
        sizes = search.state_bytes(shape, p.shape, states, 2)
        assert sizes.tolist() == [max_local_bytes(x, 2) for x in layouts]
        for j, k, a, cost in zip(src, dst, axis, search.move_costs(shape, p, 2)):
            step = search.axis_step(layouts[j], layouts[k], a, 2)
            assert cost == (float("inf") if step is None else step.cost(2))
            assert layouts[k].sbp[:a] + layouts[k].sbp[a + 1:] == \
                layouts[j].sbp[:a] + layouts[j].sbp[a + 1:]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_transfer_tables_equal_the_transfers(mesh):
    # every (reduced source, target) pair of several shapes, priced with one memo of
    # pair keys across the shapes, equals transfer_cost pair by pair
    p = Placement("cpu", mesh)
    planning.clear_caches()
    for shape in SHAPES + [(8, 8, 4, 1), (3, 8, 8)]:
        states = search.skeleton(len(shape), p.ndim)[0]
        mids = states[~((states == 1) | (states == 2)).any(axis=1)]
        table = transfer_price.transfer_table(shape, p, 4, mids, states)
        layouts = _layouts(shape, p, states)
        for i, mid in enumerate(_layouts(shape, p, mids)):
            want = [transfer_price.transfer_cost(mid, t, 4) for t in layouts]
            assert table[i].tolist() == want, (shape, mid)


def test_refined_states_are_those_of_the_refined_layouts():
    p = Placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
    sbps = [S.broadcast, S.partial_sum, S.split(0), S.split(1), S.split(2),
            S.split(0, blocks=2), S.split(0, blocks=4), S.split(1, blocks=8)]
    for shape in [(8, 16, 3), (16, 8, 8), (4, 8, 2)]:
        for nd in itertools.product(sbps, repeat=2):
            try:
                layout = Layout.make(shape, p, nd)
            except ValueError:
                continue
            for view in [(), ((0, 2),), ((0, 4),), ((1, 8),), ((0, 2), (1, 8))]:
                fine = layout.refined(dict(view)) if view else layout
                want = False if fine is None else \
                    search.state_of(fine.shape, fine.placement.ndim, fine.sbp)
                assert planning._fine_state(layout, view) == want, (layout, view)


@pytest.mark.parametrize("mesh", [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3]]], ids=str)
def test_shapes_alike_but_for_the_order_of_their_dims_price_alike(mesh):
    p = Placement("cpu", mesh)
    rng = random.Random(0)
    planning.clear_caches()
    for shape in [(6, 4, 9), (4, 1, 6, 4)]:
        order = list(range(len(shape)))
        rng.shuffle(order)
        moved = tuple(shape[d] for d in order)
        nd_sbps = list(itertools.product([S.broadcast, S.partial_sum, S.partial_max]
                                         + [S.split(d) for d in range(len(shape))], repeat=2))
        for a, b in rng.sample(list(itertools.product(nd_sbps, nd_sbps)), 150):
            src, dst = Layout.make(shape, p, a), Layout.make(shape, p, b)
            there = [Layout.make(moved, p, tuple(S.split(order.index(s.dim))
                                                 if isinstance(s, S.Split) else s for s in x))
                     for x in (a, b)]
            cost = planning.route_cost(src, dst, 4)
            assert cost == planning.route_cost(*there, 4) == planning.plan_route(src, dst, 4).cost


def test_route_costs_of_random_blocks_equal_route_cost():
    # blocks of random pairs (strided views, through broadcast where two share none,
    # other placements, partial_max) read from the tables equal route_cost pair by
    # pair, each priced alone
    p, q = Placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]]), Placement("cpu", [[0, 1], [2, 3]])
    sbps = [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(1), S.split(2),
            S.split(0, blocks=2), S.split(0, blocks=4), S.split(2, blocks=4)]
    every = []
    for placement, nd in itertools.product((p, q), itertools.product(sbps, repeat=2)):
        try:
            every.append(Layout.make((8, 6, 8), placement, nd))
        except ValueError:
            pass
    rng = random.Random(3)
    for _ in range(6):
        srcs, dsts = tuple(rng.sample(every, 40)), tuple(rng.sample(every, 30))
        planning.clear_caches()
        block = planning.route_costs(srcs, dsts, 2)
        planning.clear_caches()
        want = np.array([[planning.route_cost(s, d, 2) for d in dsts] for s in srcs])
        assert block.tolist() == want.tolist()


def test_a_kind_of_its_own_is_priced_step_by_step():
    # a kind with its own for_axis and cost is no kind priced by bytes: the tables
    # price every move by its step, and still equal the plans
    from dataclasses import dataclass

    from globaltensor.boxing import steps as St

    @dataclass(frozen=True)
    class KeepOnLast(St.AxisStep):
        @classmethod
        def for_axis(cls, axis, src, dst):
            if src.sbp[axis] == S.broadcast and dst.sbp[axis] == S.partial_sum:
                return cls(axis, src, dst)
            return None

        def cost(self, itemsize):
            return 1e-7 * self.group_size

        def start(self, x, rank, own=False):
            return St.Handle.ready(x)

        def simulate(self, locals_):
            return dict(locals_)

    p = Placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
    try:
        planning.clear_caches()
        assert not priced_by_bytes(KeepOnLast)
        shape = (4, 8)
        states, src, dst, axis, _ = search.skeleton(len(shape), p.ndim)
        layouts = _layouts(shape, p, states)
        for j, k, a, cost in zip(src, dst, axis, search.move_costs(shape, p, 4)):
            step = search.axis_step(layouts[j], layouts[k], a, 4)
            assert cost == (float("inf") if step is None else step.cost(4))
        for a, b in itertools.product(layouts[::3], layouts[::2]):
            assert planning.route_cost(a, b, 4) == planning.plan_route(a, b, 4).cost
    finally:
        St.AXIS_STEPS.remove(KeepOnLast)
        St.ALL_STEPS.remove(KeepOnLast)
        planning.clear_caches()


def test_tables_on_a_3d_placement_equal_the_pairs(monkeypatch):
    # transfers to the bit; routes to the search's tie margin
    p = Placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    sbps = [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(1)]
    every = [Layout.make((4, 3), p, nd) for nd in itertools.product(sbps, repeat=3)]
    pairs = random.Random(1).sample(list(itertools.product(every, every)), 400)
    planning.clear_caches()
    states = search.skeleton(2, 3)[0]
    mids = states[~((states == 1) | (states == 2)).any(axis=1)]
    table = transfer_price.transfer_table((4, 3), p, 4, mids, states)
    layouts = _layouts((4, 3), p, states)
    for i, mid in enumerate(_layouts((4, 3), p, mids)):
        assert table[i].tolist() == [transfer_price.transfer_cost(mid, t, 4) for t in layouts]
    batched = [planning.route_cost(a, b, 4) for a, b in pairs]
    planning.clear_caches()
    monkeypatch.setattr(planning, "_table_cost", lambda src, dst, itemsize: None)
    alone = [planning.route_cost(a, b, 4) for a, b in pairs]
    monkeypatch.undo()
    planning.clear_caches()
    # a search keeps the first of two routes within 1e-15 of each other (its tie
    # margin), the tables the least: here some differ in the last bit
    assert all(abs(x - y) <= 1e-15 for x, y in zip(batched, alone))


def test_a_transfer_table_of_128_ranks_takes_memory_of_its_pairs_times_n_squared(monkeypatch):
    # per pair (rank, region, holder) arrays: pairs x n^2, not the pairs x n^3 of a
    # one-hot (rank, region) -> holder matrix: 2.4 GB here (144 pairs), 19 GB at 256
    # ranks, where a 2-D Llama step could not be planned (MemoryError)
    from globaltensor.testing import peak_rise
    monkeypatch.setenv("WORLD_SIZE", "128")
    p = Placement("cpu", [list(range(r * 16, r * 16 + 16)) for r in range(8)])
    shape = (512, 256)
    states = search.skeleton(len(shape), p.ndim)[0]
    mids = states[~((states == 1) | (states == 2)).any(axis=1)]
    planning.clear_caches()
    with peak_rise() as rise:
        table = transfer_price.transfer_table(shape, p, 4, mids, states)
    assert rise.mib < 500, rise.mib
    layouts, middles = _layouts(shape, p, states), _layouts(shape, p, mids)
    for i, j in [(0, 0), (1, len(layouts) - 1), (len(middles) - 1, 3)]:
        assert table[i, j] == transfer_price.transfer_cost(middles[i], layouts[j], 4)


def test_one_calls_pairs_read_the_universes_table_on_a_few_ranks_only(monkeypatch):
    # deciding a call prices its pairs from the table of their shape and placement
    # where that is cheap to make (a first step on 2 x 2 decides 1.5x faster), and
    # searches them one by one on hundreds of ranks or in a universe of hundreds of
    # states (where tables take GiBs); the same costs either way
    sbps = [S.broadcast, S.partial_sum, S.split(0), S.split(1)]
    big = planning.TABLE_RANKS * 2
    for mesh, tables in (([[0, 1], [2, 3]], 1), ([[0, 1, 2, 3]], 1),
                         ([list(range(big // 2)), list(range(big // 2, big))], 0),
                         ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], 0)):
        monkeypatch.setenv("WORLD_SIZE", str(big))
        p = Placement("cpu", mesh)
        shape = (p.size,) * 2
        layouts = [Layout.make(shape, p, nd) for nd in itertools.product(sbps, repeat=p.ndim)]
        planning.clear_caches()
        got = [planning.pair_cost(a, b, 4) for a in layouts for b in layouts]
        assert search.route_table.cache_info().currsize == tables, mesh
        planning.clear_caches()
        assert got == [planning.plan_route(a, b, 4).cost for a in layouts for b in layouts]
