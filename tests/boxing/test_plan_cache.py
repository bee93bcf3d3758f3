"""The planner's kept searches and pruned general routes give the plans a fresh,
exhaustive search gives (boxing/plan.py keeps one Dijkstra search per source and skips
general routes a lower bound rules out; the references here do neither)."""
import functools
import heapq
import itertools

import pytest

from globaltensor import sbp as S
from globaltensor.boxing import plan as planning
from globaltensor.boxing import search, transfer_price
from globaltensor.boxing.steps import Transfer
from globaltensor.layout import Layout
from globaltensor.placement import Placement


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def fresh_search(src: Layout, dst: Layout, itemsize: int):
    """(cost, steps) of one Dijkstra search from src that stops at dst, or None."""
    cands = search.candidates(len(src.shape), src.sbp + dst.sbp)
    best, heap, counter = {src.sbp: 0.0}, [(0.0, 0, src.sbp, ())], 1
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dst.sbp:
            return cost, path
        if cost > best.get(state, float("inf")):
            continue
        for axis in range(len(state)):
            for new in cands:
                if new == state[axis] or not search.valid(state, axis, new):
                    continue
                nxt = state[:axis] + (new,) + state[axis + 1:]
                step = search.axis_step(Layout.make(src.shape, src.placement, state),
                                           Layout.make(src.shape, src.placement, nxt),
                                           axis, itemsize)
                if step is None:
                    continue
                c = cost + step.cost(itemsize)
                if c < best.get(nxt, float("inf")) - 1e-15:
                    best[nxt] = c
                    heapq.heappush(heap, (c, counter, nxt, path + (step,)))
                    counter += 1
    return None


@functools.lru_cache(maxsize=None)
def _fresh_search_once(src: Layout, dst: Layout, itemsize: int):
    # the reference's own memo (a source meets the same reductions for every target),
    # apart from the library's caches
    return fresh_search(src, dst, itemsize)


def every_general_route(src: Layout, dst: Layout, itemsize: int, bound: float):
    """(cost, steps) of the cheapest general route under ``bound``, pricing every one."""
    best = None
    for mid in planning._reduced_sources(src):
        pre = (0.0, ()) if mid == src else _fresh_search_once(src, mid, itemsize)
        if pre is None:
            continue
        transfer = Transfer.between(mid, dst)
        total = pre[0] + transfer.cost(itemsize)
        if total < (bound if best is None else best[0]):
            best = (total, pre[1] + (transfer,))
    return best


