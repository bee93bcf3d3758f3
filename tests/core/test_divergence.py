"""Ranks that do not all take part: member-only process groups, collectives that one
rank never joins (named errors, no silent hang), and the check mode that catches
diverging ranks before they communicate."""
from __future__ import annotations

import time

import pytest
from mp import World, world_test

pytestmark = pytest.mark.multiprocess  # every test here runs in a world of processes

TIMEOUT = 5  # GLOBALTENSOR_TIMEOUT of the worlds below (seconds)


def _setup():
    import globaltensor as gt
    return gt, gt.get_rank()


def check_member_only_groups():
    # Rank 1 makes group [0, 1] and then [2, 1]; rank 2 only [2, 1]; rank 3 none. With
    # groups made by the whole world (or named by a per-process count) this hangs.
    gt, r = _setup()
    if r in (0, 1):
        x = gt.ones(4, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
        assert x.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [1.0] * 4
    if r in (1, 2):
        y = gt.full((3,), 2.0, placement=gt.placement("cpu", [2, 1]), sbp=gt.sbp.partial_sum)
        assert y.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [2.0] * 3


def _split_on_ranks_0_and_1():
    """(rank, a split tensor on ranks [0, 1], the default store)."""
    import torch.distributed as dist

    import globaltensor as gt
    x = gt.ones(4, 2, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    return gt.get_rank(), x, dist.distributed_c10d._get_default_store()


def _broadcast_again(x, ranks, before=lambda: None):
    """``x.to_global(sbp=broadcast)`` from one line twice, as a loop's steps: on ranks 0
    and 1 (its ranks meet there first: a new call path), then, after ``before()``, on
    ``ranks`` only. A call path met before is not met again, so the second is a plain
    collective, which waits GLOBALTENSOR_TIMEOUT for a rank that never comes. Returns the
    second one's CollectiveError (None where it completed or was not called) and seconds."""
    import globaltensor as gt
    r = gt.get_rank()
    for step in range(2):
        if step == 1:
            before()
        if r in ((0, 1) if step == 0 else ranks):
            start = time.monotonic()
            try:
                x.to_global(sbp=gt.sbp.broadcast)
            except gt.debug.CollectiveError as error:
                if step == 0:
                    raise
                return error, time.monotonic() - start
    return None, 0.0


def check_collective_one_rank_skips():
    import datetime

    r, x, store = _split_on_ranks_0_and_1()
    error, took = _broadcast_again(x, (0,))  # rank 1 never joins the second one
    if r == 0:
        store.set("one_rank_skipped", "done")
        assert error is not None
        text = str(error)
        assert took < 4 * TIMEOUT, took
        for word in ("to_global", "AllGather", "[0, 1]", "GLOBALTENSOR_TIMEOUT"):
            assert word in text, (word, text)
    else:
        # the others meet rank 0 in the harness's final barrier, whose timeout is as
        # short as the abandoned collective's: they wait for rank 0 in the store first
        store.wait(["one_rank_skipped"], datetime.timedelta(seconds=60))


def _mean(x):
    return x.mean()  # a scalar reduced at once: its ranks meet first


MEAN_LINE = _mean.__code__.co_firstlineno + 1


def check_collective_after_a_metric_on_one_rank_names_it():
    # Rank 0 computes a metric over split rows alone; rank 1 goes on to a collective (no
    # scalar reduction where the two would meet). Rank 0 fails within
    # GLOBALTENSOR_READ_TIMEOUT naming its mean; rank 1's collective fails (here after
    # GLOBALTENSOR_TIMEOUT; in a job as soon as rank 0's process ends) naming rank 0's
    # mean as the cause, not only its own to_global.
    import datetime

    import globaltensor as gt
    r, x, store = _split_on_ranks_0_and_1()
    metric = "reduce the torch.float32 scalar of aten.mean.default"

    def metric_on_rank_0():
        if r == 0:
            with pytest.raises(gt.debug.CollectiveError) as info:
                _mean(x).item()
            text = str(info.value)
            for words in ("aten.mean.default on rank 0 needs every rank", metric,
                          f"{__file__}:{MEAN_LINE}", "x.to_local()"):
                assert words in text, (words, text)
            store.set("metric_given_up", "yes")
        elif r == 1:
            # (in a job, rank 1's collective fails long after: at rank 0's exit, or after
            # GLOBALTENSOR_TIMEOUT; here that timeout is short, so start once rank 0 gave up)
            store.wait(["metric_given_up"], datetime.timedelta(seconds=60))
    error, _ = _broadcast_again(x, (1,), before=metric_on_rank_0)
    if r == 1:
        store.set("metric_on_one_rank", "done")
        assert error is not None
        text = str(error)
        for words in ("AllGather", f"Probable cause: rank 0 gave up waiting for {metric}",
                      f"{__file__}:{MEAN_LINE}", "which rank 1 never reached"):
            assert words in text, (words, text)
    if r != 1:
        # rank 0 must not join rank 1's collective, nor anyone leave before it failed
        store.wait(["metric_on_one_rank"], datetime.timedelta(seconds=60))


# --- divergences that fail within seconds, not after GLOBALTENSOR_TIMEOUT ----------------

BOUND = 30  # seconds: every rank raises well within the shared worlds' 60 s collective timeout


def _world_goes_on():
    """Every rank waits here (a plain collective: no meeting) for the others: the ranks
    that went on, for the one that gave up."""
    from globaltensor import comm
    comm.barrier()


def _short_read_timeout():
    """GLOBALTENSOR_READ_TIMEOUT=1 inside: meetings no other rank comes to fail fast."""
    import os
    from unittest import mock
    return mock.patch.dict(os.environ, {"GLOBALTENSOR_READ_TIMEOUT": "1"})


def _to_target(x, target):
    return x.to_global(sbp=target)  # one line on every rank: only the target differs


TARGET_LINE = _to_target.__code__.co_firstlineno + 1


def check_to_global_target_that_differs_per_rank():
    # One tensor boxed to split(0) on rank 0 and to broadcast on rank 1: their collectives
    # (all-to-all or reduce-scatter, all-gather or all-reduce) waited GLOBALTENSOR_TIMEOUT
    # (300 s by default). A to_global's ranks meet the first time it moves data from a call
    # path and compare its layouts: both raise at once, naming both targets.
    import globaltensor as gt
    from globaltensor import env
    assert env.timeout_seconds() >= 2 * BOUND, "the bound must not be the collective timeout"
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    mine = gt.sbp.split(0) if r == 0 else gt.sbp.broadcast
    for src in (gt.sbp.split(1), gt.sbp.partial_sum):
        x = gt.ones(4, 4, placement=p, sbp=src)
        start = time.monotonic()
        with pytest.raises(gt.debug.DivergenceError) as info:
            _to_target(x, mine)
        assert time.monotonic() - start < BOUND
        text = str(info.value)
        for words in (f"x.to_global() on rank {r} met the other ranks",
                      f"ranks [0] box a torch.float32 tensor with x.to_global() from sbp ({src},) "
                      f"to sbp (split(dim=0),)",
                      f"ranks [1] box a torch.float32 tensor with x.to_global() from sbp ({src},) "
                      f"to sbp (broadcast,)",
                      f"called from {__file__}:{TARGET_LINE}",
                      "sbp=split(0) if rank == 0 else broadcast", "x.to_local()"):
            assert words in text, (words, text)
    # Split(0) already on rank 0: nothing moves there, so nothing waits; rank 1's gather
    # meets no one and fails within GLOBALTENSOR_READ_TIMEOUT (rank 0 learns of it at its
    # next meeting, or in its next collective once rank 1's process ends).
    x = gt.ones(4, 4, placement=p, sbp=gt.sbp.split(0))
    with _short_read_timeout():
        if r == 1:
            start = time.monotonic()
            with pytest.raises(gt.debug.CollectiveError) as info:
                _to_target(x, mine)
            assert time.monotonic() - start < BOUND
            text = str(info.value)
            for words in ("x.to_global() on rank 1 needs every rank of [0, 1]",
                          "GLOBALTENSOR_READ_TIMEOUT=1 s", f"called from {__file__}:{TARGET_LINE}",
                          "sbp=split(0) if rank == 0 else broadcast"):
                assert words in text, (words, text)
        else:
            assert _to_target(x, mine) is x
        _world_goes_on()
    # the world goes on, and so does the line with one target on every rank
    assert _to_target(x, gt.sbp.broadcast).to_local().tolist() == [[1.0] * 4] * 4


def _backward(loss):
    loss.backward()  # the gradients' all-reduce: every rank of the placement must be here


BACKWARD_LINE = _backward.__code__.co_firstlineno + 1


def check_backward_skipped_on_one_rank():
    # Rank 1 skips backward() (a step it decided to skip alone): rank 0's gradient
    # all-reduce waited GLOBALTENSOR_TIMEOUT. A bucket's ranks meet the first time it is
    # reduced from a call path: rank 0 fails within GLOBALTENSOR_READ_TIMEOUT naming
    # backward(), its line and the fix; a rank at another meeting (a read) raises at once.
    import copy

    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    r = gt.get_rank()
    p, s0 = gt.placement("cpu", [0, 1]), gt.sbp.split(0)
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = gt.nn.to_global(copy.deepcopy(reference), p, gt.sbp.broadcast)
    g = torch.Generator().manual_seed(1)
    xv, yv = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    x, y = gt.tensor(xv, placement=p, sbp=s0), gt.tensor(yv, placement=p, sbp=s0)

    def loss():
        return F.mse_loss(model(x), y)
    with _short_read_timeout():
        step = loss()
        if r == 0:
            start = time.monotonic()
            with pytest.raises(gt.debug.CollectiveError) as info:
                _backward(step)
            assert time.monotonic() - start < BOUND
            text = str(info.value)
            for words in ("backward() on rank 0 needs every rank of [0, 1]",
                          "GLOBALTENSOR_READ_TIMEOUT=1 s", "all-reduce the torch.float32 gradients of",
                          f"in backward() called from {__file__}:{BACKWARD_LINE}",
                          "if not torch.isfinite(loss): continue"):
                assert words in text, (words, text)
        _world_goes_on()
    model.zero_grad(set_to_none=True)
    step = loss()
    with pytest.raises(gt.debug.DivergenceError) as info:
        if r == 0:
            _backward(step)
        else:
            x.tolist()
    for words in ("ranks [0] all-reduce the torch.float32 gradients",
                  f"in backward() called from {__file__}:{BACKWARD_LINE}",
                  "ranks [1] read a torch.float32 (4, 3) tensor"):
        assert words in str(info.value), (words, str(info.value))
    # the world goes on: backward on every rank reduces the gradients as before
    model.zero_grad(set_to_none=True)
    _backward(loss())
    F.mse_loss(reference(xv), yv).backward()
    for mine, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad.full(), want.grad)
    # Gradients kept from that backward (no zero_grad(): gradient accumulation): autograd
    # adds the next ones to them with an all-reduce of its own, outside the buckets,
    # which meets as well. (Four steps in all: the fifth would be recorded for the step
    # planner, whose replay would take over the next checks' calls.)
    with _short_read_timeout():
        step = loss()
        if r == 0:
            with pytest.raises(gt.debug.CollectiveError) as info:
                _backward(step)
            for words in ("backward() on rank 0 needs every rank of [0, 1]",
                          "to add them to the kept .grad",
                          f"in backward() called from {__file__}:{BACKWARD_LINE}"):
                assert words in str(info.value), (words, str(info.value))
        _world_goes_on()
    assert x.tolist() == xv.tolist()  # every rank reads together again


def check_read_of_different_tensors():
    # Rank 0 asks a.tolist(), rank 1 b.tolist() (split: gathered): without the check mode
    # the all-gathers pair up and both ranks print one mixed value; with it, both raise.
    import globaltensor as gt
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    a = gt.tensor([11.0, 22.0, 33.0], placement=p, sbp=gt.sbp.split(0))
    b = gt.tensor([22.0, 44.0, 66.0], placement=p, sbp=gt.sbp.split(0))
    with gt.debug.check_consistency():
        with pytest.raises(gt.debug.DivergenceError, match="ranks"):
            if r == 0:
                a.tolist()
            else:
                b.tolist()
        assert a.tolist() == [11.0, 22.0, 33.0] and b.tolist() == [22.0, 44.0, 66.0]


def check_same_line_ops_on_different_tensors():
    # A logging helper: one line, called with a on rank 0 and b on rank 1 (same shape,
    # layout and dtype). Without the check mode both ranks get a mix; with it, each
    # tensor's origin (the line that made it, the ops since) is part of the fingerprint.
    import globaltensor as gt
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])

    def log(t):
        return t.sum().item()
    with gt.debug.check_consistency():
        a = gt.tensor([11.0, 22.0, 33.0], placement=p, sbp=gt.sbp.split(0))
        b = gt.tensor([22.0, 44.0, 66.0], placement=p, sbp=gt.sbp.split(0))
        mine = a if r == 0 else b
        with pytest.raises(gt.debug.DivergenceError, match="ranks"):
            log(mine)
        with pytest.raises(gt.debug.DivergenceError, match="ranks"):
            mine.tolist()
        with pytest.raises(gt.debug.DivergenceError, match="ranks"):
            mine.to_global(sbp=gt.sbp.broadcast)
        with pytest.raises(gt.debug.DivergenceError, match="ranks"):
            (mine * 2).tolist()  # an op's output: the op on inputs of other origins
        assert (log(a), log(b)) == (66.0, 132.0)
        assert (a * 2).tolist() == [22.0, 44.0, 66.0]


