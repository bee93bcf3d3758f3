"""Compiled graphs traced before a plan existed are traced again, once.

torch.compile's first trace of a graph decides every call op by op (there is no plan
yet) while ``planner/record.py`` records it; the plan made from that record only helps
if the graph is traced again. Dynamo re-traces a graph when one of its guards fails:
every GlobalTensor input carries a ``Mark`` in its flatten metadata (the recorded trace
the graph came from, if any), which the guard saves when the graph's trace ends, and
``guard`` fails for the marks of traces named by ``retrace``. Graphs whose plans did
not improve, and graphs traced without recording (pipeline stages), keep their code.
The planning itself waits for the next guard check (``at_next_guard``): a guard runs
only when compiled code is about to run again, after the trace that was recorded has
ended.

>>> mark = new_trace()
>>> trace_begins(mark)   # planner/traced.py, as a recorded trace begins
>>> retrace({mark})      # the graph traced then traces again at its next call
"""
from __future__ import annotations

from typing import Callable

from torch._guards import CompileContext


class Mark:
    """The recorded trace a graph's guard was made after (0: none). Marks compare equal
    to each other, so that metadata compared at run time (AOTAutograd checks its
    tangents') never differs by its mark alone; only ``guard`` reads them."""
    __slots__ = ("trace",)

    def __init__(self, trace: int = 0):
        self.trace = trace

    def __eq__(self, other) -> bool:
        return isinstance(other, Mark)

    def __hash__(self) -> int:
        return 0

    def __deepcopy__(self, memo) -> "Mark":
        return Mark(self.trace)

    def __repr__(self) -> str:
        return f"Mark({self.trace})"


current = Mark()        # what a GlobalTensor's flatten metadata carries now
planning = False        # planner/record.py plans traced graphs (not cached by AOTAutograd)
_stale: set = set()     # recorded traces whose graphs trace again
_traces = 0             # recorded traces so far (never reset: marks stay unique)
_pending: "Callable[[], None] | None" = None


def new_trace() -> int:
    """A mark for a trace that is recorded, unique for the process."""
    global _traces
    _traces += 1
    return _traces


def trace_begins(trace: int) -> None:
    """A graph's trace begins (AOTAutograd's): the guards made when it ends save which
    recorded trace it is (``new_trace()``; 0: not recorded)."""
    global current
    current = Mark(trace)


def retrace(traces: set) -> None:
    """Make the compiled graphs of these recorded traces fail their guard once (and so
    be traced again) at their next call."""
    global current
    _stale.update(traces)
    # A stale mark is handed out no more: a frame compiled next without a trace of its
    # own (a resume function after a graph break whose graph runs no op) would save it
    # in its guard, which dynamo checks as it builds it (and raises on failing).
    if current.trace in _stale:
        current = Mark()


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
    return saved.trace not in _stale
