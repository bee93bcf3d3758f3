"""Reading values on one rank: a loss (the scalar result of a reduction over split rows)
is broadcast, so ``if rank == 0: log(loss.item())`` reads its copy with no
communication; reads of split tensors called on some ranks only fail within
GLOBALTENSOR_READ_TIMEOUT (1 s here) naming the call, and leave the world working."""
from __future__ import annotations

import contextlib
import os
import time

import pytest

from mp import checks_in_worlds

READ_TIMEOUT = 1.0


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


def check_broadcast_reads_on_one_rank():
    import torch
    import globaltensor as gt
    v = torch.arange(6.0).reshape(2, 3)
    whole = gt.tensor(v, placement=gt.placement.all("cpu"), sbp=gt.sbp.broadcast)
    last = gt.get_world_size() - 1
    alone = gt.tensor(v, placement=gt.placement("cpu", [last]), sbp=gt.sbp.broadcast)
    if gt.get_rank() == last:  # any placement: a rank of it reads its copy
        for x in (whole, alone):
            assert _no_communication(x.tolist) == v.tolist()
            assert (_no_communication(x.numpy) == v.numpy()).all()
            assert _no_communication(lambda: float(x[1, 2])) == 5.0
            assert _no_communication(lambda: bool(x[0, 1])) is True
    elif gt.get_rank() == 0:  # holds nothing of `alone`: says so at once
        for read, call in ((alone.tolist, "x.tolist()"), (lambda: float(alone[0, 0]), "float(x)")):
            with pytest.raises(RuntimeError, match=r"holds no part .*x\.full\(\)") as info:
                read()
            assert call in str(info.value), info.value


def check_split_read_on_some_ranks_fails_fast():
    import torch
    import globaltensor as gt
    P = gt.placement("cpu", [0, 1])
    rank = gt.get_rank()
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    one = gt.tensor([5.0], placement=P, sbp=gt.sbp.split(0))  # one element, rank 0 holds it
    with _read_timeout(READ_TIMEOUT):
        if rank == 0:
            for read, call in ((x.tolist, "x.tolist()"), (x.numpy, "x.numpy()"),
                               (one.item, "x.item()"), (lambda: float(one), "float(x)")):
                start = time.monotonic()
                with pytest.raises(gt.debug.CollectiveError) as info:
                    read()
                took = time.monotonic() - start
                text = str(info.value)
                assert took < READ_TIMEOUT + 2, (call, took)
                for words in (call, "GLOBALTENSOR_READ_TIMEOUT", "[0, 1]",
                              "x.to_global(sbp=gt.sbp.broadcast)"):
                    assert words in text, (words, text)
        # The world still works: a collective, then reads on both ranks.
        if rank in P:
            assert x.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
            assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and one.item() == 5.0


def check_read_after_the_others_gave_up_fails():
    # Rank 1 reaches the read rank 0 gave up on: it raises too, rather than pairing its
    # gather with rank 0's next read.
    import torch
    import globaltensor as gt
    P = gt.placement("cpu", [0, 1])
    rank = gt.get_rank()
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))

    def read():
        return x.tolist()

    with _read_timeout(READ_TIMEOUT):
        if rank == 0:
            with pytest.raises(gt.debug.CollectiveError, match="not all of them called it"):
                read()
        if rank in P:
            x.to_global(sbp=gt.sbp.broadcast)  # rank 1 waits here until rank 0 gave up
        if rank == 1:
            with pytest.raises(gt.debug.CollectiveError, match="came after rank 0 stopped"):
                read()
        if rank in P:
            assert read() == [0.0, 1.0, 2.0, 3.0]


def check_pipeline_loss_read_on_rank_0():
    # rank 0 runs the first stage: the loss comes to every rank of the pipeline
    import torch
    import torch.nn.functional as F
    import globaltensor as gt
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)]
    reference = torch.nn.Sequential(*[torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)])
    reference.load_state_dict(torch.nn.Sequential(*layers).state_dict())
    stages = [gt.nn.to_global(m, gt.placement("cpu", [k]), gt.sbp.broadcast)
              for k, m in enumerate(layers)]
    pipe = gt.pipeline.Pipeline(stages, micro_batches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    loss = pipe.step(x, y)
    if gt.get_rank() == 0:
        want = F.mse_loss(reference(x), y).item()
        assert abs(_no_communication(loss.item) - want) < 1e-5


def check_read_needs_only_the_ranks_holding_its_parts():
    # split along axis 0 of a 2-D placement: ranks 0 and 2 hold the parts of rank 0's
    # value; they read, ranks 1 and 3 do not
    import torch
    import globaltensor as gt
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])
    x = gt.tensor(torch.arange(4.0), placement=mesh, sbp=(gt.sbp.split(0), gt.sbp.broadcast))
    with _read_timeout(30):  # a generous bound: it must not be needed
        if gt.get_rank() in (0, 2):
            assert x.tolist() == [0.0, 1.0, 2.0, 3.0]


def check_ops_that_read_values_run_on_ranks_outside():
    # F.one_hot counts the classes from the values; ranks 2 and 3, outside the
    # placement, run the op too and need the count for the output shape
    import torch
    import torch.nn.functional as F
    import globaltensor as gt
    idx = gt.tensor(torch.tensor([0, 3, 1]), placement=gt.placement("cpu", [0, 1]),
                    sbp=gt.sbp.split(0))
    out = F.one_hot(idx)
    assert out.shape == (3, 4), out.shape


CHECKS = ["check_loss_is_broadcast_and_read_on_one_rank", "check_broadcast_reads_on_one_rank",
          "check_split_read_on_some_ranks_fails_fast", "check_read_after_the_others_gave_up_fails",
          "check_pipeline_loss_read_on_rank_0"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS,
                                            ["check_read_needs_only_the_ranks_holding_its_parts",
                                             "check_ops_that_read_values_run_on_ranks_outside"])
