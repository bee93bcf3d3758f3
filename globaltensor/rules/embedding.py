"""Embedding lookups and their weight gradient.

The table may be split by rows (vocab parallel): each rank looks up the indices that
fall in its rows and writes zeros for the others, so the output is a partial sum and
no index or row is gathered. Split by columns, the output is split on its last dim.
Split indices (data parallel) give a split output and a partial-sum table gradient.
Indices are checked against the table's global row count first: a row outside the
table would otherwise look like a row another rank holds, and give zeros.
"""
from __future__ import annotations

import functools

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from .indices import check_index_range
from .registry import register, with_direct

aten = torch.ops.aten
B, P = broadcast, partial_sum


@register(aten.embedding)
def embedding_rule(call):
    """(weight, indices) -> out (indices.shape + (dim,)). Indices may be a plain tensor
    of one element (T5's relative position bucket of one query and one key)."""
    idx_ndim = call.arg("indices").dim()
    cands = [((B, B), (B,)), ((Split(0), B), (P,)), ((Split(1), B), (Split(idx_ndim),)),
             ((P, B), (P,))]
    if len(call.inputs) == 1:
        return [((w,), out) for (w, _), out in cands]
    cands += [((B, Split(d)), (Split(d),)) for d in range(idx_ndim)]
    return cands


def _row_window(indices, region):
    """Which indices fall in this rank's rows, and each one's row in the local part
    (clamped into it for the others, whose lookups are masked out)."""
    lo, rows = region.offsets[0], region.sizes[0]
    mine = (indices >= lo) & (indices < lo + rows)
    return mine, (indices - lo).clamp(0, max(rows - 1, 0))


def _lookup_direct(ctx):
    """A decision whose table is whole here (not row-split) runs the lookup itself."""
    if ctx.in_layouts[0].local_shape(ctx.rank)[0] != ctx.call.in_shapes[0][0]:
        return functools.partial(_embedding_local, ctx)
    op = aten.embedding.default._op
    return lambda weight, indices, *args, **kwargs: op(weight, indices)


@with_direct(_lookup_direct)
def _embedding_local(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                     sparse=False):
    # No branch on index values: torch.compile cannot trace one, and on a GPU reading
    # them would wait for the device.
    region = ctx.region(0)
    if region.sizes[0] == ctx.call.in_shapes[0][0]:  # every row here (not row-split)
        return aten.embedding(weight, indices)
    mine, local_index = _row_window(indices, region)
    out = aten.embedding(weight, local_index) if weight.shape[0] else \
        weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    return out * mine.unsqueeze(-1).to(out.dtype)


register(aten.embedding, local=_embedding_local)(embedding_rule)


@register(aten.embedding, decompose=True)
def embedding_checks_indices(weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                             sparse=False):
    if sparse and weight.requires_grad and torch.is_grad_enabled():
        # (its backward would make a sparse gradient, which no sbp describes; without
        # a gradient the lookup is the dense one)
        raise ValueError(
            "embedding on GlobalTensors: sparse gradients (nn.Embedding(sparse=True)) "
            "are not supported; use sparse=False (the dense gradient, reduced like any "
            "parameter's) or gt.ps.EmbeddingTable for tables too large for one")
    held = indices if isinstance(indices, GlobalTensor) else weight   # (plain: broadcast)
    if not (isinstance(held, GlobalTensor) and held.placement.size == 1):
        # (on one rank the lookup gets the whole table: torch's kernel checks)
        check_index_range(indices, weight.shape[0], "embedding")
    return NotImplemented


@register(aten.embedding_dense_backward)
def embedding_backward_rule(call):
    """(grad, indices) -> grad_weight (num_weights, dim); indices plain as the
    lookup's may be."""
    idx_ndim = call.arg("indices").dim()
    cands = [((B, B), (B,)), ((Split(idx_ndim), B), (Split(1),)), ((P, B), (P,))]
    if not call.arg("scale_grad_by_freq"):  # frequencies would need global counts
        cands.append(((B, B), (Split(0),)))
        cands += [((Split(d), Split(d)), (P,)) for d in range(idx_ndim)]
    if len(call.inputs) == 1:
        return [((g,), out) for (g, i), out in cands if i == B]
    return cands


def _gradient_direct(ctx):
    """A decision whose table gradient is whole here (not row-split) runs the op itself."""
    out = ctx.out_layouts[0]
    if out.local_shape(ctx.rank)[0] == out.shape[0]:
        return aten.embedding_dense_backward.default._op
    return functools.partial(_embedding_backward_local, ctx)


@with_direct(_gradient_direct)
def _embedding_backward_local(ctx, grad, indices, num_weights, padding_idx,
                              scale_grad_by_freq):
    region = ctx.out_layouts[0].region(ctx.rank)
    rows = region.sizes[0]
    if rows == num_weights:
        return aten.embedding_dense_backward(grad, indices, num_weights, padding_idx,
                                             scale_grad_by_freq)
    mine, local_index = _row_window(indices, region)
    if padding_idx >= 0:
        mine &= indices != padding_idx
    # Others' indices add zeros at a clamped row: no selection by value (untraceable).
    flat = grad.reshape(-1, grad.shape[-1]) * mine.reshape(-1, 1).to(grad.dtype)
    out = grad.new_zeros(rows, grad.shape[-1])
    if rows:
        out.index_add_(0, local_index.reshape(-1), flat)
    return out


register(aten.embedding_dense_backward, local=_embedding_backward_local)(embedding_backward_rule)
