"""Whole-step layouts in eager mode: record a step's calls, plan them together, replay.

An SPMD training program repeats one step. The fifth time a step runs (``RECORD_AT``:
the first steps may differ, optimizer state is made lazily, and planning pays off over
a run, not a few steps), every call is decided op by op (``decide.py``) and recorded: every signature its rule allows
(``options.options``) and which earlier call of the step made each operand (outputs
carry ``_origin``). At the next step boundary the record becomes a min-sum problem
(``problem.py``, ``solve.py``: options priced by the boxing between them, with the
alpha-beta model of ``cost.py``; tensors made before the step, parameters among them, keep their
layouts, as do the layouts ``to_global`` pins) and the cheapest choice is kept as a
plan, keyed by the step's first call. A later step whose first call matches replays
it: call i takes its planned decision when its op, arguments and operand layouts are
those the plan expects (or those of one of the next few planned calls: a step may skip
some); a call that differs (another program path, another batch shape) is decided op
by op, and the replay goes on when the next calls match again (up to ``MAX_MISSES``
in a row; then the rest of the step is decided op by op and the plan is dropped).

A step begins at the outermost forward of a module made global (``step_boundary``,
called by ``gt.nn``'s hooks) and at ``gt.debug.explain_step``; in a program that runs
no such module (functions of GlobalTensors), at the first call after a backward.
Graphs torch.compile traces replay plans and plan themselves in ``traced.py``, with
the recording and replay of this module. Off with ``GLOBALTENSOR_PLAN_STEPS=0``.

>>> for _ in range(8):                        # doctest: +SKIP
...     model(x).sum().backward()             # 4 op by op, 1 recorded, then replayed
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from .. import env, explicit_mode, gradsync, modes, retrace
from ..cost import PARAMETER_WEIGHT
from ..propagation.cache import cached_decision, call_key, key_of_call
from ..propagation.decide import Decision
from ..propagation.options import options
from ..sbp import StridedSplit
from ..tensor import GlobalTensor
from .problem import Node, StepPlan, plan_step
from .state import StepState, token

log = logging.getLogger("globaltensor")

ENABLED = True      # GLOBALTENSOR_PLAN_STEPS=0 turns whole-step planning off (see below)
MAX_PLANS = 16
MAX_MISSES = 8      # calls in a row the plan does not know before replay stops
LOOKAHEAD = 4       # planned calls a step may skip
RECORD_AT = 5      # the occurrence of a step that is recorded; planned from the next
MAX_RECORDINGS = 3
MAX_KEYS = 256      # step starts remembered
MAX_CALLS = 20000   # a recording longer than this is dropped


state = StepState()


class StepMode(modes.Mode):
    """On while a step is armed, recorded or replayed (``state.mode``): each call
    takes the plan's decision, or is recorded (``decision``; while torch.compile
    traces, ``traced.decision``, which planner/traced.py installs)."""

    traced_decision: "Callable | None" = None

    def call(self, func, leaves: list, spec, tracing: bool):
        decide = StepMode.traced_decision if tracing else decision
        chosen, node = decide(func, leaves, spec)
        out = modes.top().run(func, chosen, leaves, spec, None)
        if node is not None:
            made(node, out)
        return out


STEP = StepMode()


class _Functional:
    """The owner of the steps of a program that runs no module made global (a function
    of GlobalTensors): such a step begins at the first call after a backward."""


FUNCTIONAL = _Functional()


class FunctionalSteps(modes.Mode):
    """On from the start (with planning) until a module's forward marks a step: in a
    program whose steps no module marks, a step begins at the first call after a backward.
    It sees every call first (``sees_first``); the step it begins (``STEP``) is below it."""

    sees_first = True
    after_backward = False   # a call ran in backward since the last step began

    def passes(self) -> bool:
        """Whether this call begins no step (one in backward is noted): modes below take it."""
        if torch._C._current_graph_task_id() == -1:
            return not self.after_backward
        self.after_backward = True
        return True

    def call(self, func, leaves: list, spec, tracing: bool):
        if not self.passes():
            self.after_backward = False
            step_boundary(FUNCTIONAL)
        return self.below.call(func, leaves, spec, tracing)


WATCH = FunctionalSteps()


def _watch_from_start() -> None:
    """Watch for functional steps from the start, with planning."""
    WATCH.after_backward = False
    if ENABLED and not modes.is_on(WATCH):
        modes.enter(WATCH)
    elif not ENABLED:
        modes.leave(WATCH)


@env.read_at_import
def _read_plan_steps_variable() -> None:
    global ENABLED
    ENABLED = env.plan_steps_enabled()
    retrace.planning = ENABLED
    _watch_from_start()


def _set(mode: str) -> None:
    state.mode = mode
    if mode in ("armed", "recording", "replaying"):
        if not modes.is_on(STEP):
            modes.enter(STEP)
    else:
        modes.leave(STEP)


def step_boundary(owner: object = None) -> None:
    """A step of ``owner`` (the module whose forward begins) begins: plan what was
    recorded, and watch the next call."""
    if owner is not FUNCTIONAL:
        modes.leave(WATCH)    # steps are marked by modules: no functional ones
    if state.hold:      # explain_step records its function whole; a module whose
        if not state.record and state.also is None:   # forward starts it also keys
            state.also = token(owner)                 # the plan (steps replay it)
        return
    if torch._C._current_graph_task_id() != -1:
        return          # a forward recomputed in backward (activation checkpointing)
    if state.mode == "recording":
        finish_recording()
    elif state.mode == "replaying":   # the step ended early (an eval forward): the
        state.plan = None             # plan stays for the steps that follow it
        _set("idle")
    # In a world of one every layout holds the same parts (boxing moves nothing), so
    # a plan would only repeat per-op choice, at the cost of keying every call.
    if ENABLED and env.get_world_size() > 1:
        state.owner = token(owner)
        _set("armed")


_FUNCTIONAL_TOKEN = token(FUNCTIONAL)


@contextlib.contextmanager
def paused():
    """No step boundary, recording or replay inside (a pipeline runs its stages per
    micro-batch and needs each stage's outputs in one layout)."""
    saved = (state.mode, state.hold)
    state.hold = True
    _set("idle")
    try:
        yield
    finally:
        state.hold = saved[1]
        _set(saved[0])


def clear() -> None:
    """Forget every plan and recording (``gt.testing.reset()``; no program needs it)."""
    global state
    state = StepState()
    _set("idle")
    _watch_from_start()


modes.on_reset(clear)


def restart() -> None:
    """Plan from here as a run resumed here plans: forget every plan and recording and
    record the next step at its first occurrence (``Autosave`` calls it at each save
    and restore, so that a resumed run replays what the uninterrupted one replays and
    ends with the same bits; each save costs one step op by op, and its planning
    takes the choice remembered for that step, ``reuse.py``)."""
    clear()
    state.restarted = True


def start_recording(owner: object, hold: bool = True) -> None:
    """Record from the next call on (``explain_step``), whatever was planned; ``hold``:
    step boundaries change nothing until ``finish_recording``."""
    if state.mode == "recording":
        finish_recording()
    state.serial += 1
    state.record, state.sinks, state.pin_grads = [], [], []
    state.owner, state.also = token(owner), None
    state.hold = hold
    _set("recording")


def finish_recording() -> "StepPlan | None":
    """Plan the recorded calls; keep and return the plan (None when nothing fits)."""
    record, sinks, pin_grads = state.record, state.sinks, state.pin_grads
    state.record, state.sinks, state.pin_grads = [], [], []
    _set("idle")
    if not record:
        state.hold = False
        return None
    started = time.perf_counter()
    try:
        # explain_step (``hold``) reports the problem's costs: it solves anew
        plan = plan_step(record, sinks, pin_grads, reuse=not state.hold)
    except Exception as e:  # noqa: BLE001  (every rank fails alike: SPMD records agree)
        log.warning("globaltensor: a step could not be planned (%s: %s); it runs op by "
                    "op", type(e).__name__, e)
        state.hold = False
        return None
    plan.seconds = time.perf_counter() - started
    if not state.hold:
        plan.problem = None
    retrace.planning = True   # traced graphs may replay it
    for owner in {state.owner, state.also} - {None}:
        state.plans.pop((owner, plan.first_key), None)   # (re)inserted as the newest
        if len(state.plans) >= MAX_PLANS:
            state.plans.pop(next(iter(state.plans)))
        state.plans[owner, plan.first_key] = plan
    state.also = None
    state.last = plan
    state.hold = False
    log.debug("globaltensor: planned a step of %d calls in %.3f s: %.3f ms per op, "
              "%.3f ms planned", len(record), plan.seconds, plan.per_op_cost * 1e3,
              plan.planned_cost * 1e3)
    return plan


def decision(func, leaves: list, spec):
    """The decision for a call inside an eager step, and the node recording it (or
    None); a call while torch.compile traces goes to ``traced.decision``."""
    if state.mode == "armed":
        key = (state.owner, key_of_call(func, leaves, spec))
        plan = state.plans.get(key)
        repeats = True
        if state.owner == _FUNCTIONAL_TOKEN:
            # recorded only in a program that repeats one step: functional steps of two
            # programs in turns (an eager and a compiled one) would never replay
            repeats, state.functional_first = key == state.functional_first, key
        if plan is not None:
            state.plan, state.cursor, state.misses = plan, 0, 0
            _set("replaying")
        elif key[1] is not None and _worth_recording(key) and repeats:
            state.serial += 1
            state.record, state.sinks, state.pin_grads = [], [], []
            _set("recording")
        else:
            _set("idle")
    if state.mode == "replaying":
        nodes = state.plan.nodes
        # The expected call, or one a little further: calls the plan has and this step
        # skips (no_grad saves nothing for backward: no detach) are passed over.
        key = key_of_call(func, leaves, spec)
        for ahead in range(state.cursor, min(state.cursor + LOOKAHEAD, len(nodes))):
            found = replayed(nodes[ahead], func, leaves, spec, key)
            if found is not None:
                state.cursor = ahead
                break
        if found is not None:
            state.cursor += 1
            state.misses = 0
            if state.cursor == len(state.plan.nodes):
                state.plan = None
                _set("idle")
            return found, None
        # A call the plan does not know (a gradient accumulated into an existing
        # ``.grad``) runs op by op, and the plan goes on if the next calls match.
        state.misses += 1
        if state.misses <= MAX_MISSES:
            return cached_decision(func, leaves, spec), None
        node = nodes[state.cursor]
        log.debug("globaltensor: %s (key %s) differs from the planned step at call %d "
                  "(%s, key %s); the rest of this step is decided op by op", func, key,
                  state.cursor, node.func, node.expected)
        _give_up()
    greedy = cached_decision(func, leaves, spec)
    if state.mode != "recording":
        return greedy, None
    return greedy, record_call(func, leaves, spec, greedy, state.record, state.serial)


def replay_by_index(func, args: tuple, kwargs: dict):
    """(planned decision, local parts) of the call a replayed step expects next (op,
    key, floats read by value: ``call_key``), the cursor moved on as ``decision`` moves
    it; else None (``decision`` takes the call: look-ahead, misses)."""
    if state.mode != "replaying":
        return None
    node = state.plan.nodes[state.cursor]
    if node.func is not func or node.planned is None:
        return None
    found = call_key(func, args, kwargs, gradsync.watch)
    if found is None or found[0] != node.expected or (node.floats and tuple(
            x for x in found[1] if x.__class__ is float) != node.floats):
        return None
    state.cursor, state.misses = state.cursor + 1, 0
    if state.cursor == len(state.plan.nodes):
        state.plan = None
        _set("idle")
    return node.planned, found[1]


def _worth_recording(key) -> bool:
    """Whether a step starting with this call is recorded now: its RECORD_AT-th
    occurrence (recording and planning pay off over a run, not over a few steps; a
    program whose shapes change every step never pays for them), at most
    MAX_RECORDINGS times."""
    seen = state.recorded.pop(key, 0) + 1
    if state.restarted:   # (``restart``)
        seen, state.restarted = max(seen, RECORD_AT), False
    if len(state.recorded) >= MAX_KEYS:   # oldest first: shapes seen once and gone
        state.recorded.pop(next(iter(state.recorded)))
    state.recorded[key] = seen
    return RECORD_AT <= seen < RECORD_AT + MAX_RECORDINGS


def _give_up() -> None:
    """The step did not follow its plan to the end: drop the plan, so that the next
    step is recorded again (at most MAX_RECORDINGS times per step start)."""
    if state.plan is not None:
        state.plans = {k: p for k, p in state.plans.items() if p is not state.plan}
        if state.traced is not None and state.traced[0] is state.plan:
            state.traced = None   # nor does a later trace go on with it
        state.plan = None
    _set("idle")


def replayed(node: Node, func, leaves: list, spec, key) -> "Decision | None":
    """The planned decision when this call is the one the plan expects, else None. A
    call the plan could not choose for runs as decided op by op, provided that gives
    the outputs the plan counted on."""
    if func is not node.func:
        return None
    if node.planned is not None:
        return node.planned if key == node.expected and _floats(node.greedy, leaves) \
            == node.floats else None
    if node.expected is not None and key != node.expected:
        return None
    found = cached_decision(func, leaves, spec)
    return found if found.out_layouts == node.greedy.out_layouts else None


def _floats(decision: Decision, leaves: list) -> tuple:
    # Cache keys hold a float's type only; a decision that depends on the values (a
    # rule read one) is replayed only for the values it was planned with.
    return tuple(x for x in leaves if x.__class__ is float) if decision.by_value else ()


def record_call(func, leaves: list, spec, greedy: Decision, record: list, serial: int) -> Node:
    """Append the node of this call to ``record`` (made with ``serial``)."""
    key = key_of_call(func, leaves, spec)
    if state.strided_blocks[0] != serial:
        state.strided_blocks = (serial, set())
    blocks = state.strided_blocks[1]
    for i in greedy.gidx:
        blocks.update(s.blocks for s in leaves[i]._layout.sbp if isinstance(s, StridedSplit))
    opts = None
    # in an explicit region each call keeps its own decision: a plan boxes only where
    # the program does
    if key is not None and not greedy.fallback and not explicit_mode.active():
        opts = options(func, leaves, spec, greedy, tuple(sorted(blocks)))
    producers, inputs = [], []
    for i in greedy.gidx:
        x = leaves[i]
        origin = recorded_origin(x, record, serial)
        producers.append(None if origin is None else origin[1:])
        weight = PARAMETER_WEIGHT if x.requires_grad and x.is_leaf else 1.0
        inputs.append((x._layout, x.element_size(), weight))
    node = Node(func, key, greedy, opts, producers, inputs, _floats(greedy, leaves),
                origin=(serial, len(record)),
                in_backward=torch._C._current_graph_task_id() != -1)
    if state.sent is not None:
        node.sent_bytes = -state.sent.total_bytes
    record.append(node)
    if len(record) >= MAX_CALLS:   # no step boundary came: this is no step
        log.debug("globaltensor: %d calls without a step boundary: not planned", MAX_CALLS)
        record.clear()
        if record is state.record:
            _set("idle")
    return node


def recorded_origin(t: GlobalTensor, record: list, serial: int):
    """``t``'s origin when a call of ``record`` (made with ``serial``) made it as it is."""
    origin = getattr(t, "_origin", None)
    if origin is None or origin[0] != serial:
        return None   # an older step's
    made = _made_as(origin, record)
    if len(origin) > 3:   # through a to_global's backward
        return origin if made is not None and made.without_partials() == t._layout else None
    return origin if made is t._layout else None   # (else changed since: an in-place view)


def grad_arrived(grad: GlobalTensor, layout) -> None:
    """A gradient that a recorded call made reached its leaf's ``.grad`` (of ``layout``):
    the plan prices boxing it there for each option of that call (``gradsync`` reduces
    partial ones in a bucket), also where it arrived in ``layout`` op by op."""
    if state.mode != "recording":
        return
    origin = recorded_origin(grad, state.record, state.serial)
    if origin is not None and len(origin) == 3:
        state.sinks.append((origin[1], origin[2], layout, grad.element_size(), "gradient"))
        if grad._layout == layout:   # its readers (the optimizer) read it in ``layout``
            grad._origin = None        # whatever the plan makes, as gradsync's result


gradsync.install_grad_watch(grad_arrived)


def _made_as(origin: tuple, record: list):
    u, k = origin[1], origin[2]
    if u >= len(record):
        return None
    layouts = record[u].greedy.out_layouts
    return layouts[k] if k < len(layouts) else None


def made(node: Node, out) -> None:
    """Mark the GlobalTensors a recorded call returned as made by it."""
    serial, index = node.origin
    if state.sent is not None:
        node.sent_bytes += state.sent.total_bytes
    if node.greedy.fallback:   # its outputs count as made outside the step
        return
    if isinstance(out, GlobalTensor):
        out._origin = (serial, index, 0)
        return
    for k, o in enumerate(tree_flatten(out)[0]):   # indexed as decisions index outputs
        if isinstance(o, GlobalTensor):
            o._origin = (serial, index, k)
