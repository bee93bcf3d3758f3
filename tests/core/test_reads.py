"""Reading values on one rank: a loss (the scalar result of a reduction over split rows)
is broadcast on every rank, so ``if rank == 0: log(loss.item())`` reads its copy with no
communication; other reads are collectives of the whole world (also of the ranks outside
the placement, which get the value too); called on some ranks only they fail within
GLOBALTENSOR_READ_TIMEOUT (1 s here) naming the call, and leave the world working. So
does the reduction itself when one rank computes such a scalar alone (a metric on rank
0): it meets like a read."""
from __future__ import annotations

import contextlib
import inspect
import os
import time

import pytest
from mp import checks_in_worlds

READ_TIMEOUT = 1.0
ABANDONED_READ_TIMEOUT = 0.25   # reads that no other rank comes to


@contextlib.contextmanager
def _read_timeout(seconds: float):
    saved = os.environ.get("GLOBALTENSOR_READ_TIMEOUT")
    os.environ["GLOBALTENSOR_READ_TIMEOUT"] = str(seconds)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["GLOBALTENSOR_READ_TIMEOUT"]
        else:
            os.environ["GLOBALTENSOR_READ_TIMEOUT"] = saved


def _no_communication(read):
    import globaltensor as gt
    with gt.debug.comm_stats() as stats:
        value = read()
    assert stats.total_calls == 0, stats
    return value


def check_loss_is_broadcast_and_read_on_one_rank():
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    P = gt.placement.all("cpu")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(0)  # the same reference on every rank
    reference = torch.nn.Linear(5, 3)
    model = gt.nn.to_global(torch.nn.Linear(5, 3), P, gt.sbp.broadcast)
    model.load_state_dict(reference.state_dict())
    S0 = gt.sbp.split(0)
    loss = F.cross_entropy(model(gt.tensor(x, placement=P, sbp=S0)),
                           gt.tensor(y, placement=P, sbp=S0))
    want = F.cross_entropy(reference(x), y)
    assert loss.sbp == (gt.sbp.broadcast,), loss.sbp
    if gt.get_rank() == 0:  # the other ranks read nothing, and are not waited for
        assert abs(_no_communication(loss.item) - want.item()) < 1e-5
        assert abs(_no_communication(lambda: float(loss)) - want.item()) < 1e-5
        assert _no_communication(lambda: f"{loss:.4f}") == f"{want.item():.4f}"
        assert _no_communication(loss.tolist) == _no_communication(loss.numpy).item()
        assert _no_communication(lambda: bool(loss)) is True
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.sbp == (gt.sbp.broadcast,)
        torch.testing.assert_close(p.grad.full(), q.grad)
    v = torch.arange(12.0).reshape(6, 2)
    xs = gt.tensor(v, placement=P, sbp=S0)
    for name, got, expected in [("sum", xs.sum(), v.sum()), ("mean", xs.mean(), v.mean()),
                                ("amax", xs.amax(), v.amax()),
                                ("mse_loss", F.mse_loss(xs, xs * 2), F.mse_loss(v, v * 2))]:
        assert got.sbp == (gt.sbp.broadcast,), (name, got.sbp)
        if gt.get_rank() == 1:
            torch.testing.assert_close(torch.tensor(_no_communication(got.item)), expected,
                                       msg=name)


def check_reads_of_a_sub_placement_reach_every_rank():
    # ranks outside the placement run the same program and get the value too (torch's
    # trunc_normal_ tests values in a loop on every rank); on its own rank, to_local()
    # is a broadcast tensor's copy
    import torch

    import globaltensor as gt
    v = torch.arange(6.0).reshape(2, 3)
    last = gt.get_world_size() - 1
    alone = gt.tensor(v, placement=gt.placement("cpu", [last]), sbp=gt.sbp.broadcast)
    assert alone.tolist() == v.tolist() and float(alone[1, 2]) == 5.0
    assert torch.equal(torch.from_numpy(alone.numpy()), v)
    if gt.get_rank() == last:
        assert _no_communication(lambda: alone.to_local().tolist()) == v.tolist()
    with _read_timeout(READ_TIMEOUT):
        if gt.get_rank() == last:  # its own rank alone: the others never come
            with pytest.raises(gt.debug.CollectiveError, match=r"x\.tolist\(\) on rank .* "
                               r"needs every rank .*x\.to_local\(\) is that copy"):
                alone.tolist()
        _everyone_waits_here()


def _everyone_waits_here():
    """A collective of the world that does not meet first (a to_global from a new call
    path would): the ranks that went on wait here, reading nothing, until the one
    reading alone gave up."""
    from globaltensor import comm
    comm.barrier()


