"""The server side: table shards and the calls workers make on them.

A server holds one shard of every table: a block of rows (the balanced split of
``globaltensor.layout``) of a table of ``num_embeddings`` rows, or, for a hashed table
(``num_embeddings=None``), the ids ``hashed.server_of`` sends it, in ``capacity``
slots (``hashed.HashSlots``: admission, eviction). Workers reach the functions below
through ``globaltensor.comm.rpc``; they run on the server's RPC threads, so every shard
has a lock (pulls and pushes of different workers interleave). Keys arriving here are
rows local to the shard (row tables) or ids (hashed tables). Every call checks its
input and raises ``ValueError`` on bad input: RPC hands the exception back to the
worker, the server keeps serving.

How each mode updates a shard:

- sync: ``push_sync`` holds each worker's gradient until every worker pushed for the
  step, then applies their mean once (what one process training on the global batch
  does) and only then answers the workers, so their next pulls see the update. A
  worker that finished (``worker_done``) fails the step the others wait in at once;
- async: ``push_grad`` applies each worker's gradient (scaled by 1 / workers, so that
  a round of pushes moves rows as far as one sync step) the moment it arrives;
- geo: ``exchange`` adds a worker's change of the rows it changed and answers with
  the rows that changed since its last exchange among those it holds (the shard keeps
  which worker holds which row, ``held``, and which of them are out of date, ``stale``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import rpc
from ..layout import balanced_split
from .hashed import HashedRows, HashPolicy, HashSlots, hashed_normal, part_of
from .optim import RowOptimizer, add_rows, coalesce

# Rows per initialisation block: a block's values depend only on (seed, block), so a
# server draws the blocks of its own rows only, and the result does not depend on
# how many servers share the table.
INIT_BLOCK = 4096


def initial_rows(start: int, stop: int, dim: int, std: float, seed: int) -> torch.Tensor:
    """Rows ``start..stop-1`` of a table initialised N(0, std^2) from ``seed``.

    >>> initial_rows(0, 10, 3, 0.1, 0)[4:6].equal(initial_rows(4, 6, 3, 0.1, 0))
    True
    """
    if std == 0 or stop <= start:
        return torch.zeros(max(stop - start, 0), dim)
    parts = []
    for block in range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1):
        g = torch.Generator().manual_seed(seed * 1_000_003 + block)
        values = torch.randn(INIT_BLOCK, dim, generator=g) * std
        lo, hi = block * INIT_BLOCK, (block + 1) * INIT_BLOCK
        parts.append(values[max(start, lo) - lo:min(stop, hi) - lo])
    return torch.cat(parts)


class Shard:
    """This server's part of one table: the rows, their optimizer state, and the
    bookkeeping of sync steps and geo exchanges."""

    def __init__(self, config: dict, server: int, servers: int, initial: Optional[torch.Tensor]):
        self.config, self.name, dim = config, config["name"], config["dim"]
        self.slots: Optional[HashSlots] = None
        self.slot_seed = config["seed"] * 7919 + server
        if config["num_rows"] is None:
            self.slots = HashSlots(HashPolicy(**config["hash"]), seed=self.slot_seed)
            self.offset, self.rows = 0, self.slots.policy.capacity
            self.weight = torch.zeros(self.rows, dim)
        else:
            self.offset, self.rows = balanced_split(config["num_rows"], servers)[server]
            if initial is not None:  # a dense table: the creating worker's values
                self.weight = initial[self.offset:self.offset + self.rows].clone()
            else:
                self.weight = initial_rows(self.offset, self.offset + self.rows, dim,
                                           config["init_std"], config["seed"])
        self.optimizer = RowOptimizer(config["optimizer"], config["lr"], (self.rows, dim),
                                      config["options"])
        self.workers = config["workers"]
        self.lock = threading.Lock()
        # sync mode: this step's pushes by worker rank, the futures answering them, and
        # the steps applied so far
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.waiting: list[rpc.Future] = []
        self.steps = 0
        geo = config["mode"] == "geo" and not config["dense"]
        self.held = torch.zeros(self.workers, self.rows, dtype=torch.bool) if geo else None
        self.stale = torch.zeros_like(self.held) if geo else None

    def check(self, keys: torch.Tensor, values: Optional[torch.Tensor] = None) -> None:
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            raise ValueError("rows must be a 1-D int64 tensor")
        if self.slots is None and keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= self.rows):
            raise ValueError(f"rows out of range for a shard of {self.rows} rows")
        if values is not None and (not isinstance(values, torch.Tensor)
                                   or values.shape != (keys.numel(), self.weight.shape[1])
                                   or values.dtype != self.weight.dtype):
            raise ValueError(f"values must be a {self.weight.dtype} tensor of shape "
                             f"({keys.numel()}, {self.weight.shape[1]})")

    def locate(self, keys: torch.Tensor, create: bool) -> torch.Tensor:
        """Slots of ``keys`` (-1: a hashed id without a row; ``create`` admits new ids).
        Call with the lock held."""
        if self.slots is None:
            return keys
        slots = self.slots.find(keys)
        if create:
            new_slots, new_ids, evicted = self.slots.admit(keys, slots)
            self.weight[new_slots] = hashed_normal(new_ids, self.weight.shape[1],
                                                   self.config["init_std"], self.config["seed"])
            self.optimizer.reset(new_slots)
            if self.held is not None:  # no worker holds a row that left
                self.held[:, evicted] = False
                self.stale[:, evicted] = False
        return slots

    def key_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots if self.slots is None else self.slots.id_of[slots]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Values of ``slots``; zeros for -1 (an id not admitted reads as zeros)."""
        out = self.weight.index_select(0, slots.clamp(min=0))
        out[slots < 0] = 0
        return out

    def update(self, keys: torch.Tensor, grads: torch.Tensor, divisor: int) -> None:
        """Apply ``grads / divisor`` to the rows of ``keys`` (ids without a row: dropped)."""
        slots = self.locate(keys, create=False)
        keep = slots >= 0
        rows, grads = coalesce(slots[keep], grads[keep])
        self.optimizer.apply(self.weight, rows, grads / divisor)
        self.changed(rows)

    def export(self, parts: torch.Tensor, count: int) -> HashedRows:
        """The held rows of a hashed table whose checkpoint part (of ``count``) is in
        ``parts``. Call with the lock held."""
        slots, ids, age, idle = self.slots.held()
        mine = torch.isin(part_of(ids, count), parts)
        slots = slots[mine]
        return HashedRows(ids[mine], self.weight[slots], {n: t[slots] for n, t in self.optimizer.state.items()},
                          age[mine], idle[mine])

    def restore(self, rows: HashedRows) -> None:
        """Take a hashed table's rows from a checkpoint. Call with the lock held."""
        slots, evicted = self.slots.restore(rows.ids, rows.age, rows.idle)
        keep = slots >= 0
        self.weight[slots[keep]] = rows.values[keep]
        for name, t in self.optimizer.state.items():
            t[slots[keep]] = rows.state[name][keep]
        if self.held is not None:
            self.held[:, evicted] = False
            self.stale[:, evicted] = False

    def clear(self) -> None:
        """Forget every row of a hashed table (before a checkpoint is loaded); geo
        workers clear their copies too. Call with the lock held."""
        self.slots = HashSlots(self.slots.policy, seed=self.slot_seed)
        self.weight.zero_()
        for t in self.optimizer.state.values():
            t.zero_()
        if self.held is not None:
            self.held.zero_()
            self.stale.zero_()

    def changed(self, rows: torch.Tensor) -> None:
        """geo: the workers holding ``rows`` must get them at their next exchange."""
        if self.held is not None and rows.numel():
            self.stale[:, rows] |= self.held[:, rows]


