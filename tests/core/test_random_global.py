"""Random ops on global tensors in worlds of 2 and 4: the value of every random factory,
in-place op, ``nn.init`` function and dropout is the generator's function of (seed, draw,
global index), whatever the placement, sbp and world size; every rank takes every draw
(ranks outside the placement too); each rank generates only its part (peak resident
memory measured against the part)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.layout import Region
from globaltensor.random import sample
from globaltensor.testing import peak_rise

B, P, PM, S = gt.sbp.broadcast, gt.sbp.partial_sum, gt.sbp.partial_max, gt.sbp.split


def _layouts():
    """(placement, sbp) pairs of this world: 1-D, reversed, one rank, sub-placement,
    partials, and a 2x2 mesh in the world of 4."""
    n = gt.get_world_size()
    every, rev = gt.placement("cpu", list(range(n))), gt.placement("cpu", list(range(n))[::-1])
    out = [(every, S(0)), (rev, S(1)), (gt.placement("cpu", [n - 1]), B), (every, B),
           (every, P), (every, PM), (gt.placement("cpu", [1]), S(0))]
    if n == 4:
        mesh = gt.placement("cpu", [[0, 1], [2, 3]])
        out += [(mesh, (S(0), S(1))), (mesh, (S(1), S(1))), (mesh, (B, S(0))), (mesh, (P, S(1))),
                (gt.placement("cpu", [1, 2]), S(1))]
    return out


def _whole(shape):
    return Region((0,) * len(shape), tuple(shape))


def _same_on_every_rank(t: torch.Tensor, where: str):
    parts = [None] * gt.get_world_size()
    dist.all_gather_object(parts, t)
    assert all(torch.equal(parts[0], q) for q in parts[1:]), f"{where}: ranks differ"


FACTORIES = [
    ("randn", lambda **k: gt.randn(7, 5, **k), "normal", torch.float32, {}),
    ("rand", lambda **k: gt.rand(7, 5, dtype=torch.float64, **k), "uniform", torch.float64, {}),
    ("randint", lambda **k: gt.randint(-3, 9, (7, 5), **k), "integers", torch.int64,
     {"low": -3, "high": 9}),
    ("normal", lambda **k: gt.normal(2.0, 0.5, (7, 5), **k), "normal", torch.float32,
     {"mean": 2.0, "std": 0.5}),
]


def check_factories_are_the_generators_function():
    for name, make, kind, dtype, params in FACTORIES:
        expected = sample(kind, (7, 5), _whole((7, 5)), (123, 1), dtype, **params)
        for p, s in _layouts():
            gt.manual_seed(123)
            x = make(placement=p, sbp=s)
            assert x.dtype == dtype and tuple(x.shape) == (7, 5), name
            got = x.full()
            assert torch.equal(got, expected), f"{name} on {p.ranks} {s}"


def check_reproducible_and_draws_differ():
    p = gt.placement.all("cpu")
    gt.manual_seed(5)
    a, b = gt.randn(6, 4, placement=p, sbp=S(0)).full(), gt.randn(6, 4, placement=p, sbp=S(0)).full()
    gt.manual_seed(5)
    assert torch.equal(gt.randn(6, 4, placement=p, sbp=S(1)).full(), a)
    assert not torch.equal(a, b)
    gt.manual_seed(6)
    assert not torch.equal(gt.randn(6, 4, placement=p, sbp=S(0)).full(), a)


def check_every_rank_takes_every_draw():
    """The issue's case: dropout on a sub-placement, then random ops on every rank: a
    broadcast result is equal everywhere, and a later draw does not depend on where an
    earlier one was placed."""
    n = gt.get_world_size()
    sub = gt.placement("cpu", list(range(n // 2)))
    every = gt.placement.all("cpu")
    results = []
    for first in (sub, every):
        gt.manual_seed(1)
        F.dropout(gt.ones(8, 8, placement=first, sbp=B), 0.5)
        y = F.dropout(gt.ones(8, 8, placement=every, sbp=B), 0.5)
        _same_on_every_rank(y.to_local(), f"dropout after a draw on {first.ranks}")
        z = torch.rand_like(y)
        _same_on_every_rank(z.to_local(), "rand_like on every rank")
        results.append((y.full(), z.full()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


INPLACE = [
    ("uniform_", lambda t: t.uniform_(-2, 3)), ("normal_", lambda t: t.normal_(1, 3)),
    ("bernoulli_", lambda t: t.bernoulli_(0.3)), ("exponential_", lambda t: t.exponential_(2)),
    ("log_normal_", lambda t: t.log_normal_(0, 0.5)), ("cauchy_", lambda t: t.cauchy_()),
    ("geometric_", lambda t: t.geometric_(0.4)), ("random_", lambda t: t.random_(3, 11)),
    ("kaiming_uniform_", lambda t: torch.nn.init.kaiming_uniform_(t, a=5 ** 0.5)),
    ("kaiming_normal_", torch.nn.init.kaiming_normal_),
    ("xavier_uniform_", torch.nn.init.xavier_uniform_),
    ("trunc_normal_", lambda t: torch.nn.init.trunc_normal_(t, std=0.02)),
]


def check_inplace_ops_and_init_are_placement_invariant():
    every = gt.placement.all("cpu")
    for name, fill in INPLACE:
        values = []
        for p, s in _layouts():
            gt.manual_seed(9)
            t = gt.zeros(9, 6, placement=p, sbp=s)
            with torch.no_grad():
                out = fill(t)
            assert out is t, name
            values.append((p, s, t.full()))
        first = values[0][2]
        for p, s, v in values[1:]:
            assert torch.equal(v, first), f"{name} on {p.ranks} {s}"
        assert first.unique().numel() > 1 and bool(torch.isfinite(first).all()), name
    # the moments of kaiming_uniform_ on a split weight match its bound
    gt.manual_seed(0)
    w = gt.zeros(256, 512, placement=every, sbp=S(1))
    torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)
    full, bound = w.full(), 1 / 512 ** 0.5
    assert full.abs().max() <= bound and abs(full.std() - bound / 3 ** 0.5) < 0.02 * bound


def check_parts_of_a_draw_are_independent():
    """Parts of one draw are uncorrelated with each other; statistics of the whole."""
    every = gt.placement.all("cpu")
    gt.manual_seed(3)
    x = gt.randn(400, 300, placement=every, sbp=S(1))
    full = x.full()
    assert abs(full.mean()) < 0.02 and abs(full.var() - 1) < 0.02
    n = gt.get_world_size()
    parts = full.tensor_split(n, dim=1)
    width = min(q.shape[1] for q in parts)
    for a, b in zip(parts, parts[1:]):
        r = torch.corrcoef(torch.stack([a[:, :width].flatten(), b[:, :width].flatten()]))[0, 1]
        assert abs(r) < 0.02, r
    u = gt.rand(400, 300, placement=every, sbp=S(0)).full()
    assert abs(torch.corrcoef(torch.stack([u.flatten(), full.flatten()]))[0, 1]) < 0.02
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 12000).abs().max() < 600


def check_dropout_values_and_gradients():
    every = gt.placement.all("cpu")
    g = torch.randn(12, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outs = []
    for p, s in _layouts():
        gt.manual_seed(4)
        x = gt.tensor(torch.ones(12, 10, dtype=torch.float64), placement=p, sbp=(B,) * p.ndim)
        x = x.to_global(sbp=s).detach().requires_grad_()
        y = F.dropout(x, 0.25, training=True)
        if not x.global_layout.partial_axes:   # (partial inputs: the dispatcher picks)
            assert y.sbp == x.sbp, (p.ranks, s, y.sbp)
        (y * gt.tensor(g, placement=p, sbp=(B,) * p.ndim)).sum().backward()
        full = y.full()
        kept = full != 0
        assert 0.6 < kept.double().mean() < 0.9
        torch.testing.assert_close(full[kept], torch.full_like(full[kept], 1 / 0.75))
        torch.testing.assert_close(x.grad.full(), kept.double() / 0.75 * g)
        outs.append(full)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    channels = []                 # Dropout2d: whole channels, the same for every layout
    for p, s in _layouts():
        gt.manual_seed(8)
        x = gt.ones(4, 6, 3, 2, placement=p, sbp=(B,) * p.ndim).to_global(sbp=s)
        full = torch.nn.Dropout2d(0.5)(x).full()
        assert torch.equal(full, full[:, :, :1, :1].expand_as(full)), (p.ranks, s)
        channels.append(full)
    assert all(torch.equal(c, channels[0]) for c in channels[1:])
    assert 0 < (channels[0] == 0).double().mean() < 1
    x = gt.ones(4, 4, placement=every, sbp=S(0))
    assert torch.equal(F.dropout(x, 0.5, training=False).full(), torch.ones(4, 4))
    assert torch.equal(F.dropout(x, 1.0).full(), torch.zeros(4, 4))


def check_local_generation_memory():
    """Peak resident memory rise of a random factory, an init and dropout on a split
    tensor: about the part, not the whole (measured with the kernel's high-water mark;
    each op runs once on a small tensor first, so one-time setup is not counted)."""
    n = gt.get_world_size()
    every = gt.placement.all("cpu")
    rows, cols = 2048, 4096                      # 32 MiB whole, fp32
    part_mib = rows * cols * 4 / n / 2 ** 20
    small = gt.randn(4, 4, placement=every, sbp=S(0))
    torch.nn.init.normal_(small)
    F.dropout(small, 0.1)
    with peak_rise() as peak:
        x = gt.randn(rows, cols, placement=every, sbp=S(0))
    assert peak.mib <= 1.3 * part_mib + 4, (peak.mib, part_mib)
    with peak_rise() as peak:
        torch.nn.init.normal_(x)
    assert peak.mib <= 0.3 * part_mib + 4, (peak.mib, part_mib)
    with peak_rise() as peak:
        y = F.dropout(x, 0.1)
    # the output and its bool mask (kept for backward): 1.25 parts
    assert peak.mib <= 1.3 * part_mib + 4, (peak.mib, part_mib)
    del x, y


CHECKS = ["check_local_generation_memory", "check_factories_are_the_generators_function",
          "check_reproducible_and_draws_differ", "check_every_rank_takes_every_draw",
          "check_inplace_ops_and_init_are_placement_invariant",
          "check_parts_of_a_draw_are_independent", "check_dropout_values_and_gradients"]

test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
