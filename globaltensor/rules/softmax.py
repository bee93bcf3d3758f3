"""Softmax and log_softmax (the losses are in losses.py).

Softmax over a dim that is not split runs locally. Over a split dim it decomposes into
global ops: a partial_max for the row maxima and a partial_sum for the normaliser, so
only row statistics move, never the logits.
"""
from __future__ import annotations

import torch

from .. import comm
from ..layout import Layout
from ..local_parts import empty_local
from ..partials import identity_value
from ..sbp import Partial, Split, broadcast, candidates, partial_sum
from ..tensor import GlobalTensor, to_layout
from ._dims import normalize_dim
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum


def splits_dim(x, dim) -> bool:
    """Whether an axis of ``x``'s sbp splits ``dim``."""
    dim = normalize_dim(dim, x.dim())
    return any(isinstance(s, Split) and s.dim == dim for s in x.sbp)


@register(aten._softmax, aten._log_softmax, aten._safe_softmax)  # (attention's math path)
def softmax_rule(call):
    ndim = len(call.in_shapes[0])
    whole = Split(normalize_dim(call.arg("dim"), ndim))
    return [((s,), (s,)) for s in candidates(ndim) if s != whole]


@register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward_rule(call):
    ndim = len(call.in_shapes[0])
    whole = Split(normalize_dim(call.arg("dim"), ndim))
    return [((s, s), (s,)) for s in candidates(ndim) if s != whole]


def _row_stat(x, dim: int, reduce: str):
    """max or sum of ``x`` over ``dim`` (kept as size 1), broadcast on every axis that
    split ``dim``: each rank reduces its part, then one all-reduce of the row
    statistics. Done here rather than left to dispatch, which could judge moving the
    (small) logits cheaper than reducing a partial and then move them back."""
    dim = normalize_dim(dim, x.dim())
    shape = list(x.shape)
    shape[dim] = 1
    cut = {a for a, s in enumerate(x.sbp) if isinstance(s, Split) and s.dim == dim}
    partial = tuple(Partial(reduce) if a in cut else s for a, s in enumerate(x.sbp))
    layout = Layout.make(shape, x.placement, partial)
    rank = comm.get_rank()
    if rank not in x.placement:
        local = empty_local(layout, x.dtype)
    elif x.local_part.shape[dim] == 0:
        local = torch.full(layout.local_shape(rank), identity_value(reduce, x.dtype),
                           dtype=x.dtype, device=x.local_part.device)
    elif reduce == "max":
        local = x.local_part.amax(dim, keepdim=True)
    else:
        local = x.local_part.sum(dim, keepdim=True)
    whole = tuple(B if a in cut else s for a, s in enumerate(partial))
    return to_layout(GlobalTensor(local, layout), sbp=whole, donate=True)


def _softmax_decomposition(log: bool):
    def decomposition(x, dim, half_to_float):
        if not splits_dim(x, dim):
            return NotImplemented
        shifted = x - _row_stat(x, dim, "max")
        total = _row_stat(shifted.exp(), dim, "sum")
        if log:
            return shifted - total.log()
        return shifted.exp() / total
    return decomposition


register(aten._softmax, decompose=True)(_softmax_decomposition(log=False))
register(aten._log_softmax, decompose=True)(_softmax_decomposition(log=True))


@register(aten._softmax_backward_data, decompose=True)
def softmax_backward_over_split_dim(grad, out, dim, input_dtype):
    if not splits_dim(out, dim):
        return NotImplemented
    return out * (grad - _row_stat(grad * out, dim, "sum"))


@register(aten._log_softmax_backward_data, decompose=True)
def log_softmax_backward_over_split_dim(grad, out, dim, input_dtype):
    if not splits_dim(out, dim):
        return NotImplemented
    return grad - out.exp() * _row_stat(grad, dim, "sum")
