"""Real boxing on gloo (worlds of 2 and 4) against the simulator, through the public API."""
import itertools
import zlib

import pytest
import torch
from boxing_cases import random_locals, reference_locals
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.boxing import plan_route, simulate
from globaltensor.layout import Layout
from globaltensor.testing import boxing_log

SBPS = [gt.sbp.broadcast, gt.sbp.partial_sum, gt.sbp.partial_max, gt.sbp.split(0),
        gt.sbp.split(1)]


def _check_pair(shape, p, q, src_sbp, dst_sbp, seed):
    """Box a known value from (p, src) to (q, dst) and compare this rank's local with
    the simulator's, and (for non-partial destinations) with the exact slice."""
    rank = gt.get_rank()
    src, dst = Layout.make(shape, p, src_sbp), Layout.make(shape, q, dst_sbp)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    locals_ = random_locals(value, src, gen)
    mine = locals_.get(rank, torch.empty(0, dtype=torch.float64))
    x = gt.from_local(mine, placement=p, sbp=src_sbp, shape=shape)
    y = x.to_global(placement=q, sbp=dst_sbp)
    assert y.placement == q and y.sbp == dst.sbp and tuple(y.shape) == shape
    got = y.to_local()
    if rank not in q:
        assert got.numel() == 0, f"rank {rank} is outside {q} but holds {got.shape}"
        return
    expected = simulate(plan_route(src, dst, 8), locals_)[rank]
    where = f"{src_sbp} on {p} -> {dst_sbp} on {q}, shape {shape}, rank {rank}"
    assert tuple(got.shape) == dst.local_shape(rank), where
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=where)
    if not dst.partial_axes:
        torch.testing.assert_close(got, reference_locals(value, dst)[rank], msg=where)
    if rank in p:  # the source is untouched by boxing
        torch.testing.assert_close(x.to_local(), mine, msg=where + " (source changed)")


def check_every_pair_1d():
    n = gt.get_world_size()
    ranks = list(range(n))
    # Both member orders with both shapes on 2 ranks; on 4 (oversubscribed, slow) the
    # uneven shape in member order and the one-row shape in reversed order.
    for k, p in enumerate((gt.placement("cpu", ranks), gt.placement("cpu", ranks[::-1]))):
        for j, shape in enumerate(((2 * n + 1, 3), (1, n - 1))):
            if n > 2 and j != k:
                continue
            for a, b in itertools.product(SBPS, SBPS):
                _check_pair(shape, p, p, a, b, seed=zlib.crc32(f"{shape}{a}{b}".encode()))


def check_every_pair_2d():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    q = gt.placement("cpu", [[3, 1], [0, 2]])
    pairs = list(itertools.product(itertools.product(SBPS, SBPS), repeat=2))
    for i, (a, b) in enumerate(pairs):
        shape = (5, 3) if i % 2 else (3, 2)
        _check_pair(shape, p if i % 3 else q, p if i % 3 else q, a, b, seed=i)


