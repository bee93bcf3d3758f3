"""The warm path of a repeated call (``dispatch/entry.py``, ``propagation/direct.py``):
a decision that runs directly gives the outputs, layouts and strides the general path
gives, for one output and for several (layer norm, attention), for views (their local
size computed once), by-value decisions and calls whose decomposition declined; it is
taken where it may and not where it must not. In a world of one (in this process) and in
worlds of 2 and 4, where parts differ from the whole.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor import modes
from globaltensor.dispatch import entry
from globaltensor.planner import record

aten = torch.ops.aten


class _Through(modes.Mode):
    """A mode that changes nothing but is on: every call takes the general path."""

    def run(self, func, decision, leaves, spec, why):
        return self.below.run(func, decision, leaves, spec, why)


@contextlib.contextmanager
def _counted(monkeypatch):
    """Counts of the warm path's hits and of calls carried out by the general path."""
    counts = {"warm": 0, "general": 0}
    real_direct, real_carry_out = entry.direct_call, entry._carry_out

    def direct_call(*a):
        found = real_direct(*a)
        counts["warm"] += found is not None
        return found

    def carry_out(*a, **k):
        counts["general"] += 1
        return real_carry_out(*a, **k)
    monkeypatch.setattr(entry, "direct_call", direct_call)
    monkeypatch.setattr(entry, "_carry_out", carry_out)
    yield counts


def _no_mode() -> None:
    """No mode on, as in a program whose modules mark its steps (no functional watch)."""
    modes.leave(record.WATCH)
    assert modes.active is None


@pytest.fixture
def warm():
    _no_mode()
    yield
    gt.testing.reset()


def _same(got, want):
    """Equal values, layouts and global strides, output by output."""
    got, want = (o if isinstance(o, (tuple, list)) else (o,) for o in (got, want))
    assert type(got) is type(want) and len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, gt.GlobalTensor) and g.global_layout == w.global_layout
        assert g.stride() == w.stride() and g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.to_local(), w.to_local())


def _both(fn, *args):
    """``fn(*args)`` twice (the first decides) and once on the general path."""
    fn(*args)
    warm_out = fn(*args)
    with _Through():
        general = fn(*args)
    return warm_out, general


def _g(t, sbp, requires_grad=False):
    return gt.tensor(t, placement=gt.placement.all("cpu"), sbp=sbp, requires_grad=requires_grad)


