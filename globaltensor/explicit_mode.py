"""Explicit mode: inside ``with gt.explicit():`` only the program moves data.

Implicit boxing is the default: an op whose operands are in layouts it cannot take
gets them boxed, and a 0-d partial result (a loss) is reduced at once so that any rank
can read it. In an explicit region the program writes every redistribution itself
(``x.to_global(...)``, ``x.full()``); an op that would box one of its operands raises
``LayoutError`` before anything is sent, naming the op, the program's line, each
operand's layout and the one the op would take, the cheapest boxing with its bytes and
estimated time, and the ``to_global`` call that makes it explicit. Partial results flow
(``allow_partial=True``, the default, as DTensor lets Partial flow): an op's 0-d
partial result stays partial instead of being reduced; with ``allow_partial=False`` an
op that makes a partial result raises too. The gradient sync of leaves (a parameter's
partial gradient reduced into its own layout) is what the parameter's layout says, and
is not an implicit boxing; nor is the backward of a ``to_global`` the program wrote.

The same check runs while torch.compile traces (it raises during tracing), in
backward (naming the autograd node whose backward boxes and the forward line that made
it: nodes made in a region keep the program's line), and with whole-step
planning (a step recorded in an explicit region keeps every call's own decision, so
its plan boxes only where the program does).

>>> import globaltensor as gt
>>> with gt.explicit():                                          # doctest: +SKIP
...     y = x @ w      # x split(0), w broadcast: no boxing needed, runs
...     z = y @ v      # v split(0): LayoutError names v's boxing to broadcast
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from . import modes
from .layout import Layout
from .sbp import Partial


class LayoutError(ValueError):
    """An op in an explicit region (``gt.explicit()``) would box an operand, or make a
    partial result where ``allow_partial=False``."""


_written = 0          # open boxings the program wrote (to_global, full)


class Region(modes.Mode):
    """The mode of an open explicit region: the innermost one checks every decision
    before it is carried out (``check``, installed by ``dispatch/entry.py``, which
    knows the ops' rules)."""

    check: "Callable | None" = None   # (region, func, decision, leaves, spec) -> decision

    def __init__(self, allow_partial: bool):
        self.allow_partial = allow_partial

    def run(self, func, decision, leaves: list, spec, why):
        if modes.innermost(Region) is self:
            decision = Region.check(self, func, decision, leaves, spec)
        return self.below.run(func, decision, leaves, spec, why)


def active() -> bool:
    """Whether an explicit region is open."""
    return modes.innermost(Region) is not None


def allows_partial() -> bool:
    """Whether the innermost explicit region lets partial results flow."""
    return modes.innermost(Region).allow_partial


class explicit(contextlib.ContextDecorator):
    """A region in which the program writes every redistribution (module docstring).
    A context manager, or a decorator: ``gt.explicit(fn)`` or ``@gt.explicit()``.

    >>> with gt.explicit(allow_partial=False):                  # doctest: +SKIP
    ...     loss = model(x, y)
    >>> step = gt.explicit(train_step)                          # doctest: +SKIP
    """

    def __new__(cls, fn: Callable | None = None, *, allow_partial: bool = True):
        self = super().__new__(cls)
        self.allow_partial = allow_partial
        if fn is not None:
            if not callable(fn):
                raise TypeError(f"gt.explicit takes a function to wrap, or none, not {fn!r} "
                                f"(allow_partial is a keyword: gt.explicit(allow_partial=False))")
            return self(fn)
        return self

    def __init__(self, fn: Callable | None = None, *, allow_partial: bool = True):
        pass

    def __enter__(self) -> "explicit":
        region = Region(self.allow_partial)
        modes.enter(region)
        _lines.append((region, _ForwardLines()))
        _lines[-1][1].__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if not _lines:   # gt.testing.reset() closed it
            return False
        region, lines = _lines.pop()
        lines.__exit__(*exc)
        modes.leave(region)
        return False


class _ForwardLines(TorchFunctionMode):
    """While a region is open: each autograd node made by a call of the program's
    keeps the program's line (``node.metadata``), so a boxing its backward would do is
    named at the forward line that caused it (``backward_node``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is not None and _LINE not in node.metadata:
                node.metadata[_LINE] = program_line()
        return out


_LINE = "globaltensor_forward_line"
_lines: list = []   # (Region, _ForwardLines) of the open regions, innermost last


def _close_regions() -> None:
    """End the regions left open (``modes.reset``)."""
    global _written
    while _lines:
        _lines.pop()[1].__exit__(None, None, None)
    _written = 0


modes.on_reset(_close_regions)


@contextlib.contextmanager
def written() -> Iterator[None]:
    """A boxing the program wrote (its ``to_global``, ``full``, their backward): allowed
    in an explicit region."""
    global _written
    _written += 1
    try:
        yield
    finally:
        _written -= 1


def boxing_written() -> bool:
    return _written > 0


# Frames of these modules are the library's own way to a to_global the program wrote
# (gt.to_global(t, ...), gt.nn.to_global(model, ...)), not a call of its own.
_PASS_THROUGH = ("globaltensor.tensor", "globaltensor.factory", "globaltensor.nn.module")


def called_by_program(depth: int = 2) -> bool:
    """Whether the caller of the function ``depth`` frames up, past the library's
    entry points, is the program (not globaltensor: a rule's decomposition that
    gathers is the library's boxing, not the program's)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__", "") in _PASS_THROUGH:
        frame = frame.f_back
    name = "" if frame is None else frame.f_globals.get("__name__", "")
    return not (name == "globaltensor" or name.startswith("globaltensor."))


def program_line() -> str:
    """``file:line`` of the innermost frame outside globaltensor and torch (the
    program's line that made the call), or "" when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("globaltensor.", "torch.", "torch")) or name == "globaltensor"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def backward_node() -> str:
    """" in backward (MmBackward0, forward at train.py:12)" inside backward, else "". The
    forward's line is known for a node made in an explicit region (``_ForwardLines``),
    or under ``torch.autograd.set_detect_anomaly(True)``, which keeps each node's
    forward traceback."""
    node = torch._C._current_autograd_node()
    if node is None:
        return ""
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    forward = f", forward at {node.metadata[_LINE]}" if node.metadata.get(_LINE) else ""
    for line in reversed(stack or [] if not forward else []):   # formatted frames: '  File "x.py", line 3, in f\n...'
        if "/globaltensor/" not in line and "/torch/" not in line and 'File "' in line:
            file, _, rest = line.split('File "', 1)[1].partition('", line ')
            forward = f", forward at {file}:{rest.split(',')[0]}"
            break
    if not forward:
        forward = "; torch.autograd.set_detect_anomaly(True) names its forward line"
    return f" in backward ({node.name()}{forward})"


def sbp_text(layout: Layout) -> str:
    """``layout``'s nd-sbp as messages show it: ``split(dim=0)``, or ``(split(dim=0), broadcast)``."""
    sbp = layout.sbp
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(str(s) for s in sbp) + ")"


def op_boxing_error(func, moves: list) -> LayoutError:
    """The error of an op that would box operands: ``moves``, per operand that moves,
    (its position, its layout, the target, the plan)."""
    line = program_line()
    lines = [f"globaltensor: {func} at {line or '(no program line)'}{backward_node()} "
             f"would box {len(moves)} operand(s) in an explicit region (gt.explicit()):"]
    total = 0
    for i, src, dst, plan in moves:
        moved = plan.sent_bytes()
        total += moved
        steps = " + ".join(type(s).__name__ for s in plan.steps) or "nothing"
        lines.append(f"  operand {i}: {tuple(src.shape)} {src.placement} {sbp_text(src)} -> "
                     f"{sbp_text(dst)} ({steps}: {moved} B per rank, ~{plan.cost * 1e6:.0f} us)")
    lines.append("  the op takes its operands in the layouts after '->' (the cheapest of the "
                 "signatures its rule accepts, from these inputs)")
    fixes = "; ".join(f"operand {i} .to_global(sbp={sbp_text(dst)})" for i, _, dst, _ in moves)
    lines.append(f"  to box explicitly, write before the op: {fixes}")
    return LayoutError("\n".join(lines))


def boxing_error(why: object, src: Layout, dst: Layout) -> LayoutError:
    """The error of a boxing the library would do on its own (inside an op's
    decomposition) in an explicit region."""
    return LayoutError(
        f"globaltensor: {why} at {program_line() or '(no program line)'}{backward_node()} "
        f"would box {tuple(src.shape)} {src.placement} {sbp_text(src)} -> {sbp_text(dst)} "
        f"in an explicit region (gt.explicit()); box the operands first with "
        f"x.to_global(...), or run this op outside the region")


def partial_error(func, outs: list) -> LayoutError:
    """The error of an op that makes a partial result where ``allow_partial=False``."""
    made = ", ".join(sbp_text(o) for o in outs)
    return LayoutError(
        f"globaltensor: {func} at {program_line() or '(no program line)'}{backward_node()} "
        f"makes a partial result ({made}) in an explicit region with allow_partial=False; "
        f"reduce it explicitly (y.to_global(sbp=...)) or allow partials")


def makes_partial(in_layouts: list, out_layouts: list) -> list:
    """The output layouts partial on an axis where no input is."""
    partial_in = {a for layout in in_layouts for a, s in enumerate(layout.sbp)
                  if isinstance(s, Partial)}
    return [o for o in out_layouts if o is not None and any(
        isinstance(s, Partial) and a not in partial_in for a, s in enumerate(o.sbp))]
