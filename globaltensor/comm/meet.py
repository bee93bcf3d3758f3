"""A short meeting of the ranks of a read before it communicates.

``x.item()`` of a split tensor needs every rank of its placement. Called on some of
them only (``if rank == 0: log(x.item())``), its collective would wait for the others
until GLOBALTENSOR_TIMEOUT (300 s) and the job would die. Before such a read, its ranks
meet through the store (no collective), waiting GLOBALTENSOR_READ_TIMEOUT (10 s) at
most; a rank that waits in vain cancels the meeting and raises, naming the read. The
ranks that never came called nothing, so they are not left in a broken collective.
The scalars that ops reduce at once so that one rank can read them (a loss,
``x.mean()`` over split rows: ``boxing/run.py``) meet the same way, in the same rounds:
a metric computed on one rank only (``if rank == 0: acc = (p == y).float().mean()``)
fails like a read, and a rank that went on meets it at its own next such reduction.

A meeting is a numbered round per group of ranks: each arrival notes what it reads (the
tensor's layout and dtype) and increments the round's count; the last arrival marks it
"go", or "differ" when the ranks read different tensors (they all raise
``DivergenceError`` instead of pairing their gathers), and a rank that waited too long
marks it cancelled (one atomic compare-and-set decides). A rank that did not take part in
a cancelled read finds that round cancelled at its next read, and moves to the next
round, where the others are. The rank that cancels records what it was reading (the
call, the layout and the program line): a rank that finds a cancelled round of that
same read came too late for it, and raises as well, instead of pairing its read with
the others' next one.

Reads meet at every call. What runs every step (a scalar reduction, a ``to_global``, a
bucket of gradients) meets once per key instead (``meet_once``; the key holds the
program's call path): its ranks meet the first time, the keys they met at are
remembered alike on every member, and a training loop pays nothing after its first
steps. A branch on the rank takes a new path, so it meets.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .. import env
from . import groups, guard, stats
from .groups import init
from .guard import CollectiveError, DivergenceError

_GO = b"go"
_CANCEL = "cancel|"
_DIFFER = "differ|"
_round: dict[tuple[int, ...], int] = {}    # the next round this rank meets in, per group
_cleaned: dict[tuple[int, ...], int] = {}  # rounds below this are deleted from the store
# Per group (sorted ranks): the keys its members met at together (``meet_once``). Every
# member adds a key at the same meeting, so the sets agree among them, and so does the
# choice to meet.
_met: dict[tuple[int, ...], set] = {}
_MAX_MET = 4096  # keys kept per group (a program whose shapes vary makes new ones)


def meet(ranks: tuple[int, ...], what: str, read: str, advice: str, same: str = "") -> None:
    """Return once every rank of ``ranks`` has reached this read (``what``: the call,
    e.g. "x.item()"; ``read``: a description of the read that tells two reads apart;
    ``same``: what every rank must be at alike, a phrase after "ranks [0]", e.g. "read a
    torch.float32 (4,) tensor ..."); raise ``CollectiveError`` naming ``what`` and giving
    ``advice`` when they do not all arrive within GLOBALTENSOR_READ_TIMEOUT seconds,
    ``DivergenceError`` (with ``advice``) when their ``same`` differ.

    >>> meet((0, 1), "x.item()", "x.item() of ... at train.py:12", "...")  # doctest: +SKIP
    """
    members = tuple(sorted(ranks))
    init()
    rank = dist.get_rank()
    # a dry run (check_step) meets no one, nor does a rank outside the placement
    if len(members) == 1 or stats.dry() or rank not in members:
        return
    store = groups.default_store()
    timeout = env.read_timeout_seconds()
    mine = f"{_CANCEL}{rank}|{read}"
    mark = f"{rank}|{same}"
    skipped: list[str] = []  # other ranks' cancelled rounds this rank passed over
    while True:
        number = _round.get(members, 0)
        _round[members] = number + 1
        key = _key(members, number)
        state, last = _arrive(store, key, len(members), timeout, mine, mark)
        if state == _GO:
            _clean(store, members, number, last)
            return
        text = state.decode(errors="replace")
        if text.startswith(_DIFFER):
            _clean(store, members, number, last)
            by_read: dict = {}
            for line in text[len(_DIFFER):].split("\n"):
                r, at = line.split("|", 1)
                by_read.setdefault(at, []).append(int(r))
            reads = "; ".join(f"ranks {sorted(rs)} {at}"
                              for at, rs in sorted(by_read.items(), key=lambda kv: min(kv[1])))
            raise DivergenceError(
                f"globaltensor: {what} on rank {rank} met the other ranks at different "
                f"communication ({reads}). Every rank must reach the same reads, scalar "
                f"reductions, to_global calls and gradient reductions in the same order, "
                f"alike: a branch on the rank that reads or reduces on some ranks only (if "
                f"rank == 0: ...), or a rank-dependent target layout, does not. {advice}")
        if text == mine:
            raise CollectiveError(
                f"globaltensor: {what} on rank {rank} needs every rank of {list(ranks)}, and "
                f"not all of them called it within GLOBALTENSOR_READ_TIMEOUT={timeout:g} s "
                f"({read}).{_skipped(skipped)} {advice}")
        _, canceller, theirs = text.split("|", 2)
        if theirs == read:
            raise CollectiveError(
                f"globaltensor: {what} on rank {rank} came after rank {canceller} stopped "
                f"waiting for it (GLOBALTENSOR_READ_TIMEOUT={timeout:g} s; ranks "
                f"{list(ranks)}; {read}). Every rank of a placement must reach such a read "
                f"within that time of each other; raise GLOBALTENSOR_READ_TIMEOUT if they "
                f"legitimately do not.{_skipped(skipped)} {advice}")
        # A read of other ranks that this rank never took part in: the next round (the
        # others may have caught their error and gone on; they are there).
        skipped.append(f"rank {canceller} gave up waiting for {theirs}")


def met_before(members: tuple[int, ...], key: object) -> bool:
    """Whether the ranks ``members`` (sorted) met at ``key`` before (``meet_once``), so
    need not again; never in check mode, which meets every time. One set look-up: what
    a step pays once its keys are met.

    >>> if not met_before(ranks, key): meet_once(ranks, key, "x.to_global()", ...)  # doctest: +SKIP
    """
    met = _met.get(members)
    return met is not None and key in met and not guard.check_mode()


def meet_once(members: tuple[int, ...], key: object, what: str, read: str, advice: str,
              same: str = "") -> None:
    """``meet`` (same arguments), then remember ``key`` (the same on every member for
    the same communication: no rank numbers, no local sizes) so that ``met_before`` is
    True from now on. Not in check mode: there keys hold the tensors' origins (new each
    time), and every one meets anyway."""
    meet(members, what, read, advice, same)
    if not guard.check_mode() and not stats.dry():   # a dry run (check_step) met no one
        met = _met.setdefault(members, set())
        if len(met) >= _MAX_MET:
            met.clear()
        met.add(key)


def _key(members: tuple[int, ...], number: int) -> str:
    """The store key prefix of round ``number`` of the group ``members`` (sorted)."""
    return f"globaltensor/read/{','.join(map(str, members))}/{number}"


def _skipped(skipped: list[str]) -> str:
    """The rounds this rank passed over, as a sentence (or ""): when it then waits in
    vain, the others most likely stopped there for it, in a branch it did not take."""
    if not skipped:
        return ""
    return (f" Before it, {'; '.join(skipped[-3:])}, which this rank never reached: a "
            f"rank-dependent branch (if rank == 0: ...) probably made those ranks read or "
            f"reduce without this one; that is the cause to fix.")


def missed(ranks: tuple[int, ...]) -> str:
    """On the failure of a collective among ``ranks``: a sentence naming a meeting that
    another rank gave up waiting for and this rank never reached (its next round in a
    group it meets in, or in the collective's group, or the world's), or "". A rank that
    went on past a read or scalar reduction that another rank ran alone waits in its
    next collective; that other rank's giving up is what to report. Reads the store
    only (this runs on a failure, never on the way of a collective that completes)."""
    if not dist.is_initialized():
        return ""
    rank = dist.get_rank()
    met = set(_round) | {tuple(sorted(ranks)), tuple(range(dist.get_world_size()))}
    found = []
    try:
        store = groups.default_store()
        for members in sorted(met):
            if rank not in members or len(members) == 1:
                continue
            key = _key(members, _round.get(members, 0)) + "/state"
            if not store.check([key]):
                continue
            text = store.get(key).decode(errors="replace")
            if text.startswith(_CANCEL):
                _, canceller, theirs = text.split("|", 2)
                if int(canceller) != rank:
                    found.append(f"rank {canceller} gave up waiting for {theirs}")
    except (RuntimeError, dist.DistError, ValueError):  # a store gone with its host
        return ""
    if not found:
        return ""
    return (f" Probable cause: {'; '.join(found)}, which rank {rank} never reached (a "
            f"rank-dependent branch, such as a metric computed on one rank only, reduced "
            f"or read there without this rank, which went on to this collective).")


guard.failure_notes.append(missed)


def _arrive(store, key: str, n: int, timeout: float, cancel: str,
            mark: str) -> tuple[bytes, bool]:
    """This rank's arrival at a round: ("go" once all ``n`` arrived and read alike,
    "differ|<marks>" when they did not, or the cancel mark of whoever cancelled it: this
    rank after ``timeout`` seconds, or another), and whether this rank arrived last."""
    store.append(key + "/who", mark + "\n")  # before counting: the last sees every mark
    if store.add(key + "/n", 1) >= n:
        marks = store.get(key + "/who").decode(errors="replace").splitlines()
        alike = len({m.split("|", 1)[1] for m in marks}) == 1
        decision = _GO.decode() if alike else _DIFFER + "\n".join(marks)
        return store.compare_set(key + "/state", "", decision), True
    try:
        store.wait([key + "/state"], datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):  # DistStoreError: a timeout
        return store.compare_set(key + "/state", "", cancel), False
    return store.get(key + "/state"), False


def _clean(store, members: tuple[int, ...], number: int, last: bool) -> None:
    """Round ``number`` was decided with every member there, so every member is past the
    rounds before it: the last arrival deletes their keys (three per read, which would
    pile up in the store)."""
    start = _cleaned.get(members, 0)
    _cleaned[members] = number
    if last:
        for old in range(start, number):
            for suffix in ("/n", "/who", "/state"):
                store.delete_key(_key(members, old) + suffix)
