"""What a collective was for, so a failure or a hang says so, and the check mode.

``activity(what)`` names the work in progress (an op, a boxing plan, a gradient
bucket); a collective that fails (a peer never joined within GLOBALTENSOR_TIMEOUT, or
died) re-raises as ``CollectiveError`` naming that work, the collective and its ranks,
instead of gloo's bare "Timed out waiting 5000ms for recv". While the torch profiler
runs, the same names mark ranges in its trace.

``agree(fingerprint, ranks, what)``: the check mode's exchange before communicating.
Every involved rank contributes one integer (a hash of the plan, dtype and call site);
if they differ, every rank raises naming the ranks that disagree.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from .. import env, modes

# Renamed in recent torch; the old name still works but warns (once per process, in
# the program's output).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_doing: list = []  # descriptions (str or objects with __str__), innermost last


def check_mode() -> bool:
    """True while check mode is on (origins.Checking: under GLOBALTENSOR_DEBUG=1, read
    when globaltensor is imported, or inside ``gt.debug.check_consistency()``)."""
    return modes.checking


class CollectiveError(RuntimeError):
    """A collective that did not complete: a peer never joined it in time, or failed."""


class DivergenceError(RuntimeError):
    """Ranks that must run the same communication reached different ones."""


@contextlib.contextmanager
def activity(what: object):
    """Name the work that the collectives inside belong to (``what`` is formatted only
    when needed: on an error, or for a profiler range)."""
    _doing.append(what)
    rf = None
    if torch._C._autograd._profiler_enabled():
        rf = torch.autograd.profiler.record_function(f"globaltensor: {what}")
        rf.__enter__()
    try:
        yield
    finally:
        if rf is not None:
            rf.__exit__(None, None, None)
        _doing.pop()


def describe() -> str:
    return " <- ".join(str(w) for w in reversed(_doing)) or "a direct collective call"


def guarded(kind: str, ranks, run: Callable):
    """``run()``, re-raising a backend failure with what it was for."""
    try:
        return run()
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, (CollectiveError, DivergenceError)):
            raise
        raise collective_error(kind, ranks, e) from e


# What else may explain a failed collective, beyond the work this rank was doing: each
# takes the collective's ranks and returns a sentence or "". ``meet.py`` adds one (a
# read or scalar reduction another rank gave up waiting for, which this rank skipped);
# it registers itself because it imports this module.
failure_notes: list[Callable[[tuple], str]] = []


def collective_error(kind: str, ranks, cause: BaseException) -> CollectiveError:
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    notes = "".join(note(tuple(ranks)) for note in failure_notes)
    return CollectiveError(
        f"globaltensor: {kind} among ranks {list(ranks)} did not complete on rank "
        f"{dist.get_rank()} while doing: {describe()}. A rank of the group did not join it "
        f"within GLOBALTENSOR_TIMEOUT={env.timeout_seconds():g} s or failed (every rank of "
        f"a placement must run the same ops: SPMD; GLOBALTENSOR_DEBUG=1 checks this before "
        f"communicating).{notes} Backend error: {first}")


class Waiting:
    """A started collective's handle whose ``wait()`` names the work on failure."""

    def __init__(self, kind: str, ranks, work, what: str):
        self.kind, self.ranks, self.work, self.what = kind, ranks, work, what

    def wait(self) -> None:
        if self.work is None:
            return
        with activity(self.what):
            guarded(self.kind, self.ranks, self.work.wait)


_ELSEWHERE = ("reached a different communication (another op, layout, dtype or line). "
              "Every rank of a placement must run the same ops.")


_MADE_ELSEWHERE = ("made others (a shape, sbp or dtype from rank-dependent arguments, such as a "
                   "batch size). Every rank of a placement must make the same global tensors.")

# Global tensors made from this rank's arguments (factories, module conversion) since
# their ranks last boxed together, by sorted ranks: (digest, the last one). Compared
# (``settle``) before those ranks' next boxing, so a rank-dependent argument raises a
# DivergenceError on every member, where the boxing's collective of other sizes would
# abort the process (gloo) or leave garbage (a receive of fewer bytes than expected).
_claims: dict[tuple[int, ...], tuple[int, object]] = {}


def claim(ranks: tuple[int, ...], fingerprint: int, what: object) -> None:
    """Note that this rank made a global tensor on ``ranks`` (sorted): ``fingerprint``
    (the same on every rank for the same shape, sbp and dtype) is compared with the
    other members at their next boxing; ``what`` describes it (formatted on a mismatch)."""
    digest = _claims[ranks][0] if ranks in _claims else 0
    _claims[ranks] = ((digest * 1_000_003 + fingerprint) & (2**62 - 1), what)


def claims_pending() -> bool:
    return bool(_claims)


def settle(ranks: tuple[int, ...]) -> None:
    """Compare the tensors made on ``ranks`` (sorted) since they last boxed together:
    one small all-gather among them, nothing when none was made. Every member calls it
    at the same boxing (they made the same calls, so all or none have claims)."""
    pending = _claims.pop(ranks, None)
    if pending is not None:
        agree(pending[0], ranks, f"the global tensors made on ranks {list(ranks)} since their last "
              f"boxing (the last: {pending[1]})", _MADE_ELSEWHERE, check=False)


def agree(fingerprint: int, ranks: tuple[int, ...], what: str, differ: str = _ELSEWHERE,
          check: bool = True) -> None:
    """Raise ``DivergenceError`` on every member unless all members of ``ranks`` pass
    the same ``fingerprint`` (sorted ``ranks``: one group whatever the order). ``check``:
    the check mode's comparison, so named in errors (False: one made always, ``settle``)."""
    from .groups import get_group
    members = tuple(sorted(ranks))
    if len(members) == 1:
        return
    mine = torch.tensor([fingerprint & (2**63 - 1)], dtype=torch.int64)
    everyone = torch.empty(len(members), dtype=torch.int64)
    with activity(f"{'check mode: ' if check else ''}comparing {what}"):
        guarded("comparing all_gather", members, lambda: all_gather_single(
            everyone, mine, group=get_group(members)))
    others = [r for r, f in zip(members, everyone.tolist()) if f != mine.item()]
    if others:
        mode = " check mode" if check else ""
        raise DivergenceError(f"globaltensor{mode}: rank {dist.get_rank()} is at {what}, "
                              f"but ranks {others} (of {list(members)}) {differ}")