def check_reads_of_different_tensors_raise():
    # rank 0 reads x, the others y: they meet, see it, and all raise (their gathers
    # would have paired up)
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    y = gt.tensor(torch.ones(2, 3), placement=P, sbp=gt.sbp.split(1))
    with pytest.raises(gt.debug.DivergenceError, match=r"ranks \[0\] read a torch.float32 "
                       r"\(4,\) tensor .*ranks \[1.*\] read a torch.float32 \(2, 3\)"):
        if gt.get_rank() == 0:
            x.tolist()
        else:
            y.tolist()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and y.tolist() == [[1.0] * 3] * 2


def check_split_read_on_some_ranks_fails_fast():
    import numpy as np
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    one = gt.tensor([5.0], placement=P, sbp=gt.sbp.split(0))  # one element, rank 0 holds it
    # the other ranks never come to these reads: a short timeout fails them as surely
    with _read_timeout(ABANDONED_READ_TIMEOUT):
        if gt.get_rank() == 0:
            for read, call in ((x.tolist, "x.tolist()"), (x.numpy, "x.numpy()"),
                               (lambda: np.asarray(x), "x.numpy()"),
                               (lambda: x.detach().numpy(), "x.numpy()"),
                               (one.item, "x.item()"), (lambda: float(one), "float(x)")):
                start = time.monotonic()
                with pytest.raises(gt.debug.CollectiveError) as info:
                    read()
                took = time.monotonic() - start
                text = str(info.value)
                assert took < ABANDONED_READ_TIMEOUT + 2, (call, took)
                everyone = str(list(range(gt.get_world_size())))
                for words in (call, "GLOBALTENSOR_READ_TIMEOUT", everyone,
                              "x.to_global(sbp=gt.sbp.broadcast)"):
                    assert words in text, (words, text)
            # x.full(), which x.numpy() is as numpy, meets the first time it gathers from
            # a call path (a branch on the rank is a new one)
            start = time.monotonic()
            with pytest.raises(gt.debug.CollectiveError) as info:
                x.full()
            assert time.monotonic() - start < ABANDONED_READ_TIMEOUT + 2
            for words in (f"x.full() on rank 0 needs every rank of {everyone}",
                          "GLOBALTENSOR_READ_TIMEOUT", "Call it on every rank"):
                assert words in str(info.value), (words, str(info.value))
        _everyone_waits_here()
    with _read_timeout(READ_TIMEOUT):
        # The world still works: a collective, then reads on every rank.
        assert x.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and one.item() == 5.0


def check_read_after_the_others_gave_up_fails():
    # The other ranks reach the read rank 0 gave up on: they raise too, rather than
    # pairing their gather with rank 0's next read.
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))

    def read():
        return x.tolist()

    with _read_timeout(READ_TIMEOUT):
        if gt.get_rank() == 0:
            with pytest.raises(gt.debug.CollectiveError, match="not all of them called it"):
                read()
        _everyone_waits_here()  # the others wait here until rank 0 gave up
        if gt.get_rank() != 0:
            with pytest.raises(gt.debug.CollectiveError, match="came after rank 0 stopped"):
                read()
        assert read() == [0.0, 1.0, 2.0, 3.0]


def check_pipeline_loss_read_on_rank_0():
    # rank 0 runs the first stage (a stage per rank): the loss comes to every rank of the
    # pipeline
    import copy

    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    torch.manual_seed(0)
    n = gt.get_world_size()
    layers = [torch.nn.Linear(4, 6)] + [torch.nn.Linear(6, 6) for _ in range(n - 2)] + \
        [torch.nn.Linear(6, 2)]
    reference = copy.deepcopy(torch.nn.Sequential(*layers))
    stages = [gt.nn.to_global(m, gt.placement("cpu", [k]), gt.sbp.broadcast)
              for k, m in enumerate(layers)]
    pipe = gt.pipeline.Pipeline(stages, micro_batches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    loss = pipe.step(x, y)
    if gt.get_rank() == 0:
        want = F.mse_loss(reference(x), y).item()
        assert abs(_no_communication(loss.item) - want) < 1e-5


# --- a metric computed on one rank -----------------------------------------------------

BOUND = 30  # seconds within which every rank raises: far below the collective timeout


def _accuracy(logits, y):
    return (logits.argmax(-1) == y).float().mean()  # a reduction over split rows


ACCURACY_LINE = _accuracy.__code__.co_firstlineno + 1


def _classifier_step():
    """A data-parallel step of a small classifier (embedding, linear) on split rows, run
    once on every rank: (step, logits, y, (x, y) as plain tensors, the plain reference
    model). ``step()`` runs the next step on the same batch (no tensors made: nothing
    left for the ranks to compare after an error)."""
    import copy

    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    from globaltensor import env
    assert env.timeout_seconds() >= 2 * BOUND, "the bound must not be the collective timeout"
    P, S0 = gt.placement.all("cpu"), gt.sbp.split(0)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(),
                                    torch.nn.Linear(8, 3))
    model = gt.nn.to_global(copy.deepcopy(reference), P, gt.sbp.broadcast)
    g = torch.Generator().manual_seed(5)
    xv, yv = torch.randint(0, 10, (8, 2), generator=g), torch.randint(0, 3, (8,), generator=g)
    x, y = gt.tensor(xv, placement=P, sbp=S0), gt.tensor(yv, placement=P, sbp=S0)

    def step():
        logits = model(x)
        F.cross_entropy(logits, y).backward()
        return logits
    return step, step(), y, (xv, yv), reference