def check_dtype_differs_per_rank():
    import torch

    import globaltensor as gt
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    dtype = torch.float32 if r == 0 else torch.float64
    # from_local with a given shape compares the dtype too: both ranks raise there
    with pytest.raises(gt.debug.DivergenceError, match=r"ranks \[0\] / \[1\] passed different ones"):
        gt.from_local(torch.ones(2, dtype=dtype), placement=p, sbp=gt.sbp.split(0), shape=(4,))
    # a tensor made some other way (here: a trusted part) is caught by the check mode
    from globaltensor.layout import Layout
    from globaltensor.tensor import from_local_part
    x = from_local_part(torch.ones(2, dtype=dtype), Layout.make((4,), p, gt.sbp.split(0)))
    with gt.debug.check_consistency():
        with pytest.raises(gt.debug.DivergenceError):
            x.to_global(sbp=gt.sbp.broadcast)


def check_rank_dependent_shapes_raise_at_the_next_boxing():
    import warnings

    import torch

    import globaltensor as gt
    from globaltensor.comm import guard
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    # a factory given a rank-dependent size: the collective of the next boxing would
    # abort the process (gloo: "Received data size doesn't match expected size")
    x = gt.randn(4 + 2 * r, 3, placement=p, sbp=gt.sbp.split(0))
    with pytest.raises(gt.debug.DivergenceError, match=rf"the last: \({4 + 2 * r}, 3\) .*ranks \[{1 - r}\]"):
        x.to_global(sbp=gt.sbp.broadcast)
    # a plain module built differently per rank: its broadcast would leave garbage
    with pytest.raises(gt.debug.DivergenceError, match=rf"the last: \(2, {3 + r}\) "):
        gt.nn.to_global(torch.nn.Linear(3 + r, 2), p, gt.sbp.broadcast)
    # tensors made alike: compared once at the next boxing, then nothing is pending
    a = gt.arange(4, placement=p, sbp=gt.sbp.split(0))
    b = gt.ones(4, placement=p, sbp=gt.sbp.split(0))
    assert guard._claims
    with warnings.catch_warnings(record=True) as caught:   # (torch's deprecation warnings
        warnings.simplefilter("always")                     # would reach every program)
        assert (a + b).to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert not guard._claims and not caught, [str(w.message) for w in caught]


