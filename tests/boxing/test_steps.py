"""The boxing step registry: each step kind declares its transition, cost, run and
simulation in one class; a kind missing a part fails when defined; a new kind is one
class that the planner, simulator and explain pick up."""
from dataclasses import dataclass

import pytest
import torch

from globaltensor import sbp as S
from globaltensor.boxing import materialize, plan_boxing, search, simulate
from globaltensor.boxing import plan as planning
from globaltensor.boxing import steps as St
from globaltensor.boxing.simulate import scatter
from globaltensor.layout import Layout
from globaltensor.placement import Placement


@pytest.fixture(autouse=True)
def world_of_four(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")


ONE_AXIS = [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(1)]


def test_each_one_axis_change_has_a_step_and_the_cheapest_is_planned():
    p = Placement("cpu", [0, 1, 2])
    for a in ONE_AXIS:
        for b in ONE_AXIS:
            if a == b:
                continue
            src, dst = Layout.make((5, 3), p, a), Layout.make((5, 3), p, b)
            steps = [s for s in (k.for_axis(0, src, dst) for k in St.AXIS_STEPS) if s]
            partials = {a, b} == {S.partial_sum, S.partial_max}
            assert bool(steps) != partials, (a, b, steps)
            if steps:
                chosen = search.axis_step(src, dst, 0, 4)
                assert chosen.cost(4) == min(s.cost(4) for s in steps)


def test_every_step_class_of_the_package_is_discovered_once():
    """No list to keep: each module of boxing/steps/ is imported, and each concrete
    step class in it is registered exactly once (and exported under its name)."""
    import importlib
    import inspect
    import pkgutil
    defined = []
    for info in pkgutil.iter_modules(St.__path__):
        module = importlib.import_module(f"{St.__name__}.{info.name}")
        defined += [c for _, c in inspect.getmembers(module, inspect.isclass)
                    if issubclass(c, St.Step) and c.__module__ == module.__name__
                    and not inspect.isabstract(c) and c not in (St.Step, St.AxisStep, St.SbpChange)]
    assert defined and sorted(map(id, defined)) == sorted(map(id, St.ALL_STEPS))
    assert len(set(St.ALL_STEPS)) == len(St.ALL_STEPS)
    assert all(getattr(St, c.__name__) is c for c in St.ALL_STEPS)
    assert St.Transfer not in St.AXIS_STEPS and St.AllGather in St.AXIS_STEPS


def test_a_step_kind_missing_a_part_fails_when_defined():
    before = list(St.ALL_STEPS)
    with pytest.raises(TypeError, match="cost.*simulate|simulate.*cost"):
        @dataclass(frozen=True)
        class Half(St.AxisStep):  # noqa: F841 - defining it is the test
            @classmethod
            def for_axis(cls, axis, src, dst):
                return None

            def start(self, x, rank, own=False):
                return St.Handle.ready(x)
    assert St.ALL_STEPS == before


def test_costs_come_from_the_steps():
    p = Placement("cpu", [0, 1, 2, 3])
    big = Layout.make((1024, 4), p, S.broadcast)
    s0, ps = Layout.make((1024, 4), p, S.split(0)), Layout.make((1024, 4), p, S.partial_sum)
    gather = St.AllGather.for_axis(0, s0, big)
    reduce = St.AllReduce.for_axis(0, ps, big)
    sliced = St.LocalSlice.for_axis(0, big, s0)
    assert reduce.cost(4) > gather.cost(4) > sliced.cost(4) > 0
    assert gather.cost(8) > gather.cost(4)
    q = Placement("cpu", [2, 3])
    transfer = St.Transfer.between(s0, Layout.make((1024, 4), q, S.split(0)))
    assert transfer.cost(4) > 0 and transfer.moves


def test_local_steps_run_on_meta_tensors():
    p = Placement("cpu", [0, 1])
    b, s1 = Layout.make((4, 6), p, S.broadcast), Layout.make((4, 6), p, S.split(1))
    pm = Layout.make((4, 6), p, S.partial_max)
    x = torch.empty(4, 6, device="meta")
    out = St.LocalSlice.for_axis(0, b, s1).start(x, 1).wait()
    assert out.device.type == "meta" and out.shape == (4, 3)
    padded = St.PadToPartial.for_axis(0, s1, pm).start(out, 1).wait()
    assert padded.device.type == "meta" and padded.shape == (4, 6)


def test_handle_waits_once_and_chains():
    calls = []

    class Work:
        def wait(self):
            calls.append("wait")

        def is_completed(self):
            return False

    h = St.Handle(Work(), lambda: torch.ones(2))
    doubled = h.then(lambda t: t * 2)
    assert not doubled.is_completed()
    assert doubled.wait().tolist() == [2.0, 2.0] and h.wait().tolist() == [1.0, 1.0]
    assert calls == ["wait"]
    assert St.Handle.ready(torch.zeros(1)).is_completed()


def test_a_new_step_kind_is_one_class():
    """broadcast -> partial_sum kept on the last member instead of the first: the planner
    prices the new kind against ZeroNonRoot and picks it when it is cheaper (and not
    when it is dearer), the simulator runs it, explain describes it."""

    @dataclass(frozen=True)
    class KeepOnLast(St.AxisStep):
        @classmethod
        def for_axis(cls, axis, src, dst):
            if src.sbp[axis] == S.broadcast and dst.sbp[axis] == S.partial_sum:
                return cls(axis, src, dst)
            return None

        price = 0.0

        def cost(self, itemsize):
            return self.price

        def start(self, x, rank, own=False):
            last = self.src.placement.coord(rank)[self.axis] == self.group_size - 1
            return St.Handle.ready(x if last else torch.zeros_like(x))

        def simulate(self, locals_):
            return self.by_group(locals_, lambda ms, xs: [torch.zeros_like(x) if k < len(xs) - 1
                                                          else x for k, x in enumerate(xs)])

    planning.clear_caches()
    try:
        p = Placement("cpu", [0, 1, 2])
        src, dst = Layout.make((3, 2), p, S.broadcast), Layout.make((3, 2), p, S.partial_sum)
        plan = plan_boxing(src, dst, 8)
        assert [type(s) for s in plan.steps] == [KeepOnLast]
        value = torch.randn(3, 2, dtype=torch.float64)
        out = simulate(plan, scatter(value, src))
        assert out[2].equal(value) and not out[0].any()
        torch.testing.assert_close(materialize(out, dst), value)
        assert "KeepOnLast(axis=0" in str(plan) and "groups: [0, 1, 2]" in str(plan)
        KeepOnLast.price = 1.0                       # dearer than ZeroNonRoot now
        planning.clear_caches()
        assert [type(s) for s in plan_boxing(src, dst, 8).steps] == [St.ZeroNonRoot]
    finally:
        St.AXIS_STEPS.remove(KeepOnLast)
        St.ALL_STEPS.remove(KeepOnLast)
        planning.clear_caches()
