"""Whole-step layouts for compiled graphs: replay a plan while torch.compile traces, and
plan a graph from its own trace.

Tracing runs the program's calls on fake parts with no step boundary: dynamo's pass,
then AOTAutograd's metadata pass and its trace of forward and backward (one make_fx
session, the graph that is compiled). A call that begins a planned step (the newest
plan whose first call it is: made eagerly, by ``explain_step``, or from an earlier
trace of the graph) starts replaying that plan, and the calls that follow take their
planned decisions as in eager mode (``record.py``). A graph whose trace begins with no
plan is recorded (``Trace``) and planned at its next guard check (``plan_traces``);
a plan at least ``MIN_GAIN`` cheaper than the traced per-op choice is kept and the
graph recorded then traces again (``retrace.py``), replaying it. Each graph (by its first
call) is recorded once; a graph whose trace leaves the plan it began with (another
program's with the same first call: more than ``MAX_MISSES`` calls in a row differ) is
recorded once more and planned on its own. A recorded trace follows no plan. The
trace shows no ``.grad``: the graph's inputs that require
grad get a hook while their forward is traced, and the gradient the traced backward
computes for each is priced into the input's layout (``gradsync`` boxes it there).
Inside ``step.paused()`` (pipeline stages) traced calls are decided op by op.

>>> loss_fn = torch.compile(step_fn)      # doctest: +SKIP
>>> loss_fn(x)          # traced op by op and recorded
>>> loss_fn(x)          # planned, traced again: the planned collectives from here on
"""
from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .. import retrace
from ..propagation.cache import cached_decision, key_of_call
from ..tensor import GlobalTensor
from . import record
from .problem import plan_step

log = logging.getLogger("globaltensor")

MIN_GAIN = 0.01     # a traced graph is traced again for a plan at least this much cheaper


@dataclass
class Trace:
    """A compiled graph's calls as torch.compile traced them: AOTAutograd's forward and
    backward over fake parts, in one make_fx session."""
    serial: int
    mark: int = field(default_factory=retrace.new_trace)   # what its guards save
    record: list = field(default_factory=list)
    pin_grads: list = field(default_factory=list)   # problem.plan_step's pin_grads
    backward: set = field(default_factory=set)   # the calls made in backward
    sinks: list = field(default_factory=list)    # problem.plan_step's sinks: gradients of inputs
    watched: set = field(default_factory=set)    # ids of the inputs given a hook

    def watch_inputs(self, leaves: list) -> None:
        """Hook the graph's inputs that require grad (parameters): the gradient the
        traced backward computes for each is a sink in the input's layout, where
        ``gradsync`` boxes it after backward."""
        for x in leaves:   # (fake parts only: a hook must not outlive the trace)
            if x.__class__ is GlobalTensor and x.requires_grad and id(x) not in self.watched \
                    and x._local.__class__ is not torch.Tensor:
                origin = getattr(x, "_origin", None)
                if origin is None or origin[0] != self.serial:
                    self.watched.add(id(x))
                    x.register_hook(functools.partial(self._arrived, x._layout))

    def _arrived(self, layout, grad) -> None:
        origin = getattr(grad, "_origin", None)
        if origin is not None and origin[0] == self.serial:
            self.sinks.append((origin[1], origin[2], layout, grad.element_size(), "gradient"))


def decision(func, leaves: list, spec) -> tuple:
    """A call while torch.compile traces: (its decision, the node recording it or None)."""
    state = record.state
    session = get_proxy_mode()   # make_fx's: AOTAutograd traces the graph it compiles
    fresh = session is not None and (state.session is None or state.session() is not session)
    if fresh:   # a graph's trace begins: it replays a plan from its first call, or none
        state.session, state.trace, state.traced = weakref.ref(session), None, None
        state.follows, state.traced_misses = None, 0
        retrace.trace_begins(0)
    if state.hold and state.mode == "idle":   # inside record.paused(): op by op
        return cached_decision(func, leaves, spec), None
    key = key_of_call(func, leaves, spec)
    found = _follow(func, leaves, spec, key)
    if found is not None:
        state.traced_misses = 0
    elif state.follows is not None:
        state.traced_misses += 1
        if state.traced_misses > record.MAX_MISSES:
            _diverged()
    again = key is not None and key in state.record_next   # recorded afresh
    if again:
        state.traced = None   # nor goes on with a plan begun in an earlier pass
    # A recorded trace decides every call op by op: a plan taken up in its middle (a
    # call like its first) would leave its record with gaps.
    recording = session is not None and state.trace is not None
    if found is None and key is not None and not again and not recording:
        for (_, first), plan in reversed(state.plans.items()):   # the newest first
            if key == first:
                state.traced = [plan, 0]
                if fresh:
                    state.follows = (key, retrace.new_trace())
                    retrace.trace_begins(state.follows[1])
                found = _follow(func, leaves, spec, key)
                break
    if found is not None:
        return found, None
    greedy = cached_decision(func, leaves, spec)
    if fresh and record.ENABLED and key is not None and state.mode != "recording" and (
            again or key not in state.traced_firsts and len(state.traced_firsts) < record.MAX_KEYS):
        state.record_next.discard(key)
        (state.rerecorded if again else state.traced_firsts).add(key)
        state.serial += 1
        state.trace = Trace(state.serial)
        state.pending.append(state.trace)
        retrace.at_next_guard(plan_traces)
        retrace.trace_begins(state.trace.mark)
    trace = state.trace
    if session is None or trace is None:
        return greedy, None
    if torch._C._current_graph_task_id() == -1:
        trace.watch_inputs(leaves)
    node = record.record_call(func, leaves, spec, greedy, trace.record, trace.serial)
    if not trace.record:   # too long (``step.MAX_CALLS``): this graph is not planned
        state.trace = None
        state.pending.remove(trace)
        return greedy, None
    if torch._C._current_graph_task_id() != -1:
        trace.backward.add(len(trace.record) - 1)
    return greedy, node