STEP_LINE = inspect.getsource(_classifier_step).splitlines().index(
    "        logits = model(x)") + _classifier_step.__code__.co_firstlineno


def _names_the_fix(text: str) -> None:
    for words in ("on every rank", "if rank == 0", "x.to_local()"):
        assert words in text, (words, text)


def check_metric_on_one_rank_meets_the_others_at_their_next_new_reduction():
    # rank 0 computes a metric alone; the others go on to a step on a call path not met
    # before (as in a loop's first step), whose embedding checks its indices with a
    # scalar reduction: they meet there, and every rank raises at once naming both,
    # instead of rank 0's mean waiting the collective timeout or pairing its all-reduce
    # with the others' (wrong values, or a misleading error there)
    import globaltensor as gt
    step, logits, y, (xv, yv), _ = _classifier_step()
    start = time.monotonic()
    with pytest.raises(gt.debug.DivergenceError) as info:
        if gt.get_rank() == 0:
            _accuracy(logits, y).item()
        else:
            step()
    took = time.monotonic() - start
    text = str(info.value)
    assert took < BOUND, took
    others = str(list(range(1, gt.get_world_size())))
    for words in ("ranks [0] reduce the torch.float32 scalar of aten.mean.default",
                  f"called from {__file__}:{ACCURACY_LINE}",
                  f"ranks {others} reduce the torch.int64 scalar of embedding index check",
                  f"called from {__file__}:{STEP_LINE}"):
        assert words in text, (words, text)   # on each rank: the cause, not only the effect
    _names_the_fix(text)
    assert y.tolist() == yv.tolist()  # the world goes on: nothing was left half done


def check_metric_on_one_rank_fails_fast_while_the_others_wait_elsewhere():
    # the others wait in a collective (not a reduction that meets): rank 0's metric
    # fails within GLOBALTENSOR_READ_TIMEOUT naming the op, its line and the fix, and
    # never starts its all-reduce (which would pair with the others' gather)
    import globaltensor as gt
    _, logits, y, (xv, yv), _ = _classifier_step()
    with _read_timeout(READ_TIMEOUT):
        if gt.get_rank() == 0:
            start = time.monotonic()
            with pytest.raises(gt.debug.CollectiveError) as info:
                _accuracy(logits, y).item()
            took = time.monotonic() - start
            text = str(info.value)
            assert took < BOUND, took
            for words in ("aten.mean.default on rank 0 needs every rank",
                          f"called from {__file__}:{ACCURACY_LINE}",
                          "GLOBALTENSOR_READ_TIMEOUT"):
                assert words in text, (words, text)
            _names_the_fix(text)
        _everyone_waits_here()
    assert y.tolist() == yv.tolist()


def check_next_reduction_after_a_metric_on_one_rank_names_it():
    # the others reach their next scalar reduction only after rank 0 gave up on its
    # metric: they pass over its cancelled round, wait in vain in the next one, and their
    # error names rank 0's metric as the cause, not only their own sum
    import datetime

    import torch.distributed as dist

    import globaltensor as gt
    _, logits, y, (xv, yv), _ = _classifier_step()
    store = dist.distributed_c10d._get_default_store()
    wait = datetime.timedelta(seconds=2 * BOUND)
    with _read_timeout(READ_TIMEOUT):
        if gt.get_rank() == 0:
            with pytest.raises(gt.debug.CollectiveError, match="aten.mean.default on rank 0"):
                _accuracy(logits, y).item()
            store.set("metric_alone/given_up", "yes")
            store.wait(["metric_alone/done"], wait)  # not in their round: they give up
        else:
            store.wait(["metric_alone/given_up"], wait)
            start = time.monotonic()
            with pytest.raises(gt.debug.CollectiveError) as info:
                logits.sum()
            assert time.monotonic() - start < BOUND
            text = str(info.value)
            for words in ("aten.sum.default", "rank 0 gave up waiting for reduce the "
                          "torch.float32 scalar of aten.mean.default",
                          f"called from {__file__}:{ACCURACY_LINE}", "never reached"):
                assert words in text, (words, text)
            if store.add("metric_alone/failed", 1) == gt.get_world_size() - 1:
                store.set("metric_alone/done", "yes")
    assert y.tolist() == yv.tolist()  # then every rank reads together again


