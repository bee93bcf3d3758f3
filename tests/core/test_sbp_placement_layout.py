"""Pure tests (no processes) of sbp values, Placement and the layout shape math."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globaltensor import sbp
from globaltensor.layout import Layout, Region, balanced_split
from globaltensor.placement import Placement

HYP = settings(max_examples=100, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])
SBPS = (sbp.split(0), sbp.broadcast, sbp.partial_sum, sbp.partial_max)


@pytest.fixture(autouse=True)
def _world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


# ---------------------------------------------------------------- sbp
def test_sbp_equality_hash_and_values():
    assert sbp.split(0) == sbp.split(dim=0) and sbp.split(0) != sbp.split(1)
    assert len({sbp.split(0), sbp.split(dim=0), sbp.split(1), sbp.broadcast,
                sbp.partial_sum, sbp.partial_max}) == 5
    assert {sbp.split(0): "a", sbp.broadcast: "b"}[sbp.split(dim=0)] == "a"
    assert sbp.partial_sum != sbp.partial_max and sbp.broadcast != sbp.partial_sum
    for s in SBPS:
        assert not callable(s)
        assert isinstance(s, sbp.SbpParallel)


def test_sbp_reprs():
    assert repr(sbp.split(0)) == "split(dim=0)"
    assert repr(sbp.split(dim=2)) == "split(dim=2)"
    assert [repr(s) for s in SBPS[1:]] == ["broadcast", "partial_sum", "partial_max"]


@pytest.mark.parametrize("dim", [1.0, "0", None, [0]])
def test_split_non_int_dim_raises(dim):
    with pytest.raises(ValueError):
        sbp.split(dim)


def test_normalize_ok():
    assert sbp.normalize(sbp.broadcast, 1, 2) == (sbp.broadcast,)
    assert sbp.normalize(sbp.split(1), 1, 2) == (sbp.split(1),)
    assert sbp.normalize(sbp.split(-1), 1, 3) == (sbp.split(2),)
    assert sbp.normalize(sbp.split(-3), 1, 3) == (sbp.split(0),)
    assert sbp.normalize((sbp.split(-2), sbp.partial_sum), 2, 2) == (
        sbp.split(0), sbp.partial_sum)
    assert sbp.normalize([sbp.broadcast, sbp.split(0)], 2, 1) == (sbp.broadcast, sbp.split(0))
    assert isinstance(sbp.normalize([sbp.broadcast], 1, 1), tuple)


@pytest.mark.parametrize("value, pndim, tndim", [
    (sbp.split(2), 1, 2), (sbp.split(-3), 1, 2), (sbp.split(0), 1, 0),
    ((sbp.split(0), sbp.split(0)), 1, 2), (sbp.broadcast, 2, 2), ((), 1, 1),
    ((sbp.broadcast, "broadcast"), 2, 1), (0, 1, 1), (None, 1, 1),
    (sbp.split, 1, 1), ((sbp.split,), 1, 1), ((sbp.broadcast, sbp.split), 2, 1),
])
def test_normalize_rejects(value, pndim, tndim):
    with pytest.raises(ValueError):
        sbp.normalize(value, pndim, tndim)


# ---------------------------------------------------------------- Placement
def test_placement_1d_and_2d():
    p = Placement("cpu", ranks=[0, 1])
    assert (p.type, p.ranks, p.shape, p.ndim) == ("cpu", [0, 1], (2,), 1)
    q = Placement("cuda", ranks=[[0, 1], [2, 3]])
    assert (q.type, q.ranks, q.shape, q.ndim) == ("cuda", [[0, 1], [2, 3]], (2, 2), 2)
    k = Placement(type="cpu", ranks=[0, 1])
    assert k == p and hash(k) == hash(p)
    assert 1 in p and 2 not in p and 3 in q and 4 not in q


def test_placement_equality_and_hash():
    a, b = Placement("cpu", [0, 1]), Placement("cpu", [0, 1])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert Placement("cpu", [0, 1]) != Placement("cpu", [1, 0])
    assert Placement("cpu", [0, 1]) != Placement("cuda", [0, 1])
    assert Placement("cpu", [[0, 1], [2, 3]]) != Placement("cpu", [0, 1, 2, 3])
    assert {Placement("cpu", [[0, 1], [2, 3]]): 1}[Placement("cpu", [[0, 1], [2, 3]])] == 1


def test_placement_immutable():
    p = Placement("cpu", ranks=[[0, 1], [2, 3]])
    for name, value in [("type", "cuda"), ("ranks", [0]), ("shape", (4,)), ("ndim", 1),
                        ("new_attribute", 1)]:
        with pytest.raises(AttributeError):
            setattr(p, name, value)
    r = p.ranks
    r[0][0] = 7
    r.append([5, 6])
    assert p.ranks == [[0, 1], [2, 3]] and p.shape == (2, 2)
    assert p == Placement("cpu", ranks=[[0, 1], [2, 3]])


def test_placement_all():
    p = Placement.all("cpu")
    assert p.ranks == list(range(8)) and p.ndim == 1 and p.type == "cpu"
    assert all(r in p for r in range(8))


@pytest.mark.parametrize("kwargs, words", [
    (dict(type="cpu", ranks=[]), "empty"),
    (dict(type="cpu", ranks=[[]]), "empty"),
    (dict(type="cpu", ranks=[0, 1, 1]), "duplicate"),
    (dict(type="cpu", ranks=[[0, 1], [1, 2]]), "duplicate"),
    (dict(type="cpu", ranks=[0, 8]), "world"),
    (dict(type="cpu", ranks=[0, -1]), "-1"),
    (dict(type="cpu", ranks=[[0, 1], [2]]), "ragged"),
    (dict(type="cpu", ranks=[[0, 1], 2]), "ragged"),
    (dict(type="tpu", ranks=[0]), "tpu"),
    (dict(type="cpu"), "ranks"),
])
def test_placement_invalid(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Placement(**kwargs)


def test_placement_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    Placement("cpu", [0, 1])
    with pytest.raises(ValueError):
        Placement("cpu", [0, 2])
    assert Placement.all("cpu").ranks == [0, 1]


def test_placement_mesh_hierarchy():
    p = Placement("cpu", ranks=[[5, 1, 2], [0, 3, 4]])
    assert p.coord(5) == (0, 0) and p.coord(0) == (1, 0) and p.coord(4) == (1, 2)
    assert p.coord(7) is None
    for r in [5, 1, 2, 0, 3, 4]:
        assert p.rank_at(p.coord(r)) == r
    assert p.group(1, axis=0) == (1, 3) and p.group(3, axis=0) == (1, 3)
    assert p.group(3, axis=1) == (0, 3, 4)
    assert p.groups(0) == [(5, 0), (1, 3), (2, 4)]
    assert p.groups(1) == [(5, 1, 2), (0, 3, 4)]


def test_placement_permuted_1d():
    p = Placement("cpu", ranks=[1, 0])
    assert p.coord(1) == (0,) and p.coord(0) == (1,)
    assert p.rank_at((0,)) == 1 and p.rank_at((1,)) == 0
    assert p.group(0, axis=0) == (1, 0) and p.groups(0) == [(1, 0)]


# ---------------------------------------------------------------- layout
@HYP
@given(st.integers(0, 200), st.integers(1, 40))
def test_balanced_split_property(length, n):
    parts = balanced_split(length, n)
    assert len(parts) == n
    sizes = [s for _, s in parts]
    assert sum(sizes) == length and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sizes.count(length // n + 1) == length % n or length % n == 0
    offset = 0
    for o, s in parts:
        assert o == offset
        offset += s
    if n > length:
        assert sizes[length:] == [0] * (n - length)


def _spans(layout, dim):
    return [(layout.region(r).offsets[dim], layout.region(r).sizes[dim])
            for r in layout.placement.flat_ranks]


def test_region_1d_split():
    lay = Layout.make((5, 3), Placement("cpu", [0, 1]), sbp.split(0))
    assert lay.region(0) == Region((0, 0), (3, 3)) and lay.region(1) == Region((3, 0), (2, 3))
    assert lay.local_shape(1) == (2, 3)
    rev = Layout.make((5, 3), Placement("cpu", [1, 0]), sbp.split(0))
    assert rev.region(1) == Region((0, 0), (3, 3)) and rev.region(0) == Region((3, 0), (2, 3))
    small = Layout.make((4, 2), Placement("cpu", [3, 2, 1, 0, 4, 5]), sbp.split(-1))
    assert [small.local_shape(r) for r in [3, 2, 1, 0, 4, 5]] == [(4, 1)] * 2 + [(4, 0)] * 4
    assert small.region(3) == Region((0, 0), (4, 1)) and small.region(2) == Region((0, 1), (4, 1))
    for s in (sbp.broadcast, sbp.partial_sum, sbp.partial_max):
        lay = Layout.make((5, 3), Placement("cpu", [0, 1]), s)
        assert lay.region(0) == lay.region(1) == Region((0, 0), (5, 3))


def test_region_outside_placement():
    lay = Layout.make((5, 3), Placement("cpu", [1, 2]), sbp.split(0))
    assert lay.region(0) is None and lay.region(7) is None
    assert lay.local_shape(0) == (0, 0)
    assert lay.region(1) is not None


def test_region_2d_same_dim_twice():
    p = Placement("cpu", [[0, 1], [2, 3]])
    lay = Layout.make((7,), p, (sbp.split(0), sbp.split(0)))
    assert _spans(lay, 0) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    lay = Layout.make((3, 1), Placement("cpu", [[3, 2], [1, 0]]), (sbp.split(0), sbp.split(0)))
    assert [lay.local_shape(r) for r in (3, 2, 1, 0)] == [(1, 1), (1, 1), (1, 1), (0, 1)]
    assert lay.region(1).offsets == (2, 0)


def test_region_2d_mixed():
    p = Placement("cpu", [[0, 1, 2], [3, 4, 5]])
    lay = Layout.make((5, 7), p, (sbp.split(0), sbp.split(1)))
    assert lay.region(0) == Region((0, 0), (3, 3)) and lay.region(2) == Region((0, 5), (3, 2))
    assert lay.region(4) == Region((3, 3), (2, 2))
    bcast = Layout.make((5, 7), p, (sbp.broadcast, sbp.split(1)))
    assert [bcast.region(r) for r in (1, 4)] == [Region((0, 3), (5, 2))] * 2
    part = Layout.make((5, 7), p, (sbp.split(0), sbp.partial_sum))
    assert {part.region(r) for r in (0, 1, 2)} == {Region((0, 0), (3, 7))}
    assert {part.region(r) for r in (3, 4, 5)} == {Region((3, 0), (2, 7))}
    assert Layout.make((5, 7), p, (sbp.partial_max, sbp.broadcast)).region(5) == \
        Region((0, 0), (5, 7))


@st.composite
def _layouts(draw):
    pshape = draw(st.sampled_from([(1,), (2,), (3,), (5,), (8,), (2, 2), (2, 3), (4, 2),
                                   (2, 2, 2)]))
    ranks = draw(st.permutations(range(8)))[: int(torch.tensor(pshape).prod())]
    nested = torch.tensor(ranks).reshape(pshape).tolist()
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    choices = [sbp.broadcast] + [sbp.split(d) for d in range(-len(shape), len(shape))]
    nd = tuple(draw(st.sampled_from(choices)) for _ in pshape)
    return Layout.make(shape, Placement("cpu", nested), nd)


@HYP
@given(_layouts())
def test_split_regions_tile_global_tensor(lay):
    p = lay.placement
    split_axes = [a for a, s in enumerate(lay.sbp) if isinstance(s, sbp.Split)]
    by_key = {}
    for r in p.flat_ranks:
        key = tuple(p.coord(r)[a] for a in split_axes)
        region = lay.region(r)
        assert len(region.offsets) == len(region.sizes) == len(lay.shape)
        assert by_key.setdefault(key, region) == region  # same split coord, same region
    count = torch.zeros(lay.shape, dtype=torch.int32)
    for region in by_key.values():
        count[region.slices()] += 1
    assert bool((count == 1).all())
    assert sum(reg.numel for reg in by_key.values()) == count.numel()
    assert len(by_key) == len(list(itertools.product(*[range(p.shape[a]) for a in split_axes])))


def test_region_intersect():
    a, b = Region((0, 0), (4, 4)), Region((2, 3), (5, 5))
    assert a.intersect(b) == Region((2, 3), (2, 1)) == b.intersect(a)
    assert a.intersect(a) == a
    assert a.intersect(Region((1, 1), (1, 1))) == Region((1, 1), (1, 1))
    assert a.intersect(Region((4, 0), (2, 4))) is None  # touching, no overlap
    assert a.intersect(Region((0, 5), (4, 1))) is None
    assert Region((0,), (3,)).intersect(Region((1,), (0,))) is None  # empty region
    assert Region((), ()).intersect(Region((), ())) == Region((), ())


def test_summed_axes_to_names_the_axes_an_all_reduce_settles(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    mesh = Placement("cpu", [[0, 1], [2, 3]])
    S0, B, P, M = sbp.split(0), sbp.broadcast, sbp.partial_sum, sbp.partial_max

    def lay(*s):
        return Layout.make((4, 6), mesh, s)
    assert lay(S0, P).summed_axes_to(lay(S0, B)) == (1,)
    assert lay(P, P).summed_axes_to(lay(B, B)) == (0, 1)
    assert lay(S0, B).summed_axes_to(lay(S0, B)) == ()
    assert lay(M, B).summed_axes_to(lay(B, B)) is None        # a max is no sum
    assert lay(P, B).summed_axes_to(lay(S0, B)) is None       # a reduce-scatter, not this
    assert lay(P, B).summed_axes_to(Layout.make((4, 7), mesh, (B, B))) is None
