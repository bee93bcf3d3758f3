"""gt.ps.DenseOptimizer as a torch.optim.Optimizer (in one process, a sync worker's state
set by hand: no servers are needed for the dense side of sync mode): torch's
get_state_dict / set_state_dict round trip, torch's state initialisation stays local,
and the deprecated name gt.ps.Optimizer. The round trip in a job of servers and
workers: tests/ps/ps_sync_job.py (get_state_dict(model, opt))."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import globaltensor as gt
from globaltensor.ps import runtime


@pytest.fixture
def worker(monkeypatch):
    """This process as worker 0 of a sync job of 2 workers."""
    fake = runtime._State()
    fake.strategy, fake.role, fake.workers = gt.ps.Strategy(mode="sync"), "worker", 2
    for module in ("runtime", "dense", "table"):
        monkeypatch.setattr(f"globaltensor.ps.{module}.state", fake)
    return fake


def model_and_opt(kind: str = "adam"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    return model, gt.ps.DenseOptimizer(model.parameters(), kind, lr=0.1)


def local_steps(model, opt, n: int) -> None:
    """Steps as one worker of one would take them (the local optimizer: no all-reduce)."""
    for i in range(n):
        opt.zero_grad()
        model(torch.full((2, 4), float(i + 1))).square().sum().backward()
        opt.local.step()


@pytest.mark.parametrize("kind", ["adam", "adagrad", "sgd"])
def test_get_and_set_state_dict_round_trip(worker, kind):
    model, opt = model_and_opt(kind)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.local.param_groups and opt.state is opt.local.state
    local_steps(model, opt, 3)
    model_sd, optim_sd = get_state_dict(model, opt)
    assert set(optim_sd["state"]) == ({"0.weight", "0.bias", "1.weight", "1.bias"}
                                      if kind != "sgd" else set())
    assert optim_sd["param_groups"][0]["lr"] == 0.1
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_state = {k: {n: t.clone() for n, t in v.items()} for k, v in optim_sd["state"].items()}

    fresh, fresh_opt = model_and_opt(kind)  # before any step: torch initialises its state
    _, template = get_state_dict(fresh, fresh_opt)
    assert fresh_opt.steps == 0              # ... locally, not as a training step
    # copies, as dcp.save + dcp.load would give (the state dicts hold the live tensors)
    set_state_dict(fresh, fresh_opt, model_state_dict=copy.deepcopy(model_sd),
                   optim_state_dict=copy.deepcopy(optim_sd))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    _, got = get_state_dict(fresh, fresh_opt)
    assert got["state"].keys() == want_state.keys()
    for k, v in want_state.items():
        for n, t in v.items():
            assert torch.equal(got["state"][k][n], t), (k, n)
    # and the two go on alike
    local_steps(model, opt, 1)
    local_steps(fresh, fresh_opt, 1)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_state_initialisation_is_local_and_a_training_step_is_not(worker, monkeypatch):
    """torch's get_state_dict steps an optimizer without state once (zero gradients, lr
    0): on the local optimizer only. A step called by anyone else is a training step
    (the all-reduce of the gradients among the workers)."""
    reduced = []
    monkeypatch.setattr("globaltensor.ps.dense.comm.all_reduce_",
                        lambda t, op, ranks: reduced.append((op, ranks)))
    model, opt = model_and_opt("adam")
    before = [p.detach().clone() for p in model.parameters()]
    get_state_dict(model, opt)
    assert opt.steps == 0 and len(opt.local.state) == 4 and reduced == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert opt.steps == 1 and reduced == [("sum", (0, 1))]
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)


def test_an_lr_scheduler_and_autosave_take_it(worker, tmp_path, monkeypatch):
    def no_all_reduce(*args):
        raise AssertionError("a training step")
    monkeypatch.setattr("globaltensor.ps.dense.comm.all_reduce_", no_all_reduce)
    model, opt = model_and_opt("sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    get_state_dict(model, opt)   # through the scheduler's wrapper of step: still local
    assert opt.steps == 0
    local_steps(model, opt, 1)
    sched.step()
    assert opt.local.param_groups[0]["lr"] == 0.05
    gt.checkpoint.Autosave(tmp_path, model, opt)   # a torch.optim.Optimizer


def test_the_former_name_warns_and_is_the_class():
    with pytest.warns(DeprecationWarning, match=r"gt\.ps\.Optimizer is deprecated .* "
                                                r"gt\.ps\.DenseOptimizer"):
        assert gt.ps.Optimizer is gt.ps.DenseOptimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gt.ps.DenseOptimizer is not None
        assert "Optimizer" not in gt.ps.__all__
    with pytest.raises(AttributeError):
        gt.ps.NoSuchName  # noqa: B018 (the attribute access is what raises)
