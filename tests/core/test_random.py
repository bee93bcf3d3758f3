"""The counter-based generator in one process: values are a function of (seed, draw,
global index), so any region of a tensor equals that slice of the whole, whatever the
chunking inside; the distributions have the right moments."""
import math

import pytest
import torch

from globaltensor.layout import Region
from globaltensor.random import sample


def whole(shape):
    return Region((0,) * len(shape), tuple(shape))


@pytest.mark.parametrize("shape,region", [
    ((7, 5), Region((2, 1), (3, 4))),
    ((3, 70000), Region((1, 12345), (2, 40000))),     # rows longer than a chunk
    ((40000, 3), Region((999, 1), (30001, 2))),        # many rows per chunk
    ((2, 3, 4, 5), Region((1, 0, 2, 1), (1, 3, 2, 4))),
    ((2, 3, 9000), Region((0, 1, 100), (2, 2, 8000))),
    ((6,), Region((6,), (0,))),                        # an empty part
    ((7, 5), Region((0, 3), (7, 1))),                  # one column: inner size 1
    ((4, 3, 2), Region((1, 2, 1), (2, 1, 1))),
])
@pytest.mark.parametrize("kind,dtype,params", [
    ("uniform", torch.float32, {}), ("normal", torch.float64, {}),
    ("bernoulli", torch.bool, {"p": 0.3}), ("integers", torch.int64, {"low": -5, "high": 9}),
    ("normal", torch.bfloat16, {"mean": 1.0, "std": 2.0})])
def test_a_region_is_the_slice_of_the_whole(shape, region, kind, dtype, params):
    full = sample(kind, shape, whole(shape), (3, 1), dtype, **params)
    part = sample(kind, shape, region, (3, 1), dtype, **params)
    assert part.shape == region.sizes and part.dtype == dtype
    assert torch.equal(part, full[region.slices()])


def test_zero_dim_and_reproducible_draws():
    a = sample("normal", (), Region((), ()), (0, 1), torch.float32)
    assert a.shape == () and torch.equal(a, sample("normal", (), Region((), ()), (0, 1),
                                                   torch.float32))
    b = sample("normal", (50,), whole((50,)), (0, 2), torch.float32)
    c = sample("normal", (50,), whole((50,)), (1, 1), torch.float32)
    d = sample("normal", (50,), whole((50,)), (0, 1), torch.float32)
    assert not torch.equal(b, d) and not torch.equal(c, d)


def test_tensors_beyond_two_to_the_32_elements():
    # rows of 2**32 elements get their own key: not shifted copies of each other
    shape = (4, 2 ** 31)
    near_end = Region((3, 2 ** 31 - 1000), (1, 1000))
    a = sample("uniform", shape, near_end, (0, 1), torch.float32)
    assert torch.equal(a[:, 500:], sample("uniform", shape, Region((3, 2 ** 31 - 500), (1, 500)),
                                          (0, 1), torch.float32))
    row1 = sample("uniform", shape, Region((1, 2 ** 31 - 1000), (1, 1000)), (0, 1), torch.float32)
    assert not torch.equal(a, row1)   # index i and i + 2**32 differ
    assert abs(torch.corrcoef(torch.stack([a[0], row1[0]]))[0, 1]) < 0.15


def test_moments_and_histogram():
    n = 1 << 20
    shape = (n,)
    u = sample("uniform", shape, whole(shape), (7, 1), torch.float32)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert (counts - n / 20).abs().max() < 5 * math.sqrt(n / 20)      # 5 sigma
    z = sample("normal", shape, whole(shape), (7, 2), torch.float32)
    assert abs(z.mean()) < 5e-3 and abs(z.var() - 1) < 5e-3
    assert abs((z ** 4).mean() - 3) < 0.05                             # kurtosis
    assert abs((z.abs() < 1).float().mean() - 0.6827) < 3e-3
    # neighbours and successive draws are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([u, z]))[0, 1]) < 5e-3
    e = sample("exponential", shape, whole(shape), (7, 3), torch.float64, lambd=2.0)
    assert e.min() > 0 and abs(e.mean() - 0.5) < 5e-3
    b = sample("bernoulli", shape, whole(shape), (7, 4), torch.bool, p=0.3)
    assert abs(b.float().mean() - 0.3) < 3e-3
    i = sample("integers", shape, whole(shape), (7, 5), torch.int64, low=0, high=10)
    assert i.min() == 0 and i.max() == 9
    assert (torch.bincount(i) - n / 10).abs().max() < 5 * math.sqrt(n / 10)
    g = sample("geometric", shape, whole(shape), (7, 6), torch.float32, p=0.25)
    assert g.min() >= 1 and abs(g.mean() - 4) < 0.05
