"""The worker side of sparse tables, looked up like ``nn.Embedding``.

``EmbeddingTable(num_embeddings, dim)`` has no rows on the worker: its rows are split
over the servers (the balanced split of ``globaltensor.layout``), or, with
``num_embeddings=None``, any int64 id goes to the server ``hashed.server_of`` picks,
which keeps at most ``capacity`` rows of the table (admission and eviction:
``globaltensor.ps.hashed``). ``table(ids)`` pulls the rows of the batch's distinct ids
from the servers holding them and returns a tensor that autograd treats like any
other; ``backward`` pushes the gradient of those rows back (sync: combined with the
other workers' before the servers apply it; async: applied as it arrives; geo:
applied to this worker's local copy, ``geo.GeoCopy``, whose changed rows are exchanged
every ``k_steps`` steps). Only touched rows move, in either direction.

Example (in a worker, after ``gt.ps.init``)::

    emb = gt.ps.EmbeddingTable(1_000_000, 16, optimizer="adagrad", lr=0.05, init_std=0.01)
    ids_table = gt.ps.EmbeddingTable(None, 16, capacity=100_000, admit_count=2)  # any int64 id
    mlp = torch.nn.Linear(16, 1)
    opt = gt.ps.DenseOptimizer(mlp.parameters(), optimizer="sgd", lr=0.1)
    for ids, labels in batches:                        # ids: int64 (batch, slots)
        logits = mlp(emb(ids).sum(1)).squeeze(1)       # pull
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad(); loss.backward()               # push of the rows' gradients
        opt.step()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import balanced_split
from . import checkpoint, server
from .geo import GeoCopy
from .hashed import HashPolicy, server_of
from .optim import check_options
from .runtime import Call, state, wait_calls, wait_pending

__all__ = ["EmbeddingTable", "TableStats"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def need_worker(what: str) -> None:
    if state.strategy is None:
        raise RuntimeError(f"{what}: call gt.ps.init(strategy) first")
    if state.role != "worker":
        raise RuntimeError(f"{what} is used in worker processes (this is a server)")
    if state.stopped:
        raise RuntimeError(f"{what}: this worker was stopped (gt.ps.stop_worker)")


class Rows:
    """The row-level traffic of one table with the servers: which server holds a row,
    pull, push, exchange. Shared by ``EmbeddingTable`` and the flat table of
    ``DenseOptimizer``. ``num_rows=None``: a hashed table (``hash`` its policy)."""

    def __init__(self, num_rows: Optional[int], dim: int, optimizer: str, lr: float, init_std: float,
                 seed: int, name: str, options: Optional[dict] = None,
                 hash: Optional[HashPolicy] = None, initial: Optional[torch.Tensor] = None):
        if num_rows is not None and (not isinstance(num_rows, int) or num_rows < 1):
            raise ValueError(f"num_embeddings must be an int >= 1 or None (hashed ids), got {num_rows!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        options = check_options(optimizer, lr, options)
        self.num_rows, self.dim, self.name = num_rows, dim, name
        self.id = len(state.tables) + len(state.optimizers)
        self.mode = state.strategy.mode
        self.config = {"num_rows": num_rows, "dim": dim, "optimizer": optimizer, "lr": float(lr),
                       "options": options, "init_std": float(init_std), "seed": int(seed),
                       "workers": state.workers, "mode": self.mode, "dense": initial is not None,
                       "name": name, "hash": None if hash is None else vars(hash).copy()}
        # Row tables: server s holds rows starts[s] .. starts[s+1]-1.
        starts = [offset for offset, _ in balanced_split(num_rows or 1, state.servers)]
        self.starts = torch.tensor(starts + [num_rows or 0])
        wait_calls([self.call(s, "creation", server.create, (self.id, self.config, initial))
                    for s in range(state.servers)])

    def call(self, s: int, what: str, fn, args) -> Call:  # type: ignore[no-untyped-def]
        return Call.start(s, self.name, what, fn, args)

    def by_server(self, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """For sorted distinct ``ids``: (server, positions in ids, keys it knows them by:
        rows local to it, or the ids of a hashed table) per server holding any."""
        out = []
        if self.num_rows is None:
            owner = server_of(ids, state.servers)
            for s in range(state.servers):
                positions = (owner == s).nonzero().squeeze(1)
                if positions.numel():
                    out.append((s, positions, ids[positions]))
            return out
        cuts = torch.searchsorted(ids, self.starts).tolist()
        for s in range(state.servers):
            lo, hi = cuts[s], cuts[s + 1]
            if hi > lo:
                out.append((s, torch.arange(lo, hi), ids[lo:hi] - self.starts[s]))
        return out

    def to_ids(self, s: int, keys: torch.Tensor) -> torch.Tensor:
        return keys if self.num_rows is None else keys + self.starts[s]

    def pull(self, ids: torch.Tensor, holder: int = -1) -> torch.Tensor:
        """Values of sorted distinct ``ids`` (in that order); geo: ``holder`` (this
        worker) now holds them."""
        if self.mode == "sync":
            wait_pending()  # this worker's last pushes must be applied first (the step's update)
        out = torch.empty(ids.numel(), self.dim)
        parts = self.by_server(ids)
        calls = [self.call(s, "pull", server.pull, (self.id, keys, holder)) for s, _, keys in parts]
        for (_, positions, _), values in zip(parts, wait_calls(calls)):
            out[positions] = values
        return out

    def push(self, ids: torch.Tensor, values: torch.Tensor, kind: str) -> None:
        """Send gradients ("grad") or changes ("delta") of sorted distinct ``ids``; the
        answers are waited for later (``runtime.wait_pending``)."""
        parts = {s: (positions, keys) for s, positions, keys in self.by_server(ids)}
        for s in range(state.servers):
            positions, keys = parts.get(s, (torch.zeros(0, dtype=torch.int64),) * 2)
            if kind == "grad" and self.mode == "sync":
                # Every worker pushes to every server each step (an empty push too):
                # the server applies the step once all workers' pushes are in.
                fn, args = server.push_sync, (self.id, state.rank, keys, values[positions])
            elif keys.numel() == 0:
                continue
            elif kind == "grad":
                fn, args = server.push_grad, (self.id, keys, values[positions])
            else:
                fn, args = server.push_delta, (self.id, keys, values[positions])
            state.pending.append(self.call(s, "push", fn, args))
        # Answered pushes leave the list (async mode may never wait for them); a push
        # the server refused raises here.
        done = [c for c in state.pending if c.future.done()]
        state.pending = [c for c in state.pending if not c.future.done()]
        try:
            wait_calls(done)
        except Exception:
            state.pending = []  # the step failed: one error for it, not one per server
            raise

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Values and optimizer state of sorted distinct ``ids`` (a checkpoint)."""
        parts = self.by_server(ids)
        answers = wait_calls([self.call(s, "checkpoint read", server.read_rows, (self.id, keys))
                              for s, _, keys in parts])
        values = torch.empty(ids.numel(), self.dim)
        state: dict = {}
        for (_, positions, _), (part, part_state) in zip(parts, answers):
            values[positions] = part
            for name, t in part_state.items():
                state.setdefault(name, torch.empty(ids.numel(), t.shape[1]))[positions] = t
        return values, state

    def write(self, ids: torch.Tensor, values: torch.Tensor, state: dict) -> None:
        """Set sorted distinct ``ids`` and their optimizer state (loading a checkpoint)."""
        wait_calls([self.call(s, "checkpoint load", server.write_rows,
                              (self.id, keys, values[positions], {n: t[positions] for n, t in state.items()}))
                    for s, positions, keys in self.by_server(ids)])

    def exchange(self, ids: torch.Tensor, delta: torch.Tensor,
                 released: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """geo: push ``delta`` of sorted distinct ``ids``, release ids no longer held;
        returns (ids, values) of the held rows that changed since the last exchange."""
        parts = {s: (p, k) for s, p, k in self.by_server(ids)}
        gone = {s: k for s, _, k in self.by_server(torch.sort(released).values)}
        empty = torch.zeros(0, dtype=torch.int64)
        calls = []
        for s in range(state.servers):
            positions, keys = parts.get(s, (empty, empty))
            calls.append(self.call(s, "exchange", server.exchange,
                                   (self.id, state.rank, keys, delta[positions], gone.get(s, empty))))
        answers = wait_calls(calls)
        return (torch.cat([self.to_ids(s, keys) for s, (keys, _) in enumerate(answers)]),
                torch.cat([values for _, values in answers]))


@dataclass(frozen=True)
class TableStats:
    """Rows of a table on the servers (summed over them) and, for hashed tables, the
    ids admitted, rows evicted and lookups of ids not admitted (``filtered``) so far;
    ``local_rows``: rows of this worker's geo copy (0 in other modes)."""

    rows: int
    capacity: int
    admitted: int
    evicted: int
    filtered: int
    local_rows: int


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, table: "EmbeddingTable", unique: torch.Tensor,
                inverse: torch.Tensor) -> torch.Tensor:
        values, ctx.slots = table._values(unique)
        ctx.table, ctx.unique, ctx.inverse = table, unique, inverse
        return values[inverse]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        table = ctx.table
        grad = torch.zeros(ctx.unique.numel(), table.dim, dtype=grad_out.dtype)
        # (index_put_ accumulates several times faster than index_add_ on CPU)
        grad.index_put_((ctx.inverse.reshape(-1),), grad_out.reshape(-1, table.dim), accumulate=True)
        table._push_grad(ctx.unique, grad, ctx.slots)
        return None, None, None, None