@dataclass(frozen=True)
class Refusal:
    """A sync push's answer when the step cannot be applied: the worker raises it as a
    ValueError (a Future completed with an exception under ``async_execution`` never
    wakes the caller's wait in torch 2.x's RPC, so the error travels as a value)."""

    message: str


_shards: dict[int, Shard] = {}
_lock = threading.Lock()
_done: set[int] = set()
_all_done = threading.Event()
_role: dict = {}  # this server's rank, the number of servers and of workers (set by init)


def configure(server: int, servers: int, workers: int) -> None:
    _role.update(server=server, servers=servers, workers=workers)


def _shard(table: int) -> Shard:
    shard = _shards.get(table)
    if shard is None:
        raise ValueError(f"no table {table} on server {_role.get('server')}")
    return shard


# --- the calls workers make (module-level: RPC pickles them by name) -------------------

def create(table: int, config: dict, initial: Optional[torch.Tensor] = None) -> int:
    """Make this server's shard of ``table`` (every worker calls; the first one makes
    it, the others must agree on its configuration). Returns the shard's row count."""
    with _lock:
        shard = _shards.get(table)
        if shard is None:
            shard = _shards[table] = Shard(config, _role["server"], _role["servers"], initial)
        elif shard.config != config:
            raise ValueError(f"table {table} was created as {shard.config}, this worker asks "
                             f"for {config}: every worker must create the same tables in "
                             f"the same order")
    return shard.rows


