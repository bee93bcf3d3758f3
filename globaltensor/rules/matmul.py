"""Matrix products: mm, addmm, bmm, baddbmm, mv, dot (torch.matmul, @ and F.linear
reach these).

For C = A @ B with A (m, k) and B (k, n), per placement axis:
(S0, B) -> S0 (rows), (B, S1) -> S1 (columns), (S1, S0) -> P (the contracted dim),
(P, B) -> P, (B, P) -> P, (B, B) -> B. Batched products add (S0, S0) -> S0 on the
batch dim. A bias (addmm's ``self``) follows the output, except that under a partial
output it must be partial too, so it is added once.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from .pointwise import aligned_sbp
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum


def _product_cands(batch: int):
    """(A sbp, B sbp, out sbp) for A (..., m, k) @ B (..., k, n) with ``batch`` leading dims."""
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    cands = [(B, B, B), (Split(m), B, Split(m)), (B, Split(n), Split(n)),
             (Split(k_a), Split(k_b), P), (P, B, P), (B, P, P)]
    for d in range(batch):
        cands.append((Split(d), Split(d), Split(d)))
    return cands


def _bias_sbp(bias_shape, out_shape, out_sbp):
    """The sbp a bias of ``bias_shape`` needs so that bias + product has ``out_sbp``."""
    if out_sbp == P:
        return P
    if isinstance(out_sbp, Split):
        return aligned_sbp(bias_shape, out_shape, out_sbp.dim)
    return B


@register(aten.mm, aten.bmm)
def product_rule(call, axis):
    batch = len(call.in_shapes[0]) - 2
    return [((a, b), (o,)) for a, b, o in _product_cands(batch)]


@register(aten.mv)
def matrix_vector_rule(call, axis):
    # A (m, k) @ v (k,): rows of A give rows of the result, a split k a partial sum
    return [((B, B), (B,)), ((Split(0), B), (Split(0),)), ((Split(1), Split(0)), (P,)),
            ((P, B), (P,)), ((B, P), (P,))]


@register(aten.dot)
def dot_rule(call, axis):
    return [((B, B), (B,)), ((Split(0), Split(0)), (P,)), ((P, B), (P,)), ((B, P), (P,))]


@register(aten.addmm, aten.baddbmm)
def biased_product_rule(call, axis):
    if len(call.inputs) != 3:
        return []  # a plain-tensor operand: let the fallback handle it
    bias_shape, out_shape = call.in_shapes[0], call.out_shapes[0]
    batch = len(call.in_shapes[1]) - 2
    return [((_bias_sbp(bias_shape, out_shape, o), a, b), (o,))
            for a, b, o in _product_cands(batch)]
