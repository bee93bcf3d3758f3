"""Ids to slots: the sorted index both sides use, and the servers' hash-table slots.

A table made with ``num_embeddings=None`` takes any int64 id. The worker sends each id
to server ``server_of(id)``; that server keeps at most ``capacity`` rows for the table
in fixed slots (memory never grows with the ids seen): ``HashSlots`` admits a new id
(count filter: seen in ``admit_count`` lookups, counted in a fixed-size count-min
sketch; or probability filter: each lookup admits it with ``admit_prob``) and, when
the slots are full, evicts (``lru``: the row looked up or updated least recently;
``ttl``: rows idle for ``ttl`` seconds, and new ids wait while no row has expired).
An id not admitted (or refused for want of room) reads as zeros and its gradients are
dropped, as Paddle's entry filters and TorchRec's managed-collision tables do.

A new row starts at ``hashed_normal(id)``: its values depend on the id and the seed
only, so a row evicted and admitted again, or a table on another number of servers,
starts alike.

>>> index = IdIndex()
>>> index.insert(torch.tensor([7, -3]), torch.tensor([0, 1]))
>>> index.find(torch.tensor([-3, 5, 7])).tolist()
[1, -1, 0]
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["IdIndex", "HashSlots", "HashPolicy", "HashedRows", "server_of", "part_of", "hashed_normal", "mix"]

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as signed int64
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 ``x`` (wrapping arithmetic): well-spread 64-bit hashes."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def server_of(ids: torch.Tensor, servers: int) -> torch.Tensor:
    """The server holding each id of a hashed table.

    >>> server_of(torch.tensor([0, 1, 2, 2]), 3).tolist()[2:]
    [2, 2]
    """
    return torch.remainder(_shr(mix(ids), 1), servers)


def hashed_normal(ids: torch.Tensor, dim: int, std: float, seed: int) -> torch.Tensor:
    """(len(ids), dim) values N(0, std^2), each a function of (id, column, seed) only."""
    if std == 0 or ids.numel() == 0:
        return torch.zeros(ids.numel(), dim)
    key = mix(mix(ids) + seed * 1_000_003)
    h = mix(key[:, None] + torch.arange(dim, dtype=torch.int64) * _GOLDEN)
    u1 = (_shr(h, 40).double() + 1) / (1 << 24)            # (0, 1]
    u2 = (_shr(h, 16) & ((1 << 24) - 1)).double() / (1 << 24)
    return ((-2 * u1.log()).sqrt() * torch.cos(2 * torch.pi * u2) * std).float()


def part_of(ids: torch.Tensor, parts: int) -> torch.Tensor:
    """The checkpoint part of each id of a hashed table (``HashedRows``): a hash of
    its own, so parts spread over the servers whatever their number."""
    return torch.remainder(_shr(mix(mix(ids)), 1), parts)


@dataclass(frozen=True)
class HashedRows:
    """Rows of a hashed table as a checkpoint keeps them: ids, values, the sparse
    optimizer's state (name -> one row per id), and their recency (``age``: lookups of
    their server since last use; ``idle``: seconds). ``counters``: the table's
    ``stats()`` counts (``admitted``, ``evicted``, ``filtered``, ``rows``), kept in part 0."""

    ids: torch.Tensor
    values: torch.Tensor
    state: dict
    age: torch.Tensor
    idle: torch.Tensor
    counters: Optional[dict] = None

    def __len__(self) -> int:
        return self.ids.numel()

    def select(self, which: torch.Tensor) -> "HashedRows":
        return HashedRows(self.ids[which], self.values[which], {n: t[which] for n, t in self.state.items()},
                          self.age[which], self.idle[which])

    @staticmethod
    def cat(rows: "list[HashedRows]") -> "HashedRows":
        return HashedRows(torch.cat([r.ids for r in rows]), torch.cat([r.values for r in rows]),
                          {n: torch.cat([r.state[n] for r in rows]) for n in rows[0].state},
                          torch.cat([r.age for r in rows]), torch.cat([r.idle for r in rows]))


class IdIndex:
    """id -> slot, vectorised (no per-id Python): a direct map of ``size`` entries when
    the ids are known to be in ``[0, size)`` (4 bytes an id: one gather a lookup), else
    sorted keys and their slots (a binary search a lookup)."""

    def __init__(self, size: Optional[int] = None) -> None:
        self.count = 0
        self.direct = None if size is None else torch.full((size,), -1, dtype=torch.int32)
        self.keys = torch.zeros(0, dtype=torch.int64)
        self.slots = torch.zeros(0, dtype=torch.int64)

    def __len__(self) -> int:
        return self.count

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where absent."""
        if self.direct is not None:
            return self.direct[ids].long()
        if not self.count:
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self.keys, ids).clamp_(max=self.count - 1)
        return torch.where(self.keys[pos] == ids, self.slots[pos], -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add absent, distinct ``ids`` at ``slots``."""
        self.count += ids.numel()
        if self.direct is not None:
            self.direct[ids] = slots.int()
        elif ids.numel():
            # a merge: O(held + new log held), where sorting everything again is not linear
            new, order = torch.sort(ids)
            at = torch.searchsorted(self.keys, new) + torch.arange(new.numel())
            old = torch.ones(self.keys.numel() + new.numel(), dtype=torch.bool)
            old[at] = False
            keys, where = torch.empty_like(old, dtype=torch.int64), torch.empty_like(old, dtype=torch.int64)
            keys[at], keys[old] = new, self.keys
            where[at], where[old] = slots[order], self.slots
            self.keys, self.slots = keys, where

    def remove(self, ids: torch.Tensor) -> None:
        """Drop held, distinct ``ids``."""
        self.count -= ids.numel()
        if self.direct is not None:
            self.direct[ids] = -1
        elif ids.numel():
            pos = torch.searchsorted(self.keys, ids).clamp_(max=self.keys.numel() - 1)
            keep = torch.ones(self.keys.numel(), dtype=torch.bool)
            keep[pos[self.keys[pos] == ids]] = False
            self.keys, self.slots = self.keys[keep], self.slots[keep]


def _least_recent(last_tick: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` least recently used rows; ties go by id, so the choice
    does not depend on which slots the rows happen to occupy (a table restored from a
    checkpoint evicts as the saved one would have)."""
    by_id = torch.argsort(ids)
    return by_id[torch.argsort(last_tick[by_id], stable=True)[:k]]


@dataclass(frozen=True)
class HashPolicy:
    """Admission and eviction of a hashed table (see the module docstring).

    >>> HashPolicy(capacity=100, admit_count=2).eviction
    'lru'
    """

    capacity: int
    admit_count: int = 1
    admit_prob: float = 1.0
    eviction: str = "lru"
    ttl: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity (rows per server) must be an int >= 1, got {self.capacity!r}")
        if not isinstance(self.admit_count, int) or self.admit_count < 1:
            raise ValueError(f"admit_count must be an int >= 1, got {self.admit_count!r}")
        if not 0 < self.admit_prob <= 1:
            raise ValueError(f"admit_prob must be in (0, 1], got {self.admit_prob!r}")
        if self.eviction not in ("lru", "ttl"):
            raise ValueError(f"eviction must be 'lru' or 'ttl', got {self.eviction!r}")
        if (self.eviction == "ttl") != (self.ttl is not None) or (self.ttl is not None and self.ttl <= 0):
            raise ValueError(f"eviction='ttl' takes ttl > 0 (seconds), 'lru' none; got "
                             f"eviction={self.eviction!r}, ttl={self.ttl!r}")


class HashSlots:
    """One server's slots of a hashed table: which id each holds, admission, eviction,
    and the counts ``stats()`` reports. ``clock`` gives seconds (tests pass their own)."""

    def __init__(self, policy: HashPolicy, seed: int = 0, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        cap = policy.capacity
        self.index = IdIndex()
        self.id_of = torch.zeros(cap, dtype=torch.int64)
        self.taken = torch.zeros(cap, dtype=torch.bool)          # (any int64 is an id)
        self.last_tick = torch.zeros(cap, dtype=torch.int64)     # lru: the call that used it last
        self.last_time = torch.zeros(cap, dtype=torch.float64)   # ttl
        self.tick = 0
        self.free = torch.zeros(0, dtype=torch.int64)  # slots given back (never-used: from .fresh on)
        self.fresh = 0
        # count filter: a count-min sketch of fixed size (2 rows of counters), halved
        # every `width` counts (TinyLFU's aging: old sightings fade, the sketch never
        # saturates on an endless stream of ids)
        width = max(1 << 16, 8 * cap) if policy.admit_count > 1 else 0
        self.sketch = torch.zeros(2, width, dtype=torch.int32)
        self.counted = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.admitted = self.evicted = self.filtered = 0

    def stats(self) -> dict:
        self._expire()
        return {"rows": self.admitted - self.evicted, "capacity": self.policy.capacity,
                "admitted": self.admitted, "evicted": self.evicted, "filtered": self.filtered}

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (-1: not held), marking the held ones used now."""
        self.tick += 1
        slots = self.index.find(ids)
        used = slots[slots >= 0]
        self.last_tick[used] = self.tick
        self.last_time[used] = self.clock()
        return slots

    def admit(self, ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give slots to the ids of this lookup (``slots`` from ``find``) that pass
        admission, evicting if full. Returns (new slots, their ids, evicted slots);
        ``slots`` is updated in place."""
        missing = (slots < 0).nonzero().squeeze(1)
        candidates = missing[self._passes(ids[missing])]
        evicted = self._expire()
        short = candidates.numel() - self._room()
        if short > 0 and self.policy.eviction == "lru":
            idle = (self.taken & (self.last_tick < self.tick)).nonzero().squeeze(1)
            oldest = idle[_least_recent(self.last_tick[idle], self.id_of[idle], short)]
            evicted = torch.cat([evicted, self._drop(oldest)])
        candidates = candidates[:self._room()]  # the rest wait (no room)
        self.filtered += missing.numel() - candidates.numel()
        new_slots, new_ids = self._take(candidates.numel()), ids[candidates]
        slots[candidates] = new_slots
        self.id_of[new_slots], self.taken[new_slots] = new_ids, True
        self.index.insert(new_ids, new_slots)
        self.last_tick[new_slots] = self.tick
        self.last_time[new_slots] = self.clock()
        self.admitted += new_ids.numel()
        return new_slots, new_ids, evicted

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, ids, calls since last use, seconds since last use) of the rows held:
        what a checkpoint keeps of them besides their values."""
        self._expire()
        slots = self.taken.nonzero().squeeze(1)
        return (slots, self.id_of[slots], self.tick - self.last_tick[slots],
                self.clock() - self.last_time[slots])

    def restore(self, ids: torch.Tensor, age: torch.Tensor, idle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take rows of a checkpoint (``held``'s ids, ages and idle seconds; distinct ids
        not held here) without admission. If they do not all fit, the most recently used
        of the rows held and those given stay. Returns (slot of each id, -1 for those
        left out; evicted slots)."""
        ticks = self.tick - age
        evicted = torch.zeros(0, dtype=torch.int64)
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        short = ids.numel() - self._room()
        if short > 0:
            held = self.taken.nonzero().squeeze(1)
            out = _least_recent(torch.cat([self.last_tick[held], ticks]),
                                torch.cat([self.id_of[held], ids]), short)
            evicted = self._drop(held[out[out < held.numel()]])
            keep[out[out >= held.numel()] - held.numel()] = False
            self.evicted += int((~keep).sum())  # counted as admitted, then evicted
        slots = torch.full_like(ids, -1)
        slots[keep] = self._take(int(keep.sum()))
        new_slots, new_ids = slots[keep], ids[keep]
        self.id_of[new_slots], self.taken[new_slots] = new_ids, True
        self.index.insert(new_ids, new_slots)
        self.last_tick[new_slots] = ticks[keep]
        self.last_time[new_slots] = self.clock() - idle[keep]
        self.admitted += ids.numel()
        return slots, evicted

    def _room(self) -> int:
        return self.free.numel() + self.policy.capacity - self.fresh

    def _take(self, n: int) -> torch.Tensor:
        reused, self.free = self.free[:n], self.free[n:]
        fresh = torch.arange(self.fresh, self.fresh + n - reused.numel())
        self.fresh += fresh.numel()
        return torch.cat([reused, fresh])

    def _passes(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.policy
        ok = torch.ones(ids.numel(), dtype=torch.bool)
        if p.admit_count > 1:
            h = mix(ids)
            cols = torch.stack([torch.remainder(h, self.sketch.shape[1]),
                                torch.remainder(_shr(h, 32), self.sketch.shape[1])])
            counts = self.sketch.gather(1, cols) + 1
            self.sketch.scatter_(1, cols, counts)
            self.counted += ids.numel()
            if self.counted >= self.sketch.shape[1]:
                self.sketch.bitwise_right_shift_(1)
                self.counted = 0
            ok &= counts.min(0).values >= p.admit_count
        if p.admit_prob < 1:
            ok &= torch.rand(ids.numel(), generator=self.generator) < p.admit_prob
        return ok

    def _expire(self) -> torch.Tensor:
        if self.policy.ttl is None:
            return torch.zeros(0, dtype=torch.int64)
        old = (self.taken & (self.clock() - self.last_time > self.policy.ttl)).nonzero().squeeze(1)
        return self._drop(old)

    def _drop(self, slots: torch.Tensor) -> torch.Tensor:
        self.index.remove(self.id_of[slots])
        self.taken[slots] = False
        self.free = torch.cat([self.free, slots])
        self.evicted += slots.numel()
        return slots