def plan_traces() -> None:
    """Plan the graphs recorded while torch.compile traced them (at a guard check, when
    their traces have ended). A plan cheaper than the traced per-op choice is kept, and
    its graph traces again (``retrace.py``) and replays it."""
    state = record.state
    pending, state.pending, state.trace = state.pending, [], None
    better, state.diverged = state.diverged, set()
    for trace in pending:
        if not trace.record:
            continue
        try:
            plan = plan_step(trace.record, _graph_outputs(trace), trace.pin_grads)
        except Exception as e:  # noqa: BLE001  (every rank fails alike: SPMD records agree)
            log.warning("globaltensor: a compiled graph could not be planned (%s: %s); it "
                        "stays decided op by op", type(e).__name__, e)
            continue
        plan.problem = None
        if plan.planned_cost < (1 - MIN_GAIN) * plan.per_op_cost:
            state.plans.pop((0, plan.first_key), None)   # (re)inserted as the newest
            if len(state.plans) >= record.MAX_PLANS:
                state.plans.pop(next(iter(state.plans)))
            state.plans[0, plan.first_key] = plan   # owner 0: replayed by traces only
            state.last = plan
            better.add(trace.mark)
    retrace.retrace(better)


def _graph_outputs(trace: Trace) -> list:
    """Sinks for the outputs that no later call of the trace uses: the graph's outputs.
    A gradient of an input goes into the input's layout (``Trace.watch_inputs``); a
    forward output (the loss) keeps the layout the trace gave it (its caller sees that
    layout); another backward output has its partial sums reduced where it is."""
    used = {p[:2] for node in trace.record for p in node.producers if p is not None}
    used.update(made_by for _, _, made_by, *_ in trace.pin_grads if made_by is not None)
    sinks = list(trace.sinks)
    used.update((u, k) for u, k, *_ in trace.sinks)
    for u, node in enumerate(trace.record):
        decision = node.greedy
        for k, (layout, dtype) in enumerate(zip(decision.out_layouts, decision.out_dtypes)):
            if (u, k) not in used and layout is not None:
                sinks.append((u, k, None if u in trace.backward else layout, dtype.itemsize,
                              "gradient"))
    return sinks


def _diverged() -> None:
    """The graph being traced leaves the plan it began with: another program whose first
    call is the same (a variant of a step with a layout pinned, an evaluation step).
    Its trace goes on op by op; the graph traces again once, recorded from its first
    call on and followed by no plan, so that it is planned on its own."""
    state = record.state
    key, mark = state.follows
    state.follows = None
    if key not in state.rerecorded and key not in state.record_next:
        state.record_next.add(key)
        state.diverged.add(mark)
        retrace.at_next_guard(plan_traces)   # not now: the trace's own guard must hold


def recording() -> "Trace | None":
    """The trace being recorded now, if any."""
    return record.state.trace if get_proxy_mode() is not None else None


def _follow(func, leaves: list, spec, key):
    """The planned decision when this call goes on the plan being replayed, else None."""
    traced = record.state.traced
    if traced is None:
        return None
    plan, cursor = traced
    for ahead in range(cursor, min(cursor + record.LOOKAHEAD, len(plan.nodes))):
        found = record.replayed(plan.nodes[ahead], func, leaves, spec, key)
        if found is not None:
            traced[1] = ahead + 1
            return found
    return None


record.StepMode.traced_decision = staticmethod(decision)
