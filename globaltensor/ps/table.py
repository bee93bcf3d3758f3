"""The worker side: sparse tables looked up like ``nn.Embedding``, and dense parameters.

``EmbeddingTable(num_rows, dim)`` has no rows on the worker: its rows are split over
the servers (the balanced split of ``globaltensor.layout``). ``table(ids)`` pulls the
rows of the batch's distinct ids from the servers holding them and returns a tensor
that autograd treats like any other; ``backward`` pushes the gradient of those rows
back (sync: combined with the other workers' before the servers apply it; async:
applied as it arrives; geo: applied to this worker's local copy, whose change is
pushed every ``k_steps`` steps). Only touched rows move, in either direction.

``DenseOptimizer(dense_params)`` steps the ordinary (dense) parameters: sync mode
all-reduces their gradients among the workers (data parallelism over a group of the
workers only) and steps them locally; async keeps them on the servers as a flat table
(pushed and pulled every step, nobody waits for a slow worker); geo trains them
locally and averages them through the servers every ``k_steps`` steps. Its ``step()``
also marks the end of a training step for geo mode, so call it once per step.

Example (in a worker, after ``gt.ps.init``)::

    emb = gt.ps.EmbeddingTable(1_000_000, 16, optimizer="adagrad", lr=0.05, init_std=0.01)
    mlp = torch.nn.Linear(16, 1)
    opt = gt.ps.DenseOptimizer(mlp.parameters(), optimizer="sgd", lr=0.1)
    for ids, labels in batches:                        # ids: int64 (batch, slots)
        logits = mlp(emb(ids).sum(1)).squeeze(1)       # pull
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad(); loss.backward()               # push of the rows' gradients
        opt.step()
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .. import comm
from ..comm import rpc
from ..layout import balanced_split
from . import server
from .optim import OPTIMIZERS, RowOptimizer
from .runtime import server_rank_of, state

__all__ = ["EmbeddingTable", "DenseOptimizer"]

# async / geo: values per row of the servers' table of a worker's dense parameters
DENSE_ROW = 256
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _need_worker(what: str) -> None:
    if state.strategy is None:
        raise RuntimeError(f"{what}: call gt.ps.init(strategy) first")
    if state.role != "worker":
        raise RuntimeError(f"{what} is used in worker processes (this is a server)")
    if state.stopped:
        raise RuntimeError(f"{what}: this worker was stopped (gt.ps.stop_worker)")


class _Rows:
    """The row-level traffic of one table with the servers: which server holds a row,
    pull, push. Shared by ``EmbeddingTable`` and the flat table of ``DenseOptimizer``."""

    def __init__(self, num_rows: int, dim: int, optimizer: str, lr: float, init_std: float,
                 seed: int, initial: Optional[torch.Tensor] = None):
        if not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.num_rows, self.dim = num_rows, dim
        self.id = len(state.tables) + len(state.optimizers)
        self.mode = state.strategy.mode
        config = {"num_rows": num_rows, "dim": dim, "optimizer": optimizer, "lr": float(lr),
                  "init_std": float(init_std), "seed": int(seed), "workers": state.workers,
                  "mode": self.mode, "dense": initial is not None}
        self.config = config
        # Shard boundaries: server s holds rows starts[s] .. starts[s+1]-1.
        parts = balanced_split(num_rows, state.servers)
        self.starts = torch.tensor([offset for offset, _ in parts] + [num_rows])
        rpc.wait_all([rpc.call_async(server_rank_of(s), server.create, (self.id, config, initial))
                      for s in range(state.servers)])

    def by_server(self, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """For sorted unique ``ids``: (server, positions in ids, rows local to it) per
        server holding any of them."""
        cuts = torch.searchsorted(ids, self.starts).tolist()
        out = []
        for s in range(state.servers):
            lo, hi = cuts[s], cuts[s + 1]
            if hi > lo:
                out.append((s, torch.arange(lo, hi), ids[lo:hi] - self.starts[s]))
        return out

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of sorted unique ``ids`` (in that order)."""
        if self.mode == "sync":
            # This worker's last pushes must be applied first (the step's update).
            from .runtime import wait_pending
            wait_pending()
        out = torch.empty(ids.numel(), self.dim)
        parts = self.by_server(ids)
        futures = [rpc.call_async(server_rank_of(s), server.pull, (self.id, rows))
                   for s, _, rows in parts]
        for (_, positions, _), values in zip(parts, rpc.wait_all(futures)):
            out[positions] = values
        return out

    def push(self, ids: torch.Tensor, values: torch.Tensor, kind: str) -> None:
        """Send gradients ("grad") or changes ("delta") of sorted unique ``ids``; the
        answers are waited for later (``runtime.wait_pending``)."""
        parts = {s: (positions, rows) for s, positions, rows in self.by_server(ids)}
        for s in range(state.servers):
            positions, rows = parts.get(s, (torch.zeros(0, dtype=torch.int64),) * 2)
            if kind == "grad" and self.mode == "sync":
                # Every worker pushes to every server each step (an empty push too):
                # the server applies the step once all workers' pushes are in.
                fn, args = server.push_sync, (self.id, state.rank, rows, values[positions])
            elif rows.numel() == 0:
                continue
            elif kind == "grad":
                fn, args = server.push_grad, (self.id, rows, values[positions])
            else:
                fn, args = server.push_delta, (self.id, rows, values[positions])
            state.pending.append(rpc.call_async(server_rank_of(s), fn, args))
        # Answered pushes leave the list (async mode may never wait for them); a push
        # the server refused raises here.
        done = [f for f in state.pending if f.done()]
        state.pending = [f for f in state.pending if not f.done()]
        rpc.wait_all(done)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, table: "EmbeddingTable", unique: torch.Tensor,
                inverse: torch.Tensor) -> torch.Tensor:
        ctx.table, ctx.unique, ctx.inverse = table, unique, inverse
        return table._values(unique)[inverse]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        table = ctx.table
        grad = torch.zeros(ctx.unique.numel(), table.dim, dtype=grad_out.dtype)
        grad.index_add_(0, ctx.inverse.reshape(-1), grad_out.reshape(-1, table.dim))
        table._push_grad(ctx.unique, grad)
        return None, None, None, None