def check_cross_placements():
    n = gt.get_world_size()
    everyone = gt.placement("cpu", list(range(n)))
    firsts = gt.placement("cpu", list(range(n // 2)))
    lasts = gt.placement("cpu", list(range(n // 2, n)))
    one = gt.placement("cpu", [n - 1])
    placements = [everyone, firsts, lasts, one]
    if n == 4:
        placements += [gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [1, 2, 3])]
    i = 0
    for p, q in itertools.product(placements, placements):
        if p == q:
            continue
        for a, b in [(gt.sbp.split(0), gt.sbp.split(1)), (gt.sbp.partial_sum, gt.sbp.split(0)),
                     (gt.sbp.broadcast, gt.sbp.partial_max), (gt.sbp.split(1), gt.sbp.broadcast),
                     (gt.sbp.partial_max, gt.sbp.partial_sum)]:
            a = (a,) * p.ndim
            b = (b,) * q.ndim
            i += 1
            _check_pair((5, 3), p, q, a, b, seed=i)


def check_full_and_numpy_everywhere():
    n = gt.get_world_size()
    value = torch.arange(15.0).reshape(5, 3)
    for p in (gt.placement("cpu", list(range(n))), gt.placement("cpu", [n - 1])):
        for s in (gt.sbp.split(0), gt.sbp.split(1), gt.sbp.broadcast, gt.sbp.partial_sum):
            x = gt.tensor(value, placement=p, sbp=s)
            torch.testing.assert_close(x.full(), value)
            assert (x.numpy() == value.numpy()).all()


def check_gradients_go_back_to_the_source():
    n = gt.get_world_size()
    p = gt.placement("cpu", list(range(n)))
    q = gt.placement("cpu", [0]) if n == 2 else gt.placement("cpu", [[0, 1], [2, 3]])
    w = torch.arange(12.0).reshape(4, 3)
    for src in (gt.sbp.split(0), gt.sbp.broadcast, gt.sbp.split(1)):
        x = gt.tensor(torch.ones(4, 3), placement=p, sbp=src, requires_grad=True)
        for dst in (gt.sbp.broadcast, gt.sbp.split(1), gt.sbp.partial_sum):
            x.grad = None
            y = x.to_global(placement=q, sbp=(dst,) * q.ndim)
            loss = (y.full() * w).sum()
            loss.backward()
            assert x.grad.placement == p and x.grad.sbp == (src,)
            torch.testing.assert_close(x.grad.full(), w, msg=f"{src} -> {dst}")


def check_from_local_derives_uneven_shapes():
    rank, n = gt.get_rank(), gt.get_world_size()
    p = gt.placement("cpu", list(range(n)))
    sizes = [len(range(7))//n + (1 if r < 7 % n else 0) for r in range(n)]
    x = gt.from_local(torch.full((sizes[rank], 2), float(rank)), placement=p, sbp=gt.sbp.split(0))
    assert tuple(x.shape) == (7, 2)
    expected = torch.cat([torch.full((s, 2), float(r)) for r, s in enumerate(sizes)])
    torch.testing.assert_close(x.full(), expected)
    with pytest.raises(ValueError, match="do not fit"):
        bad = 3 if rank == 0 else 1  # 3 + 1 (+1 +1) does not split in balance
        gt.from_local(torch.zeros(bad, 2), placement=p, sbp=gt.sbp.split(0))
    with pytest.raises(ValueError, match=r"rank \d: local tensor of shape \(5, 2\), expected"):
        gt.from_local(torch.zeros(5, 2), placement=p, sbp=gt.sbp.split(0), shape=(7, 2))
    # with a given shape, a part that does not fit on one rank raises on every rank (the
    # others would go on to collectives of other sizes), and so do shapes that differ
    parts = [len(range(r, 7, n)) for r in range(n)]
    mine = torch.zeros(parts[rank] + (rank == 0), 2)
    with pytest.raises(ValueError, match=r"the local tensors of ranks \[0\] do not fit"):
        gt.from_local(mine, placement=p, sbp=gt.sbp.split(0), shape=(7, 2))
    claim = (7 + (rank == n - 1), 2)
    part = torch.zeros(len(range(rank, claim[0], n)), 2)
    with pytest.raises(gt.debug.DivergenceError, match="passed different ones"):
        gt.from_local(part, placement=p, sbp=gt.sbp.split(0), shape=claim)
    ok = gt.from_local(torch.zeros(parts[rank], 2), placement=p, sbp=gt.sbp.split(0), shape=(7, 2))
    assert tuple(ok.shape) == (7, 2)


def check_random_factories_are_placement_invariant():
    n = gt.get_world_size()
    layouts = [(gt.placement("cpu", list(range(n))), gt.sbp.split(0)),
               (gt.placement("cpu", list(range(n))[::-1]), gt.sbp.split(1)),
               (gt.placement("cpu", [0]), gt.sbp.broadcast),
               (gt.placement("cpu", list(range(n))), gt.sbp.partial_sum)]
    for factory in (gt.randn, gt.rand):
        values = []
        for p, s in layouts:
            gt.manual_seed(123)
            values.append(factory(5, 3, placement=p, sbp=s).full())
        gt.manual_seed(123)   # reproducible after gt.manual_seed, the same for every layout
        reference = factory(5, 3, placement=gt.placement("cpu", [0]), sbp=gt.sbp.broadcast).full()
        for v in values:
            assert torch.equal(v, reference)


def check_bad_input_raises_before_communicating():
    p = gt.placement("cpu", [0, 1])
    x = gt.zeros(4, 2, placement=p, sbp=gt.sbp.split(0))
    with pytest.raises(ValueError, match="out of range"):
        x.to_global(sbp=gt.sbp.split(2))
    with pytest.raises(ValueError, match="placement"):
        x.to_global(sbp=(gt.sbp.split(0), gt.sbp.broadcast))
    with pytest.raises(ValueError):
        gt.placement("cpu", [0, gt.get_world_size()])
    y = gt.zeros(4, 2, placement=gt.placement("cpu", [1, 0]), sbp=gt.sbp.split(0))
    with pytest.raises(ValueError, match="different placements"):
        x + y


def check_bystanders_need_not_take_part():
    # A point-to-point route involves only the ranks that hold or receive data: a rank
    # in neither placement may skip the call without anyone waiting for it.
    rank, n = gt.get_rank(), gt.get_world_size()
    src, dst = gt.placement("cpu", [0, 1]), gt.placement("cpu", [1, 2] if n > 2 else [1])
    value = torch.arange(12.0).reshape(4, 3)
    x = gt.tensor(value, placement=src, sbp=gt.sbp.split(0))
    if rank in src or rank in dst:
        y = x.to_global(placement=dst, sbp=gt.sbp.broadcast)
        if rank in dst:
            torch.testing.assert_close(y.to_local(), value)


def check_debug_tools():
    import os
    rank, n = gt.get_rank(), gt.get_world_size()
    src_p, dst_p = gt.placement("cpu", [0, 1]), gt.placement("cpu", list(range(1, n)))
    x = gt.tensor(torch.arange(16.0).reshape(8, 2), placement=src_p, sbp=gt.sbp.split(0))
    plan = gt.debug.explain(x, dst_p, gt.sbp.split(0))
    text = str(plan)
    assert "Transfer" in text and "general (p2p)" in text and "estimated" in text, text
    assert "AllGather" in str(gt.debug.explain(x, sbp=gt.sbp.broadcast))
    with gt.debug.comm_stats() as stats:
        y = x.to_global(placement=dst_p, sbp=gt.sbp.split(0))
    torch.testing.assert_close(y.full(), torch.arange(16.0).reshape(8, 2))
    # Bytes the route must move: rows each destination needs and does not hold itself.
    src = Layout.make((8, 2), src_p, gt.sbp.split(0))
    dst = Layout.make((8, 2), dst_p, gt.sbp.split(0))
    def rows(layout, r):
        region = layout.region(r)
        return set() if region is None else set(range(region.offsets[0],
                                                      region.offsets[0] + region.sizes[0]))
    needed = sum(len(rows(dst, r) - rows(src, r)) for r in range(n)) * 2 * 4
    sent = sum(v[0] for v in gt.comm.all_gather_ints([stats.bytes["send"]]))
    assert sent == needed, (sent, needed)
    assert stats.total_calls == stats.calls["send"]  # no collective on this route
    layout_text = gt.debug.show_layout(y, file=open(os.devnull, "w"))
    assert f"rank {n - 1}" in layout_text and "shape" in layout_text
    with boxing_log() as logged:  # GLOBALTENSOR_DEBUG=1 at start does the same
        x.to_global(sbp=gt.sbp.broadcast)
    if rank in src_p:
        assert any("AllGather" in m for m in logged), logged


CHECKS = ["check_every_pair_1d", "check_full_and_numpy_everywhere",
          "check_gradients_go_back_to_the_source", "check_from_local_derives_uneven_shapes",
          "check_random_factories_are_placement_invariant", "check_cross_placements",
          "check_bad_input_raises_before_communicating", "check_debug_tools",
          "check_bystanders_need_not_take_part"]


test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, ["check_every_pair_2d"])