SBPS = [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(1)]
MESHES = [[[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[3, 1], [0, 2]], [0, 1, 2]]


def layouts(shape, p):
    return [Layout.make(shape, p, nd) for nd in itertools.product(SBPS, repeat=p.ndim)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("shape", [(5, 3), (4, 8), (1, 6)], ids=str)
def test_kept_searches_plan_as_a_search_per_pair(mesh, shape):
    planning.clear_caches()
    p = Placement("cpu", mesh)
    every = layouts(shape, p)
    for src, dst in itertools.product(every, every):   # one search per source, resumed
        got = planning.plan_boxing(src, dst, 4)
        want = fresh_search(src, dst, 4) if src != dst else (0.0, ())
        assert (None if got is None else (got.cost, got.steps)) == want, (src, dst)


@pytest.mark.parametrize("shape", [(5, 3), (4, 8)], ids=str)
def test_pruned_general_routes_are_the_cheapest(shape):
    planning.clear_caches()
    placements = [Placement("cpu", m) for m in MESHES]
    for p, q in [(placements[0], placements[0]), (placements[1], placements[1]),
                 (placements[0], placements[1]), (placements[3], placements[0]),
                 (placements[2], placements[3])]:
        for src, dst in itertools.product(layouts(shape, p), layouts(shape, q)[::2]):
            same = planning.plan_boxing(src, dst, 4)
            bound = float("inf") if same is None else same.cost
            got = planning.general_plan(src, dst, 4, bound)
            want = every_general_route(src, dst, 4, bound)
            assert (None if got is None else (got.cost, got.steps)) == want, (src, dst)


def test_transfers_are_priced_without_their_moves():
    # transfer_cost is the moves' cost to the bit; transfer_floor bounds it, and is
    # it where every piece is a local copy
    plain = [S.broadcast, S.split(0), S.split(1), S.split(2)]
    placements = [Placement("cpu", m) for m in MESHES + [[5], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]]
    exact = 0
    for shape in [(5, 3, 2), (8, 4, 1), (1, 2, 7), (0, 3, 4)]:
        for p, q in itertools.product(placements, placements[:3] + placements[4:]):
            mids = [Layout.make(shape, p, nd) for nd in itertools.product(plain, repeat=p.ndim)]
            dsts = [Layout.make(shape, q, nd) for nd in itertools.product(
                [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(2)],
                repeat=q.ndim)]
            for mid, dst in itertools.product(mids[::3], dsts[::2]):
                transfer = Transfer.between(mid, dst)
                cost = transfer.cost(2)
                assert transfer_price.transfer_cost(mid, dst, 2) == cost, (mid, dst)
                floor = transfer_price.transfer_floor(mid, dst, 2)
                assert floor <= cost, (mid, dst)
                if all(m.src == m.dst for m in transfer.moves):
                    assert floor == cost, (mid, dst)
                    exact += 1
    assert exact > 0


def test_a_rank_runs_its_share_of_a_transfers_moves():
    # Transfer.start takes a rank's moves without making every rank's (n x n at n
    # ranks): the same moves in the same order, other placements and 0-d included
    plain = [S.broadcast, S.split(0), S.split(1), S.split(2)]
    placements = [Placement("cpu", m) for m in MESHES + [[5], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]]
    for shape in [(5, 3, 2), (8, 4, 1), (0, 3, 4), (6, 6, 6), ()]:
        sbps = plain[:1 + len(shape)]
        for p, q in itertools.product(placements, placements):
            srcs = [Layout.make(shape, p, nd) for nd in itertools.product(sbps, repeat=p.ndim)]
            dsts = [Layout.make(shape, q, nd) for nd in itertools.product(
                sbps + [S.partial_sum], repeat=q.ndim)]
            for src, dst in itertools.product(srcs[::4], dsts[::5]):
                transfer = Transfer.between(src, dst)
                for rank in range(8):
                    mine = tuple(m for m in transfer.moves if rank in (m.src, m.dst))
                    assert transfer.moves_of(rank) == mine, (src, dst, rank)


def test_route_cost_is_the_plans_cost():
    # step planning prices with route_cost, which makes no plan: strided splits (on
    # the refined view, or through broadcast), partials, other placements
    planning.clear_caches()
    placements = [Placement("cpu", m) for m in MESHES]
    sbps = SBPS + [S.split(1, blocks=2), S.split(0, blocks=2)]
    for shape in [(4, 8), (6, 4)]:
        every = {}
        for p in placements:
            every[p] = []
            for nd in itertools.product(sbps, repeat=p.ndim):
                try:
                    every[p].append(Layout.make(shape, p, nd))
                except ValueError:
                    pass
        for p, q in [(placements[0], placements[0]), (placements[1], placements[1]),
                     (placements[0], placements[3])]:
            for src, dst in itertools.product(every[p], every[q][::2]):
                assert planning.route_cost(src, dst, 4) == \
                    planning.plan_route(src, dst, 4).cost, (src, dst)


@pytest.mark.parametrize("mesh", [[[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]], [0, 1, 2]],
                         ids=str)
def test_batched_route_costs_equal_pair_by_pair(mesh, monkeypatch):
    """``route_cost`` prices a shape's whole universe at once (every route on the
    placement as arrays, the general routes' transfers as arrays), and ``route_costs``
    reads a block of pairs from those tables: the very floats of the search and pruned
    general routes of each pair, partial_max and strided ends too."""
    p = Placement("cpu", mesh)
    sbps = SBPS + [S.split(2), S.split(0, blocks=2)]
    every = []
    for nd in itertools.product(sbps, repeat=p.ndim):
        try:
            every.append(Layout.make((4, 6, 8), p, nd))
        except ValueError:
            pass
    pairs = list(itertools.product(every, every))
    planning.clear_caches()
    batched = [planning.route_cost(src, dst, 4) for src, dst in pairs]
    planning.clear_caches()
    block = planning.route_costs(tuple(every), tuple(every[::-1]), 4).tolist()
    planning.clear_caches()
    monkeypatch.setattr(planning, "_table_cost", lambda src, dst, itemsize: None)
    alone = [planning.route_cost(src, dst, 4) for src, dst in pairs]
    monkeypatch.undo()
    planning.clear_caches()
    assert batched == alone
    assert [row[::-1] for row in block] == [alone[k:k + len(every)]
                                            for k in range(0, len(alone), len(every))]



def test_a_split_sources_transfer_is_priced_per_dim(monkeypatch):
    # a source split on every axis (each rank a region of its own) into a target with no
    # partial axis: what each rank sends, receives and keeps is a product over dims of
    # sums, counted without a receiver-by-region table; the moves' cost to the bit,
    # uneven and empty parts included
    splits = [S.split(0), S.split(1), S.split(2)]
    placements = [Placement("cpu", m) for m in MESHES + [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]]
    served = 0
    for shape in [(5, 3, 2), (8, 4, 1), (1, 2, 7), (0, 3, 4), (6, 6, 6)]:
        for p in placements:
            srcs = [Layout.make(shape, p, nd) for nd in itertools.product(splits, repeat=p.ndim)]
            dsts = [Layout.make(shape, p, nd) for nd in itertools.product(
                [S.broadcast] + splits, repeat=p.ndim)]
            for src, dst in itertools.product(srcs[::2], dsts[::3]):
                served += transfer_price._split_counts(src, dst) is not None
                assert transfer_price.transfer_cost(src, dst, 2) == \
                    Transfer.between(src, dst).cost(2), (src, dst)
    assert served > 100
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setattr(transfer_price, "_overlaps_of", None)   # no [receiver][region] table
    big = Placement("cpu", [list(range(r * 8, r * 8 + 8)) for r in range(128)])
    src = Layout.make((256, 16, 64), big, (S.split(0), S.split(2)))
    dst = Layout.make((256, 16, 64), big, (S.split(0), S.split(1)))
    assert transfer_price.transfer_cost(src, dst, 4) > 0