def check_load_state_dict_differs_per_rank():
    import torch

    import globaltensor as gt
    r = gt.get_rank()
    model = gt.nn.to_global(torch.nn.Linear(3, 2), gt.placement("cpu", [0, 1]),
                            gt.sbp.broadcast)
    same = {k: torch.full(v.shape, 1.0) for k, v in model.state_dict().items()}
    with gt.debug.check_consistency():
        model.load_state_dict(same)  # equal everywhere: accepted
        assert float(model.weight.sum()) == 6.0
        differ = {k: torch.full(v.shape, float(r)) for k, v in model.state_dict().items()}
        # torch's load_state_dict re-raises what copy_ raised as a RuntimeError.
        with pytest.raises(RuntimeError, match="hold different values"):
            model.load_state_dict(differ)


def check_from_local_exchanges_no_pickles():
    import torch
    import torch.distributed as dist

    import globaltensor as gt
    r = gt.get_rank()

    def refuse(*args, **kwargs):
        raise AssertionError("from_local must not unpickle peer data")
    saved = dist.all_gather_object
    dist.all_gather_object = refuse
    try:
        p = gt.placement("cpu", [0, 1])
        x = gt.from_local(torch.full((2 - r, 2), float(r)), placement=p, sbp=gt.sbp.split(0))
        assert tuple(x.shape) == (3, 2), x.shape
        assert x.full().tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    finally:
        dist.all_gather_object = saved


