"""A short meeting of the ranks of a read before it communicates.

``x.item()`` of a split tensor needs every rank of its placement. Called on some of
them only (``if rank == 0: log(x.item())``), its collective would wait for the others
until GLOBALTENSOR_TIMEOUT (300 s) and the job would die. Before such a read, its ranks
meet through the store (no collective), waiting GLOBALTENSOR_READ_TIMEOUT (10 s) at
most; a rank that waits in vain cancels the meeting and raises, naming the read. The
ranks that never came called nothing, so they are not left in a broken collective.

A meeting is a numbered round per group of ranks: each arrival increments the round's
count; the last arrival marks it "go", a rank that waited too long marks it cancelled
(one atomic compare-and-set decides between the two). A rank that did not take part in
a cancelled read finds that round cancelled at its next read, and moves to the next
round, where the others are. The rank that cancels records what it was reading (the
call, the layout and the program line): a rank that finds a cancelled round of that
same read came too late for it, and raises as well, instead of pairing its read with
the others' next one.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import env
from .guard import CollectiveError
from .groups import init

_GO = b"go"
_CANCEL = "cancel|"
_round: dict[tuple[int, ...], int] = {}    # the next round this rank meets in, per group
_cleaned: dict[tuple[int, ...], int] = {}  # rounds below this are deleted from the store


def meet(ranks: tuple[int, ...], what: str, read: str, advice: str) -> None:
    """Return once every rank of ``ranks`` has reached this read (``what``: the call,
    e.g. "x.item()"; ``read``: a description of the read that tells two reads apart);
    raise ``CollectiveError`` naming ``what`` and giving ``advice`` when they do not
    all arrive within GLOBALTENSOR_READ_TIMEOUT seconds.

    >>> meet((0, 1), "x.item()", "x.item() of ... at train.py:12", "...")  # doctest: +SKIP
    """
    members = tuple(sorted(ranks))
    if len(members) == 1:
        return
    init()
    store = c10d._get_default_store()
    group = ",".join(map(str, members))
    rank = dist.get_rank()
    timeout = env.read_timeout_seconds()
    mine = f"{_CANCEL}{rank}|{read}"
    while True:
        number = _round.get(members, 0)
        _round[members] = number + 1
        key = f"globaltensor/read/{group}/{number}"
        state, last = _arrive(store, key, len(members), timeout, mine)
        if state == _GO:
            _clean(store, members, group, number, last)
            return
        text = state.decode(errors="replace")
        if text == mine:
            raise CollectiveError(
                f"globaltensor: {what} on rank {rank} needs every rank of {list(ranks)}, and "
                f"not all of them called it within GLOBALTENSOR_READ_TIMEOUT={timeout:g} s "
                f"({read}). {advice}")
        _, canceller, theirs = text.split("|", 2)
        if theirs == read:
            raise CollectiveError(
                f"globaltensor: {what} on rank {rank} came after rank {canceller} stopped "
                f"waiting for it (GLOBALTENSOR_READ_TIMEOUT={timeout:g} s; ranks "
                f"{list(ranks)}; {read}). Every rank of a placement must reach such a read "
                f"within that time of each other; raise GLOBALTENSOR_READ_TIMEOUT if they "
                f"legitimately do not. {advice}")
        # A read of other ranks that this rank never took part in: the next round.


def _arrive(store, key: str, n: int, timeout: float, cancel: str) -> tuple[bytes, bool]:
    """This rank's arrival at a round: ("go" once all ``n`` arrived, or the cancel mark
    of whoever cancelled it: this rank after ``timeout`` seconds, or another), and
    whether this rank arrived last."""
    if store.add(key + "/n", 1) >= n:
        return store.compare_set(key + "/state", "", _GO.decode()), True
    try:
        store.wait([key + "/state"], datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):  # DistStoreError: a timeout
        return store.compare_set(key + "/state", "", cancel), False
    return store.get(key + "/state"), False


def _clean(store, members: tuple[int, ...], group: str, number: int, last: bool) -> None:
    """Round ``number`` went ahead, so every member is past the rounds before it: the
    last arrival deletes their keys (two per read, which would pile up in the store)."""
    start = _cleaned.get(members, 0)
    _cleaned[members] = number
    if last:
        for old in range(start, number):
            for suffix in ("/n", "/state"):
                store.delete_key(f"globaltensor/read/{group}/{old}{suffix}")
