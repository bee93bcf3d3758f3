"""Complex numbers: conj, view_as_real / view_as_complex; and metadata queries.

torch conjugates lazily: ``x.conj()`` is a view with a "conj bit" that later kernels
resolve on the way in. A local part cannot carry that bit: ops on local parts run
below the dispatch level that resolves it, so the bit would be silently ignored (the
imaginary part came back with the wrong sign). Here the local conj (and negation) view
is made physical. Conjugation is linear over the reals, so partial sums pass through.
"""
from __future__ import annotations

import torch

from ..sbp import candidates, partial_sum
from .registry import register

aten = torch.ops.aten


def _elementwise(call):
    """Every dim keeps its split; conjugation and negation are linear over the reals,
    so partial sums pass through."""
    return [((s,), (s,)) for s in candidates(len(call.in_shapes[0]), partials=(partial_sum,))]


def _conj_local(ctx, x):
    return torch.conj_physical(x)


def _neg_local(ctx, x):
    return torch.neg(x)


register(aten._conj, local=_conj_local)(_elementwise)
register(aten._neg_view, local=_neg_local)(_elementwise)


@register(aten.view_as_real)
def view_as_real_rule(call):
    """(...) complex -> (..., 2) real: every dim keeps its split."""
    return _elementwise(call)


@register(aten.view_as_complex)
def view_as_complex_rule(call):
    """(..., 2) real -> (...) complex: every dim but the pair keeps its split."""
    return [((s,), (s,)) for s in candidates(len(call.in_shapes[0]) - 1, partials=(partial_sum,))]


def _view_as_complex_local(ctx, x):
    # A part of a transposed or sliced tensor may lack the strides the view needs.
    if x.stride(-1) != 1 or any(s % 2 for s in x.stride()[:-1]):
        x = x.contiguous()
    return torch.view_as_complex(x)


register(aten.view_as_complex, local=_view_as_complex_local)(view_as_complex_rule)


# Metadata queries need no layout: every rank answers from what it has.
@register(aten.is_pinned, decompose=True)
def is_pinned(x, device=None) -> bool:
    return x.local_part.is_pinned()


@register(aten.is_same_size, decompose=True)
def is_same_size(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape)
