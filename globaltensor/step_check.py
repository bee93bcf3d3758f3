"""``gt.debug.check_step``: every boxing a step would do, without running it.

The step runs once on fake tensors (``FakeTensorMode``: the operands' layouts and
shapes, no values, no compute) with every collective counted and none sent
(``comm.stats.dry_run``): the same dispatch, rules, boxing plans, backward and gradient
sync as a real step, so the collectives it lists are those a real step runs. Nothing is
sent, so one rank may check alone. What the step leaves behind is undone: the gradients
of the leaves it touched are put back, and whole-step planning does not count it as a
step. What it cannot run: a read of a value (``.item()``, a print of a tensor, a branch
on one), which fake tensors do not have; and an optimizer step, whose state would be
made of fake tensors (check forward and backward; the optimizer does not communicate).

>>> report = gt.debug.check_step(lambda: model(x).sum().backward())   # doctest: +SKIP
>>> print(report)     # each boxing: op, line, layouts, collective, bytes  # doctest: +SKIP
>>> report.raise_if_any()     # AssertionError listing them, if any     # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from . import explicit_mode, gradsync
from .boxing.run import observed
from .comm import stats
from .comm.stats import CommCounter
from .dispatch.entry import fake_parts
from .layout import Layout
from .planner import record


@dataclass(frozen=True)
class Boxing:
    """One boxing of the step: what asked for it (an op, "to_global", ...), the
    program's line (and the autograd node, in backward), the layouts, the steps of its
    plan and the bytes the busiest rank sends (as ``comm_stats`` counts them)."""
    why: str
    line: str
    src: Layout
    dst: Layout
    steps: tuple
    sent_bytes: int

    def __str__(self) -> str:
        sbp = explicit_mode.sbp_text
        return (f"{self.why} at {self.line}: {tuple(self.src.shape)} {sbp(self.src)} -> "
                f"{sbp(self.dst)} by {' + '.join(self.steps) or 'nothing'}, "
                f"{self.sent_bytes} B")


@dataclass(frozen=True)
class StepCheck:
    """What ``check_step`` found: ``boxings`` (Boxing per boxing that sends, in order),
    ``counted`` (this rank's collectives by kind, as ``comm_stats`` counts a real step:
    gradient sync and scalar reductions included) and ``result`` (what ``fn`` returned,
    on fake tensors)."""
    boxings: tuple
    counted: CommCounter
    result: object = None

    @property
    def total_bytes(self) -> int:
        """Bytes this rank would send in the step (every collective)."""
        return self.counted.total_bytes

    def __str__(self) -> str:
        lines = [f"{len(self.boxings)} boxing(s) that send, {self.counted.total_calls} "
                 f"collective call(s), {self.counted.total_bytes} B sent by this rank: "
                 f"{self.counted!r}"]
        lines += [f"  {k + 1:>3}. {b}" for k, b in enumerate(self.boxings)]
        return "\n".join(lines)

    __repr__ = __str__

    def raise_if_any(self) -> None:
        """Raise ``AssertionError`` listing the boxings, when there are any (a test
        that a step sends nothing but what it must)."""
        if self.boxings:
            raise AssertionError(f"the step boxes:\n{self}")


def check_step(fn: Callable, *args, **kwargs) -> StepCheck:
    """Run ``fn(*args, **kwargs)`` on fake tensors with no communication and report
    every boxing it would do, forward and backward (module docstring).

    >>> report = gt.debug.check_step(train_step, x, y)      # doctest: +SKIP
    >>> assert report.counted.calls == {"all_reduce": 2}     # doctest: +SKIP
    """
    found: list = []

    def note(why: object, src: Layout, dst: Layout, plan) -> None:
        if plan.sends:
            found.append(Boxing(
                why if isinstance(why, str) else str(why),
                explicit_mode.program_line() + explicit_mode.backward_node(), src, dst,
                tuple(type(s).__name__ for s in plan.steps),
                plan.sent_bytes()))
    with gradsync.grads_kept(), record.paused(), stats.dry_run() as counted, observed(note), \
            fake_parts(FakeTensorMode(allow_non_fake_inputs=True)):
        try:
            result = fn(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise RuntimeError(f"globaltensor: check_step runs the step on fake tensors, which "
                               f"have no values: a read of one (.item(), print, a branch on a "
                               f"value) or an op whose shape depends on values cannot run there "
                               f"({type(e).__name__}: {e})") from e
    return StepCheck(tuple(found), counted, result)
