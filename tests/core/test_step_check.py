"""``gt.debug.check_step``: a step run on fake tensors with no communication lists the
collectives a real step runs (forward, backward, gradient sync), on 2 and 4 ranks;
it leaves parameters and gradients as they were, and one rank can check alone."""
from __future__ import annotations

import pytest
from mp import checks_in_worlds


def _megatron_mlp():
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    B, S0, S1 = gt.sbp.broadcast, gt.sbp.split(0), gt.sbp.split(1)
    x = gt.to_global(torch.randn(8, 16), P, B)
    w1 = gt.to_global(torch.randn(32, 16), P, B).to_global(sbp=S0).detach().requires_grad_()
    w2 = gt.to_global(torch.randn(16, 32), P, B).to_global(sbp=S1).detach().requires_grad_()
    v = gt.to_global(torch.randn(16, 16), P, B).detach().requires_grad_()

    def step():
        h = F.linear(F.linear(x, w1).relu(), w2)      # partial_sum: boxed at the next op
        (F.linear(h + x, v) ** 2).mean().backward()
    return gt, torch, step, (w1, w2, v)


def check_check_step_lists_the_collectives_a_real_step_runs():
    gt, torch, step, params = _megatron_mlp()
    before = [p.detach().full().clone() for p in params]
    import importlib
    meet = importlib.import_module("globaltensor.comm.meet")   # (comm.meet is also a function)
    met = {k: set(v) for k, v in meet._met.items()}
    report = gt.debug.check_step(step)
    assert {k: set(v) for k, v in meet._met.items()} == met   # a dry run meets no one
    assert all(p.grad is None for p in params), [p.grad for p in params]
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach().full(), b)
    with gt.debug.comm_stats() as real:
        step()
    assert dict(report.counted.calls) == dict(real.calls), (report.counted, real)
    assert dict(report.counted.bytes) == dict(real.bytes), (report.counted, real)
    assert report.boxings and all(b.sent_bytes > 0 for b in report.boxings), report
    text = str(report)
    assert "test_step_check.py" in text and "collective call(s)" in text, text
    with pytest.raises(AssertionError, match="the step boxes"):
        report.raise_if_any()
    # a step that boxes nothing: nothing to raise
    x = gt.randn(8, 4, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0))
    gt.debug.check_step(lambda: (x * 2).relu()).raise_if_any()


def check_nanogpt_tensor_parallel_step_is_listed_exactly():
    # benchmarks/tp.py's GPT with Megatron's layout: forward, loss and backward
    import torch
    from mp import benchmark_module

    import globaltensor as gt
    tp = benchmark_module("tp")
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    model = gt.nn.to_global(tp.GPT(tp.Config(64, 16, 32, 4, 2)), P,
                            lambda name, t: tp._megatron_sbp(name))
    ids, targets = (gt.tensor(torch.randint(64, (4, 16)), placement=P, sbp=gt.sbp.broadcast)
                    for _ in range(2))

    def step():
        model(ids, targets).backward()
    report = gt.debug.check_step(step)
    assert all(p.grad is None for p in model.parameters())
    with gt.debug.comm_stats() as real:
        step()
    assert dict(report.counted.calls) == dict(real.calls), (report.counted, real)
    assert dict(report.counted.bytes) == dict(real.bytes), (report.counted, real)
    assert report.boxings, report


def check_one_rank_checks_alone():
    # nothing is sent: rank 0 checks while the others do not, and nobody waits
    import time
    gt, torch, step, params = _megatron_mlp()
    if gt.get_rank() == 0:
        t0 = time.perf_counter()
        report = gt.debug.check_step(step)
        assert report.counted.total_calls > 0 and time.perf_counter() - t0 < 30
    gt.comm.barrier()


def check_a_read_in_the_step_is_refused_clearly():
    gt, torch, step, params = _megatron_mlp()
    x = gt.randn(8, 4, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0))
    with pytest.raises(RuntimeError, match="fake tensors"):
        gt.debug.check_step(lambda: x.sum().item())


CHECKS = ["check_check_step_lists_the_collectives_a_real_step_runs",
          "check_nanogpt_tensor_parallel_step_is_listed_exactly"]
# what 4 ranks would not tell more of (the oversubscribed world costs time)
ONLY_IN_2 = ["check_one_rank_checks_alone", "check_a_read_in_the_step_is_refused_clearly"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, only_in_2=ONLY_IN_2)