class EmbeddingTable(torch.nn.Module):
    """A ``num_embeddings`` x ``dim`` table whose rows live on the servers.

    ``optimizer`` (``"sgd"``, ``"adagrad"``, ``"adam"``: lazy, ``"ftrl"``; options such
    as ``{"l1": 1.0}`` in ``optimizer_options``, see ``globaltensor.ps.optim``) and
    ``lr`` update its rows on the servers (or, in geo mode, on this worker's local
    copy). Rows start N(0, ``init_std``^2) from ``seed`` (``initial_weight`` gives the
    same values, for a reference model). Every worker must create the same tables in
    the same order. In sync mode every worker must look a table up the same number of
    times per step, and run the same number of steps.

    ``num_embeddings=None``: ids are any int64, hashed to the servers; each server
    keeps at most ``capacity`` rows, admits a new id once seen in ``admit_count``
    lookups (or with probability ``admit_prob`` per lookup), and evicts the least
    recently used row (``eviction="lru"``) or rows idle ``ttl`` seconds
    (``eviction="ttl"``); see ``stats()``.

    ``geo_rows``: geo mode, the rows this worker keeps between exchanges (least
    recently used go first; default: as many as the table has).

    ``table(ids)``: ``ids`` an integer tensor of any shape; returns ``ids.shape + (dim,)``
    float32 values. ``name`` names the table in errors.
    """

    def __init__(self, num_embeddings: Optional[int], dim: int, optimizer: str = "sgd",
                 lr: float = 0.01, init_std: float = 0.0, seed: int = 0, *,
                 optimizer_options: Optional[dict] = None, capacity: Optional[int] = None,
                 admit_count: int = 1, admit_prob: float = 1.0, eviction: str = "lru",
                 ttl: Optional[float] = None, geo_rows: Optional[int] = None, name: Optional[str] = None):
        super().__init__()
        need_worker("EmbeddingTable")
        policy = None
        if num_embeddings is None:
            if capacity is None:
                raise ValueError("a hashed table (num_embeddings=None) needs capacity (rows per server)")
            policy = HashPolicy(capacity, admit_count, admit_prob, eviction, ttl)
        elif capacity is not None:
            raise ValueError("capacity is for hashed tables (num_embeddings=None); a table of "
                             f"{num_embeddings} rows holds them all")
        if geo_rows is not None and (not isinstance(geo_rows, int) or geo_rows < 1):
            raise ValueError(f"geo_rows must be an int >= 1, got {geo_rows!r}")
        self.num_embeddings, self.num_rows, self.dim = num_embeddings, num_embeddings, dim
        table_name = name or f"table{len(state.tables) + len(state.optimizers)}"
        self._rows = Rows(num_embeddings, dim, optimizer, lr, init_std, seed, table_name,
                          optimizer_options, policy)
        self._optimizer_kind, self._lr = optimizer, lr
        # Gives the lookup an input that requires grad, so autograd calls its backward.
        self._anchor = torch.zeros(0, requires_grad=True)
        self.last_exchange = (0, 0)
        size = num_embeddings if policy is None else policy.capacity * state.servers
        self._geo = (GeoCopy(dim, optimizer, lr, optimizer_options, geo_rows or size, num_embeddings)
                     if self._rows.mode == "geo" else None)
        state.tables.append(self)

    @staticmethod
    def initial_weight(num_embeddings: int, dim: int, init_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """The values a table made with these arguments starts with (all rows)."""
        return server.initial_rows(0, num_embeddings, dim, init_std, seed)

    def extra_repr(self) -> str:
        size = "hashed" if self.num_embeddings is None else self.num_embeddings
        return (f"{size}, {self.dim}, optimizer={self._optimizer_kind!r}, lr={self._lr}, "
                f"servers={state.servers}, name={self._rows.name!r}")

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"EmbeddingTable expects a tensor of ids, got {type(ids).__name__}")
        if ids.dtype not in _INT_DTYPES:
            raise TypeError(f"EmbeddingTable ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        if ids.numel() and self.num_rows is not None:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_rows:
                bad = lo if lo < 0 else hi
                raise IndexError(f"EmbeddingTable id {bad} out of range: the table has "
                                 f"{self.num_rows} rows (ids must be in [0, {self.num_rows}))")
        return ids.to(torch.int64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        need_worker("EmbeddingTable lookup")
        ids = self._check_ids(ids)
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return _Lookup.apply(self._anchor, self, unique, inverse)

    # --- pulls and pushes -------------------------------------------------------------

    def _values(self, unique: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple[int, torch.Tensor]]]:
        """Values of ``unique``, and (geo) where they are in the local copy."""
        if self._geo is None:
            return self._rows.pull(unique), None
        slots = self._slots(unique)  # may grow the copy: read its values after
        return self._geo.values[slots], (self._geo.evictions, slots)

    def _push_grad(self, unique: torch.Tensor, grad: torch.Tensor,
                   where: Optional[tuple[int, torch.Tensor]]) -> None:
        if self._geo is None:
            self._rows.push(unique, grad, "grad")
            return
        # train the local copy (its change goes out in flush()); the lookup's slots
        # unless rows were evicted since
        evictions, slots = where
        self._geo.train(slots if evictions == self._geo.evictions else self._slots(unique), grad)

    def _slots(self, unique: torch.Tensor) -> torch.Tensor:
        assert self._geo is not None
        return self._geo.slots(unique, lambda missing: self._rows.pull(missing, holder=state.rank))

    def flush(self) -> None:
        """geo: exchange with the servers now (push this worker's changed rows, take
        the held rows others changed); ``DenseOptimizer.step`` calls it every
        ``k_steps`` steps."""
        if self._geo is None:
            return
        ids, delta = self._geo.changes(state.workers)
        order = torch.argsort(ids)
        fresh_ids, values = self._rows.exchange(ids[order], delta[order], self._geo.take_released())
        self._geo.refresh(fresh_ids, values)
        self.last_exchange = (ids.numel(), fresh_ids.numel())  # rows pushed, rows taken back

    def stats(self) -> TableStats:
        """The table's statistics, from every server (see ``TableStats``)."""
        need_worker("EmbeddingTable.stats")
        each = wait_calls([self._rows.call(s, "stats", server.stats, (self._rows.id,))
                           for s in range(state.servers)])
        total = {k: sum(d[k] for d in each) for k in each[0]}
        return TableStats(**total, local_rows=len(self._geo) if self._geo is not None else 0)

    # --- checkpoints: get_state_dict / dcp.save / dcp.load / set_state_dict -------------

    def get_extra_state(self) -> dict:
        """The rows and their optimizer state: what ``model.state_dict()`` and
        ``get_state_dict(model, optimizer)`` hold for the table, so that ``dcp.save``
        writes them and a job with any number of servers and workers loads them (row
        tables: GlobalTensors split by rows over the workers; hashed tables: parts by
        id; see ``globaltensor.ps.checkpoint``). Every worker calls it, as it calls
        ``dcp.save``."""
        need_worker("EmbeddingTable.state_dict")
        self.flush()
        wait_pending()
        checkpoint.workers_meet()  # every worker's changes are in before any reads
        if self.num_rows is None:
            return checkpoint.hashed_state(self._rows)
        return checkpoint.row_state(self._rows)

    def set_extra_state(self, saved: dict) -> None:
        """Replace the rows and optimizer state by ``saved`` (``get_extra_state``'s
        form, filled by ``dcp.load``)."""
        need_worker("EmbeddingTable.load_state_dict")
        wait_pending()
        if self.num_rows is None:
            checkpoint.load_hashed_state(self._rows, saved)
        else:
            checkpoint.load_row_state(self._rows, saved)
        if self._geo is not None:
            self._geo.clear()  # rows held from before the load: pulled again on use
        checkpoint.workers_meet()  # no worker trains before every block is loaded

    def weight(self) -> torch.Tensor:
        """All rows as the servers hold them now (pulls the whole table: for checks
        and saving small tables). In geo mode, pushes this worker's change first."""
        need_worker("EmbeddingTable.weight")
        if self.num_rows is None:
            raise ValueError(f"table {self._rows.name!r} is hashed (num_embeddings=None): it has "
                             f"no row numbers to list; look ids up instead")
        self.flush()
        wait_pending()
        return self._rows.pull(torch.arange(self.num_rows))
