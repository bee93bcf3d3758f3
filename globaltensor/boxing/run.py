"""Every boxing that moves data between ranks runs here: ``to_global`` and the ops'
input boxing (``box``), pipeline hand-offs (``start``, non-blocking) and DTensor
rechunking (``run`` of a given plan). Each run is logged at DEBUG level on the
"globaltensor" logger (``GLOBALTENSOR_DEBUG=1`` shows it on stderr), checked in check
mode (every rank taking part must be at the same boxing, from the same line of the
program, before any of them communicates) and named in profiler ranges and in
collective errors. The scalars an op reduces at once so that one rank can read them (a
loss) first meet as a read's ranks do (``box(meet=True)``, ``reduction_meets``), and so
does a boxing the program asked for (``x.to_global()``, ``x.full()``: ``box(call=...)``,
``boxing_meets``), once per call path: a target layout that differs between ranks
fails at once, naming each rank's, and a ``to_global`` on some ranks only within
GLOBALTENSOR_READ_TIMEOUT, instead of waiting GLOBALTENSOR_TIMEOUT in a collective.

>>> local = box(x_local, src_layout, dst_layout)                 # doctest: +SKIP
>>> handle = start(plan, x_local, "pipeline hand-off", ranks)    # doctest: +SKIP
>>> local = handle.wait()                                        # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import zlib
from typing import ContextManager, Iterator

import torch

from .. import comm, env, explicit_mode
from ..comm.meet import meet_once, met_before
from ..layout import Layout
from ..local_parts import empty_local
from .execute import execute
from .plan import Plan, plan_route
from .steps import Handle

_log = logging.getLogger("globaltensor")


def box(local: torch.Tensor, src: Layout, dst: Layout, donate: bool = False,
        why: object = "to_global", meet: bool = False, call: str | None = None) -> torch.Tensor:
    """This rank's local tensor of ``dst``, from its local tensor of ``src``; with
    ``donate``, ``local`` is a temporary that boxing may overwrite (reduce in place).
    ``why`` (an op, "to_global", ...) names the work in logs, errors and profiles.
    ``meet``: the boxing reduces scalars an op made, at once, so that any one rank can
    read them (a loss, ``x.mean()`` over split rows, an index check): its ranks first
    meet as a read's do (``reduction_meets``). ``call``: the program's call that asked
    for this boxing ("x.to_global()", "x.full()"; not an op's input boxing, whose target
    follows from its inputs' layouts): its ranks meet once per call path
    (``boxing_meets``)."""
    plan = plan_route(src, dst, local.element_size())
    if not plan.steps:
        return local
    if explicit_mode.active() and call is None and not meet and not explicit_mode.boxing_written() \
            and plan.sends:
        # a boxing the library would do on its own (inside an op's decomposition): the
        # op's own operands were checked before it ran (dispatch/entry.py)
        raise explicit_mode.boxing_error(why, src, dst)
    for observe in _observers:   # gt.debug.check_step
        observe(why, src, dst, plan)
    if (meet or call is not None) and not comm.tracing():  # (a traced graph runs on every rank)
        if meet:
            reduction_meets(plan, local.dtype, why)
        else:
            boxing_meets(plan, local.dtype, call)
    out = run(plan, local, why, donate)
    if comm.get_rank() not in dst.placement:
        return empty_local(dst, local.dtype, like=local)
    return out


_observers: list = []   # functions told of every boxing (why, src, dst, plan) before it runs


@contextlib.contextmanager
def observed(observe) -> Iterator[None]:
    """Tell ``observe(why, src, dst, plan)`` of every boxing inside, before it runs."""
    _observers.append(observe)
    try:
        yield
    finally:
        _observers.remove(observe)


REDUCTION_ADVICE = (
    "An op's scalar result over split or partial parts (a loss, x.mean() or x.sum() over "
    "split rows) is reduced among the ranks of its placement as the op runs: a collective, "
    "which every one of them must run. Compute such a value on every rank and read it on "
    "one (acc = (pred == y).float().mean() on every rank, then if rank == 0: "
    "log(acc.item()): the reduced scalar is broadcast, so that read needs no "
    "communication); or, for a figure of this rank's own rows only, compute it from "
    "x.to_local() (plain tensors, no communication).")


def reduction_meets(plan: Plan, dtype: torch.dtype, why: object) -> None:
    """Before a scalar reduction made at once (``box(meet=True)``), its ranks meet
    through the store like a read's (``comm.meet``), so it fails like a read when it is
    called on some ranks only: a metric computed on one rank (``if rank == 0: acc =
    (p == y).float().mean()``) would otherwise wait GLOBALTENSOR_TIMEOUT in its
    all-reduce, or pair it with another rank's next collective (wrong values, or a
    misleading error there). Reductions are told apart by op, layouts, dtype and the
    program's call path (every frame outside globaltensor and torch: an ``accuracy()``
    helper called for training on every rank and for validation on rank 0 is two
    reductions): ranks at different ones (one computing a metric, the others their next
    loss) all raise ``DivergenceError`` naming both, instead of summing one's metric
    into the others' loss.

    A reduction its ranks met at once, from the same call path, is not met again
    (except in check mode): a branch on the rank sends one rank down a path the others
    never took, whose reductions are new. So a training loop meets in its first step
    only, and then costs no store round trips (a meeting: 0.15 ms measured, against 0.4
    ms for gloo's all-reduce of the scalar, two local ranks) and does not fail when a
    rank is late to its loss by more than GLOBALTENSOR_READ_TIMEOUT (a rank validating
    alone). A path run on every rank and later on some ranks only (``if rank == 0 or
    step == 0``) is not caught; check mode catches it."""
    src, dst = plan.src, plan.dst
    ranks = _ranks_of(plan)
    if comm.get_rank() not in ranks:
        return
    path = call_path()
    key = ("reduction", why, src, dst, dtype, path)
    if met_before(ranks, key):
        return
    scalars = "scalar" if not src.shape else f"{src.shape[0]} scalars"
    same = (f"reduce the {dtype} {scalars} of {why} from sbp {src.sbp} to {dst.sbp} on "
            f"{src.placement}, called from {where(path)}")
    meet_once(ranks, key, str(why), same, REDUCTION_ADVICE, same)


BOXING_ADVICE = {
    "x.to_global()": (
        "x.to_global() moves data among the ranks of both placements: a collective, which "
        "every one of them must call, with the same placement and sbp (a target computed "
        "from the rank, sbp=split(0) if rank == 0 else broadcast, or a to_global inside if "
        "rank == 0: ..., is not). Compute the target from what every rank has alike and "
        "call it on every rank; for this rank's own part, use x.to_local() (no "
        "communication)."),
    "x.full()": (
        "x.full() gathers the whole value on every rank of the world: a collective, which "
        "every rank must call. Call it on every rank, then use the value on one; for this "
        "rank's own part, use x.to_local() (no communication)."),
}


def boxing_meets(plan: Plan, dtype: torch.dtype, call: str) -> None:
    """Before a boxing the program asked for (``call``: "x.to_global()", "x.full()") first
    runs from a call path, its ranks meet as a read's do (``comm.meet``): a target layout
    that differs between ranks (``x.to_global(sbp=split(0))`` on rank 0, ``sbp=broadcast``
    on rank 1) raises ``DivergenceError`` on both, naming both layouts, where their
    different collectives would wait GLOBALTENSOR_TIMEOUT or pair up (garbage); one on
    some ranks only raises ``CollectiveError`` within GLOBALTENSOR_READ_TIMEOUT. Met once
    per (call, layouts without their shapes, dtype, call path), as ``reduction_meets``:
    a loop meets in its first step only, also when its shapes vary; later steps pay the
    call path (microseconds) and a set look-up. A plan that communicates nothing (a
    broadcast tensor sliced to a split) does not meet: it cannot wait for anyone."""
    src, dst = plan.src, plan.dst
    ranks = _ranks_of(plan)
    if comm.get_rank() not in ranks or not plan.sends:
        return
    path = call_path()
    key = ("boxing", call, src.placement, src.sbp, dst.placement, dst.sbp, dtype, path)
    if met_before(ranks, key):
        return
    moves = f"sbp {src.sbp} to sbp {dst.sbp} on {src.placement}" if dst.placement == src.placement \
        else f"sbp {src.sbp} on {src.placement} to sbp {dst.sbp} on {dst.placement}"
    tail = f"tensor with {call} from {moves}, called from {where(path)}"
    # Compared (``same``): not the shape, which the ranks compare at the boxing itself
    # (``_settle_claims``: naming the tensors made with a rank-dependent size).
    advice = BOXING_ADVICE.get(call, BOXING_ADVICE["x.to_global()"])
    meet_once(ranks, key, call, f"box a {dtype} {tuple(src.shape)} {tail}", advice,
              f"box a {dtype} {tail}")


def _ranks_of(plan: Plan) -> tuple[int, ...]:
    """Every rank of both placements of ``plan``, sorted: the ranks that run it."""
    return tuple(sorted(set(plan.src.placement.flat_ranks) | set(plan.dst.placement.flat_ranks)))


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
_internal_files: dict[str, bool] = {}  # file name -> not the program's (``call_path``)
_paths = sysconfig.get_paths()
_STDLIB = tuple({_paths["stdlib"], _paths["platstdlib"]})
_INSTALLED = tuple({_paths["purelib"], _paths["platlib"]})


def where(path: tuple[tuple[str, int], ...]) -> str:
    """A ``call_path`` as text: "file:line <- file:line ..." (innermost first)."""
    return " <- ".join(f"{name}:{line}" for name, line in path) or "?"


def call_path() -> tuple[tuple[str, int], ...]:
    """(file, line) of every frame of the program, innermost first: its path to this
    call, where a branch on the rank shows. Not frames of globaltensor, torch or
    Python's standard library (a launcher's, a test harness's: the same on every rank,
    and noise in an error); installed packages' frames count (a user's library)."""
    path = []
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        internal = _internal_files.get(name)
        if internal is None:
            internal = any(part in name for part in _INTERNAL) or (
                name.startswith(_STDLIB) and not name.startswith(_INSTALLED))
            _internal_files[name] = internal
        if not internal:
            path.append((name, frame.f_lineno))
        frame = frame.f_back
    return tuple(path)


def called_from(code, depth: int = 24) -> bool:
    """Whether a frame running ``code`` (a function's ``__code__``) is among the
    ``depth`` innermost frames of this call (cold paths only: it walks the stack)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


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
