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
    """(rank, a split tensor on ranks [0, 1] whose group exists, the default store)."""
    import torch.distributed as dist

    import globaltensor as gt
    r = gt.get_rank()
    x = gt.ones(4, 2, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    if r in (0, 1):
        x.to_global(sbp=gt.sbp.broadcast)  # both join: the group exists
    return r, x, dist.distributed_c10d._get_default_store()


def check_collective_one_rank_skips():
    import datetime

    import globaltensor as gt
    r, x, store = _split_on_ranks_0_and_1()
    if r == 0:  # rank 1 never joins this one
        start = time.monotonic()
        with pytest.raises(gt.debug.CollectiveError) as info:
            x.to_global(sbp=gt.sbp.broadcast)
        took = time.monotonic() - start
        store.set("one_rank_skipped", "done")
        text = str(info.value)
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
        with pytest.raises(gt.debug.CollectiveError) as info:
            x.to_global(sbp=gt.sbp.broadcast)
        store.set("metric_on_one_rank", "done")
        text = str(info.value)
        for words in ("AllGather", f"Probable cause: rank 0 gave up waiting for {metric}",
                      f"{__file__}:{MEAN_LINE}", "which rank 1 never reached"):
            assert words in text, (words, text)
    if r != 1:
        # rank 0 must not join rank 1's collective, nor anyone leave before it failed
        store.wait(["metric_on_one_rank"], datetime.timedelta(seconds=60))


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
CHECKS2 = ["check_read_of_different_tensors", "check_same_line_ops_on_different_tensors",
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


test_world2 = world_test(__name__, 2, CHECKS2)   # in the session's world of 2


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
