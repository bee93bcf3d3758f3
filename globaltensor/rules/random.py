"""Random ops on global tensors: dropout, bernoulli_, uniform_, normal_, rand_like, ...

Values come from the placement-invariant generator (``env.generator``): every rank
draws the whole tensor and keeps its region. So a broadcast tensor gets identical
values on every rank, the parts of a split tensor are independent, and the global
value does not depend on the layout at all.
"""
from __future__ import annotations

import torch

from .. import env
from ..boxing import local_part
from ..sbp import Split, broadcast, partial_max, partial_sum
from . import register

aten = torch.ops.aten


def _same_layout(call, axis):
    if len(call.inputs) != 1:
        return []  # a tensor-valued parameter (bernoulli_(p=tensor)): the fallback runs it
    ndim = len(call.in_shapes[0])
    sbps = [broadcast, partial_sum, partial_max] + [Split(d) for d in range(ndim)]
    return [((s,), (s,) * len(call.out_shapes)) for s in sbps]


def _draw(ctx, fill):
    """This rank's part of a whole tensor drawn by ``fill(whole)`` on every rank."""
    layout = ctx.out_layouts[0]
    meta = ctx.call.inputs[0]
    whole = torch.empty(layout.shape, dtype=meta.dtype)
    fill(whole)
    return local_part(whole, layout, ctx.rank)


def _inplace(fill):
    def local(ctx, self, *args, **kwargs):
        part = _draw(ctx, lambda whole: fill(whole, *args, **kwargs))
        return self.copy_(part)
    return local


g = env.generator  # evaluated per call: gt.manual_seed replaces the generator

register(aten.uniform_, local=_inplace(
    lambda t, a=0.0, b=1.0, generator=None: t.uniform_(a, b, generator=g())))(_same_layout)
register(aten.normal_, local=_inplace(
    lambda t, mean=0.0, std=1.0, generator=None: t.normal_(mean, std, generator=g())))(_same_layout)
register(aten.bernoulli_, local=_inplace(
    lambda t, p=0.5, generator=None: t.bernoulli_(p, generator=g())))(_same_layout)
register(aten.exponential_, local=_inplace(
    lambda t, lambd=1.0, generator=None: t.exponential_(lambd, generator=g())))(_same_layout)
register(aten.random_, local=_inplace(
    lambda t, *a, generator=None, **k: t.random_(*a, generator=g(), **k)))(_same_layout)


def _like(draw):
    def local(ctx, self, *args, dtype=None, **kwargs):
        dtype = dtype or self.dtype
        return _draw(ctx, lambda whole: whole.copy_(draw(whole.shape, dtype)))
    return local


@register(aten.rand_like, aten.randn_like)
def random_like_rule(call, axis):
    ndim = len(call.in_shapes[0])
    return [((s,), (s,)) for s in [broadcast] + [Split(d) for d in range(ndim)]]


register(aten.rand_like, local=_like(
    lambda shape, dtype: torch.rand(shape, generator=g(), dtype=dtype)))(random_like_rule)
register(aten.randn_like, local=_like(
    lambda shape, dtype: torch.randn(shape, generator=g(), dtype=dtype)))(random_like_rule)


@register(aten.native_dropout)
def dropout_rule(call, axis):
    ndim = len(call.in_shapes[0])
    cands = [((s,), (s, s)) for s in [broadcast] + [Split(d) for d in range(ndim)]]
    return cands + [((partial_sum,), (partial_sum, broadcast))]


def _dropout_local(ctx, x, p, train):
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask_layout = ctx.out_layouts[1]
    whole = torch.empty(mask_layout.shape).bernoulli_(1 - p, generator=g()) > 0
    mask = local_part(whole, mask_layout, ctx.rank)
    return x * mask / (1 - p), mask


register(aten.native_dropout, local=_dropout_local)(dropout_rule)
