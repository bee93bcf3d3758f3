"""One process: how rules are registered and called, and the pieces they share.

A rule gets the axis only when it asks (``register(..., per_axis=True)``); dim
arguments are wrapped by one ``normalize_dim``; one tensor's sbp on one axis come from
``sbp.candidates``; the matrix products take their signatures from einsum's rule, so
mm and the einsum "mk,kn->mn" offer the same combinations in the same order (dispatch
breaks cost ties by that order)."""
from __future__ import annotations

import inspect

import pytest
import torch

import globaltensor as gt
from globaltensor import sbp as S
from globaltensor.layout import Layout
from globaltensor.placement import Placement
from globaltensor.propagation import decide
from globaltensor.propagation.call import Call, flatten_args
from globaltensor.rules import registry
from globaltensor.rules._dims import normalize_dim
from globaltensor.rules.einsum import einsum_pair, einsum_rule
from globaltensor.rules.matmul import product_rule
from globaltensor.rules.registry import lookup, register
from globaltensor.tensor import GlobalTensor

aten = torch.ops.aten
B, P = S.broadcast, S.partial_sum


@pytest.fixture
def four_ranks(monkeypatch):
    """Placements of up to four ranks, for rules only: nothing here dispatches on them
    (a dispatch would start a world of four)."""
    monkeypatch.setenv("WORLD_SIZE", "4")


@pytest.fixture
def scratch_op():
    """A fresh op ``x -> 2 x`` (its own library) and, afterwards, no trace of it or of
    the rule a test registers for it."""
    lib = torch.library.Library("gt_rule_registry_test", "FRAGMENT")
    made = []

    def make(name: str):
        lib.define(f"{name}(Tensor x) -> Tensor")
        lib.impl(name, lambda x: x * 2, "CompositeExplicitAutograd")
        op = getattr(torch.ops.gt_rule_registry_test, name).default
        made.append(op)
        return op

    yield make
    for op in made:
        registry._RULES.pop(op, None)
    lib._destroy()


def _one_rank_mesh():
    """A 1x1 placement: two axes, so the dispatcher asks a rule twice, in one process."""
    return gt.placement("cpu", [[0]])


def test_a_rule_registered_without_per_axis_is_called_with_the_call_alone(scratch_op):
    op = scratch_op("once_per_axis_without_it")
    seen = []

    @register(op)
    def rule(call):
        seen.append(call.func)
        return [((B,), (B,))]

    x = gt.tensor(torch.arange(6.0).reshape(2, 3), placement=_one_rank_mesh(), sbp=(B, B))
    out = op(x)
    assert rule.per_axis is False
    assert seen == [op, op]  # asked once per placement axis, never given one
    assert torch.equal(out.full(), torch.arange(6.0).reshape(2, 3) * 2)


def test_a_per_axis_rule_is_called_with_each_axis(scratch_op):
    op = scratch_op("once_per_axis_with_it")
    axes = []

    @register(op, per_axis=True)
    def rule(call, axis):
        axes.append(axis)
        return [((B,), (B,))]

    x = gt.tensor(torch.ones(2, 3), placement=_one_rank_mesh(), sbp=(B, B))
    op(x)
    assert rule.per_axis is True and axes == [0, 1]


def test_a_rule_registered_twice_must_agree_on_per_axis():
    def rule(call):
        return []

    register()(rule)
    register()(rule)  # again, the same way: fine (a local implementation is added so)
    with pytest.raises(ValueError, match="per_axis=False, now with per_axis=True"):
        register(per_axis=True)(rule)
    with pytest.raises(ValueError, match="per_axis is for rules"):
        register(decompose=True, per_axis=True)(lambda x: x)


def test_every_rule_takes_the_axis_exactly_when_registered_per_axis():
    wrong, per_axis = [], set()
    for key, rule in registry._RULES.items():
        params = list(inspect.signature(rule).parameters)
        if len(params) != 1 + rule.per_axis:
            wrong.append(f"{key}: {rule.__name__}{tuple(params)}, per_axis={rule.per_axis}")
        if rule.per_axis:
            per_axis.add(rule.__name__)
    assert not wrong, wrong
    assert per_axis == {"view_rule"}  # reshapes: which splits survive depends on the axis's size


def test_normalize_dim_wraps_as_torch_does():
    for ndim in range(4):
        shape = tuple(range(2, 2 + ndim))
        x = torch.zeros(shape)
        for dim in range(-ndim - 2, ndim + 2):
            try:
                torch_size = x.sum(dim, keepdim=True).shape
            except IndexError as e:
                with pytest.raises(IndexError) as ours:
                    normalize_dim(dim, ndim)
                assert str(ours.value) == str(e).splitlines()[0], (dim, ndim)
                continue
            d = normalize_dim(dim, ndim)
            assert 0 <= d < max(ndim, 1)
            # the dim torch reduced is the one we name
            assert ndim == 0 or torch_size == shape[:d] + (1,) + shape[d + 1:], (dim, ndim)


def test_normalize_dim_treats_a_scalar_as_having_one_dim():
    assert [normalize_dim(d, 0) for d in (0, -1)] == [0, 0]
    with pytest.raises(IndexError, match=r"\[-1, 0\], but got 1"):
        normalize_dim(1, 0)
    with pytest.raises(IndexError, match=r"\[-3, 2\], but got -4"):
        normalize_dim(-4, 3)


