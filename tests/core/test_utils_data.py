"""globaltensor.utils.data: the sharding sampler (pure) and the global batch loader
(a world of 2 against a single-process torch DataLoader with the same seed)."""
import pytest
import torch
import torch.utils.data as tud
from mp import world_test

import globaltensor as gt
import globaltensor.utils.data  # noqa: F401  (until globaltensor/__init__ imports utils)
from globaltensor.utils.data import DistributedSampler, GlobalDataLoader

# --- the sampler, without processes ------------------------------------------------

def _shards(n, shards, **kw):
    return [list(DistributedSampler(n, num_shards=shards, shard_id=i, **kw))
            for i in range(shards)]


@pytest.mark.parametrize("n", [0, 1, 7, 12, 13])
@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_cover_the_dataset_with_equal_lengths(n, shards, shuffle):
    parts = _shards(n, shards, shuffle=shuffle, seed=4)
    length = -(-n // shards)
    assert [len(p) for p in parts] == [length] * shards
    assert [len(DistributedSampler(n, shards, i)) for i in range(shards)] == [length] * shards
    flat = sorted(i for p in parts for i in p)
    assert set(flat) == set(range(n))
    padding = shards * length - n
    assert len(flat) == n + padding and padding < shards
    if n:  # the padding repeats the start of the epoch's order (wrap-around)
        order = [parts[k % shards][k // shards] for k in range(shards * length)]
        assert order[n:] == order[:padding]
        assert sorted(order[:n]) == list(range(n))


@pytest.mark.parametrize("n,shards", [(13, 3), (12, 3), (5, 2), (2, 3)])
def test_drop_last_gives_disjoint_equal_shards(n, shards):
    parts = _shards(n, shards, shuffle=True, seed=1, drop_last=True)
    assert [len(p) for p in parts] == [n // shards] * shards
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat) == shards * (n // shards)


def test_shards_are_strided_slices_of_one_seeded_permutation():
    for epoch in (0, 1, 5):
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        for i in range(4):
            s = DistributedSampler(20, num_shards=4, shard_id=i, seed=7)
            s.set_epoch(epoch)
            assert list(s) == perm[i::4]
    assert list(DistributedSampler(10, 3, 2, shuffle=False)) == [2, 5, 8, 1]  # 0, 1 pad


def test_each_epoch_is_deterministic_and_different():
    a, b = DistributedSampler(50, 2, 0, seed=3), DistributedSampler(50, 2, 0, seed=3)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b) == list(a)  # the same on every rank, and re-iterable
        orders.append(list(a))
    assert orders[0] != orders[1] != orders[2]
    assert list(DistributedSampler(50, 2, 0, seed=4)) != orders[0]
    assert isinstance(a, tud.Sampler)


def test_defaults_come_from_the_world_or_the_placement(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    s = DistributedSampler(10)
    assert (s.num_shards, s.shard_id) == (4, 2)
    p = gt.placement("cpu", ranks=[3, 2])
    s = DistributedSampler(10, placement=p)
    assert (s.num_shards, s.shard_id) == (2, 1)
    assert (DistributedSampler(10, num_shards=3, placement=p).num_shards) == 3
    with pytest.raises(ValueError, match="outside"):
        DistributedSampler(10, placement=gt.placement("cpu", ranks=[0, 1]))
    assert DistributedSampler(10, num_shards=5, shard_id=0, placement=p).shard_id == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        DistributedSampler(10, num_shards=2, shard_id=2)
    with pytest.raises(ValueError):
        DistributedSampler(10, num_shards=0, shard_id=0)
    with pytest.raises(ValueError):
        DistributedSampler(-1, num_shards=1, shard_id=0)


# --- the loader, in a world of 2 ---------------------------------------------------

class Recording(tud.Dataset):
    """(x, y) rows with a log of which rows this process read."""

    def __init__(self, n, as_dict=False):
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 3, 2, generator=g), torch.arange(n) * 10
        self.as_dict, self.read = as_dict, []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.read.append(i)
        return {"x": self.x[i], "y": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def _reference(ds, batch_size, seed, drop_last, shuffle, epoch):
    """What a single-process torch DataLoader with the same seed yields."""
    sampler = DistributedSampler(len(ds), num_shards=1, shard_id=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(tud.DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last))


def _check(ds, batch_size, placement, sbp=gt.sbp.split(0), seed=0, drop_last=False,
           shuffle=True, epochs=2):
    rank = gt.get_rank()
    loader = GlobalDataLoader(ds, batch_size, placement, sbp=sbp, seed=seed,
                              drop_last=drop_last, shuffle=shuffle)
    for epoch in range(epochs):
        expected = _reference(Recording(len(ds)), batch_size, seed, drop_last, shuffle, epoch)
        ds.read.clear()
        got = list(loader)
        assert len(got) == len(loader) == len(expected)
        mine = []  # the rows this rank should have read
        for (x, y), (ex, ey) in zip(got, expected):
            assert isinstance(x, gt.GlobalTensor) and isinstance(y, gt.GlobalTensor)
            assert x.placement == placement and x.sbp == y.sbp == tuple(
                sbp if isinstance(sbp, tuple) else (sbp,) * placement.ndim)
            assert tuple(x.shape) == tuple(ex.shape) and x.dtype == ex.dtype
            torch.testing.assert_close(x.full(), ex, rtol=0, atol=0)
            torch.testing.assert_close(y.full(), ey, rtol=0, atol=0)
            if rank not in placement:
                assert x.to_local().numel() == 0 and y.to_local().numel() == 0
                continue
            if sbp == gt.sbp.split(0):
                n, i = placement.size, placement.flat_ranks.index(rank)
                start = i * (len(ey) // n) + min(i, len(ey) % n)
                count = len(ey) // n + (i < len(ey) % n)
            else:
                start, count = 0, len(ey)
            assert y.to_local().tolist() == ey[start:start + count].tolist()
            mine += (ey[start:start + count] // 10).tolist()
        # Only its own rows, in order; plus dataset[0] once (for the sample shapes) on a
        # rank that had a batch without rows.
        reads = list(ds.read)
        assert reads == mine or any(
            reads[:k] + reads[k + 1:] == mine and epoch == 0 for k in range(len(reads))
            if reads[k] == 0), (rank, reads, mine)


def check_uneven_batches_match_single_process():
    p = gt.placement.all("cpu")
    for n, batch_size in [(23, 5), (23, 7), (10, 3), (9, 4), (6, 6)]:
        for drop_last in (False, True):
            _check(Recording(n), batch_size, p, seed=batch_size, drop_last=drop_last)
    _check(Recording(11), 4, p, shuffle=False)


def check_batches_smaller_than_the_world():
    p = gt.placement.all("cpu")
    _check(Recording(5), 1, p, seed=1)  # rank 1 has no rows: zero-row parts


def check_reversed_subset_and_broadcast_placements():
    _check(Recording(13), 5, gt.placement("cpu", [1, 0]), seed=2)
    _check(Recording(13), 5, gt.placement("cpu", [1]), seed=3)  # rank 0 is outside
    _check(Recording(13), 5, gt.placement("cpu", [0, 1]), sbp=gt.sbp.broadcast, seed=4)
    _check(Recording(9), 4, gt.placement("cpu", [0]), seed=5)   # a single-device loader


def check_dict_samples_and_epochs():
    ds = Recording(10, as_dict=True)
    loader = GlobalDataLoader(ds, 4, gt.placement.all("cpu"), seed=9)
    first = [b["y"].full() for b in loader]
    second = [b["y"].full() for b in loader]  # the epoch advances by itself
    loader.set_epoch(0)
    again = [b["y"].full() for b in loader]
    assert all(isinstance(b, dict) and set(b) == {"x", "y"} for b in loader)
    assert [t.tolist() for t in first] == [t.tolist() for t in again]
    assert [t.tolist() for t in first] != [t.tolist() for t in second]
    ref = _reference(Recording(10), 4, 9, False, True, 1)
    assert [t.tolist() for t in second] == [y.tolist() for _, y in ref]


def check_loader_rejects_bad_layouts():
    p = gt.placement.all("cpu")
    ds = Recording(4)
    for sbp in (gt.sbp.split(1), gt.sbp.partial_sum, (gt.sbp.split(0), gt.sbp.split(0))):
        with pytest.raises(ValueError, match="split\\(0\\) or broadcast"):
            GlobalDataLoader(ds, 2, p, sbp=sbp)
    with pytest.raises(ValueError):
        GlobalDataLoader(ds, 0, p)


class Stream(tud.IterableDataset):
    """Samples (j, 10 * j) for j < n, in order; remembers which it yielded to this rank."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return ((torch.tensor([float(j)]), torch.tensor(10 * j)) for j in range(self.n))


def test_dataloader_options_are_forwarded():
    """Construction only (no communication): the inner DataLoader gets every option."""
    p = gt.placement("cpu", [0])
    g = torch.Generator().manual_seed(5)

    def init_fn(worker_id):
        pass

    for ds in (Recording(12), Stream(12)):
        loader = GlobalDataLoader(ds, 4, p, collate_fn=tud.default_collate, num_workers=2,
                                  persistent_workers=True, prefetch_factor=3, generator=g,
                                  worker_init_fn=init_fn, timeout=30, pin_memory=True)
        inner = loader._loader
        assert (inner.num_workers, inner.persistent_workers, inner.prefetch_factor) == (2, True, 3)
        assert inner.generator is g and inner.worker_init_fn is init_fn and inner.timeout == 30
        assert inner.pin_memory and inner.collate_fn.fn is tud.default_collate
    with pytest.raises(ValueError, match="prefetch_factor"):
        GlobalDataLoader(Recording(8), 4, p, prefetch_factor=2)  # torch's own check: no workers


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_stream_shard_with_dataloader_workers_keeps_stream_order(workers):
    """Rank part [3, 5) of each batch of 5 from a 23-sample stream, through DataLoader
    workers: disjoint from the other parts, in stream order."""
    from globaltensor.utils.data import _StreamShard

    got = [y.tolist() for _, y in tud.DataLoader(_StreamShard(Stream(23), 5, 3, 2), batch_size=2,
                                                 num_workers=workers)]
    assert got == [[10 * (5 * k + 3), 10 * (5 * k + 4)] for k in range(4)]
    kept = [v for batch in got for v in batch]
    assert kept == sorted(kept) and len(set(kept)) == len(kept)
    assert all((v // 10) % 5 in (3, 4) for v in kept)


def check_iterable_dataset_is_sharded_by_rank():
    rank = gt.get_rank()
    for workers in (0,):  # DataLoader workers: test_stream_shard_with_dataloader_workers_...
        for placement, sbp in [(gt.placement.all("cpu"), gt.sbp.split(0)),
                               (gt.placement("cpu", [1, 0]), gt.sbp.split(0)),
                               (gt.placement("cpu", [1]), gt.sbp.split(0)),
                               (gt.placement.all("cpu"), gt.sbp.broadcast)]:
            loader = GlobalDataLoader(Stream(23), 5, placement, sbp=sbp, num_workers=workers)
            batches = list(loader)
            assert len(batches) == 4  # 23 // 5: the incomplete last batch is dropped
            mine = []
            for k, (x, y) in enumerate(batches):
                assert tuple(x.shape) == (5, 1) and x.sbp == (sbp,)
                assert y.full().tolist() == [10 * j for j in range(5 * k, 5 * k + 5)]
                mine += y.to_local().tolist()
            if rank not in placement:
                assert mine == []
            elif sbp == gt.sbp.split(0):  # a disjoint part: this rank's rows only
                i = placement.flat_ranks.index(rank)
                n = placement.size
                start, count = i * (5 // n) + min(i, 5 % n), 5 // n + (i < 5 % n)
                assert mine == [10 * (5 * k + j) for k in range(4) for j in range(start, start + count)]
    small = list(GlobalDataLoader(Stream(5), 1, gt.placement.all("cpu")))  # rank 1: no rows
    assert [y.full().tolist() for _, y in small] == [[0], [10], [20], [30], [40]]
    with pytest.raises(ValueError, match="shuffle the stream"):
        GlobalDataLoader(Stream(4), 2, gt.placement.all("cpu"), shuffle=True)
    with pytest.raises(TypeError, match="no length"):
        len(GlobalDataLoader(Stream(4), 2, gt.placement.all("cpu")))


CHECKS = ["check_iterable_dataset_is_sharded_by_rank",
          "check_uneven_batches_match_single_process", "check_batches_smaller_than_the_world",
          "check_reversed_subset_and_broadcast_placements", "check_dict_samples_and_epochs",
          "check_loader_rejects_bad_layouts"]


test_world2 = world_test(__name__, 2, CHECKS)
