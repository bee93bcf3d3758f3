"""A geo-mode worker's local copy of a table's rows.

The worker trains the rows its batches touch on this copy (its own ``RowOptimizer``)
and, at each exchange, pushes only the rows it changed since the last one (their
change since then, scaled by 1 / workers) and takes back from the servers only the
rows it holds that changed since (its own pushed rows and rows other workers changed;
the servers keep who holds what, ``server.exchange``). The copy is bounded: after an
exchange (every row clean), rows beyond ``limit`` go, least recently used first; the
servers hear of them at the next exchange, and a row used again is pulled again.

>>> copy = GeoCopy(2, "sgd", 1.0, None, limit=1)
>>> slots = copy.slots(torch.tensor([3, 5]), lambda ids: torch.zeros(ids.numel(), 2))
>>> copy.train(slots[:1], torch.ones(1, 2))
>>> ids, delta = copy.changes(workers=1)
>>> ids.tolist(), delta.tolist()
([3], [[-1.0, -1.0]])
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .hashed import IdIndex
from .optim import RowOptimizer

__all__ = ["GeoCopy"]


class GeoCopy:
    """Rows of one table held by this worker, in slots (``values``, ``base``: as
    pulled last), with the local optimizer's state per slot."""

    def __init__(self, dim: int, optimizer: str, lr: float, options: Optional[dict], limit: int,
                 num_rows: Optional[int] = None):
        self.dim, self.limit = dim, limit
        self.index = IdIndex(num_rows)  # ids of a row table are < num_rows: a direct map
        self.id_of = torch.zeros(0, dtype=torch.int64)
        self.taken = torch.zeros(0, dtype=torch.bool)    # (any int64 is an id)
        self.values = torch.zeros(0, dim)
        self.base = torch.zeros(0, dim)
        self.dirty = torch.zeros(0, dtype=torch.bool)    # trained since the last exchange
        self.last_used = torch.zeros(0, dtype=torch.int64)
        self.optimizer = RowOptimizer(optimizer, lr, (0, dim), options)
        self.released = torch.zeros(0, dtype=torch.int64)  # ids evicted, not yet told
        self.clock = 0
        self.evictions = 0  # rounds of eviction so far: slots found before one may be stale

    def __len__(self) -> int:
        return len(self.index)

    def slots(self, ids: torch.Tensor, pull: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Slots of distinct ``ids``, pulling (``pull(missing ids) -> values``) the rows
        not held."""
        slots = self.index.find(ids)
        absent = slots < 0
        if absent.any():
            missing = ids[absent]
            fresh = pull(missing)
            new = self._allocate(missing.numel())
            self.id_of[new], self.values[new], self.base[new] = missing, fresh, fresh
            self.taken[new] = True
            self.dirty[new] = False
            self.optimizer.reset(new)
            self.index.insert(missing, new)
            if self.released.numel():  # held again: the servers must keep sending it
                self.released = self.released[~torch.isin(self.released, missing)]
            slots[absent] = new
        self.clock += 1
        self.last_used.index_fill_(0, slots, self.clock)
        return slots

    def _allocate(self, n: int) -> torch.Tensor:
        free = (~self.taken).nonzero().squeeze(1)[:n]
        grow = n - free.numel()
        if grow > 0:
            held = self.id_of.numel()
            self.id_of = torch.cat([self.id_of, self.id_of.new_zeros(grow)])
            self.taken = torch.cat([self.taken, self.taken.new_zeros(grow)])
            self.values = torch.cat([self.values, self.values.new_zeros(grow, self.dim)])
            self.base = torch.cat([self.base, self.base.new_zeros(grow, self.dim)])
            self.dirty = torch.cat([self.dirty, self.dirty.new_zeros(grow)])
            self.last_used = torch.cat([self.last_used, self.last_used.new_zeros(grow)])
            self.optimizer.grow(grow)
            free = torch.cat([free, torch.arange(held, held + grow)])
        return free

    def train(self, slots: torch.Tensor, grad: torch.Tensor) -> None:
        """The local optimizer's step on distinct ``slots``."""
        self.optimizer.apply(self.values, slots, grad)
        self.dirty.index_fill_(0, slots, True)

    def changes(self, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, change since the last exchange / workers) of the rows trained since."""
        rows = self.dirty.nonzero().squeeze(1)
        return self.id_of[rows], (self.values[rows] - self.base[rows]) / workers

    def take_released(self) -> torch.Tensor:
        released, self.released = self.released, self.released[:0]
        return released

    def refresh(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """After an exchange: the servers' values of ``ids`` (rows no longer held are
        skipped); then every row is clean, and rows beyond ``limit`` go."""
        slots = self.index.find(ids)
        keep = slots >= 0
        slots = slots[keep]
        self.values[slots] = values[keep]
        self.base[slots] = values[keep]
        self.dirty.zero_()
        self._evict()

    def _evict(self) -> None:
        over = len(self) - self.limit
        if over <= 0:
            return
        self.evictions += 1
        held = self.taken.nonzero().squeeze(1)
        coldest = held[torch.argsort(self.last_used[held], stable=True)[:over]]
        ids = self.id_of[coldest]
        self.index.remove(ids)
        self.taken[coldest] = False
        self.released = torch.cat([self.released, ids])

    def clear(self) -> None:
        """Hold no row (they are released at the next exchange)."""
        held = self.taken.clone()
        self.released = torch.cat([self.released, self.id_of[held]])
        self.index.remove(self.id_of[held])
        self.taken.zero_()
        self.dirty.zero_()
        self.evictions += 1