class EmbeddingTable(torch.nn.Module):
    """A ``num_rows`` x ``dim`` table whose rows live on the servers.

    ``optimizer`` ("sgd" or "adagrad") and ``lr`` update its rows on the servers (or,
    in geo mode, on this worker's local copy). Rows start N(0, ``init_std``^2) from
    ``seed`` (``initial_weight`` gives the same values, for a reference model). Every
    worker must create the same tables in the same order. In sync mode every worker
    must look a table up the same number of times per step.

    ``table(ids)``: ``ids`` an integer tensor of any shape with values in
    ``[0, num_rows)``; returns ``ids.shape + (dim,)`` float32 values.
    """

    def __init__(self, num_rows: int, dim: int, optimizer: str = "sgd", lr: float = 0.01,
                 init_std: float = 0.0, seed: int = 0):
        super().__init__()
        _need_worker("EmbeddingTable")
        self.num_rows, self.dim = num_rows, dim
        self._rows = _Rows(num_rows, dim, optimizer, lr, init_std, seed)
        self._optimizer_kind, self._lr = optimizer, lr
        # Gives the lookup an input that requires grad, so autograd calls its backward.
        self._anchor = torch.zeros(0, requires_grad=True)
        # geo: this worker's copy of the rows it touched (in the order first touched),
        # the values pulled last, the local optimizer's state for them, and each table
        # row's position in the copy (-1: not held; 4 bytes a row, made on first use:
        # a lookup is then one gather, where a sorted index costs two binary searches)
        self._slot_of: Optional[torch.Tensor] = None
        self._cache_ids = torch.zeros(0, dtype=torch.int64)
        self._cache = torch.zeros(0, dim)
        self._base = torch.zeros(0, dim)
        self._local_opt = RowOptimizer(optimizer, lr, (0, dim))
        state.tables.append(self)

    @staticmethod
    def initial_weight(num_rows: int, dim: int, init_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """The values a table made with these arguments starts with (all rows)."""
        return server.initial_rows(0, num_rows, dim, init_std, seed)

    def extra_repr(self) -> str:
        return (f"{self.num_rows}, {self.dim}, optimizer={self._optimizer_kind!r}, lr={self._lr}, "
                f"servers={state.servers}")

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"EmbeddingTable expects a tensor of ids, got {type(ids).__name__}")
        if ids.dtype not in _INT_DTYPES:
            raise TypeError(f"EmbeddingTable ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_rows:
                bad = lo if lo < 0 else hi
                raise IndexError(f"EmbeddingTable id {bad} out of range: the table has "
                                 f"{self.num_rows} rows (ids must be in [0, {self.num_rows}))")
        return ids.to(torch.int64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _need_worker("EmbeddingTable lookup")
        ids = self._check_ids(ids)
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return _Lookup.apply(self._anchor, self, unique, inverse)

    # --- pulls and pushes -------------------------------------------------------------

    def _values(self, unique: torch.Tensor) -> torch.Tensor:
        if self._rows.mode != "geo":
            return self._rows.pull(unique)
        slots = self._slots(unique)
        return self._cache[slots]

    def _push_grad(self, unique: torch.Tensor, grad: torch.Tensor) -> None:
        if self._rows.mode != "geo":
            self._rows.push(unique, grad, "grad")
        else:  # train the local copy; its change goes out in flush()
            self._local_opt.apply(self._cache, self._slots(unique), grad)

    def _slots(self, unique: torch.Tensor) -> torch.Tensor:
        """geo: positions of ``unique`` in the local copy, pulling the rows it lacks."""
        if self._slot_of is None:
            self._slot_of = torch.full((self.num_rows,), -1, dtype=torch.int32)
        slots = self._slot_of[unique].long()
        missing = unique[slots < 0]  # sorted, as unique is
        if missing.numel():
            fresh = self._rows.pull(missing)
            held = self._cache_ids.numel()
            self._slot_of[missing] = torch.arange(held, held + missing.numel(), dtype=torch.int32)
            self._cache_ids = torch.cat([self._cache_ids, missing])
            self._cache = torch.cat([self._cache, fresh])
            self._base = torch.cat([self._base, fresh])
            self._local_opt.grow(missing.numel())
            slots = self._slot_of[unique].long()
        return slots

    def flush(self) -> None:
        """geo: push the local copy's change since the last pull (scaled by 1 / workers,
        so that all workers' changes average), then pull fresh values of its rows."""
        if self._rows.mode != "geo" or self._cache_ids.numel() == 0:
            return
        order = torch.argsort(self._cache_ids)  # pushes and pulls take sorted ids
        ids = self._cache_ids[order]
        delta = (self._cache[order] - self._base[order]) / state.workers
        changed = (delta != 0).any(dim=1)  # rows touched since the last pull
        self._rows.push(ids[changed], delta[changed], "delta")
        from .runtime import wait_pending
        wait_pending()  # our own change must be in what we pull next
        self._cache[order] = self._rows.pull(ids)
        self._base = self._cache.clone()

    def weight(self) -> torch.Tensor:
        """All rows as the servers hold them now (pulls the whole table: for checks
        and saving small tables). In geo mode, pushes this worker's change first."""
        _need_worker("EmbeddingTable.weight")
        if self._rows.mode == "geo":
            self.flush()
        from .runtime import wait_pending
        wait_pending()
        return self._rows.pull(torch.arange(self.num_rows))


class DenseOptimizer:
    """Steps the dense parameters of a worker's model, per the strategy's mode.

    ``optimizer`` ("sgd" or "adagrad") and ``lr`` as torch's ``SGD`` / ``Adagrad``. All
    workers must create it with the same parameter values (seed the model alike).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: str = "sgd", lr: float = 0.01):
        _need_worker("gt.ps.DenseOptimizer")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("gt.ps.DenseOptimizer got no parameters that require grad")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.mode = state.strategy.mode
        self.k_steps = state.strategy.k_steps
        self.workers = tuple(range(state.workers))  # global ranks of the workers
        local = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
        self.local = local(self.params, lr=lr)  # sync and geo step locally
        self.numel = sum(p.numel() for p in self.params)
        self.steps = 0
        self.flat: Optional[_Rows] = None
        if self.mode != "sync":
            # async / geo: the parameters, flattened and cut into rows of DENSE_ROW
            # values (zero-padded), as a table on the servers starting from these values.
            # Whole rows of a few hundred values keep the servers' index ops few.
            rows = -(-self.numel // DENSE_ROW)
            initial = self._as_rows(self._flat_values())
            self.flat = _Rows(rows, DENSE_ROW, optimizer, lr, 0.0, 0, initial=initial)
            self.all_ids = torch.arange(rows)
            self.base = initial.clone()
        state.optimizers.append(self)

    def _flat_values(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in self.params])

    def _as_rows(self, flat: torch.Tensor) -> torch.Tensor:
        rows = -(-self.numel // DENSE_ROW)
        return torch.nn.functional.pad(flat, (0, rows * DENSE_ROW - self.numel)).view(rows, DENSE_ROW)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in self.params])

    def _assign(self, flat: torch.Tensor) -> None:
        flat = flat.reshape(-1)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def step(self) -> None:
        """One training step's update (call once per step, after ``backward``)."""
        _need_worker("gt.ps.DenseOptimizer.step")
        self.steps += 1
        if self.mode == "sync":
            # Data parallelism among the workers: the mean gradient, then a local step.
            grad = self._flat_grad()
            if len(self.workers) > 1:
                comm.all_reduce_(grad, "sum", self.workers)
                grad /= len(self.workers)
            offset = 0
            for p in self.params:
                p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            self.local.step()
        elif self.mode == "async":
            assert self.flat is not None
            self.flat.push(self.all_ids, self._as_rows(self._flat_grad()), "grad")
            self._assign(self.flat.pull(self.all_ids))
        else:
            self.local.step()
            if self.steps % self.k_steps == 0:
                if state.optimizers[0] is self:  # the tables' exchange, once per step
                    for table in state.tables:
                        table.flush()
                self.flush()

    def flush(self) -> None:
        """geo: push the dense parameters' change since the last pull, pull fresh ones."""
        if self.mode != "geo":
            return
        assert self.flat is not None
        current = self._as_rows(self._flat_values())
        self.flat.push(self.all_ids, (current - self.base) / state.workers, "delta")
        from .runtime import wait_pending
        wait_pending()
        self.base = self.flat.pull(self.all_ids)
        self._assign(self.base)
