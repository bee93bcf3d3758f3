"""Simulated worlds (``gt.testing.simulated_world``): n ranks as threads of this one
process, through the same dispatch, boxing, autograd and gradient sync as a world of
processes; collectives in memory; one rank runs at a time."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import globaltensor as gt

simulated_world = gt.testing.simulated_world


def _gather_sum():
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.arange(8, placement=p, sbp=gt.sbp.split(0)).float()
    whole = x.to_global(sbp=gt.sbp.broadcast).to_local()
    return gt.get_rank(), gt.get_world_size(), x.to_local().tolist(), whole.sum().item(), os.getpid()


def test_each_rank_runs_the_program_in_this_process():
    gt.init()                                          # a world of one here, put aside
    out = simulated_world(2)(_gather_sum)
    assert [o[:4] for o in out] == [(0, 2, [0.0, 1.0, 2.0, 3.0], 28.0),
                                    (1, 2, [4.0, 5.0, 6.0, 7.0], 28.0)]
    assert {o[4] for o in out} == {os.getpid()}
    assert torch.distributed.get_world_size() == 1     # the caller's world is as it was
    assert simulated_world(2)(_gather_sum) == out      # the same every time


def _train(steps: int):
    """A data-parallel linear model with gradients kept across steps, on ranks [0, 1]
    of the world (a third rank holds nothing)."""
    p = gt.placement("cpu", ranks=[0, 1])
    gt.manual_seed(0)
    w = gt.randn(8, 4, placement=p, sbp=gt.sbp.broadcast).requires_grad_()
    x = gt.randn(6, 8, placement=p, sbp=gt.sbp.split(0))
    for _ in range(steps):
        loss = (x @ w).relu().sum()
        loss.backward()
    return loss.item(), w.grad.to_local().clone(), w.full(), x.full()


def test_training_equals_one_process_also_for_a_rank_outside():
    out = simulated_world(3)(_train, 3)
    _, _, w, x = out[0]
    w = w.detach().clone().requires_grad_()
    for _ in range(3):
        loss = (x @ w).relu().sum()
        loss.backward()
    for rank in (0, 1):
        assert out[rank][0] == pytest.approx(loss.item())
        torch.testing.assert_close(out[rank][1], w.grad)
    assert out[2][1].numel() == 0 or not out[2][1].any()   # the rank outside holds nothing
    assert out[2][0] == pytest.approx(loss.item())          # but reads the broadcast loss


def test_ranks_take_the_first_ranks_choice_of_each_calls_layouts(monkeypatch):
    # Every rank decides each call (its decision is its own), but what does not depend
    # on the rank (the meta run and the chosen layouts) is chosen once for all ranks,
    # and the values are those of ranks choosing alone.
    from globaltensor.propagation import cache, decide
    chosen, decided = [], []
    real_choose, real_decided = decide._choose, cache._decided
    monkeypatch.setattr(decide, "_choose", lambda *a: chosen.append(a[0]) or real_choose(*a))
    monkeypatch.setattr(cache, "_decided", lambda *a: decided.append(a[0]) or real_decided(*a))
    shared = simulated_world(3)(_train, 2)
    assert chosen and len(decided) == 3 * len(chosen) and cache._shared is None
    monkeypatch.setattr(cache, "share_choices", lambda on: None)   # each rank chooses
    chosen.clear(), decided.clear()
    alone = simulated_world(3)(_train, 2)
    assert len(chosen) == len(decided)
    for a, b in zip(shared, alone):
        assert a[0] == b[0]
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x.to_local() if isinstance(x, gt.GlobalTensor) else x,
                               y.to_local() if isinstance(y, gt.GlobalTensor) else y)


def _raises_on_one(rank_that_fails: int):
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.ones(4, 2, placement=p, sbp=gt.sbp.split(0))
    if gt.get_rank() == rank_that_fails:
        raise ValueError("bad batch")
    return x.to_global(sbp=gt.sbp.broadcast).to_local().sum().item()


def test_a_rank_that_raises_ends_the_world_with_its_error():
    with pytest.raises(ValueError, match="bad batch") as info:
        simulated_world(2, timeout=30)(_raises_on_one, 1)
    assert "rank 1 of a simulated world of 2" in "".join(info.value.__notes__)


def _one_more_to_global():
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.ones(4, 2, placement=p, sbp=gt.sbp.split(0))
    if gt.get_rank() == 0:
        x.to_global(sbp=gt.sbp.broadcast)        # rank 0 alone gathers
    return 0


def test_a_rank_that_runs_one_more_to_global_is_named_as_in_processes(monkeypatch):
    monkeypatch.setenv("GLOBALTENSOR_READ_TIMEOUT", "2")
    with pytest.raises(gt.debug.CollectiveError, match=r"x.to_global\(\) on rank 0 needs every rank"):
        simulated_world(2, timeout=20)(_one_more_to_global)


def _different_collectives():
    t = torch.ones(2)
    if torch.distributed.get_rank() == 0:
        torch.distributed.all_reduce(t)
    else:
        torch.distributed.broadcast(t, 0)


def test_ranks_at_different_collectives_are_told_apart_not_paired():
    """torch's threaded group alone would pair them (values mixed silently)."""
    with pytest.raises(gt.debug.DivergenceError, match="reached collective (Broadcast|AllReduce) where other "
                       "ranks of its group are in (AllReduce|Broadcast)"):
        simulated_world(2, timeout=20)(_different_collectives)