def pull(table: int, keys: torch.Tensor, worker: int = -1) -> torch.Tensor:
    """The current values of ``keys`` (admitting new ids of a hashed table). In geo mode
    ``worker`` now holds these rows: later changes reach it at its exchanges."""
    shard = _shard(table)
    shard.check(keys)
    with shard.lock:
        slots = shard.locate(keys, create=True)
        if shard.held is not None and worker >= 0:
            rows = slots[slots >= 0]
            shard.held[worker, rows] = True
            shard.stale[worker, rows] = False
        return shard.read(slots)


def push_grad(table: int, keys: torch.Tensor, grads: torch.Tensor) -> None:
    """async: apply one worker's gradient now."""
    shard = _shard(table)
    shard.check(keys, grads)
    with shard.lock:
        shard.update(keys, grads, shard.workers)


def push_delta(table: int, keys: torch.Tensor, delta: torch.Tensor) -> None:
    """geo (dense parameters): add a worker's (scaled) change of ``keys``."""
    shard = _shard(table)
    shard.check(keys, delta)
    with shard.lock:
        slots = shard.locate(keys, create=False)
        keep = slots >= 0
        rows, delta = coalesce(slots[keep], delta[keep])
        add_rows(shard.weight, rows, delta)
        shard.changed(rows)


def exchange(table: int, worker: int, keys: torch.Tensor, delta: torch.Tensor,
             released: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """geo: add ``worker``'s (scaled) change of ``keys``; forget the rows it no longer
    holds (``released``); answer (keys, values) of the rows it holds that changed since
    its last exchange (its own pushed rows among them), and of pushed ids that have no
    row (zeros: not admitted)."""
    shard = _shard(table)
    shard.check(keys, delta)
    shard.check(released)
    if shard.held is None or not 0 <= worker < shard.workers:
        raise ValueError(f"exchange: table {shard.name!r} is not a geo table, or worker {worker} "
                         f"out of range")
    with shard.lock:
        gone = shard.locate(released, create=False)
        gone = gone[gone >= 0]
        shard.held[worker, gone] = False
        shard.stale[worker, gone] = False
        slots = shard.locate(keys, create=True)
        keep = slots >= 0
        rows, delta = coalesce(slots[keep], delta[keep])
        add_rows(shard.weight, rows, delta)
        shard.held[worker, rows] = True
        shard.changed(rows)
        out = shard.stale[worker].nonzero().squeeze(1)
        shard.stale[worker, out] = False
        dropped = keys[~keep]
        zeros = shard.weight.new_zeros(dropped.numel(), shard.weight.shape[1])
        return torch.cat([shard.key_of(out), dropped]), torch.cat([shard.weight[out], zeros])


def _unfinished_step(shard: Shard, done: int) -> Refusal:
    return Refusal(
        f"worker {done} finished (gt.ps.stop_worker) after {shard.steps} steps of table "
        f"{shard.name!r}, but worker(s) {sorted(shard.pending)} pushed step {shard.steps + 1}: "
        f"in sync mode every worker must run the same number of steps (a step is applied "
        f"once every worker pushed it)")


@rpc.async_execution
def push_sync(table: int, worker: int, keys: torch.Tensor, grads: torch.Tensor) -> rpc.Future:
    """sync: hold this worker's gradient for the step; the answer comes once every
    worker pushed and the mean was applied."""
    answer: rpc.Future = rpc.Future()
    try:
        shard = _shard(table)
        shard.check(keys, grads)
        if not 0 <= worker < shard.workers:
            raise ValueError(f"worker {worker} out of range")
    except ValueError as e:
        answer.set_result(Refusal(str(e)))
        return answer
    with shard.lock:
        if worker in shard.pending:
            answer.set_result(Refusal(
                f"worker {worker} pushed table {shard.name!r} twice in one step (every worker "
                f"must look the table up the same number of times per step)"))
            return answer
        shard.pending[worker] = (keys, grads)
        finished = sorted(_done - set(shard.pending))
        if finished:
            error, shard.pending = _unfinished_step(shard, finished[0]), {}
            waiting, shard.waiting = shard.waiting + [answer], []
            for f in waiting:
                f.set_result(error)
            return answer
        shard.waiting.append(answer)
        if len(shard.pending) < shard.workers:
            return answer
        # In worker order, so the float sums do not depend on arrival order.
        parts = [shard.pending[w] for w in sorted(shard.pending)]
        shard.update(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), shard.workers)
        shard.steps += 1
        waiting, shard.pending, shard.waiting = shard.waiting, {}, []
    for f in waiting:  # outside the lock: completing runs the replies' callbacks
        f.set_result(None)
    return answer


