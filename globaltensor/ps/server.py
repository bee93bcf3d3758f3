"""The server side: table shards and the calls workers make on them.

A server holds one shard (a block of rows, the balanced split of
``globaltensor.layout``) of every table. Workers reach the functions below through
``globaltensor.comm.rpc``; they run on the server's RPC threads, so every shard has a
lock (pulls and pushes of different workers interleave). Row numbers arriving here are
already local to the shard. Every call checks its input and raises ``ValueError`` on
bad input: RPC hands the exception back to the worker, the server keeps serving.

How each mode updates a shard:

- sync: ``push_sync`` holds each worker's gradient until every worker pushed for the
  step, then applies their mean once (what one process training on the global batch
  does) and only then answers the workers, so their next pulls see the update;
- async: ``push_grad`` applies each worker's gradient (scaled by 1 / workers, so that
  a round of pushes moves rows as far as one sync step) the moment it arrives;
- geo: ``push_delta`` adds a worker's accumulated change of rows (already scaled).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from ..comm import rpc
from ..layout import balanced_split
from .optim import RowOptimizer, coalesce

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


class TableRows:
    """This server's rows of one table (``offset .. offset+rows-1``), with their
    optimizer state."""

    def __init__(self, config: dict, server: int, servers: int, initial: Optional[torch.Tensor]):
        self.config = config
        self.offset, self.rows = balanced_split(config["num_rows"], servers)[server]
        if initial is not None:  # a dense table: the creating worker's values
            self.weight = initial[self.offset:self.offset + self.rows].clone()
        else:
            self.weight = initial_rows(self.offset, self.offset + self.rows, config["dim"],
                                       config["init_std"], config["seed"])
        self.optimizer = RowOptimizer(config["optimizer"], config["lr"], tuple(self.weight.shape))
        self.workers = config["workers"]
        self.lock = threading.Lock()
        # sync mode: this step's pushes by worker rank, and the futures answering them
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.waiting: list[rpc.Future] = []

    def check(self, rows: torch.Tensor, values: Optional[torch.Tensor] = None) -> None:
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
            raise ValueError("rows must be a 1-D int64 tensor")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise ValueError(f"rows out of range for a shard of {self.rows} rows")
        if values is not None and (not isinstance(values, torch.Tensor)
                                   or values.shape != (rows.numel(), self.weight.shape[1])
                                   or values.dtype != self.weight.dtype):
            raise ValueError(f"values must be a {self.weight.dtype} tensor of shape "
                             f"({rows.numel()}, {self.weight.shape[1]})")


_shards: dict[int, TableRows] = {}
_lock = threading.Lock()
_done: set[int] = set()
_all_done = threading.Event()
_role: dict = {}  # this server's rank, the number of servers and of workers (set by init)


def configure(server: int, servers: int, workers: int) -> None:
    _role.update(server=server, servers=servers, workers=workers)


def _shard(table: int) -> TableRows:
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
            shard = _shards[table] = TableRows(config, _role["server"], _role["servers"],
                                               initial)
        elif shard.config != config:
            raise ValueError(f"table {table} was created as {shard.config}, this worker asks "
                             f"for {config}: every worker must create the same tables in "
                             f"the same order")
    return shard.rows


def pull(table: int, rows: torch.Tensor) -> torch.Tensor:
    """The current values of ``rows`` (local to the shard)."""
    shard = _shard(table)
    shard.check(rows)
    with shard.lock:
        return shard.weight.index_select(0, rows)


def push_grad(table: int, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """async: apply one worker's gradient now."""
    shard = _shard(table)
    shard.check(rows, grads)
    rows, grads = coalesce(rows, grads)
    with shard.lock:
        shard.optimizer.apply(shard.weight, rows, grads / shard.workers)


def push_delta(table: int, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """geo: add a worker's (scaled) change of ``rows``."""
    shard = _shard(table)
    shard.check(rows, delta)
    rows, delta = coalesce(rows, delta)
    with shard.lock:
        shard.weight.index_add_(0, rows, delta)


@rpc.async_execution
def push_sync(table: int, worker: int, rows: torch.Tensor, grads: torch.Tensor) -> rpc.Future:
    """sync: hold this worker's gradient for the step; the answer comes once every
    worker pushed and the mean was applied."""
    answer: rpc.Future = rpc.Future()
    try:
        shard = _shard(table)
        shard.check(rows, grads)
        if not 0 <= worker < shard.workers:
            raise ValueError(f"worker {worker} out of range")
    except ValueError as e:
        answer.set_exception(e)
        return answer
    with shard.lock:
        if worker in shard.pending:
            answer.set_exception(ValueError(
                f"worker {worker} pushed table {table} twice in one step (every worker must "
                f"look the table up the same number of times per step)"))
            return answer
        shard.pending[worker] = (rows, grads)
        shard.waiting.append(answer)
        if len(shard.pending) < shard.workers:
            return answer
        # In worker order, so the float sums do not depend on arrival order.
        parts = [shard.pending[w] for w in sorted(shard.pending)]
        rows, grads = coalesce(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        shard.optimizer.apply(shard.weight, rows, grads / shard.workers)
        waiting, shard.pending, shard.waiting = shard.waiting, {}, []
    for f in waiting:  # outside the lock: completing runs the replies' callbacks
        f.set_result(None)
    return answer


def worker_done(worker: int) -> None:
    """A worker has finished; when all have, ``serve`` returns."""
    with _lock:
        _done.add(worker)
        if len(_done) >= _role["workers"]:
            _all_done.set()


def serve() -> None:
    """Block until every worker said it is done."""
    _all_done.wait()
