"""Counters of communication by kind, switched on by ``debug.comm_stats()``; and dry
runs (``gt.debug.check_step``), in which every collective is counted and none is sent.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

_active: list["CommCounter"] = []
_dry = 0   # open dry runs: collectives are counted, not sent


class CommCounter:
    """Calls and bytes sent by this rank, per kind ("all_gather", "send", ...); with
    ``events``, also each one as (kind, bytes, the group's ranks or the peer's, the
    point-to-point messages this rank posts for it: 0 for a collective of the backend)."""

    def __init__(self, events: bool = False) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.events: "list | None" = [] if events else None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {self.calls[k]} call(s), {self.bytes[k]} B"
                          for k in sorted(self.calls))
        return f"CommCounter({kinds or 'no communication'})"


def record(kind: str, nbytes: int, ranks: tuple = (), messages: int = 0) -> bool:
    """Count a collective of the group ``ranks`` (a send: its peer's), ``nbytes`` sent
    by this rank, carried by ``messages`` sends and receives that this rank posts one by
    one (a batch of point-to-point messages standing for the collective; 0: one call of
    the backend's collective); True in a dry run, where the caller sends nothing."""
    for counter in _active:
        counter.calls[kind] += 1
        counter.bytes[kind] += int(nbytes)
        if counter.events is not None:
            counter.events.append((kind, int(nbytes), ranks, messages))
    return _dry > 0


def dry() -> bool:
    """Whether a dry run is open (collectives counted, not sent)."""
    return _dry > 0


@contextlib.contextmanager
def dry_run(events: bool = False) -> Iterator[CommCounter]:
    """Count every collective and point-to-point message inside, and send none: their
    outputs keep what they held (``gt.debug.check_step`` runs on fake tensors)."""
    global _dry
    counter = CommCounter(events)
    push(counter)
    _dry += 1
    try:
        yield counter
    finally:
        _dry -= 1
        pop(counter)


def push(counter: CommCounter) -> None:
    _active.append(counter)


def pop(counter: CommCounter) -> None:
    _active.remove(counter)