def check_profiler_and_debug_log_name_the_boxing():
    import logging

    import torch

    import globaltensor as gt
    p = gt.placement("cpu", [0, 1])
    x = gt.randn(4, 3, placement=p, sbp=gt.sbp.split(0))
    w = gt.randn(3, 2, placement=p, sbp=gt.sbp.split(1))
    with torch.profiler.profile() as prof:
        x @ w  # the dispatcher boxes an input
    names = [e.name for e in prof.events() if e.name.startswith("globaltensor")]
    assert any("aten.mm" in n and "boxing" in n for n in names), names
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    log = logging.getLogger("globaltensor")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        x.to_global(sbp=gt.sbp.broadcast)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert records and all(rec.levelno == logging.DEBUG for rec in records), records
    assert "AllGather" in records[0].getMessage()


CHECKS3 = ["check_member_only_groups"]
CHECKS2 = ["check_to_global_target_that_differs_per_rank", "check_backward_skipped_on_one_rank",
           "check_read_of_different_tensors", "check_same_line_ops_on_different_tensors",
           "check_dtype_differs_per_rank", "check_rank_dependent_shapes_raise_at_the_next_boxing",
           "check_load_state_dict_differs_per_rank", "check_from_local_exchanges_no_pickles",
           "check_profiler_and_debug_log_name_the_boxing"]


