"""Matrix products: mm, addmm, bmm, baddbmm, mv, dot (torch.matmul, @ and F.linear
reach these).

For C = A @ B with A (m, k) and B (k, n), per placement axis, as einsum's rule gives
them for "mk,kn->mn" (``einsum.pair_signatures``): (B, B) -> B, (S0, B) -> S0 (rows),
(B, S1) -> S1 (columns), (S1, S0) -> P (the contracted dim), (P, B) -> P,
(B, P) -> P. Batched products ("bmk,bkn->bmn") add (S0, S0) -> S0 on the batch dim;
mv is "mk,k->m", dot "k,k->". A bias (addmm's ``self``) follows the output, except
that under a partial output it must be partial too, so it is added once. ``torch.cdist``
(where it does not run as a product) keeps the splits of the batch and of either
operand's rows.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from .einsum import pair_rule, pair_signatures
from .pointwise import aligned_sbp
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum

# Each product as the einsum it is, with the schema names of its two factors: einsum's
# rule says, in one place, how rows, columns, contracted and batch dims map to splits
# and partial sums (DTensor's _mm_like_strategy asks its einsum strategy the same way).
_EINSUMS = {aten.mm: ("mk,kn->mn", "self", "mat2"), aten.bmm: ("bmk,bkn->bmn", "self", "mat2"),
            aten.mv: ("mk,k->m", "self", "vec"), aten.dot: ("k,k->", "self", "tensor"),
            aten.addmm: ("mk,kn->mn", "mat1", "mat2"),
            aten.baddbmm: ("bmk,bkn->bmn", "batch1", "batch2")}


def _bias_sbp(bias_shape, out_shape, out_sbp):
    """The sbp a bias of ``bias_shape`` needs so that bias + product has ``out_sbp``."""
    if out_sbp == P:
        return P
    if isinstance(out_sbp, Split):
        return aligned_sbp(bias_shape, out_shape, out_sbp.dim)
    return B


@register(aten.mm, aten.bmm, aten.mv, aten.dot)
def product_rule(call):
    equation, left, right = _EINSUMS[call.func.overloadpacket]
    return pair_rule(equation, call.arg(left), call.arg(right))


@register(aten.addmm, aten.baddbmm)
def biased_product_rule(call):
    if len(call.inputs) != 3:
        return []  # a plain-tensor operand: let the fallback handle it
    equation = _EINSUMS[call.func.overloadpacket][0]
    bias_shape, out_shape = call.in_shapes[0], call.out_shapes[0]
    return [((_bias_sbp(bias_shape, out_shape, o), a, b), (o,))
            for a, b, o in pair_signatures(equation, tuple(call.in_shapes[1:]))]


@register(aten._cdist_forward)
def cdist_rule(call):
    """(x1 (..., r1, c), x2 (..., r2, c)) -> distances (..., r1, r2): a batch split of
    both stays, a split of x1's rows or x2's rows gives a split of the output's."""
    n = len(call.out_shapes[0])
    if any(len(s) != n for s in call.in_shapes):   # batch dims broadcast: whole values
        return [((B, B), (B,))]
    cands = [((B, B), (B,)), ((Split(n - 2), B), (Split(n - 2),)), ((B, Split(n - 2)), (Split(n - 1),))]
    if call.in_shapes[0][:-2] == call.in_shapes[1][:-2]:
        cands += [((Split(d), Split(d)), (Split(d),)) for d in range(n - 2)]
    return cands


@register(aten._cdist_backward)
def cdist_backward_rule(call):
    """(grad, x1, x2, distances) -> x1's gradient: x1's rows split stay; x2's rows split
    leave a partial sum over them."""
    n = len(call.out_shapes[0])
    if any(len(s) != n for s in call.in_shapes):
        return [((B,) * 4, (B,))]
    rows, cols = Split(n - 2), Split(n - 1)
    cands = [((B,) * 4, (B,)), ((rows, rows, B, rows), (rows,)), ((cols, B, rows, cols), (P,))]
    if call.in_shapes[1][:-2] == call.in_shapes[2][:-2]:
        cands += [((Split(d),) * 4, (Split(d),)) for d in range(n - 2)]
    return cands
