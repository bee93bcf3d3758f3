"""``to_global`` inside recorded and planned steps: the planner sees through it.

A user's ``to_global`` in a step (a pin: Megatron's layout annotated on an activation)
is no call of the step, but the planner must price it and the replay must meet it as
recorded. While a step is recorded or replayed (eagerly or while torch.compile traces):

- a ``to_global`` that moves nothing runs too, with a new tensor as its output, as one
  that moves something: the same line may move something in the recorded step and
  nothing in the planned one, or the reverse;
- its input's boxing is a sink of the call that made the input (``step_plan``);
- its backward boxes the gradient into the input's layout, partial axes broadcast,
  which the plan chooses with the input's call: the calls after it in backward take
  the gradient as made by that call "through the pin", and the boxing there is priced
  between that call and the gradient's (``pin_grads``).

>>> y = x.to_global(sbp=gt.sbp.broadcast)   # priced, replayed    # doctest: +SKIP
"""
from __future__ import annotations

from .. import comm
from ..tensor import GlobalTensor, install_pin_watch
from . import step, traced


def note_pin(x: GlobalTensor, dst, record: list, serial: int, sinks: list):
    """A ``to_global`` of ``x`` to ``dst`` in ``record`` (made with ``serial``): the
    boxing is a sink of the call that made ``x``; returns the link its backward hands to
    ``note_pin_gradient`` (None: ``x`` was made elsewhere, its gradient's layout is
    fixed)."""
    origin = step.recorded_origin(x, record, serial)
    if origin is None or len(origin) > 3:
        return None
    sinks.append((origin[1], origin[2], dst, x.element_size(), False))
    return origin[1], origin[2]


def note_pin_gradient(out: GlobalTensor, grad, link: tuple, record: list, serial: int,
                      pin_grads: list) -> GlobalTensor:
    """The backward of a ``to_global`` noted by ``note_pin``: ``grad`` was boxed into
    ``out``. Returns ``out``, a new tensor marked as made through the pin."""
    if not isinstance(grad, GlobalTensor):
        return out
    origin = step.recorded_origin(grad, record, serial)
    made_by = origin[1:3] if origin is not None and len(origin) == 3 else None
    pin_grads.append((link[0], link[1], made_by, grad._layout, grad.element_size()))
    if out is grad:
        out = GlobalTensor(grad._local, grad._layout)
    out._origin = (serial, link[0], link[1], True)
    return out


def _recording_now():
    """(record, serial, sinks, pin_grads) of the step or trace recorded now, or None."""
    if comm.tracing():
        trace = traced.recording()
        return None if trace is None else (trace.record, trace.serial, trace.sinks,
                                           trace.pin_grads)
    state = step.state
    if state.mode != "recording":
        return None
    return state.record, state.serial, state.sinks, state.pin_grads


def _forward(x: GlobalTensor, dst):
    now = _recording_now()
    return None if now is None else note_pin(x, dst, *now[:3])


def _backward(out: GlobalTensor, grad, link: tuple) -> GlobalTensor:
    now = _recording_now()
    return out if now is None else note_pin_gradient(out, grad, link, now[0], now[1], now[3])


def _watching() -> bool:
    """Whether a step is recorded or replayed now, or a trace recorded or following a
    plan."""
    if comm.tracing():
        return traced.recording() is not None or step.state.traced is not None
    return step.state.mode == "recording" or step.state.mode == "replaying"


install_pin_watch(_forward, _backward, _watching)
