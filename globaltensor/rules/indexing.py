"""Advanced indexing with integer tensors: ``x[i]``, ``x[:, i, j]``, ``x[i, :, j]``
(``aten.index.Tensor``), and its write and backward ``x[i] = v`` / ``x.index_put_(...,
accumulate=True)`` (``index_put``). Boolean masks take the data-dependent path
(``data_dependent.py``), and so does their assignment but for one case below.

The index tensors broadcast together to one shape; the result holds that shape in
place of the indexed dims when they are adjacent, in front of the other dims when they
are not (torch's rule). Per placement axis:

- a split of a dim that no index covers stays, moved to where that dim lands;
- indices split alike on one of their broadcast dims select a split of the result (each
  rank looks up its own indices in the whole ``x``);
- ``x`` partial gives a partial result (indexing is linear);
- ``index_put`` keeps a split of an unindexed dim of its target (the values split alike),
  takes a partial target with partial values, and, accumulating, adds each rank's
  split indices and values into a partial target (the backward of a split lookup).

A split of an indexed dim is boxed first (to a partial sum of each rank's rows where
that costs less than gathering them). An index out of range raises IndexError on every
rank: a split index's range is checked first (one number reduced), as a rank holding a
bad index would raise alone while the others went on.

>>> x[i].sbp     # x split(1) of shape (6, 4), i broadcast of shape (3,)   # doctest: +SKIP
(split(dim=1),)
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from .data_dependent import run_on_whole_values
from .indices import check_split_indices
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum
_MASK_DTYPES = (torch.bool, torch.uint8)


class _Indexing:
    """Where the dims of ``x[indices]`` land (torch's advanced indexing rule)."""

    def __init__(self, x_ndim: int, indices):
        self.indexed = [d for d, t in enumerate(indices) if t is not None]
        self.tensors = [t for t in indices if t is not None]
        self.shape = tuple(torch.broadcast_shapes(*(tuple(t.shape) for t in self.tensors)))
        adjacent = self.indexed == list(range(self.indexed[0], self.indexed[-1] + 1))
        self.insert = self.indexed[0] if adjacent else 0
        self.free = [d for d in range(x_ndim) if d not in self.indexed]
        self.out_ndim = len(self.shape) + len(self.free)

    def out_dim(self, d: int) -> int:
        """Where unindexed dim ``d`` of ``x`` lands in the result."""
        if d < self.insert:
            return d
        return d + len(self.shape) - sum(1 for i in self.indexed if i < d)

    def index_splits(self, dim: int) -> list:
        """Each GlobalTensor index's sbp for a split of broadcast dim ``dim`` (None: no
        index holds that dim whole, so nothing would be split)."""
        sbps = []
        for t in self.tensors:
            if not isinstance(t, GlobalTensor):
                continue
            k = dim - (len(self.shape) - t.dim())
            sbps.append(Split(k) if k >= 0 and t.shape[k] != 1 else B)
        return sbps if any(s != B for s in sbps) else None


def _has_mask(indices) -> bool:
    return any(t is not None and t.dtype in _MASK_DTYPES for t in indices)


def _globals(indices) -> int:
    return sum(1 for t in indices if isinstance(t, GlobalTensor))


@register(aten.index.Tensor, decompose=True)
def index_checks_indices(x, indices):
    """``x[mask]`` runs on whole values (its shape depends on them); integer indices
    split now are checked on every rank, then take the rule."""
    if _has_mask(indices):
        return run_on_whole_values(aten.index.Tensor, (x, indices), {})
    check_split_indices(indices, x.shape, "x[indices]", negative=True)
    return NotImplemented


@register(aten.index_put, aten.index_put_, aten._index_put_impl_, decompose=True)
def index_put_checks_indices(x, indices, values, *rest):
    if not _has_mask(indices):
        check_split_indices(indices, x.shape, "index_put", negative=True)
    return NotImplemented


@register(aten.index.Tensor)
def index_rule(call):
    """(x, *GlobalTensor indices) -> x[indices]."""
    indices = call.arg("indices")
    whole = (B,) * _globals(indices)
    if _has_mask(indices):   # (the data-dependent path takes these first)
        return [((B, *whole), (B,))]
    at = _Indexing(len(call.in_shapes[0]), indices)
    cands = [((B, *whole), (B,)), ((P, *whole), (P,))]
    cands += [((Split(d), *whole), (Split(at.out_dim(d)),)) for d in at.free]
    for k in range(len(at.shape)):
        splits = at.index_splits(k)
        if splits is not None:
            cands.append(((B, *splits), (Split(at.insert + k),)))
    return cands


def _values_sbp(values, out_ndim: int, out_sbp):
    """The sbp of ``values`` (broadcast to the indexed result's shape) that lines up with
    the result split as ``out_sbp``: its own dim split, or broadcast where it has none."""
    if not isinstance(out_sbp, Split):
        return out_sbp
    k = out_sbp.dim - (out_ndim - values.dim())
    return Split(k) if k >= 0 and values.shape[k] != 1 else B


@register(aten.index_put, aten.index_put_, aten._index_put_impl_)
def index_put_rule(call):
    """(x, *GlobalTensor indices, values?) -> x with ``x[indices] = values`` (or ``+=``)."""
    indices, values = call.arg("indices"), call.arg("values")
    held = isinstance(values, GlobalTensor)
    whole = (B,) * _globals(indices)
    cands = [((B,) * len(call.inputs), (B,))]
    if _has_mask(indices):
        return cands + _scalar_into_mask(call, indices, values)
    at = _Indexing(len(call.in_shapes[0]), indices)
    value = (lambda sbp: (_values_sbp(values, at.out_ndim, sbp),)) if held else (lambda sbp: ())
    if held:   # a plain value written on every rank would be summed once per rank
        cands.append(((P, *whole, P), (P,)))
    cands += [((Split(d), *whole, *value(Split(at.out_dim(d)))), (Split(d),)) for d in at.free]
    if call.arg("accumulate") and held:
        for k in range(len(at.shape)):
            splits = at.index_splits(k)
            if splits is not None:
                cands.append(((P, *splits, *value(Split(at.insert + k))), (P,)))
    return cands


def _scalar_into_mask(call, indices, values) -> list:
    """``x[mask] = v`` with a scalar ``v`` and one mask over ``x``'s leading dims: any
    split of ``x`` (the mask split alike over the dims it covers)."""
    masks = [i for i in indices if i is not None]
    x_shape = call.in_shapes[0]
    if len(masks) != 1 or indices[0] is None or values.numel() != 1 \
            or tuple(masks[0].shape) != x_shape[:masks[0].dim()]:
        return []
    covered = masks[0].dim()
    value_sbp = (B,) if isinstance(values, GlobalTensor) else ()
    cands = []
    for d in range(len(x_shape)):
        mask_sbp = (Split(d) if d < covered else B,) if isinstance(masks[0], GlobalTensor) else ()
        cands.append(((Split(d), *mask_sbp, *value_sbp), (Split(d),)))
    return cands
