"""An activation read by several ops in turn, each boxing it the same way (the query,
key and value projections of one hidden state), is boxed once (``boxing/reuse.py``);
a write in between (through the tensor or its part) and an op that writes its operand
box anew, ranks holding nothing of a slice decide as the others, a kept boxing keeps
no autograd graph alive, and every value equals one process's."""
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split


def _projections(seed: int = 0):
    """Three column-split weights (each needs its input whole: broadcast) and a batch
    split by rows, with their plain values."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(8, 6, generator=g) for _ in range(3)]
    x = torch.randn(4, 6, generator=g)
    P = gt.placement.all("cpu")
    return (x, ws, gt.tensor(x, placement=P, sbp=S(0)),
            [gt.tensor(w, placement=P, sbp=S(0)) for w in ws])


def check_three_readers_of_one_activation_gather_it_once():
    x, ws, gx, gws = _projections()
    for grad in (False, True):
        leaf = gx.detach().requires_grad_(grad)
        with gt.debug.comm_stats() as counted:
            h = leaf * 2
            outs = [F.linear(h, w) for w in gws]    # each F.linear makes its own view of h
        assert counted.calls["all_gather"] == 1, (grad, counted)
        for out, w in zip(outs, ws):
            assert out.sbp == (S(1),)
            torch.testing.assert_close(out.full(), F.linear(x * 2, w))
        if grad:
            sum(o.sum() for o in outs).backward()
            torch.testing.assert_close(leaf.grad.full(),
                                       2 * sum(w.sum(0) for w in ws).expand(4, 6))


def check_a_kept_boxing_keeps_no_graph_alive():
    # a forward run with gradients and no backward (an evaluation without no_grad) is
    # freed with its output: the kept boxing does not hold its input, whose autograd
    # graph holds every activation saved for backward
    import gc
    import weakref
    x, ws, gx, gws = _projections(4)
    leaf = gx.detach().requires_grad_()
    h = leaf * 2
    out = F.linear(h, gws[0])
    assert out.grad_fn is not None
    alive = weakref.ref(h)
    del h, out
    gc.collect()
    assert alive() is None


def check_a_write_between_readers_boxes_again():
    x, ws, gx, gws = _projections(1)
    h = gx * 1.0
    with gt.debug.comm_stats() as counted:
        first = F.linear(h, gws[0])
        h.add_(1)                                   # the kept gather is stale now
        second = F.linear(h, gws[1])
        third = F.linear(h.view(4, 6), gws[2])      # a view alike reads the same values
        h.to_local().mul_(2)                        # a write to the part itself
        fourth = F.linear(h, gws[0])
    assert counted.calls["all_gather"] == 3, counted
    torch.testing.assert_close(first.full(), F.linear(x, ws[0]))
    torch.testing.assert_close(second.full(), F.linear(x + 1, ws[1]))
    torch.testing.assert_close(third.full(), F.linear(x + 1, ws[2]))
    torch.testing.assert_close(fourth.full(), F.linear(2 * (x + 1), ws[0]))


def check_a_kept_result_is_not_what_a_writing_op_gets():
    # an in-place op boxes its own operand: a later reader still gets the values of
    # the boxing it needs, and the in-place op's target is written, nothing else
    x, ws, gx, gws = _projections(2)
    h = gx * 1.0
    with gt.debug.comm_stats() as counted:
        first = F.linear(h, gws[0])
        acc = gt.tensor(torch.zeros(4, 6), placement=gx.placement, sbp=B)
        acc.add_(h)                                 # h boxed to broadcast, for a writing op
        acc.mul_(3)
        second = F.linear(h, gws[1])
    assert counted.calls["all_gather"] == 2, counted
    torch.testing.assert_close(acc.full(), 3 * x)
    torch.testing.assert_close(first.full(), F.linear(x, ws[0]))
    torch.testing.assert_close(second.full(), F.linear(x, ws[1]))


def check_ranks_holding_nothing_decide_as_the_others():
    # one column split over the ranks: rank 0 holds it, the others hold empty parts,
    # alike for every slice; each rank must still decide as rank 0 does (two slices are
    # two boxings), or one skips a collective the others run
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 1, generator=g), torch.randn(3, 4, generator=g)
    P = gt.placement.all("cpu")
    gx, gw = gt.tensor(x, placement=P, sbp=S(1)) * 1.0, gt.tensor(w, placement=P, sbp=S(1))
    with gt.debug.comm_stats() as counted:
        top, bottom, again = gx[0:3] * gw, gx[3:6] * gw, gx[3:6] * gw
    assert counted.calls["all_gather"] == 3, counted
    for got, want in ((top, x[0:3] * w), (bottom, x[3:6] * w), (again, x[3:6] * w)):
        torch.testing.assert_close(got.full(), want)


test_world2, test_world4 = checks_in_worlds(__name__, [
    "check_three_readers_of_one_activation_gather_it_once",
    "check_a_kept_boxing_keeps_no_graph_alive",
    "check_a_write_between_readers_boxes_again",
    "check_a_kept_result_is_not_what_a_writing_op_gets",
    "check_ranks_holding_nothing_decide_as_the_others",
])
