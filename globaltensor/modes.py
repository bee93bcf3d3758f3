"""The modes of the per-op path, and the one the dispatcher asks for on each call.

Six things change how a call on GlobalTensors is carried out: recording or replaying a
planned step (``planner/record.py``), watching for the steps of a program that no module
marks (``planner/record.py``), check mode (``origins.py``), implicit broadcast
(``propagation/plain.py``), explicit regions (``explicit_mode.py``) and fake parts
(``gt.debug.check_step``, ``dispatch/entry.py``). Each is a ``Mode``: an object that
keeps its own state and is on while entered. Modes stack (an explicit region inside a
recorded step inside check mode): ``active`` is the newest, which the dispatcher hands
the call to; what a mode does not change it hands to the mode below, down to the plain
path (``install_plain_path``). With no mode on, ``active`` is None and a repeated call
takes the warm path: the dispatcher reads one module attribute per call, as DTensor
reads one active debug mode.

A call passes through three hooks, each a chain from the newest mode down:
``operands`` (the arguments as the op sees them), ``call`` (who decides the layouts: a
recorded step, or the plain path's per-op choice) and ``run`` (carrying out a decision:
an explicit region checks it first, check mode names its boxing). ``reset()`` ends
every mode and clears each owner's state (``gt.testing.reset()``); the modes a
program has from the start (check mode under GLOBALTENSOR_DEBUG=1, the watch for
functional steps) are entered again.

>>> class Quiet(Mode):                        # doctest: +SKIP
...     def run(self, func, decision, leaves, spec, why):
...         print(func)
...         return self.below.run(func, decision, leaves, spec, why)
>>> with Quiet():
...     y = x @ w                             # prints aten.mm.default
"""
from __future__ import annotations

from typing import Callable

__all__ = ["Mode", "active", "top", "enter", "leave", "innermost", "is_on", "reset", "on_reset",
           "install_plain_path"]


class Mode:
    """One way of carrying out calls on GlobalTensors, on while entered (``with mode:``
    or ``enter(mode)``). A subclass overrides the hooks it changes; the others hand the
    call to ``below``, the next mode down (the plain path at the bottom)."""

    below: "Mode"
    fakes = False          # whether this mode or one below changes the operands
    sees_first = False     # above the other modes in the chain, whenever it entered
    checks = False         # check mode: while on, ``checking`` (comm.check_mode())
    takes_plain = False    # while on, ``implicit``: plain operands taken as broadcast

    def operands(self, args: tuple, kwargs: dict) -> tuple:
        """The call's ``(args, kwargs)`` as the op sees them."""
        return self.below.operands(args, kwargs)

    def call(self, func, leaves: list, spec, tracing: bool):
        """Decide the call's layouts and carry it out (``active.run``); ``tracing``: its
        parts are fake while torch.compile traces."""
        return self.below.call(func, leaves, spec, tracing)

    def run(self, func, decision, leaves: list, spec, why):
        """Carry out ``decision`` (``why`` names its boxing; None: the op)."""
        return self.below.run(func, decision, leaves, spec, why)

    def __enter__(self) -> "Mode":
        enter(self)
        return self

    def __exit__(self, *exc) -> bool:
        leave(self)
        return False


active: "Mode | None" = None   # the newest mode on that changes a hook (read per call)
checking = False               # check mode is on (read on every tensor made)
implicit = False               # plain tensor operands are taken as broadcast
_stack: list = []              # the modes on, oldest first
_plain: "Mode | None" = None   # the plain path (dispatch/entry.py)
_resets: list = []             # (clear, defaults) of each owner of mode state


def install_plain_path(mode: Mode) -> None:
    """The bottom of every chain: per-op choice, and carrying a decision out."""
    global _plain
    _plain = mode
    _relink()


def enter(mode: Mode) -> None:
    """Turn ``mode`` on, above the modes already on."""
    if any(m is mode for m in _stack):
        raise RuntimeError(f"{type(mode).__name__} is already on")
    _stack.append(mode)
    _relink()


def leave(mode: Mode) -> None:
    """Turn ``mode`` off (the newest or not: a step can end outside the region it began
    in); a mode that is not on is left alone."""
    for k in range(len(_stack) - 1, -1, -1):
        if _stack[k] is mode:
            del _stack[k]
            _relink()
            return


def top() -> Mode:
    """The newest mode on, or the plain path: where a hook's chain starts."""
    return active if active is not None else _plain


def is_on(mode: Mode) -> bool:
    return any(m is mode for m in _stack)


def innermost(kind: type) -> "Mode | None":
    """The newest mode on of class ``kind`` (None: none is)."""
    for mode in reversed(_stack):
        if isinstance(mode, kind):
            return mode
    return None


def _relink() -> None:
    """Chain the modes on that change a hook, and set the flags the others raise (a
    mode that only raises a flag, implicit broadcast, leaves the warm path open)."""
    global active, checking, implicit
    below, fakes = _plain, False
    checking = implicit = False
    for mode in [m for m in _stack if not m.sees_first] + [m for m in _stack if m.sees_first]:
        checking = checking or mode.checks
        implicit = implicit or mode.takes_plain
        kind = type(mode)
        if kind.operands is Mode.operands and kind.call is Mode.call and kind.run is Mode.run:
            continue
        fakes = fakes or kind.operands is not Mode.operands
        mode.below, mode.fakes = below, fakes
        below = mode
    active = below if below is not _plain else None


def on_reset(clear: Callable[[], None], defaults: Callable[[], None] | None = None) -> None:
    """Register an owner of mode state: ``clear()`` forgets it; ``defaults()`` enters
    the modes a program has from the start (run after every owner cleared)."""
    _resets.append((clear, defaults))


def reset() -> None:
    """End every mode and forget every owner's state (``gt.testing.reset()``); the
    modes a program starts with are on again."""
    _stack.clear()
    _relink()
    for clear, _ in _resets:
        clear()
    for _, defaults in _resets:
        if defaults is not None:
            defaults()
