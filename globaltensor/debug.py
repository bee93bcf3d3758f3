"""Introspection: what a redistribution will do, what communication ran, who holds what.

>>> import globaltensor as gt
>>> x = gt.randn(8, 4, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0))
>>> print(gt.debug.explain(x, sbp=gt.sbp.broadcast))      # doctest: +SKIP
>>> with gt.debug.comm_stats() as stats:
...     y = x.to_global(sbp=gt.sbp.broadcast)
>>> stats.total_bytes                                       # doctest: +SKIP
>>> gt.debug.show_layout(x)                                 # doctest: +SKIP
>>> gt.debug.plot_layout(x, "x.png")                        # doctest: +SKIP
>>> gt.debug.plot_step(gt.debug.explain_step(step), "step.png")  # doctest: +SKIP

Set ``GLOBALTENSOR_DEBUG=1`` to log every boxing route as it runs (logger "globaltensor",
level DEBUG) and to turn on the check mode (``check_consistency``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import origins
from .boxing import Plan, plan_route
from .comm import CollectiveError, DivergenceError, stats
from .comm.stats import CommCounter
from .device_profile import PROFILES, DeviceProfile, Link
from .layout import Layout
from .layout_spec import notation as _notation
from .pictures import draw_layout, plot_layout, plot_step
from .placement import Placement
from .planner.explain import StepReport, explain_step
from .rules.registry import FallbackWarning
from .step_check import StepCheck, check_step
from .step_simulation import SimulatedStep, simulate_step
from .tensor import GlobalTensor

__all__ = ["notation", "explain", "explain_step", "StepReport", "check_step", "StepCheck", "simulate_step",
           "SimulatedStep", "DeviceProfile", "Link", "PROFILES", "comm_stats", "show_layout",
           "plot_layout", "plot_step", "check_consistency", "CommCounter", "CollectiveError", "DivergenceError",
           "FallbackWarning"]


@contextlib.contextmanager
def check_consistency() -> Iterator[None]:
    """Check mode (also on with GLOBALTENSOR_DEBUG=1, read at import): before each
    boxing communicates, the ranks involved compare a fingerprint of it (op, layouts,
    dtype, the program line that caused it and the origins of the tensors involved,
    see ``globaltensor/origins.py``) and all raise ``DivergenceError`` when they differ,
    instead of hanging or mixing up values (e.g. ``.item()`` called on different tensors
    on different ranks, even from one line). It costs one small all-gather per boxing.

    >>> with gt.debug.check_consistency():      # doctest: +SKIP
    ...     loss = model(x).sum()
    """
    with origins.Checking():
        yield


def _layout_of(x, what: str, layouts: bool = False) -> Layout:
    """``x``'s layout (``layouts``: ``x`` may be a Layout itself); a TypeError naming what
    was given instead."""
    if isinstance(x, GlobalTensor):
        return x.global_layout
    if layouts and isinstance(x, Layout):
        return x
    hint = " (a function's step: gt.debug.explain_step)" if callable(x) else ""
    raise TypeError(f"gt.debug.{what}: expected a GlobalTensor{' or a Layout' * layouts}, "
                    f"got {type(x).__name__}{hint}")


def explain(x: GlobalTensor, placement: Placement | None = None, sbp=None) -> Plan:
    """The plan ``x.to_global(placement, sbp)`` would run: its steps, process groups,
    bytes per rank and estimated cost (print it). No communication.

    >>> print(gt.debug.explain(x, sbp=gt.sbp.broadcast))      # doctest: +SKIP
    """
    layout = _layout_of(x, "explain")
    placement = layout.placement if placement is None else placement
    sbp = layout.sbp if sbp is None else sbp
    return plan_route(layout, Layout.make(x.shape, placement, sbp), x.element_size())


@contextlib.contextmanager
def comm_stats() -> Iterator[CommCounter]:
    """Count this rank's collectives and point-to-point messages, and the bytes it sends,
    by kind ("all_gather", "all_reduce", "all_to_all", "send", ...)."""
    counter = CommCounter()
    stats.push(counter)
    try:
        yield counter
    finally:
        stats.pop(counter)


def show_layout(x: GlobalTensor, file=None) -> str:
    """Print (and return) which rank holds which block of ``x``: a text picture of its
    first two split dims (blocks labelled with their ranks: "0,1" copies, "0+1"
    addends), then each rank's slice. No communication.

    >>> gt.debug.show_layout(x)     # (8, 8) on [[0, 1], [2, 3]], (split(0), split(1))  # doctest: +SKIP
    (8, 8) torch.float32 on placement(type="cpu", ranks=[[0, 1], [2, 3]]), sbp (split(dim=0), split(dim=1))
      rows: dim 0 (8), columns: dim 1 (8)
      +---------------+--------------+
      |               |              |
      ...
      |       0       |      1       |
      ...
      rank 0 [0, 0]: [0:4, 0:4] shape (4, 4)
    """
    layout = _layout_of(x, "show_layout")
    lines = [f"{tuple(x.shape)} {x.dtype} on {layout.placement}, sbp {layout.sbp}"]
    lines += ["  " + line for line in draw_layout(layout).splitlines()]
    for rank in layout.placement:
        region = layout.region(rank)
        index = ", ".join(f"{o}:{o + s}" for o, s in zip(region.offsets, region.sizes))
        coord = layout.placement.coord(rank)
        notes = [f"{layout.sbp[a]} addend" for a in layout.partial_axes]
        extra = f"  ({'; '.join(notes)})" if notes else ""
        lines.append(f"  rank {rank} {list(coord)}: [{index}] shape {region.sizes}{extra}")
    text = "\n".join(lines)
    print(text, file=file)
    return text


def notation(x: "GlobalTensor | Layout") -> str:
    """``x``'s layout in the short notation of ``layout_spec``: ``f32[8@0, 4]`` is a
    float32 (8, 4) tensor split on dim 0 by placement axis 0.

    >>> gt.debug.notation(gt.randn(8, 4, placement=p, sbp=gt.sbp.split(0)))  # doctest: +SKIP
    'f32[8@0, 4]'
    """
    layout = _layout_of(x, "notation", layouts=True)
    return _notation(layout, x.dtype) if isinstance(x, GlobalTensor) else _notation(layout)