def test_the_op_battery_checks_run_unchanged():
    """The checks the session's worlds of processes run (``tests/ops``) run in a
    simulated world: the same program, the same comparisons with plain torch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
    try:
        import test_matmul
        import test_pointwise
    finally:
        sys.path.pop(0)
    simulated_world(2)(test_pointwise.check_pointwise)
    simulated_world(4)(test_matmul.check_matmul)


def _reduce_scattered() -> list:
    """A reduce-scatter by max, min and sum on the simulated group (torch's threaded
    group reduces only sums and averages there; a partial_max -> split boxing needs max)."""
    import torch.distributed as dist
    whole = torch.arange(8.0).reshape(4, 2) * (1 + gt.get_rank())
    out = []
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM):
        part = torch.empty(1, 2)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, whole, op=op)
        out.append(part)
    return out


def _receives_waited_out_of_order() -> list:
    import torch.distributed as dist
    if gt.get_rank() == 0:
        first, second = dist.irecv(a := torch.zeros(1), 1), dist.irecv(b := torch.zeros(1), 1)
        second.wait()
        first.wait()
        return [a.item(), b.item()]
    for value in (1.0, 2.0):
        dist.send(torch.tensor([value]), 0)
    return []


def test_receives_take_messages_in_the_order_posted_as_gloo_does():
    # a receive posted and waited later (or never: a payload left posted after a
    # fingerprint mismatch) still takes its message, not the next receive's
    assert simulated_world(2)(_receives_waited_out_of_order)[0] == [1.0, 2.0]


def test_reduce_scatter_takes_max_and_min_as_well_as_sum():
    base = torch.arange(8.0).reshape(4, 2)
    for rank, parts in enumerate(simulated_world(4)(_reduce_scattered)):
        for part, times in zip(parts, (4, 1, 10)):
            assert torch.equal(part, times * base[rank:rank + 1]), (rank, times, part)


def test_bad_world_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        simulated_world(0)


def test_the_callers_thread_count_comes_back():
    """The ranks run with one intra-op thread (one runs at a time); the caller's own
    setting, process-wide, is what it was afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = gt.testing.simulated_world(2, 60)(torch.get_num_threads)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _own_read_timeout() -> float:
    from globaltensor import env
    if gt.get_rank() == 0:
        os.environ["GLOBALTENSOR_READ_TIMEOUT"] = "3"
    p = gt.placement("cpu", [0, 1])
    gt.ones(2, placement=p, sbp=gt.sbp.split(0)).to_global(sbp=gt.sbp.broadcast)  # turns
    return env.read_timeout_seconds()


def test_a_ranks_environment_variables_are_its_own(monkeypatch):
    """A variable a rank sets is its own, as a process's would be: the other rank and
    the caller do not see it (shared, a rank leaving a block that set a knob would put
    it back under another rank still inside)."""
    monkeypatch.delenv("GLOBALTENSOR_READ_TIMEOUT", raising=False)
    assert simulated_world(2)(_own_read_timeout) == [3.0, 10.0]
    assert "GLOBALTENSOR_READ_TIMEOUT" not in os.environ


class _Knob:
    value = "original"
    entered: list = []   # ranks in the order they entered the block


def _read_inside_after_the_first_rank_in_left() -> str:
    import contextlib

    from mp import patched
    p = gt.placement("cpu", [0, 1])
    with contextlib.ExitStack() as block:
        block.enter_context(patched(_Knob, "value", "patched"))
        _Knob.entered.append(gt.get_rank())
        for _ in range(2):   # collectives: the other rank takes the turn meanwhile
            gt.ones(2, placement=p, sbp=gt.sbp.split(0)).to_global(sbp=gt.sbp.broadcast)
            if _Knob.entered[0] == gt.get_rank():
                block.close()   # the first rank in leaves before the other's second one
        return _Knob.value


def test_a_value_patched_for_the_world_stays_until_the_last_rank_leaves():
    """``tests/mp.py``'s ``patched``: a rank still inside the block sees the patch after
    the first rank in left it, and the value comes back after the last one out (each
    rank saving and restoring for itself would restore it under the other)."""
    _Knob.entered.clear()
    seen = simulated_world(2)(_read_inside_after_the_first_rank_in_left)
    assert seen[1 - _Knob.entered[0]] == "patched", (seen, _Knob.entered)
    assert _Knob.value == "original"
