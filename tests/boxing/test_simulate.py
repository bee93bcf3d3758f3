"""Property tests: every same-placement boxing pair on the simulator."""

import pytest
import torch
from boxing_cases import random_locals, reference_locals
from hypothesis import given, settings
from hypothesis import strategies as st

from globaltensor import sbp as S
from globaltensor.boxing import materialize, plan_boxing, plan_route, simulate
from globaltensor.boxing import steps as St
from globaltensor.boxing.plan import general_plan
from globaltensor.layout import Layout
from globaltensor.placement import Placement


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def sbps(ndim):
    return st.sampled_from([S.broadcast, S.partial_sum, S.partial_max]
                           + [S.split(d) for d in range(ndim)])


@st.composite
def boxing_case(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 3), (4, 2), (1, 3)]))
    size = 1
    for m in mesh:
        size *= m
    ranks = draw(st.permutations(list(range(8))))[:size]
    nested = torch.tensor(ranks).reshape(mesh).tolist()
    p = Placement("cpu", nested)
    src = tuple(draw(sbps(ndim)) for _ in mesh)
    dst = tuple(draw(sbps(ndim)) for _ in mesh)
    return shape, p, src, dst, draw(st.integers(0, 2**31 - 1))


def check_plan(shape, p, src_sbp, dst_sbp, seed, dtype=torch.float64):
    src, dst = Layout.make(shape, p, src_sbp), Layout.make(shape, p, dst_sbp)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen, dtype=dtype)
    plan = plan_boxing(src, dst, 8)
    assert plan is not None, f"no plan {src_sbp} -> {dst_sbp}"
    out = simulate(plan, random_locals(value, src, gen))
    for r in p:
        assert tuple(out[r].shape) == dst.local_shape(r), (r, plan)
    torch.testing.assert_close(materialize(out, dst), value, rtol=1e-9, atol=1e-9)
    if not dst.partial_axes:
        for r, ref in reference_locals(value, dst).items():
            torch.testing.assert_close(out[r], ref, rtol=1e-9, atol=1e-9)
    return plan


@settings(max_examples=400, deadline=None)
@given(boxing_case())
def test_every_pair_on_simulator(case):
    check_plan(*case)


@pytest.mark.parametrize("src,dst,kind", [
    (S.split(0), S.broadcast, St.AllGather),
    (S.partial_sum, S.broadcast, St.AllReduce),
    (S.partial_max, S.broadcast, St.AllReduce),
    (S.partial_sum, S.split(0), St.ReduceScatter),
    (S.split(0), S.split(1), St.AllToAll),
    (S.broadcast, S.split(1), St.LocalSlice),
    (S.broadcast, S.partial_sum, St.ZeroNonRoot),
    (S.broadcast, S.partial_max, St.Relabel),
    (S.split(1), S.partial_sum, St.PadToPartial),
])
def test_table_picks_the_single_step(src, dst, kind):
    """docs/DESIGN.md's table: each 1-D pair is one step of the named kind."""
    plan = check_plan((5, 3), Placement("cpu", [0, 1, 2]), src, dst, 0)
    assert [type(s) for s in plan.steps] == [kind]


def test_partial_sum_to_max_reduces_first():
    # Through broadcast or, cheaper, through a split: never a direct relabel.
    plan = check_plan((4,), Placement("cpu", [0, 1]), S.partial_sum, S.partial_max, 1)
    assert [type(s) for s in plan.steps] == [St.ReduceScatter, St.PadToPartial]


def test_two_axes_splitting_one_dim_are_ordered_inner_first():
    p = Placement("cpu", [[0, 1], [2, 3]])
    plan = check_plan((9, 2), p, (S.split(0), S.split(0)), (S.broadcast, S.broadcast), 2)
    assert [(type(s), s.axis) for s in plan.steps] == [(St.AllGather, 1), (St.AllGather, 0)]


def test_mixed_partials_reduce_inner_first():
    p = Placement("cpu", [[0, 1], [2, 3]])
    plan = check_plan((3,), p, (S.partial_sum, S.partial_max), (S.broadcast, S.broadcast), 3)
    assert plan.steps[0].axis == 1


