"""Counters of communication by kind, switched on by ``debug.comm_stats()``."""
from __future__ import annotations

from collections import Counter

_active: list["CommCounter"] = []


class CommCounter:
    """Calls and bytes sent by this rank, per kind ("all_gather", "send", ...)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

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


def record(kind: str, nbytes: int) -> None:
    for counter in _active:
        counter.calls[kind] += 1
        counter.bytes[kind] += int(nbytes)


def push(counter: CommCounter) -> None:
    _active.append(counter)


def pop(counter: CommCounter) -> None:
    _active.remove(counter)
