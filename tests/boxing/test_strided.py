"""Strided splits (``split(dim, blocks=k)``): the value, its parts, and every boxing to
and from every other sbp, on the simulator (no processes)."""
import itertools

import pytest
import torch

from globaltensor import sbp as S
from globaltensor.boxing import materialize, plan_route, scatter, simulate
from globaltensor.layout import Layout
from globaltensor.placement import Placement


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def test_strided_split_value_and_repr():
    s = S.split(0, blocks=4)
    assert repr(s) == "split(dim=0, blocks=4)" and isinstance(s, S.StridedSplit)
    assert S.split(1, blocks=1) == S.split(1) and s != S.split(0)
    with pytest.raises(ValueError, match="blocks"):
        S.split(0, blocks=0)
    with pytest.raises(ValueError, match="equal blocks"):
        Layout.make((6, 2), Placement("cpu", [0, 1]), S.split(0, blocks=4))
    with pytest.raises(ValueError, match="no other placement axis"):
        Layout.make((8, 2), Placement("cpu", [[0, 1], [2, 3]]),
                    (S.split(0), S.split(0, blocks=2)))


def test_strided_parts_hold_their_piece_of_every_block():
    # 2 blocks of 6 rows, 3 ranks: rank r holds rows 2r, 2r+1 of each block
    p = Placement("cpu", [0, 1, 2])
    layout = Layout.make((12, 1), p, S.split(0, blocks=2))
    value = torch.arange(12.).reshape(12, 1)
    parts = scatter(value, layout)
    assert parts[1].flatten().tolist() == [2, 3, 8, 9]
    assert layout.local_shape(2) == (4, 1)
    torch.testing.assert_close(materialize(parts, layout), value)
    # uneven blocks: 2 blocks of 5 over 2 ranks -> 3 + 2 per block
    uneven = Layout.make((10,), Placement("cpu", [0, 1]), S.split(0, blocks=2))
    assert scatter(torch.arange(10.), uneven)[0].tolist() == [0, 1, 2, 5, 6, 7]
    with pytest.raises(TypeError, match="no box"):
        layout.region(0)


MESHES = [(2,), (3,), (4,), (2, 2)]
SBPS = [S.broadcast, S.partial_sum, S.partial_max, S.split(0), S.split(1),
        S.split(0, blocks=2), S.split(0, blocks=3), S.split(1, blocks=2)]
SBPS_2D = [S.broadcast, S.partial_sum, S.split(0), S.split(1), S.split(0, blocks=2),
           S.split(1, blocks=2)]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", [(12, 6), (6, 5)])
def test_every_boxing_to_and_from_strided_on_simulator(mesh, shape):
    size = 1
    for m in mesh:
        size *= m
    p = Placement("cpu", torch.arange(1, size + 1).reshape(mesh).tolist())
    gen = torch.Generator().manual_seed(0)
    checked = 0
    sbps = SBPS if len(mesh) == 1 else SBPS_2D
    for src, dst in itertools.product(itertools.product(sbps, repeat=len(mesh)), repeat=2):
        try:
            a, b = Layout.make(shape, p, src), Layout.make(shape, p, dst)
        except ValueError:
            continue
        if not (a.strided or b.strided):
            continue
        value = torch.randn(shape, generator=gen, dtype=torch.float64)
        out = simulate(plan_route(a, b, 8), scatter(value, a))
        assert all(tuple(out[r].shape) == b.local_shape(r) for r in p), (src, dst)
        torch.testing.assert_close(materialize(out, b), value, msg=f"{src} -> {dst}")
        if not b.partial_axes:
            ref = scatter(value, b)
            assert all(torch.equal(out[r], ref[r]) for r in p), (src, dst)
        checked += 1
    assert checked > 20


def test_strided_to_split_of_its_blocks_is_one_all_to_all():
    p = Placement("cpu", [0, 1])
    src = Layout.make((8, 4), p, S.split(0, blocks=4))
    plan = plan_route(src, Layout.make((8, 4), p, S.split(1)), 4)
    assert [s.kind for s in plan.steps] == ["ViewAs", "AllToAll", "ViewAs"]
    to_b = plan_route(src, Layout.make((8, 4), p, S.broadcast), 4)
    assert [s.kind for s in to_b.steps] == ["ViewAs", "AllGather", "ViewAs"]
    assert "split(dim=0, blocks=4)" in str(plan)