def read_rows(table: int, keys: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Values and optimizer state of rows ``keys`` (a row table's checkpoint)."""
    shard = _shard(table)
    shard.check(keys)
    if shard.slots is not None:
        raise ValueError(f"table {shard.name!r} is hashed: read_rows is for tables with row numbers")
    with shard.lock:
        return shard.weight[keys], {n: t[keys] for n, t in shard.optimizer.state.items()}


def write_rows(table: int, keys: torch.Tensor, values: torch.Tensor, state: dict) -> None:
    """Set rows ``keys`` and their optimizer state (loading a checkpoint)."""
    shard = _shard(table)
    shard.check(keys, values)
    expected = shard.optimizer.state
    if shard.slots is not None or set(state) != set(expected):
        raise ValueError(f"table {shard.name!r}: a checkpoint of a row table with optimizer state "
                         f"{sorted(expected)} expected, got {sorted(state)}")
    with shard.lock:
        shard.weight[keys] = values
        for name, t in state.items():
            expected[name][keys] = t
        shard.changed(keys)


def _hashed_shard(table: int, what: str) -> Shard:
    shard = _shard(table)
    if shard.slots is None:
        raise ValueError(f"table {shard.name!r} has row numbers: {what} is for hashed tables")
    return shard


def read_hashed(table: int, parts: torch.Tensor, count: int) -> HashedRows:
    """A hashed table's held rows in checkpoint ``parts`` (of ``count``)."""
    shard = _hashed_shard(table, "read_hashed")
    with shard.lock:
        return shard.export(parts, count)


def clear_hashed(table: int) -> None:
    """Drop every row of a hashed table (a checkpoint's rows come next)."""
    shard = _hashed_shard(table, "clear_hashed")
    with shard.lock:
        shard.clear()


def write_hashed(table: int, rows: HashedRows) -> None:
    """Add rows of a checkpoint to a hashed table (after ``clear_hashed``)."""
    shard = _hashed_shard(table, "write_hashed")
    shard.check(rows.ids, rows.values)
    expected = shard.optimizer.state
    if set(rows.state) != set(expected):
        raise ValueError(f"table {shard.name!r}: a checkpoint with optimizer state {sorted(expected)} "
                         f"expected, got {sorted(rows.state)}")
    with shard.lock:
        shard.restore(rows)


def add_counts(table: int, counts: dict) -> None:
    """Add ``counts`` (admitted, evicted, filtered) to a hashed table's statistics: a
    loaded table carries on its checkpoint's counts."""
    shard = _hashed_shard(table, "add_counts")
    with shard.lock:
        for name in ("admitted", "evicted", "filtered"):
            setattr(shard.slots, name, getattr(shard.slots, name) + int(counts[name]))


def stats(table: int) -> dict:
    """Rows held, and for hashed tables the admission / eviction counts."""
    shard = _shard(table)
    with shard.lock:
        if shard.slots is None:
            return {"rows": shard.rows, "capacity": shard.rows, "admitted": 0, "evicted": 0, "filtered": 0}
        return shard.slots.stats()


def worker_done(worker: int) -> None:
    """A worker has finished; when all have, ``serve`` returns. A sync step the others
    wait in can no longer complete: it fails now, naming the worker."""
    with _lock:
        _done.add(worker)
        if len(_done) >= _role["workers"]:
            _all_done.set()
        shards = list(_shards.values())
    for shard in shards:
        with shard.lock:
            if not shard.pending or worker in shard.pending:
                continue
            error, shard.pending = _unfinished_step(shard, worker), {}
            waiting, shard.waiting = shard.waiting, []
        for f in waiting:
            f.set_result(error)


def serve() -> None:
    """Block until every worker said it is done."""
    _all_done.wait()