def test_plans_are_cached():
    p = Placement("cpu", [0, 1])
    a, b = Layout.make((4,), p, S.split(0)), Layout.make((4,), p, S.broadcast)
    assert plan_boxing(a, b) is plan_boxing(a, b)


def test_equal_layouts_need_no_step():
    p = Placement("cpu", [0, 1])
    a = Layout.make((4,), p, S.split(0))
    assert plan_boxing(a, a).steps == ()


@st.composite
def placement_st(draw):
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 3), (4, 2), (3, 1)]))
    size = 1
    for m in mesh:
        size *= m
    ranks = draw(st.permutations(list(range(8))))[:size]
    return Placement("cpu", torch.tensor(ranks).reshape(mesh).tolist())


@st.composite
def cross_case(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    p, q = draw(placement_st()), draw(placement_st())
    src = tuple(draw(sbps(ndim)) for _ in p.shape)
    dst = tuple(draw(sbps(ndim)) for _ in q.shape)
    return shape, p, q, src, dst, draw(st.integers(0, 2**31 - 1))


def check_route(shape, p, q, src_sbp, dst_sbp, seed, force_general=False):
    src, dst = Layout.make(shape, p, src_sbp), Layout.make(shape, q, dst_sbp)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    plan = general_plan(src, dst, 8) if force_general else plan_route(src, dst, 8)
    out = simulate(plan, random_locals(value, src, gen))
    assert set(out) >= set(q), plan
    for r in q:
        assert tuple(out[r].shape) == dst.local_shape(r), (r, plan)
    got = materialize({r: out[r] for r in q}, dst)
    torch.testing.assert_close(got, value, rtol=1e-9, atol=1e-9)
    if not dst.partial_axes:
        for r, ref in reference_locals(value, dst).items():
            torch.testing.assert_close(out[r], ref, rtol=1e-9, atol=1e-9)
    return plan


@settings(max_examples=400, deadline=None)
@given(cross_case())
def test_any_placement_pair_on_simulator(case):
    check_route(*case)


@settings(max_examples=150, deadline=None)
@given(boxing_case())
def test_general_route_is_a_correct_fallback_on_one_placement(case):
    shape, p, src, dst, seed = case
    check_route(shape, p, p, src, dst, seed, force_general=True)


def test_transfer_sends_only_the_intersections():
    # split(0) on [0, 1] -> split(0) on [1, 2, 3]: rows 0:4 | 4:8 become 0:3 | 3:6 | 6:8.
    src = Layout.make((8, 2), Placement("cpu", [0, 1]), S.split(0))
    dst = Layout.make((8, 2), Placement("cpu", [1, 2, 3]), S.split(0))
    plan = plan_route(src, dst, 4)
    (transfer,) = plan.steps
    moves = {(m.src, m.dst, m.region.offsets[0], m.region.sizes[0]) for m in transfer.moves}
    assert moves == {(0, 1, 0, 3), (0, 2, 3, 1), (1, 2, 4, 2), (1, 3, 6, 2)}


def test_broadcast_source_spreads_load_and_prefers_local_copies():
    src = Layout.make((8,), Placement("cpu", [0, 1, 2, 3]), S.broadcast)
    dst = Layout.make((8,), Placement("cpu", [2, 3, 4, 5, 6, 7]), S.broadcast)
    (transfer,) = plan_route(src, dst, 4).steps
    holders = {m.dst: m.src for m in transfer.moves}
    assert holders[2] == 2 and holders[3] == 3          # already there: local copy
    assert len({holders[r] for r in (4, 5, 6, 7)}) == 4  # four senders, not one


def test_partial_source_is_reduced_before_sending():
    src = Layout.make((8,), Placement("cpu", [0, 1]), S.partial_sum)
    dst = Layout.make((8,), Placement("cpu", [2, 3]), S.split(0))
    plan = plan_route(src, dst, 4)
    assert isinstance(plan.steps[0], St.ReduceScatter)
    assert isinstance(plan.steps[-1], St.Transfer)
