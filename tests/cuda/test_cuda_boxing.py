"""Boxing on cuda placements (tests/boxing/test_boxing.py's matrix on GPUs): every
same-placement sbp pair on 2 ranks (both member orders, uneven and tiny shapes) and on
a 2x2 placement (4 ranks), the moves between placements ([0] -> [0, 1], [0, 1] -> [1],
[1] -> [0]) and between cpu and cuda placements. Each rank's part must equal the
one-process result (the simulator's, and the exact slice of the value for non-partial
layouts) and live on the rank's device; the gradient through ``to_global`` must come
back to the source layout (broadcast on the source's partial axes), on the source's
device, with the value of the loss's gradient."""
from __future__ import annotations

import itertools
import zlib

import torch
from boxing.boxing_cases import random_locals, reference_locals
from cuda_suite import local_device, place, world_checks

import globaltensor as gt
from globaltensor.boxing import plan_route, simulate
from globaltensor.layout import Layout

S, B, PS = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
SBPS = [S(0), S(1), B, PS]


def _box(shape, p, q, src_sbp, dst_sbp, seed, grad=True):
    """Box a known float32 value from (p, src) to (q, dst): this rank's part against the
    one-process result, then the gradient of ``(y.full() * w).sum()`` against ``w``."""
    rank = gt.get_rank()
    src, dst = Layout.make(shape, p, src_sbp), Layout.make(shape, q, dst_sbp)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=gen)
    locals_ = random_locals(value, src, gen)   # random addends on partial axes
    where = f"{src_sbp} on {p} -> {dst_sbp} on {q}, shape {shape}, rank {rank}"
    mine = locals_.get(rank, torch.empty((0,) * len(shape)))
    x = gt.from_local(mine.to(local_device(p.type)), placement=p, sbp=src_sbp, shape=shape)
    x.requires_grad_(grad)
    y = x.to_global(placement=q, sbp=dst_sbp)
    assert y.placement == q and y.sbp == dst.sbp and tuple(y.shape) == shape, where
    got = y.to_local()
    if rank in q:
        assert got.device == local_device(q.type), (where, got.device)
        expected = simulate(plan_route(src, dst, 4), locals_)[rank]
        assert tuple(got.shape) == dst.local_shape(rank), where
        torch.testing.assert_close(got.detach().cpu(), expected, msg=lambda m: f"{where}: {m}")
        if not dst.partial_axes:
            torch.testing.assert_close(got.detach().cpu(), reference_locals(value, dst)[rank],
                                       msg=lambda m: f"{where}: {m}")
    else:
        assert got.numel() == 0, f"rank {rank} is outside {q} but holds {got.shape}"
    whole = y.full()                     # on every rank of the world
    torch.testing.assert_close(whole.detach().cpu(), value, msg=lambda m: f"{where}: {m}")
    if not grad:
        return
    w = torch.arange(value.numel(), dtype=torch.float32).reshape(shape) / 7 - 1
    (whole * w.to(whole.device)).sum().backward()
    g = x.grad
    assert g is not None and g.placement == p and tuple(g.shape) == shape, where
    # the source's layout; a partial axis's gradient is broadcast (each addend's)
    assert g.sbp == tuple(B if s == PS else s for s in x.sbp), (where, g.sbp)
    if rank in p:
        assert g.to_local().device == local_device(p.type), (where, g.to_local().device)
    torch.testing.assert_close(g.full().cpu(), w, msg=lambda m: f"{where} (gradient): {m}")


def check_every_sbp_pair_on_one_placement():
    # 2 ranks: both member orders; an uneven shape, and one smaller than the rank count
    n = gt.get_world_size()
    for k, p in enumerate((place(list(range(n))), place(list(range(n))[::-1]))):
        for shape in ((2 * n + 1, 3), (1, n - 1) if k == 0 else (3, 2)):
            for a, b in itertools.product(SBPS, SBPS):
                _box(shape, p, p, a, b, seed=zlib.crc32(f"{shape}{a}{b}{k}".encode()))


def check_every_sbp_pair_on_a_2d_placement():
    # 4 ranks, 2x2: 16 layouts to 16; the gradient of every third pair (and every
    # pair from or to a 2-D split, the blocks)
    p = place([[0, 1], [2, 3]])
    layouts = list(itertools.product(SBPS, SBPS))
    for i, (a, b) in enumerate(itertools.product(layouts, layouts)):
        shape = (5, 3) if i % 2 else (4, 6)
        blocks = (S(0), S(1)) in (a, b)
        _box(shape, p, p, a, b, seed=i, grad=blocks or i % 3 == 0)


def check_moves_between_placements():
    # [0] -> [0, 1] (one to many), [0, 1] -> [1] (many to one), [1] -> [0] (disjoint),
    # [0, 1] -> [1, 0] (the order of the members)
    moves = [([0], [0, 1]), ([0, 1], [1]), ([1], [0]), ([0, 1], [1, 0])]
    for i, (src, dst) in enumerate(moves):
        for a, b in itertools.product(SBPS, SBPS):
            _box((5, 3), place(src), place(dst), a, b, seed=zlib.crc32(f"{i}{a}{b}".encode()))


def check_moves_between_cpu_and_cuda_placements():
    # cpu <-> cuda on the same ranks, and across ranks both ways
    cpu = lambda r: place(r, "cpu")           # noqa: E731
    cuda = lambda r: place(r, "cuda")         # noqa: E731
    moves = [(cpu([0, 1]), cuda([0, 1])), (cuda([0, 1]), cpu([0, 1])),
             (cpu([0]), cuda([1])), (cuda([0, 1]), cpu([1])), (cuda([1, 0]), cpu([0, 1]))]
    for i, (p, q) in enumerate(moves):
        for a, b in itertools.product(SBPS, SBPS):
            _box((5, 3), p, q, a, b, seed=zlib.crc32(f"cpu-cuda{i}{a}{b}".encode()))


def check_factories_and_parts_live_on_the_ranks_device():
    # gt.randn's part is made on the rank's device, equals the same draw elsewhere,
    # and plain values given to gt.tensor land on it too
    p = place([0, 1])
    gt.manual_seed(5)
    x = gt.randn(6, 4, placement=p, sbp=S(0))
    assert x.to_local().device == local_device(), x.to_local().device
    gt.manual_seed(5)
    ref = gt.randn(6, 4, placement=place([0], "cpu"), sbp=B).full()
    torch.testing.assert_close(x.full().cpu(), ref)
    t = gt.tensor(torch.arange(6.0), placement=p, sbp=S(0))
    assert t.to_local().device == local_device()
    assert (t * 2).sum().item() == 30.0


test_boxing_world2 = world_checks(
    __name__, 2, ["check_factories_and_parts_live_on_the_ranks_device",
                  "check_every_sbp_pair_on_one_placement", "check_moves_between_placements"],
    cuda_only=["check_moves_between_cpu_and_cuda_placements"])
test_boxing_world4 = world_checks(__name__, 4, ["check_every_sbp_pair_on_a_2d_placement"])
