"""A recorded step is solved once per process (``planner/reuse.py``): the ranks of a
simulated world, a model built again, Autosave's replanning at each save take the
remembered choice; anything the plan depends on that differs solves anew."""
from __future__ import annotations

import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.planner import problem, reuse, solve
from globaltensor.planner import record as step

B, T, C = 4, 8, 16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(C, 4 * C), torch.nn.GELU(), torch.nn.Linear(4 * C, C))


def _megatron(name, t):
    if name == "0.weight" or name == "0.bias":
        return gt.sbp.split(0)
    return gt.sbp.split(1) if name == "2.weight" else gt.sbp.broadcast


def _train(plain, steps: int) -> tuple:
    """(the parameters after ``steps`` Megatron steps on all ranks, every plan made)."""
    P = gt.placement.all("cpu")
    model = gt.nn.to_global(copy.deepcopy(plain), P, _megatron)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = gt.to_global(torch.randn(B, T, C, generator=torch.Generator().manual_seed(1)), P,
                     gt.sbp.broadcast)
    plans = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if step.state.last is not None and step.state.last not in plans:
            plans.append(step.state.last)
    return [p.full() for p in model.parameters()], plans


@pytest.fixture
def solves(monkeypatch):
    """The number of times a step is solved (every thread's)."""
    count = []
    real = solve.solve

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(solve, "solve", counted)
    reuse.forget()
    yield count
    reuse.forget()


def test_the_ranks_of_a_simulated_world_solve_their_step_once(solves):
    plain = _model()

    def run():
        step.clear()
        return _train(plain, step.RECORD_AT + 3)
    out = gt.testing.simulated_world(4)(run)
    assert len(solves) == 1, len(solves)
    (want, plans), *others = out
    assert len(plans) == 1 and plans[0].planned_cost < plans[0].per_op_cost
    for got, their in others:
        assert [n.choice for n in their[0].nodes] == [n.choice for n in plans[0].nodes]
        assert their[0].planned_cost == plans[0].planned_cost
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_a_step_recorded_again_takes_its_remembered_choice(solves):
    plain = _model()

    def run():
        step.clear()
        first, plans = _train(plain, step.RECORD_AT + 2)
        step.clear()   # a model built again: recorded again, not solved again
        again, replans = _train(plain, step.RECORD_AT + 2)
        assert len(plans) == len(replans) == 1
        assert [n.choice for n in replans[0].nodes] == [n.choice for n in plans[0].nodes]
        assert [n.expected for n in replans[0].nodes] == [n.expected for n in plans[0].nodes]
        for a, b in zip(again, first):
            assert torch.equal(a, b)
        if gt.get_rank() != 0:
            return []
        # what the plan depends on, changed: solved anew (rank 0 alone: planning talks
        # to no other rank)
        counts, record = [len(solves)], replans[0].nodes
        sinks = ((len(record) - 1, 0, None, 4, "gradient"),)
        for kwargs in ({"sinks": sinks}, {"sinks": sinks}, {"reuse": False}, "forget", {}):
            if kwargs == "forget":
                reuse.forget()
                continue
            problem.plan_step(record, **kwargs)
            counts.append(len(solves))
        step.clear()
        return counts
    counts, _ = gt.testing.simulated_world(2)(run)
    # both ranks, both models: one solve; other sinks: one more, remembered; reuse=False
    # (explain_step's way, which keeps the problem): one more; forgotten: one more
    assert counts == [1, 2, 2, 3, 4], counts


def test_explain_step_solves_anew_and_reports_the_costs(solves):
    plain = _model()

    def run():
        step.clear()
        _train(plain, step.RECORD_AT + 2)
        P = gt.placement.all("cpu")
        model = gt.nn.to_global(copy.deepcopy(plain), P, _megatron)
        x = gt.to_global(torch.randn(B, T, C), P, gt.sbp.broadcast)
        report = gt.debug.explain_step(lambda: model(x).square().mean().backward())
        step.clear()   # (its per-call costs read the problem, which a remembered plan lacks)
        return len(report.calls) > 0 and report.planned_cost < report.per_op_cost
    assert gt.testing.simulated_world(2)(run) == [True, True]
    assert len(solves) == 1 + 2   # the training step once; explain_step on each rank
