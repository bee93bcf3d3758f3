"""What every boxing step declares, and the handle a started step returns.

A step is a frozen value (its layouts and parameters) that knows, in one class: which
change of layout it serves (``for_axis`` for per-axis steps), what it costs
(``cost``, the alpha-beta model of ``cost.py``), how it runs on this rank
(``start`` returns a ``Handle``; ``wait()`` gives the local tensor) and how it runs on
every rank's tensor in one process (``simulate``, the reference model). A concrete
class that leaves any of them abstract fails when it is defined, and every concrete
class registers itself (``registry.py``), so a new step is one new class.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ...cost import Costs, costs_of, max_local_bytes
from ...layout import Layout, balanced_split
from .registry import register

Locals = dict  # rank -> torch.Tensor, the simulator's per-rank tensors


class Handle:
    """A started step or plan. ``wait()`` finishes it and returns this rank's local
    tensor (again on later calls); ``is_completed()`` never blocks.

    >>> h = plan.start(local)       # doctest: +SKIP
    >>> out = h.wait()
    """

    __slots__ = ("_work", "_finish", "_out")

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work, self._finish, self._out = work, finish, None

    @staticmethod
    def ready(out: torch.Tensor) -> "Handle":
        """A handle whose work is already done."""
        handle = Handle(None, None)
        handle._out = out
        return handle

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._out = self._finish()
            self._work = self._finish = None
        return self._out

    def is_completed(self) -> bool:
        """True when ``wait()`` would not wait for a message."""
        return self._work is None or self._work.is_completed()

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Handle":
        """A handle whose ``wait()`` is ``fn`` of this one's result."""
        return Handle(self, lambda: fn(self.wait()))