def test_a_dim_of_a_scalar_reaches_the_rules_wrapped():
    # softmax and a vector norm over dim 0 of a 0-d tensor: the rules wrapped it as
    # ``dim % ndim``, which divided by zero
    x = gt.tensor(torch.tensor(1.5), placement=gt.placement("cpu", [0]), sbp=B)
    assert torch.equal(torch.softmax(x, 0).full(), torch.tensor(1.0))
    assert torch.equal(torch.linalg.vector_norm(x, dim=-1).full(), torch.tensor(1.5))


def test_candidates_lists_broadcast_then_partials_then_splits():
    assert S.candidates(0) == [B]
    assert S.candidates(3) == [B, S.split(0), S.split(1), S.split(2)]
    assert S.candidates(2, partials=(P, S.partial_max)) == [B, P, S.partial_max, S.split(0), S.split(1)]
    assert S.candidates(1, partials=(S.partial_max,)) == [B, S.partial_max, S.split(0)]
    with pytest.raises(ValueError, match="partial sbps"):
        S.candidates(2, partials=(S.split(0),))
    with pytest.raises(ValueError, match=">= 0"):
        S.candidates(-1)


def _global(shape, placement: Placement) -> GlobalTensor:
    """A broadcast GlobalTensor of ``shape``: only its shape and layout are read."""
    layout = Layout.make(shape, placement, (B,) * placement.ndim)
    return GlobalTensor(torch.empty(layout.local_shape(0)), layout)


def _call(func, args: tuple, out_shape, placement: Placement) -> Call:
    leaves, spec = flatten_args(args, {})
    inputs = [a for a in leaves if isinstance(a, GlobalTensor)]
    return Call(func, inputs, [tuple(x.shape) for x in inputs], [out_shape], leaves, spec,
                placement.shape)


def _combinations(call: Call) -> list:
    """Every nd-signature the call's rule gives, combined over the placement's axes."""
    rule, _ = lookup(call.func)
    return list(decide._combinations(call, rule, len(call.inputs), len(call.out_shapes)))


@pytest.mark.parametrize("mesh", [[0, 1], [[0, 1], [2, 3]]], ids=["1-D", "2-D"])
def test_mm_offers_what_einsum_offers_for_mk_kn_mn(mesh, four_ranks):
    placement = Placement("cpu", mesh)
    x, w = _global((6, 4), placement), _global((4, 2), placement)
    mm = _combinations(_call(aten.mm.default, (x, w), (6, 2), placement))
    einsum = _combinations(_call(einsum_pair, ("mk,kn->mn", x, w), (6, 2), placement))
    assert mm == einsum
    one_axis = [((B, B), (B,)), ((S.split(0), B), (S.split(0),)), ((B, S.split(1)), (S.split(1),)),
                ((S.split(1), S.split(0)), (P,)), ((P, B), (P,)), ((B, P), (P,))]
    assert len(mm) == len(one_axis) ** placement.ndim
    if placement.ndim == 1:  # the order matmul always had: rows, columns, contracted, partials
        assert [(tuple(s[0] for s in ins), tuple(s[0] for s in outs)) for ins, outs in mm] == one_axis


@pytest.mark.parametrize("func, equation, shapes, out", [
    (aten.bmm.default, "bmk,bkn->bmn", [(3, 6, 4), (3, 4, 2)], (3, 6, 2)),
    (aten.mv.default, "mk,k->m", [(6, 4), (4,)], (6,)),
    (aten.dot.default, "k,k->", [(4,), (4,)], ()),
])
def test_the_other_products_offer_what_their_einsum_offers(func, equation, shapes, out, four_ranks):
    placement = Placement("cpu", [[0, 1], [2, 3]])
    a, b = (_global(s, placement) for s in shapes)
    assert _combinations(_call(func, (a, b), out, placement)) == \
        _combinations(_call(einsum_pair, (equation, a, b), out, placement))


def test_bmm_keeps_its_batch_split_last(four_ranks):
    placement = Placement("cpu", [0, 1])
    a, b = _global((3, 6, 4), placement), _global((3, 4, 2), placement)
    found = product_rule(_call(aten.bmm.default, (a, b), (3, 6, 2), placement))
    assert found[0] == ((B, B), (B,)) and found[-1] == ((S.split(0), S.split(0)), (S.split(0),))
    assert found[3] == ((S.split(2), S.split(1)), (P,))


def test_mm_with_a_plain_one_element_operand_lists_the_global_one_only(four_ranks):
    # mm(plain (1, 1), x (1, 3)): x's columns give the output's columns; the plain
    # factor is whole everywhere and cannot be partial
    placement = Placement("cpu", [0, 1])
    plain, x = torch.ones(1, 1), _global((1, 3), placement)
    call = _call(aten.mm.default, (plain, x), (1, 3), placement)
    found = product_rule(call)
    assert found == einsum_rule(_call(einsum_pair, ("mk,kn->mn", plain, x), (1, 3), placement))
    assert ((S.split(1),), (S.split(1),)) in found and all(len(ins) == 1 for ins, _ in found)
    assert ((P,), (P,)) in found and ((B,), (P,)) not in found


def test_call_axis_sizes_and_the_deprecated_mesh(four_ranks):
    placement = Placement("cpu", [[0, 1], [2, 3]])
    x = _global((4, 4), placement)
    call = _call(aten.neg.default, (x,), (4, 4), placement)
    assert call.axis_sizes == (2, 2)
    with pytest.warns(DeprecationWarning, match="axis_sizes"):
        assert call.mesh == (2, 2)
