"""The modes of the per-op path (``globaltensor/modes.py``): the dispatcher hands each
call to the newest mode on, which hands what it does not change to the modes below;
``gt.testing.reset()`` ends them all and forgets their state."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor import comm, env, modes, origins
from globaltensor.planner import record


class Seen(modes.Mode):
    """Notes every call it carries out."""

    def __init__(self):
        self.ops = []

    def run(self, func, decision, leaves, spec, why):
        self.ops.append(func.overloadpacket.__name__)
        return self.below.run(func, decision, leaves, spec, why)


def _operands():
    p = gt.placement("cpu", ranks=[0])
    return gt.randn(4, 3, placement=p, sbp=gt.sbp.split(0)), gt.randn(3, 2, placement=p, sbp=gt.sbp.broadcast)


def test_the_active_mode_takes_every_call_and_hands_it_down():
    x, w = _operands()
    plain = (x @ w).relu()
    with Seen() as seen:
        # the newest mode, below the one watching for functional steps (which sees
        # every call first)
        assert modes.top() in (seen, record.WATCH) and modes.is_on(seen)
        y = (x @ w).relu()
    assert seen.ops == ["mm", "relu"] and torch.equal(y.to_local(), plain.to_local())
    assert modes.active is not seen and not modes.is_on(seen)


def test_modes_stack_and_leave_in_any_order():
    outer, inner = Seen(), Seen()
    modes.enter(outer)
    modes.enter(inner)
    assert inner.below is outer
    x, w = _operands()
    x @ w
    assert outer.ops == inner.ops == ["mm"]
    modes.leave(outer)          # the older one first (a step ending outside its region)
    assert inner.below is not outer and modes.is_on(inner)
    x @ w
    assert outer.ops == ["mm"] and inner.ops == ["mm", "mm"]
    modes.leave(inner)
    with pytest.raises(RuntimeError, match="already on"):
        with outer:
            modes.enter(outer)
    assert not modes.is_on(outer)


def test_a_mode_that_only_raises_a_flag_leaves_the_warm_path_open():
    before = modes.active
    with gt.implicit_broadcast():
        assert modes.implicit and modes.active is before
    assert not modes.implicit


def test_check_mode_is_a_mode_and_explicit_regions_are_modes():
    assert not comm.check_mode()
    with gt.debug.check_consistency():
        assert comm.check_mode() and modes.innermost(origins.Checking) is not None
        x, _ = _operands()
        y = x * 2
        assert origins.of(y) == origins.OpOnInputs(torch.ops.aten.mul.Tensor, [x, 2]).digest
    assert not comm.check_mode()
    with gt.explicit(allow_partial=False):
        assert gt.explicit_mode.active() and not gt.explicit_mode.allows_partial()
    assert not gt.explicit_mode.active()


def test_reset_ends_every_mode_and_forgets_the_plans(monkeypatch):
    record.state.plans[("owner", "key")] = object()   # a plan kept from an earlier step
    seen = Seen()
    modes.enter(seen)
    with gt.explicit():
        modes.enter(origins.Checking())
        gt.testing.reset()
        assert not modes.is_on(seen) and not comm.check_mode() and not gt.explicit_mode.active()
        assert not record.state.plans and record.state.mode == "idle"
    # what a program starts with is on again: the functional steps' watch (planning on)
    assert modes._stack == ([record.WATCH] if record.ENABLED else [])
    # and check mode, under GLOBALTENSOR_DEBUG=1
    monkeypatch.setenv("GLOBALTENSOR_DEBUG", "1")
    try:
        gt.testing.reset()
        assert comm.check_mode()
    finally:
        monkeypatch.delenv("GLOBALTENSOR_DEBUG")
        env.reread()
    assert not comm.check_mode()