@pytest.fixture(scope="module")
def world4():
    # fresh processes: in the session's world the groups [0, 1] and [2, 1] exist already
    return World(4, __name__, CHECKS3, timeout=120)


@pytest.mark.parametrize("name", CHECKS3)
def test_world4(world4, name):
    world4.check(name)


# in the session's world of 2 (the profiler is one per process; a patch of pickling is
# the process's, which a simulated rank's would leave on for the next check)
test_world2 = world_test(__name__, 2, CHECKS2,
                         in_processes=["check_profiler_and_debug_log_name_the_boxing",
                                       "check_from_local_exchanges_no_pickles"])


def test_collective_that_one_rank_skips_ends_with_a_named_error():
    # Three ranks: the placement's group [0, 1] is not the world's, so the final
    # barrier of the harness does not meet the abandoned collective.
    world = World(3, __name__, ["check_collective_one_rank_skips"], timeout=120,
                  env={"GLOBALTENSOR_TIMEOUT": str(TIMEOUT)})
    world.check("check_collective_one_rank_skips")


def test_collective_after_a_metric_on_one_rank_names_the_metric():
    # Three ranks, as above: the abandoned collective is the group [0, 1]'s, not the world's.
    world = World(3, __name__, ["check_collective_after_a_metric_on_one_rank_names_it"],
                  timeout=120, env={"GLOBALTENSOR_TIMEOUT": str(TIMEOUT),
                                    "GLOBALTENSOR_READ_TIMEOUT": "1"})
    world.check("check_collective_after_a_metric_on_one_rank_names_it")