def check_several_outputs_and_views_run_warm_as_generally():
    _no_mode()
    S, B = gt.sbp.split, gt.sbp.broadcast
    torch.manual_seed(0)
    x = _g(torch.randn(4, 6, 8), S(0))
    w, b = _g(torch.randn(8), B), _g(torch.randn(8), B)
    _same(*_both(lambda: aten.native_layer_norm.default(x, [8], w, b, 1e-5)))
    mean, rstd = aten.native_layer_norm.default(x, [8], w, b, 1e-5)[1:]
    grad = _g(torch.randn(4, 6, 8), S(0))
    _same(*_both(lambda: aten.native_layer_norm_backward.default(
        grad, x, [8], mean, rstd, w, b, [True, True, True])))
    for size in ([24, 8], [4, 48], [-1]):
        _same(*_both(lambda: aten.view.default(x, size)))
    column = _g(torch.randn(4, 1, 8), S(0))
    _same(*_both(lambda: aten.expand.default(column, [4, 6, 8])))
    # a part that is not contiguous where the wrapper is: the view copies it locally
    part = torch.randn(8, 4 * gt.get_world_size()).t()
    odd = gt.from_local(part, gt.placement.all("cpu"), S(0))
    _same(*_both(lambda: aten.view.default(odd, [-1])))
    q, k, v = (_g(torch.randn(2, 2, 8, 4), S(0)) for _ in range(3))
    _same(*_both(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    ids, table = _g(torch.randint(0, 8, (4, 6)), S(0)), _g(torch.randn(8, 3), B)
    _same(*_both(lambda: F.embedding(ids, table)))


def check_losses_and_lookups_on_whole_parts_equal_torch():
    """Logits and targets whole on every rank (broadcast; any layout in a world of one):
    torch's own kernels, so exactly torch's values, and its errors."""
    _no_mode()
    torch.manual_seed(1)
    logits, targets = torch.randn(6, 5, requires_grad=True), torch.tensor([0, 4, -100, 2, 1, 3])
    sbps = [gt.sbp.broadcast] + ([gt.sbp.split(0)] if gt.get_world_size() == 1 else [])
    for sbp in sbps:
        x = _g(logits.detach(), sbp, requires_grad=True)
        for _ in range(2):   # the second call is warm
            loss = F.cross_entropy(x, _g(targets, sbp))
            loss.backward()
        want = F.cross_entropy(logits, targets)
        want.backward()
        assert torch.equal(loss.full(), want.detach())
        assert torch.equal(x.grad.full() / 2, logits.grad)
        logits.grad = None
        with pytest.raises(IndexError):
            F.cross_entropy(x, _g(torch.tensor([0, 4, 5, 2, 1, 3]), sbp))
    table, ids = torch.randn(7, 3), torch.tensor([[0, 6], [3, 3]])
    got = F.embedding(_g(ids, gt.sbp.broadcast), _g(table, gt.sbp.broadcast))
    assert torch.equal(got.full(), F.embedding(ids, table))


CHECKS = ["check_several_outputs_and_views_run_warm_as_generally",
          "check_losses_and_lookups_on_whole_parts_equal_torch"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)


def test_in_a_world_of_one(warm):
    check_several_outputs_and_views_run_warm_as_generally()
    check_losses_and_lookups_on_whole_parts_equal_torch()


def test_repeated_calls_take_the_warm_path(warm, monkeypatch):
    S, B = gt.sbp.split, gt.sbp.broadcast
    x, w, b = _g(torch.randn(4, 6, 8), S(0)), _g(torch.randn(8), B), _g(torch.randn(8), B)
    q = _g(torch.randn(2, 2, 8, 4), S(0))
    calls = [lambda: aten.native_layer_norm.default(x, [8], w, b, 1e-5),   # three outputs
             lambda: aten.view.default(x, [24, 8]),                         # a view
             lambda: F.scaled_dot_product_attention(q, q, q),               # by value
             lambda: aten.native_layer_norm_backward.default(               # a bool list
                 x, x, [8], x[..., :1], x[..., :1], w, b, [True, True, True]),
             lambda: F.embedding(_g(torch.tensor([[1, 2]]), S(0)), _g(torch.randn(4, 2), B))]
    for call in calls:
        call()
        with _counted(monkeypatch) as counts:
            call()
        assert counts["general"] == 0 and counts["warm"] >= 1, counts
    with _counted(monkeypatch) as counts, _Through():
        calls[0]()
    assert counts == {"warm": 0, "general": 1}, counts   # a mode on: the general path


def test_wrapping_once_per_decision_keeps_strides_and_dtype():
    from globaltensor.layout import Layout
    from globaltensor.tensor import wrap_as, wrap_part, wrapping
    P = gt.placement("cpu", [0])
    for shape in [(2, 0, 3), (0,), (3, 0), (), (1, 1), (4, 1, 2)]:
        layout = Layout.make(shape, P, gt.sbp.broadcast)
        part = torch.zeros(shape)
        made = wrap_as(part, wrapping(layout, torch.float32))
        assert made.stride() == layout.strides == wrap_part(part, layout).stride()
        assert made._key == (layout, torch.float32) and made.global_layout is layout
    layout = Layout.make((3, 2), P, gt.sbp.broadcast)
    bent = wrap_as(torch.zeros(2, 3).t(), wrapping(layout, torch.float32, (1, 3)))
    assert bent.stride() == (1, 3) and bent._key == (layout, torch.float32, (1, 3))
    # a part of another dtype than the decision's (the default dtype changed since)
    wide = wrap_as(torch.zeros(3, 2, dtype=torch.float64), wrapping(layout, torch.float32))
    assert wide.dtype == torch.float64 and wide._key == (layout, torch.float64)


def test_the_functional_watch_lets_repeated_calls_through(monkeypatch):
    """With no module marking steps, the watch for functional steps is on: a repeated
    call it leaves as it is takes the warm path; the first call after a backward begins
    a step (the watch takes it), and the next is warm again."""
    gt.testing.reset()
    try:
        assert modes.active is record.WATCH
        x = _g(torch.randn(4, 3), gt.sbp.split(0), requires_grad=True)
        (x * 2.0).sum().backward()
        for expected in ({"warm": 0, "general": 1}, {"warm": 1, "general": 0}):
            with _counted(monkeypatch) as counts:
                aten.mul.Tensor(x, x)
            assert counts == expected, counts
        assert not record.WATCH.after_backward
    finally:
        gt.testing.reset()
