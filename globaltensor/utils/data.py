"""Data-parallel loading: a sharding sampler and a loader of global batches.

``DistributedSampler`` gives each shard (rank) a disjoint, equal-length part of a
dataset's indices, reshuffled per epoch the same way on every rank (MindSpore /
``torch.utils.data.DistributedSampler`` semantics). ``GlobalDataLoader`` yields whole
global batches as GlobalTensors laid out ``split(0)``: every rank reads only its own
rows, and ``batch.full()`` equals what a single-process loader with the same seed gives.
It also takes an ``IterableDataset`` (a stream): global batch ``k`` is stream samples
``k*batch_size ... (k+1)*batch_size - 1``, and each rank keeps only the positions of its
part of each batch (see ``_StreamShard``).

>>> import torch, globaltensor as gt
>>> from globaltensor.utils.data import GlobalDataLoader
>>> ds = torch.utils.data.TensorDataset(torch.randn(100, 8), torch.randint(0, 3, (100,)))
>>> loader = GlobalDataLoader(ds, batch_size=32, placement=gt.placement.all("cpu"))
>>> len(loader)                                 # global batches per epoch: 32, 32, 32, 4
4
>>> x, y = next(iter(loader))                   # x.shape == (32, 8), x.sbp == (split(dim=0),)
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.data as tud

from .. import comm, env
from .. import sbp as sbp_
from ..factory import from_local
from ..layout import Layout
from ..placement import Placement, check_placement

__all__ = ["DistributedSampler", "GlobalDataLoader"]


class DistributedSampler(tud.distributed.DistributedSampler):
    """Indices ``0..dataset_len-1`` of shard ``shard_id`` out of ``num_shards``.

    Each epoch's order is one permutation (``randperm`` seeded with ``seed + epoch``,
    identical on every rank; ``arange`` without ``shuffle``), padded by wrap-around to a
    multiple of ``num_shards`` (or cut to one with ``drop_last``); shard ``i`` takes
    every ``num_shards``-th index from position ``i``. So shards are disjoint (apart from
    the padding), cover the dataset, and all have ``len(sampler)`` indices.
    ``num_shards`` defaults to the size of ``placement`` (or of the world), ``shard_id``
    to this rank's index in it. Call ``set_epoch(e)`` before each epoch to reshuffle.

    >>> s = DistributedSampler(10, num_shards=3, shard_id=1, shuffle=False)
    >>> list(s), len(s)                          # 10 indices padded to 12 with 0, 1
    ([1, 4, 7, 0], 4)
    >>> s.set_epoch(3)                           # with shuffle=True: another permutation
    """

    def __init__(self, dataset_len: int, num_shards: Optional[int] = None,
                 shard_id: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, placement: Optional[Placement] = None):
        if num_shards is None or shard_id is None:
            ranks = placement.flat_ranks if placement is not None else range(
                env.get_world_size())
            rank = env.get_rank()
            if num_shards is None:
                num_shards = len(ranks)
            if shard_id is None:
                if rank not in ranks:
                    raise ValueError(f"rank {rank} is outside {placement}: pass shard_id")
                shard_id = list(ranks).index(rank)
        if int(dataset_len) < 0 or int(num_shards) < 1:
            raise ValueError(f"need dataset_len >= 0 and num_shards >= 1, got "
                             f"{dataset_len} and {num_shards}")
        super().__init__(range(int(dataset_len)), num_replicas=int(num_shards),
                         rank=int(shard_id), shuffle=shuffle, seed=seed, drop_last=drop_last)

    @property
    def num_shards(self) -> int:
        return self.num_replicas

    @property
    def shard_id(self) -> int:
        return self.rank


class _Collate:
    """``collate_fn`` that lets a rank with no rows in a batch get ``None``."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, samples: list):
        return self.fn(samples) if samples else None


class _LocalRows(tud.Sampler):
    """For each global batch of indices, the slice this rank holds under ``sbp``."""

    def __init__(self, batches: tud.BatchSampler, placement: Placement, sbp, rank: int):
        self.batches, self.placement, self.sbp, self.rank = batches, placement, sbp, rank

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list]:
        for indices in self.batches:
            region = Layout.make((len(indices),), self.placement, self.sbp).region(self.rank)
            if region is None:  # outside the placement: load nothing
                yield []
            else:
                (start,), (size,) = region.offsets, region.sizes
                yield indices[start:start + size]


