"""``to_global`` inside a recorded step: the planner sees through it.

A user's ``to_global`` in a step (Megatron's layout annotated on an activation, a
"pin") is no call of the step, but the plan must price it and its replay must meet
it as recorded. While a step (or a compiled graph's trace) is recorded:

- a ``to_global`` that moves something charges its boxing to the call that made its
  input (a "pin" sink of ``problem.plan_step``). Its backward boxes the gradient into the
  input's layout, partial axes broadcast, which the plan chooses with the input's
  call: the calls after it in backward take the gradient as made by that call
  "through the pin", and the boxing there is priced between that call and the
  gradient's (``pin_grads``). Where the plan gives the input the target layout, the
  ``to_global`` moves nothing on replay and has no backward: the plan then keeps the
  gradient in the layout the calls after it take;
- a ``to_global`` that moves nothing holds its input's layout: made real by the plan,
  it would hand the calls after it a tensor they were not recorded with.

>>> y = x.to_global(sbp=gt.sbp.broadcast)   # priced, replayed alike  # doctest: +SKIP
"""
from __future__ import annotations

from .. import comm
from ..tensor import GlobalTensor, install_pin_watch
from . import record, traced


def note_pin(x: GlobalTensor, dst, calls: list, serial: int, sinks: list):
    """A ``to_global`` of ``x`` to ``dst`` in ``calls`` (made with ``serial``) that moves
    something. Returns the link its backward hands to ``note_pin_gradient`` (None:
    ``x`` was made elsewhere, and its gradient's layout is fixed)."""
    origin = record.recorded_origin(x, calls, serial)
    if origin is None or len(origin) > 3:
        return None
    sinks.append((origin[1], origin[2], dst, x.element_size(), "pin"))
    return serial, origin[1], origin[2], dst


def note_pin_gradient(out: GlobalTensor, grad, link: tuple, calls: list, serial: int,
                      pin_grads: list) -> GlobalTensor:
    """The backward of a ``to_global`` noted by ``note_pin``: ``grad`` was boxed into
    ``out``. Returns ``out``, a new tensor marked as made through the pin. A pin noted
    in another recording (a step begins at each outermost forward of a module, and a
    program may call its modules one by one, backward after the last) has no call of
    this one to be made by: ``out`` is left as made before the step."""
    if not isinstance(grad, GlobalTensor) or link[0] != serial:
        return out
    _, u, k, dst = link
    origin = record.recorded_origin(grad, calls, serial)
    made_by = origin[1:3] if origin is not None and len(origin) == 3 else None
    pin_grads.append((u, k, made_by, grad._layout, grad.element_size(), dst))
    if out is grad:   # (its strides kept: they are part of what the next calls expect)
        strides = tuple(grad.stride())
        out = GlobalTensor(grad._local, grad._layout,
                           strides=None if strides == grad._layout.strides else strides)
    out._origin = (serial, u, k, True)
    return out


def note_unmoved(x: GlobalTensor, dst, calls: list, serial: int, sinks: list) -> None:
    """A ``to_global`` of ``x`` that moves nothing: the call that made ``x`` keeps ``dst``."""
    origin = record.recorded_origin(x, calls, serial)
    if origin is not None and len(origin) == 3:
        sinks.append((origin[1], origin[2], dst, x.element_size(), "held"))


def _recording_now():
    """(record, serial, sinks, pin_grads) of the step or trace recorded now, or None."""
    if comm.tracing():
        trace = traced.recording()
        return None if trace is None else (trace.record, trace.serial, trace.sinks,
                                           trace.pin_grads)
    state = record.state
    if state.mode != "recording":
        return None
    return state.record, state.serial, state.sinks, state.pin_grads


def _forward(x: GlobalTensor, dst):
    now = _recording_now()
    return None if now is None else note_pin(x, dst, *now[:3])


def _backward(out: GlobalTensor, grad, link: tuple) -> GlobalTensor:
    now = _recording_now()
    return out if now is None else note_pin_gradient(out, grad, link, now[0], now[1], now[3])


def _unmoved(x: GlobalTensor, dst) -> None:
    now = _recording_now()
    if now is not None:
        note_unmoved(x, dst, *now[:3])


install_pin_watch(_forward, _backward, _unmoved)
