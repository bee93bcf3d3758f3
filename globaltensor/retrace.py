"""Compiled graphs traced before a plan existed are traced again, once.

torch.compile's first trace of a graph decides every call op by op (there is no plan
yet) while ``dispatch/step.py`` records it; the plan made from that record only helps
if the graph is traced again. Dynamo re-traces a graph when one of its guards fails:
every GlobalTensor input carries a ``Mark`` in its flatten metadata, which the guard
saves when the graph's trace ends, and ``guard`` fails for the marks of recorded traces
older than the last ``retrace_recorded()``. The planning itself waits for the next
guard check (``at_next_guard``): a guard runs only when compiled code is about to run
again, after the trace that was recorded has ended.

>>> trace_begins(recorded=True)   # dispatch/step.py, as a graph's trace begins
>>> retrace_recorded()            # graphs traced so far while recorded trace again
"""
from __future__ import annotations

from typing import Callable

from torch._guards import CompileContext


class Mark:
    """The trace epoch a graph's guard was made in, and whether its trace was recorded.
    Marks compare equal to each other, so that metadata compared at run time
    (AOTAutograd checks its tangents') never differs by its mark alone; only ``guard``
    reads them."""
    __slots__ = ("epoch", "recorded")

    def __init__(self, epoch: int, recorded: bool = False):
        self.epoch, self.recorded = epoch, recorded

    def __eq__(self, other) -> bool:
        return isinstance(other, Mark)

    def __hash__(self) -> int:
        return 0

    def __deepcopy__(self, memo) -> "Mark":
        return Mark(self.epoch, self.recorded)

    def __repr__(self) -> str:
        return f"Mark({self.epoch}, recorded={self.recorded})"


current = Mark(0)       # what a GlobalTensor's flatten metadata carries now
planning = False        # dispatch/step.py plans traced graphs (not cached by AOTAutograd)
_pending: "Callable[[], None] | None" = None


def trace_begins(recorded: bool) -> None:
    """A graph's trace begins (AOTAutograd's): the guards made when it ends save whether
    it was recorded."""
    global current
    current = Mark(current.epoch, recorded)


def retrace_recorded() -> None:
    """Make every compiled graph whose trace was recorded before now fail its guard once
    (and so be traced again) at its next call."""
    global current
    current = Mark(current.epoch + 1)


def at_next_guard(fn: Callable[[], None]) -> None:
    """Call ``fn`` once, at the next guard check of a compiled graph on GlobalTensors."""
    global _pending
    _pending = fn


def guard(saved: Mark) -> bool:
    """Whether a guard made with ``saved`` still holds (after running what waits for a
    guard check before compiled code runs; dynamo also checks a new guard while it
    compiles, which runs nothing)."""
    global _pending
    if _pending is not None and CompileContext.current_compile_id() is None:
        fn, _pending = _pending, None
        fn()
    return not saved.recorded or saved.epoch == current.epoch