class _StreamShard(tud.IterableDataset):
    """This rank's samples of a stream cut into global batches of ``batch_size``.

    Position ``j`` of the stream belongs to global batch ``j // batch_size``; the rank
    keeps it when ``j % batch_size`` falls in its part ``[start, start + count)`` (the
    balanced split, as for map-style datasets). DataLoader worker ``w`` of ``W`` keeps only
    batches ``w, w + W, ...``; the DataLoader takes batches from its workers in turn, so
    the rank's batches arrive in stream order. The dataset yields the whole stream (it
    must not shard itself by worker); a rank skips other ranks' samples by iterating past
    them, so make expensive per-sample work lazy or cheap to skip.
    """

    def __init__(self, dataset: tud.IterableDataset, batch_size: int, start: int, count: int):
        self.dataset, self.batch_size, self.start, self.count = dataset, batch_size, start, count

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for j, sample in enumerate(self.dataset):
            batch, offset = divmod(j, self.batch_size)
            if batch % workers == worker and self.start <= offset < self.start + self.count:
                yield sample


class GlobalDataLoader:
    """Iterate a ``dataset`` in global batches of ``batch_size`` rows.

    Each batch comes as the collated structure of ``collate_fn`` (default
    ``torch.utils.data.default_collate``) with every tensor a GlobalTensor on
    ``placement`` with ``sbp`` (default ``split(0)``; a tuple for an n-D placement, each
    entry ``split(0)`` or ``broadcast``): a tuple for datasets of tuples (e.g.
    ``TensorDataset``), a dict for dicts, one GlobalTensor for a bare tensor.

    Map-style datasets: the order is ``DistributedSampler(len(dataset), num_shards=1,
    shard_id=0, shuffle=shuffle, seed=seed)`` (``shuffle`` defaults to True) cut into
    batches like ``torch.utils.data.DataLoader`` (the last batch is smaller unless
    ``drop_last``). Under ``split(0)`` a rank reads only its part of each batch: the
    balanced split, the first ``batch_size % n`` ranks get one extra row. A rank outside
    ``placement`` reads nothing. Ranks that have no rows (and those outside) read
    ``dataset[0]`` once, to learn the per-sample shapes; samples must all have the same
    shapes. Each ``iter()`` uses the current epoch and then advances it; ``set_epoch(e)``
    chooses the epoch of the next pass.

    ``IterableDataset`` (a stream, the same on every rank): global batch ``k`` holds
    stream samples ``k*batch_size ...``, each rank keeping its part (``_StreamShard``),
    so ``batch.full()`` is the stream's order, also with DataLoader workers. A final
    incomplete batch is dropped (its parts would not be the balanced split); the ranks
    agree on the end with one 1-element all-reduce per batch. Shuffle the stream in the
    dataset itself (``shuffle=True`` is refused).

    ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
    ``worker_init_fn``, ``generator``, ``timeout`` and ``multiprocessing_context`` go to
    the ``torch.utils.data.DataLoader`` that fetches this rank's rows.

    >>> loader = GlobalDataLoader(ds, batch_size=5, placement=gt.placement("cpu", [0, 1]),
    ...                           shuffle=True, seed=0, num_workers=2)  # doctest: +SKIP
    >>> for x, y in loader:                 # rank 0 reads 3 rows of x, rank 1 reads 2
    ...     loss = F.cross_entropy(model(x), y)                  # doctest: +SKIP
    """

    def __init__(self, dataset: Any, batch_size: int, placement: Placement,
                 sbp: Any = sbp_.split(0), shuffle: Optional[bool] = None, seed: int = 0,
                 drop_last: bool = False, collate_fn: Optional[Callable] = None,
                 num_workers: int = 0, *, pin_memory: bool = False,
                 persistent_workers: bool = False, prefetch_factor: Optional[int] = None,
                 worker_init_fn: Optional[Callable[[int], None]] = None,
                 generator: Optional[torch.Generator] = None, timeout: float = 0,
                 multiprocessing_context: Any = None):
        check_placement(placement)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        nd = tuple(sbp) if isinstance(sbp, (tuple, list)) else (sbp,) * placement.ndim
        if len(nd) != placement.ndim or not all(
                isinstance(s, sbp_.Broadcast) or (isinstance(s, sbp_.Split) and s.dim == 0)
                for s in nd):
            raise ValueError(f"GlobalDataLoader lays out batches by rows: sbp must be "
                             f"split(0) or broadcast per placement axis, got {sbp!r}")
        self.stream = isinstance(dataset, tud.IterableDataset)
        if self.stream and shuffle:
            raise ValueError("an IterableDataset is read in its own order: shuffle the stream "
                             "in the dataset, not with shuffle=True")
        self.dataset, self.batch_size, self.drop_last = dataset, int(batch_size), drop_last
        self.placement, self.sbp, self.epoch = placement, nd, 0
        self.collate_fn = collate_fn or tud.default_collate
        options = dict(num_workers=num_workers, collate_fn=_Collate(self.collate_fn),
                       pin_memory=pin_memory, persistent_workers=persistent_workers,
                       worker_init_fn=worker_init_fn, generator=generator, timeout=timeout,
                       multiprocessing_context=multiprocessing_context)
        if prefetch_factor is not None:  # DataLoader refuses any value without workers
            options["prefetch_factor"] = prefetch_factor
        self._template = None
        if self.stream:
            region = Layout.make((self.batch_size,), placement, nd).region(env.get_rank())
            (self._start,), (self._count,) = ((region.offsets, region.sizes) if region is not None
                                               else ((0,), (0,)))
            self._loader = tud.DataLoader(
                _StreamShard(dataset, self.batch_size, self._start, self._count),
                batch_size=self._count, **options) if self._count else None
            return
        self.sampler = DistributedSampler(len(dataset), num_shards=1, shard_id=0,
                                          shuffle=True if shuffle is None else shuffle, seed=seed)
        self.batch_sampler = tud.BatchSampler(self.sampler, self.batch_size, drop_last)
        rows = _LocalRows(self.batch_sampler, placement, nd, env.get_rank())
        self._loader = tud.DataLoader(dataset, batch_sampler=rows, **options)

    def __len__(self) -> int:
        """Number of global batches per epoch (map-style datasets)."""
        if self.stream:
            raise TypeError("a GlobalDataLoader over an IterableDataset has no length")
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` (so the permutation seeded with ``seed + epoch``) next pass."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.stream:
            yield from self._iter_stream()
            return
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        n = len(self.dataset)
        for k, local in enumerate(self._loader):
            rows = min(self.batch_size, n - k * self.batch_size)
            if local is None:  # no rows here: zero-row parts of the right shapes
                local = self._empty()
            yield self._wrap(local, rows)

    def _iter_stream(self) -> Iterator[Any]:
        world = tuple(range(env.get_world_size()))
        parts = iter(self._loader) if self._loader is not None else itertools.repeat(None)
        while True:
            local = next(parts, None)
            short = self._count > 0 and (local is None or _rows(local) < self._count)
            ended = torch.tensor([1.0 if short else 0.0])
            comm.all_reduce_(ended, "max", world)  # every rank stops at the same batch
            if ended.item():
                return
            yield self._wrap(self._empty() if local is None else local, self.batch_size)

    def _wrap(self, local, rows: int):
        return _map(local, lambda t: from_local(
            t, placement=self.placement, sbp=self.sbp, shape=(rows, *t.shape[1:])))

    def _empty(self):
        """Zero-row tensors with the per-sample shapes and dtypes of the first sample."""
        if self._template is None:
            first = next(iter(self.dataset)) if self.stream else self.dataset[0]
            one = self.collate_fn([first])
            self._template = _map(one, lambda t: t.new_empty((0, *t.shape[1:])))
        return self._template


def _rows(batch) -> int:
    """Rows of a collated batch (the first tensor's length)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    return _rows(next(iter(values)))


def _map(batch, fn: Callable[[torch.Tensor], Any]):
    """Apply ``fn`` to every tensor of a collated batch; lists become tuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(_map(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: _map(v, fn) for k, v in batch.items()}
    raise TypeError(f"GlobalDataLoader batches may hold tensors, tuples, lists and dicts, "
                    f"got {type(batch).__name__}")
