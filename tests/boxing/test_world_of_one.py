"""A world of one (and any axis of one rank) moves nothing: a boxing whose source and
destination parts are the same data runs no step, priced at zero."""
import copy

import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.boxing import plan as boxing_plan
from globaltensor.boxing import run as boxing_run
from globaltensor.layout import Layout
from globaltensor.placement import Placement
from globaltensor.sbp import broadcast, partial_max, partial_sum, split


def test_layouts_differing_only_on_one_rank_axes_need_no_steps(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    one, mesh = Placement("cpu", [0]), Placement("cpu", [[0], [1]])
    for a in (split(0), split(1), broadcast, partial_sum, partial_max):
        for b in (split(0), split(1), broadcast, partial_sum):
            plan = boxing_plan.plan_route(Layout.make((4, 6), one, a), Layout.make((4, 6), one, b))
            assert plan.steps == () and plan.cost == 0.0, (a, b, plan)
            assert boxing_plan.route_cost(Layout.make((4, 6), one, a),
                                          Layout.make((4, 6), one, b)) == 0.0
            # (axis of 2, axis of 1): only the one-rank axis differs
            src, dst = Layout.make((4, 6), mesh, (split(0), a)), Layout.make((4, 6), mesh, (split(0), b))
            assert boxing_plan.plan_route(src, dst).steps == ()
    moved = boxing_plan.plan_route(Layout.make((4, 6), mesh, (split(0), broadcast)),
                                   Layout.make((4, 6), mesh, (broadcast, broadcast)))
    assert moved.steps, "the axis of two ranks does move"


def test_a_training_step_at_world_one_runs_no_boxing_step(monkeypatch):
    """Data parallel at world 1 (parameters broadcast, batch split(0)): three AdamW steps
    start no boxing plan, and train equal to plain torch."""
    started = []
    real_run, real_start = boxing_run.run, boxing_run.start
    monkeypatch.setattr(boxing_run, "run",
                        lambda plan, *a, **k: started.append(plan) or real_run(plan, *a, **k))
    monkeypatch.setattr(boxing_run, "start",
                        lambda plan, *a, **k: started.append(plan) or real_start(plan, *a, **k))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(plain)
    P = gt.placement("cpu", [0])
    gt.nn.to_global(model, P, gt.sbp.broadcast)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for _ in range(3):
        losses = [F.cross_entropy(model(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))),
                                  gt.tensor(y, placement=P, sbp=gt.sbp.split(0))),
                  F.cross_entropy(plain(x), y)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(losses[0].to_local(), losses[1])
    assert started == [], [str(p) for p in started[:3]]


def test_gradients_at_one_rank_arrive_in_their_parameters_layout(monkeypatch):
    """At a one-rank placement a parameter's gradient takes its layout as it arrives
    (before accumulation): fresh, added to a kept ``.grad`` (the same tensor after each
    backward) and inside ``no_sync()``, equal to plain torch's, with nothing left for
    the after-accumulation hook to settle."""
    from globaltensor import gradsync
    settled = []
    real_settle = gradsync._settle
    monkeypatch.setattr(gradsync, "_settle", lambda *a: settled.append(a) or real_settle(*a))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(plain)
    P = gt.placement("cpu", [0])
    gt.nn.to_global(model, P, gt.sbp.broadcast)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def backward(sync=True):
        loss = F.cross_entropy(model(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))),
                               gt.tensor(y, placement=P, sbp=gt.sbp.split(0)))
        if sync:
            loss.backward()
        else:
            with gt.no_sync():
                loss.backward()
        F.cross_entropy(plain(x), y).backward()

    def check():
        for p, q in zip(model.parameters(), plain.parameters()):
            assert p.grad.global_layout == p.global_layout, p.grad.sbp
            torch.testing.assert_close(p.grad.to_local(), q.grad)
    backward()
    check()
    kept = [p.grad for p in model.parameters()]
    backward()                      # added to the kept .grad
    check()
    assert all(p.grad is k for p, k in zip(model.parameters(), kept))
    for m in (model, plain):
        m.zero_grad(set_to_none=False)
    backward(sync=False)            # micro-batches, then the synced one
    backward(sync=False)
    backward()
    check()
    assert all(p.grad is k for p, k in zip(model.parameters(), kept))
    assert settled == []