class Step:
    """The base of every boxing step (see the module docstring)."""

    # Collectives of gloo and NCCL lack some dtypes (int16): such a step's input
    # travels widened (the executor does it; point-to-point carries any dtype).
    widens: ClassVar[bool] = False
    # Whether the step sends data between ranks (explicit mode allows those that do not:
    # a broadcast tensor sliced to a split, a view).
    sends: ClassVar[bool] = True
    src: Layout
    dst: Layout

    def __init_subclass__(cls, abstract: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        missing = sorted(name for name in dir(cls)
                         if getattr(getattr(cls, name), "__isabstractmethod__", False))
        if missing:
            raise TypeError(f"boxing step {cls.__name__} does not define "
                            f"{', '.join(missing)}")
        register(cls, per_axis=issubclass(cls, AxisStep))

    @property
    def kind(self) -> str:
        return type(self).__name__

    @property
    def costs(self) -> Costs:
        """The constants of the backend that runs this step (``cost.py``)."""
        return costs_of(self.src, self.dst)

    @abstractmethod
    def cost(self, itemsize: int) -> float:
        """Estimated seconds on the slowest rank (alpha-beta model)."""

    def sent_bytes(self, itemsize: int) -> int:
        """Bytes the busiest rank sends, counted as ``gt.debug.comm_stats`` counts the
        collectives (a ring's share); a step that sends nothing: 0. A sending step
        without its own count is taken to send its whole input."""
        return self.bytes_in(itemsize) if self.sends else 0

    @abstractmethod
    def start(self, x: torch.Tensor, rank: int, own: bool = False) -> Handle:
        """Start this rank's part on its local tensor ``x``. ``own`` says no one else
        holds ``x``, so the step may reuse its memory (e.g. reduce in place)."""

    @abstractmethod
    def simulate(self, locals_: Locals) -> Locals:
        """Every rank's local tensor after the step, from every rank's before it."""

    @abstractmethod
    def describe(self, itemsize: int) -> list[str]:
        """Lines for ``explain`` under the step's name."""

    def runs_on(self, rank: int) -> bool:
        """Whether ``rank`` takes part (others skip the step)."""
        return True


@dataclass(frozen=True)
class AxisStep(Step, abstract=True):
    """A step that changes the sbp of one placement axis; it acts inside each sub-group
    along that axis (``placement.groups(axis)``)."""

    axis: int
    src: Layout
    dst: Layout

    @classmethod
    @abstractmethod
    def for_axis(cls, axis: int, src: Layout, dst: Layout) -> "AxisStep | None":
        """This kind of step changing ``axis`` from ``src``'s sbp to ``dst``'s (the
        other axes equal), or None when it does not serve that change."""

    def runs_on(self, rank: int) -> bool:
        return rank in self.src.placement

    def members(self, rank: int) -> tuple[int, ...]:
        return self.src.placement.group(rank, self.axis)

    def parts(self, length: int) -> tuple[tuple[int, int], ...]:
        """Balanced (offset, size) parts of ``length`` over this axis' group."""
        return balanced_split(length, self.group_size)

    @property
    def group_size(self) -> int:
        return self.src.placement.shape[self.axis]

    def bytes_in(self, itemsize: int) -> int:
        return max_local_bytes(self.src, itemsize)

    def bytes_out(self, itemsize: int) -> int:
        return max_local_bytes(self.dst, itemsize)

    def by_group(self, locals_: Locals, fn) -> Locals:
        """Simulation helper: ``fn(members, [their locals]) -> [new locals]`` applied
        to every sub-group along the axis."""
        out = {}
        for members in self.src.placement.groups(self.axis):
            for m, t in zip(members, fn(members, [locals_[m] for m in members])):
                out[m] = t
        return out

    def describe(self, itemsize: int) -> list[str]:
        groups = self.src.placement.groups(self.axis)
        shown = ", ".join(str(list(g)) for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
        return [f"groups: {shown}",
                f"local bytes per rank: {self.bytes_in(itemsize)} -> "
                f"{self.bytes_out(itemsize)}, est. {self.cost(itemsize) * 1e3:.3f} ms"]

    def __str__(self) -> str:
        return (f"{self.kind}(axis={self.axis}: {self.src.sbp[self.axis]} -> "
                f"{self.dst.sbp[self.axis]})")


@dataclass(frozen=True)
class SbpChange(AxisStep, abstract=True):
    """An axis step serving one kind of change: from an sbp of class ``takes[0]`` to one
    of class ``takes[1]``; ``fields(a, b)`` gives the step's own fields (after axis, src,
    dst) for the two sbp, or None where it does not serve that pair. Its cost is
    ``cost_for(group size, backend constants, bytes in, bytes out)`` (the largest local
    tensor before and after): what it serves and what it costs depend on nothing else,
    so step planning prices each (kind, group size, bytes) once for every layout graph
    (``search.py``). The built-in steps say what they serve this way; a step may write
    ``for_axis`` (and ``cost``) itself instead."""

    takes: ClassVar[tuple] = ()

    @staticmethod
    def fields(a, b) -> "tuple | None":
        return ()

    @staticmethod
    @abstractmethod
    def cost_for(n: int, k: Costs, bytes_in: int, bytes_out: int) -> float:
        """Estimated seconds of the step on a group of ``n`` ranks with constants ``k``,
        the largest local tensor ``bytes_in`` before it and ``bytes_out`` after."""

    def cost(self, itemsize: int) -> float:
        return self.cost_for(self.group_size, self.costs, self.bytes_in(itemsize),
                             self.bytes_out(itemsize))

    @classmethod
    def serves(cls, a, b) -> bool:
        """Whether this kind changes an axis from sbp ``a`` to sbp ``b``."""
        return isinstance(a, cls.takes[0]) and isinstance(b, cls.takes[1]) \
            and cls.fields(a, b) is not None

    @classmethod
    def for_axis(cls, axis: int, src: Layout, dst: Layout) -> "AxisStep | None":
        a, b = src.sbp[axis], dst.sbp[axis]
        if isinstance(a, cls.takes[0]) and isinstance(b, cls.takes[1]):
            extra = cls.fields(a, b)
            if extra is not None:
                return cls(axis, src, dst, *extra)
        return None


def priced_by_bytes(kind: type) -> bool:
    """Whether ``kind`` says what it serves and costs as ``SbpChange`` does (not by a
    ``for_axis`` or ``cost`` of its own): then ``serves`` and ``cost_for`` price it."""
    return issubclass(kind, SbpChange) and kind.cost is SbpChange.cost \
        and kind.for_axis.__func__ is SbpChange.for_axis.__func__


def reduce_of(reduce: str, dtype: torch.dtype) -> str:
    """The collective's reduction: a sum of bools is their "or" (as torch adds bools),
    which is their max."""
    return "max" if dtype == torch.bool else reduce
