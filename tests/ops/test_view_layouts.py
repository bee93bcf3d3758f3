"""Property test, one process: every signature that the view rule offers, on random
shapes, placements (1-D, 2-D and 3-D) and nd-sbps, computes the one-process value on
every rank: each rank's part (boxed to the signature's input layout) viewed to its
output part's shape holds the output's part of ``full.view(...)``.

The multi-process battery (tests/ops/test_views.py) runs the dispatch end to end; this
checks the rule and its local implementation on many more layouts than a world can."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from globaltensor import sbp as S
from globaltensor.layout import Layout
from globaltensor.placement import Placement
from globaltensor.propagation import decide
from globaltensor.propagation.call import Call, flatten_args
from globaltensor.rules.registry import lookup
from globaltensor.sbp import StridedSplit
from globaltensor.tensor import GlobalTensor

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def part_of(value: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s part of ``value`` under ``layout`` (partial axes as their reduced
    value: a view is linear, so comparing reduced values suffices)."""
    layout = layout.without_partials()
    blocks = {s.dim: s.blocks for s in layout.sbp if isinstance(s, StridedSplit)}
    if not blocks:
        return value[layout.region(rank).slices()]
    refined = layout.refined(blocks)
    shape = []
    for d, n in enumerate(layout.shape):
        shape += [blocks[d], n // blocks[d]] if d in blocks else [n]
    region = refined.region(rank)
    return value.reshape(shape)[region.slices()].reshape(layout.local_shape(rank))


def factor_shape(draw, numel: int, ndim: int) -> tuple:
    """A random shape of ``ndim`` dims with ``numel`` elements."""
    shape = []
    left = numel
    for _ in range(ndim - 1):
        divisors = [d for d in range(1, left + 1) if left % d == 0]
        d = draw(st.sampled_from(divisors))
        shape.append(d)
        left //= d
    return tuple(shape + [left])


@st.composite
def view_case(draw):
    mesh = draw(st.sampled_from([(2,), (4,), (2, 2), (2, 4), (4, 2), (2, 3), (2, 2, 2)]))
    numel = draw(st.sampled_from([16, 24, 32, 48, 64, 96, 128, 256]))
    a = factor_shape(draw, numel, draw(st.integers(1, 4)))
    b = factor_shape(draw, numel, draw(st.integers(1, 4)))
    sbps = [S.broadcast, S.partial_sum] + [S.split(d) for d in range(len(a))]
    src = tuple(draw(st.sampled_from(sbps)) for _ in mesh)
    ranks = list(range(math.prod(mesh)))
    return a, b, Placement("cpu", torch.tensor(ranks).reshape(mesh).tolist()), src


def signatures(a, b, placement: Placement, src: tuple) -> list:
    """Every (input layout, output layout) the view rule offers for this input."""
    layout = Layout.make(a, placement, src)
    x = GlobalTensor(torch.empty(layout.local_shape(0), dtype=torch.float64), layout)
    func = aten.view.default
    leaves, spec = flatten_args((x, list(b)), {})
    call = Call(func, [x], [tuple(a)], [tuple(b)], leaves, spec, placement.shape)
    meta = decide._meta_run(func, leaves, spec)
    rule, local = lookup(func)
    out = []
    for targets, outs in decide._signatures(call, rule, meta, (0,), False, local is None):
        out.append((targets[0], Layout.make(b, placement, outs[0])))
    return out


def check_view(a, b, placement, src):
    value = torch.arange(math.prod(a), dtype=torch.float64).reshape(a)
    want = value.view(b)
    found = signatures(a, b, placement, src)
    assert found, f"no signature for {a} -> {b} from {src}"
    for inp, out in found:
        for r in placement:
            got = part_of(value, inp, r).reshape(out.local_shape(r))
            assert torch.equal(got, part_of(want, out, r)), (a, b, inp.sbp, out.sbp, r)
    return found


@settings(max_examples=300, deadline=None)
@given(view_case())
def test_every_view_signature_computes_the_one_process_value(case):
    check_view(*case)


def test_a_dim_split_on_both_axes_views_without_moving():
    """An (8, 16, 16) tensor split(2) on both axes of a 2x2 placement viewed as
    (8, 16, 2, 8): its parts already line up as (split(2), split(3))."""
    p = Placement("cpu", [[0, 1], [2, 3]])
    found = check_view((8, 16, 16), (8, 16, 2, 8), p, (S.split(2), S.split(2)))
    held = Layout.make((8, 16, 16), p, (S.split(2), S.split(2)))
    kept = [out.sbp for inp, out in found if inp == held]
    assert kept == [(S.split(2), S.split(3))]


def test_a_view_compares_the_parts_of_the_axes_that_cut(monkeypatch):
    # ranks along an axis that splits neither layout hold the same parts: a 128 x 8
    # placement splitting on its second axis compares 8 parts, not 1024 (a 1024-rank
    # simulation spent a seventh of its time here), and knows the answer the next time
    from globaltensor.rules import view
    monkeypatch.setenv("WORLD_SIZE", "1024")
    p = Placement("cpu", torch.arange(1024).reshape(128, 8).tolist())
    src = Layout.make((4, 16, 64), p, (S.broadcast, S.split(2)))
    dst = Layout.make((4, 16, 8, 8), p, (S.broadcast, S.split(2)))
    read = []
    runs = view._row_major_runs
    monkeypatch.setattr(view, "_row_major_runs", lambda *a: read.append(a[1]) or runs(*a))
    view._read_alike.cache_clear()
    assert view._read_alike(src, dst) and len(read) == 2 * 8
    assert view._read_alike(src, dst) and len(read) == 2 * 8
    assert not view._read_alike(src, Layout.make((4, 16, 8, 8), p, (S.broadcast, S.split(3))))
