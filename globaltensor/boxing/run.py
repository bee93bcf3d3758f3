"""Every boxing that moves data between ranks runs here: ``to_global`` and the ops'
input boxing (``box``), pipeline hand-offs (``start``, non-blocking) and DTensor
rechunking (``run`` of a given plan). Each run is logged at DEBUG level on the
"globaltensor" logger (``GLOBALTENSOR_DEBUG=1`` shows it on stderr), checked in check
mode (every rank taking part must be at the same boxing, from the same line of the
program, before any of them communicates) and named in profiler ranges and in
collective errors.

>>> local = box(x_local, src_layout, dst_layout)                 # doctest: +SKIP
>>> handle = start(plan, x_local, "pipeline hand-off", ranks)    # doctest: +SKIP
>>> local = handle.wait()                                        # doctest: +SKIP
"""
from __future__ import annotations

import logging
import os
import sys
import zlib
from typing import ContextManager

import torch

from .. import comm, env
from ..layout import Layout
from ..local_parts import empty_local
from .execute import execute
from .plan import Plan, plan_route
from .steps import Handle

_log = logging.getLogger("globaltensor")


def box(local: torch.Tensor, src: Layout, dst: Layout, donate: bool = False,
        why: object = "to_global") -> torch.Tensor:
    """This rank's local tensor of ``dst``, from its local tensor of ``src``; with
    ``donate``, ``local`` is a temporary that boxing may overwrite (reduce in place).
    ``why`` (an op, "to_global", ...) names the work in logs, errors and profiles."""
    plan = plan_route(src, dst, local.element_size())
    if not plan.steps:
        return local
    out = run(plan, local, why, donate)
    if comm.get_rank() not in dst.placement:
        return empty_local(dst, local.dtype, like=local)
    return out


def run(plan: Plan, local: torch.Tensor, why: object, donate: bool = False) -> torch.Tensor:
    """Run ``plan`` (planned by the caller) on this rank's ``local`` part and wait: its
    part of ``plan.dst``. Every rank of both placements takes part."""
    rank = comm.get_rank()
    if comm.claims_pending() and not comm.tracing():  # (a traced graph compares nothing)
        _settle_claims(plan, rank)
    with _watch(plan, local.dtype, why, rank):
        return execute(plan, local, rank, donate)


def _settle_claims(plan: Plan, rank: int) -> None:
    """Before the first boxing of the ranks of either end since they made global
    tensors from their own arguments, compare what they made (``comm.settle``): the
    members of each end are all here."""
    done = []
    for placement in (plan.src.placement, plan.dst.placement):
        ranks = tuple(sorted(placement.flat_ranks))
        if rank in ranks and ranks not in done:
            done.append(ranks)
            comm.settle(ranks)


def start(plan: Plan, local: torch.Tensor, why: object, ranks: tuple[int, ...]) -> Handle:
    """Start ``plan`` on this rank's ``local`` part without waiting; ``wait()`` on the
    handle gives its part of ``plan.dst``. ``ranks`` are the ranks that start this plan
    together (one side of a hand-off: the senders post at one moment, the receivers at
    another), the ones check mode compares."""
    rank = comm.get_rank()
    with _watch(plan, local.dtype, why, rank, ranks):
        return plan.start(local, rank)


def _watch(plan: Plan, dtype: torch.dtype, why: object, rank: int,
           ranks: tuple[int, ...] | None = None) -> ContextManager[None]:
    """What every boxing run gets: the debug log and check mode now, and the context to
    run it in, which names it in profiler ranges and in errors of its collectives.
    ``ranks``: who runs it together (None: every rank of both placements)."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("rank %d boxes for %s:\n%s", rank, why, plan)
    work = _Boxing(why, plan, dtype)
    if comm.check_mode() and not comm.tracing():
        work.check(rank, ranks)
    return comm.activity(work)


class _Boxing:
    """One boxing run, described only when asked (errors, profiler ranges, check mode)."""

    def __init__(self, why, plan, dtype):
        self.why, self.plan, self.dtype = why, plan, dtype

    def __str__(self) -> str:
        src, dst = self.plan.src, self.plan.dst
        steps = ", ".join(str(s) for s in self.plan.steps)
        return (f"{self.why}: boxing {tuple(src.shape)} {self.dtype} from {src.placement} "
                f"{src.sbp} to {dst.placement} {dst.sbp} [{steps}]")

    def check(self, rank: int, ranks: tuple[int, ...] | None) -> None:
        """Check mode: every rank of ``ranks`` (None: of both placements) must be at the
        same boxing, from the same line of the program, before any of them communicates."""
        if ranks is None:
            ranks = tuple(set(self.plan.src.placement) | set(self.plan.dst.placement))
        if rank not in ranks:
            return
        what = f"{self} (called from {call_site()})"
        comm.agree(zlib.crc32(what.encode()), tuple(ranks), what)


def call_site() -> str:
    """file:line of the innermost frame outside globaltensor and torch (the user's line
    that a boxing or a read comes from)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _INTERNAL):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_INTERNAL = (os.sep + "globaltensor" + os.sep, os.sep + "torch" + os.sep, "<frozen ")


def _configure_debug_logging() -> None:
    # GLOBALTENSOR_DEBUG=1 shows boxing at DEBUG level on stderr; otherwise the
    # "globaltensor" logger is the program's to configure (logging.DEBUG shows the same).
    if env.debug_enabled() and _log.level == logging.NOTSET:
        _log.setLevel(logging.DEBUG)
        if not _log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[globaltensor %(levelname)s] %(message)s"))
            _log.addHandler(handler)


_configure_debug_logging()
