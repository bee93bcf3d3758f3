"""The planner's state: the step being recorded or replayed, the plans kept per step
start, and what torch.compile's traces followed (``record.py``, ``traced.py``). One
object, replaced whole by ``record.clear()`` (``gt.testing.reset()``)."""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

from .problem import StepPlan


@dataclass
class StepState:
    """What the planner knows of the steps it records, plans and replays (``record.state``)."""

    mode: str = "idle"         # "armed" | "recording" | "replaying" | "idle"
    record: list = field(default_factory=list)
    sinks: list = field(default_factory=list)   # problem.plan_step's sinks
    pin_grads: list = field(default_factory=list)   # problem.plan_step's pin_grads
    serial: int = 0            # tells this recording's outputs from older ones
    plan: "StepPlan | None" = None
    cursor: int = 0
    misses: int = 0            # calls in a row that the plan did not expect
    owner: int = 0                                 # token of the module the step is of
    hold: bool = False                             # explain_step is recording
    also: "int | None" = None                      # its step's module, if it has one
    sent: object = None                            # explain_step's CommCounter
    plans: dict = field(default_factory=dict)      # (owner, first key) -> StepPlan
    recorded: dict = field(default_factory=dict)   # (owner, first key) -> times seen
    last: "StepPlan | None" = None                 # the latest plan made
    traced: "list | None" = None                   # [plan, next call] followed while tracing
    session: object = None        # weak reference to the make_fx session traced last
    trace: object = None          # that session's recording (traced.Trace)
    pending: list = field(default_factory=list)    # traces recorded, not yet planned
    traced_firsts: set = field(default_factory=set)   # first keys of graphs recorded
    # A traced graph that leaves the plan it began with (another program's: its first
    # call is alike) is traced again, once, recorded (traced.py)
    follows: "tuple | None" = None   # (first key, mark) of the graph tracing a plan now
    record_next: set = field(default_factory=set)   # first keys to record when traced again
    rerecorded: set = field(default_factory=set)    # first keys recorded so, once each
    diverged: set = field(default_factory=set)      # marks of graphs to trace again for it
    traced_misses: int = 0    # calls in a row the plan followed by a trace did not expect
    strided_blocks: tuple = (0, set())   # (serial, strided block counts its calls held)
    functional_first: object = None      # the key of the last functional step's first call
    restarted: bool = False   # the next step is recorded whatever its count (``restart``)


_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NEXT_TOKEN = itertools.count(1)


def token(owner) -> int:
    """A number for ``owner`` that no later object gets (ids are reused)."""
    try:
        found = _TOKENS.get(owner)
        if found is None:
            found = _TOKENS[owner] = next(_NEXT_TOKEN)
        return found
    except TypeError:   # not weakly referable
        return id(owner)
