"""Reading values on one rank: a loss (the scalar result of a reduction over split rows)
is broadcast on every rank, so ``if rank == 0: log(loss.item())`` reads its copy with no
communication; other reads are collectives of the whole world (also of the ranks outside
the placement, which get the value too); called on some ranks only they fail within
GLOBALTENSOR_READ_TIMEOUT (1 s here) naming the call, and leave the world working."""
from __future__ import annotations

import contextlib
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
    """A collective of the world: the ranks that went on wait here, reading nothing, until
    the one reading alone gave up."""
    import globaltensor as gt
    gt.ones(gt.get_world_size(), placement=gt.placement.all("cpu"),
            sbp=gt.sbp.split(0)).to_global(sbp=gt.sbp.broadcast)


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
    import torch
    import globaltensor as gt
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    one = gt.tensor([5.0], placement=P, sbp=gt.sbp.split(0))  # one element, rank 0 holds it
    # the other ranks never come to these reads: a short timeout fails them as surely
    with _read_timeout(ABANDONED_READ_TIMEOUT):
        if gt.get_rank() == 0:
            for read, call in ((x.tolist, "x.tolist()"), (x.numpy, "x.numpy()"),
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
        x.to_global(sbp=gt.sbp.broadcast)  # the others wait here until rank 0 gave up
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


CHECKS = ["check_loss_is_broadcast_and_read_on_one_rank",
          "check_reads_of_a_sub_placement_reach_every_rank",
          "check_split_read_on_some_ranks_fails_fast", "check_read_after_the_others_gave_up_fails",
          "check_reads_of_different_tensors_raise",
          "check_pipeline_loss_read_on_rank_0"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