def check_reductions_met_once_are_not_met_again():
    # a loop's reductions and gradient buckets meet in its first step only: later steps
    # cost no store round trips, and a rank late to its loss (validating alone, say) is
    # waited for as long as the collective waits, not GLOBALTENSOR_READ_TIMEOUT
    import importlib

    import globaltensor as gt
    meeting = importlib.import_module("globaltensor.comm.meet")  # (comm.meet: the function)
    step, *_ = _classifier_step()
    shipped, names = meeting.meet, []
    meeting.meet = lambda ranks, what, *rest: (names.append(what), shipped(ranks, what, *rest))
    met = []
    try:
        for i in range(3):
            before = len(names)
            with _read_timeout(ABANDONED_READ_TIMEOUT if i == 2 else 10.0):
                if i == 2 and gt.get_rank() == 1:
                    time.sleep(4 * ABANDONED_READ_TIMEOUT)  # late, not gone: rank 0 waits
                step()
            met.append(names[before:])
    finally:
        meeting.meet = shipped
    for name in ("embedding index check", "aten.nll_loss_forward.default", "backward()"):
        assert name in met[0], (name, met)
    assert met[1:] == [[], []], met


def check_metric_on_every_rank_read_on_one():
    # what the errors advise: the metric computed on every rank and read on rank 0 (its
    # broadcast copy, no communication), or a local figure from this rank's rows
    import globaltensor as gt
    _, logits, y, (xv, yv), reference = _classifier_step()
    right = reference(xv).argmax(-1) == yv
    acc = _accuracy(logits, y)  # every rank
    assert acc.sbp == (gt.sbp.broadcast,), acc.sbp
    rank = gt.get_rank()
    if rank == 0:
        assert abs(_no_communication(acc.item) - right.float().mean().item()) < 1e-6
    if rank == 1:  # (rows of its own in the world of 4 too)
        region = y.global_layout.region(rank)
        rows = slice(region.offsets[0], region.offsets[0] + region.sizes[0])
        local = _no_communication(lambda: _accuracy(logits.to_local(), y.to_local()).item())
        assert abs(local - right[rows].float().mean().item()) < 1e-6


def check_allclose_compares_parts_or_the_whole_value():
    # two GlobalTensors compare part by part (one bool is read, not their parts); a plain
    # expected value is compared with the whole value, as torch.equal does
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    v = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    a = gt.tensor(v, placement=P, sbp=gt.sbp.split(0))
    b = gt.tensor(v + 1e-9, placement=P, sbp=gt.sbp.split(0))
    with gt.debug.comm_stats() as stats:
        assert torch.allclose(a, b) and a.allclose(b)
    assert set(stats.calls) == {"all_reduce"} and stats.total_bytes < 64, stats
    b = gt.tensor(v + 1e-9, placement=P, sbp=gt.sbp.split(1))
    assert torch.allclose(a, b) and torch.allclose(b, a)
    far = gt.tensor(v + 1e-3 * (v.abs() > 2), placement=P, sbp=gt.sbp.split(1))
    assert not torch.allclose(a, far) and torch.allclose(a, far, atol=1e-2)
    nan = gt.tensor(torch.full((64, 32), float("nan")), placement=P, sbp=gt.sbp.split(0))
    assert not torch.allclose(nan, nan) and torch.allclose(nan, nan, equal_nan=True)
    assert torch.allclose(a, v) and torch.allclose(v, b) and not torch.allclose(v + 1e-3, a)
    row = gt.tensor(v[:1], placement=P, sbp=gt.sbp.broadcast)   # broadcast shapes, as torch
    assert torch.allclose(gt.tensor(v[:1].expand(4, 32), placement=P, sbp=gt.sbp.split(0)), row)


CHECKS = ["check_loss_is_broadcast_and_read_on_one_rank",
          "check_reads_of_a_sub_placement_reach_every_rank",
          "check_split_read_on_some_ranks_fails_fast", "check_read_after_the_others_gave_up_fails",
          "check_reads_of_different_tensors_raise",
          "check_pipeline_loss_read_on_rank_0",
          "check_metric_on_one_rank_meets_the_others_at_their_next_new_reduction",
          "check_reductions_met_once_are_not_met_again",
          "check_metric_on_one_rank_fails_fast_while_the_others_wait_elsewhere",
          "check_next_reduction_after_a_metric_on_one_rank_names_it",
          "check_metric_on_every_rank_read_on_one",
          "check_allclose_compares_parts_or_the_whole_value"]
# (a rank waiting for a reduction the others never join times out inside the collective)
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, in_processes=["check_next_reduction_after_a_metric_on_one_rank_names_it"])
