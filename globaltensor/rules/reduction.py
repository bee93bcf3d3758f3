"""Reductions: sum, mean, amax/amin, max/min, var/std, argmax/argmin, any/all, norms,
histc (counts in fixed bins: each rank counts its part, a partial sum), trace.

A dim that is not reduced keeps its split (shifted when the dim disappears). Reducing a
split dim gives a partial: ``sum``/``mean`` -> partial_sum, ``amax``/``max`` ->
partial_max. ``mean`` runs locally as a sum divided by the *global* count, so the
partial is right. Other reductions over a split dim need the dim whole (boxing does
that), except those that decompose into partial sums or maxima: the norms, ``amin`` /
``min()`` (the maximum of ``-x``, or ``~x``), ``any`` / ``all`` (the maximum of a 0/1
flag), so that ``x.min()`` or ``(x > 0).all()`` of a split tensor all-reduce one value
per output element instead of gathering ``x``.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, broadcast, partial_max, partial_sum
from ._dims import normalize_dim
from .registry import register

aten = torch.ops.aten

# op -> the partial a reduced split dim turns into (None: it cannot)
_PARTIAL_OF = {aten.sum: partial_sum, aten.mean: partial_sum, aten.amax: partial_max,
               aten.max: partial_max, aten.nansum: partial_sum}


def reduced_dims(call, ndim: int):
    """(the reduced dims, keepdim) of a reduction call; no dim means every dim."""
    dim = call.arg("dim")
    if call.func._overloadname == "default" and call.func.overloadpacket in (aten.max, aten.min):
        dim = None
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim)), bool(call.arg("keepdim", False))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    # a 0-d tensor's dim 0 (or -1) names no dim it has: nothing to reduce over
    return ({normalize_dim(d, ndim) for d in dims} if ndim else set()), bool(call.arg("keepdim", False))


@register(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.std,
          aten.argmax, aten.argmin, aten.any, aten.all, aten.linalg_vector_norm, aten.nansum,
          aten.prod, aten.logsumexp, aten.var_mean, aten.std_mean, aten.aminmax)
def reduction_rule(call):
    in_shape = call.in_shapes[0]
    ndim = len(in_shape)
    dims, keepdim = reduced_dims(call, ndim)
    n_out = len(call.out_shapes)
    cands = [((broadcast,) + (broadcast,) * (len(call.inputs) - 1), (broadcast,) * n_out)]
    for d in range(ndim):
        if d in dims:
            partial = _PARTIAL_OF.get(call.func.overloadpacket)
            if partial is not None and n_out == 1:
                cands.append(((Split(d),), (partial,)))
            continue
        out_d = d if keepdim else d - sum(1 for r in dims if r < d)
        cands.append(((Split(d),), (Split(out_d),) * n_out))
    partial = _PARTIAL_OF.get(call.func.overloadpacket)
    if partial is not None and n_out == 1:
        cands.append(((partial,), (partial,)))
    return [c for c in cands if len(c[0]) == len(call.inputs)]


def _local_mean(ctx, x, *args, **kwargs):
    # Sum over the local part, divided by the global number of reduced elements.
    dims, keepdim = reduced_dims(ctx.call, x.dim())
    count = math.prod(ctx.call.in_shapes[0][d] for d in dims) if dims else 1
    dtype = ctx.call.arg("dtype")
    total = x.sum(dim=sorted(dims), keepdim=keepdim, dtype=dtype) if dims else x.clone()
    return total / count


register(aten.mean, local=_local_mean)(reduction_rule)


@register(aten.linalg_vector_norm, decompose=True)
def vector_norm_decomposition(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """A norm over a split dim from partial sums of |x|^p (or a partial max for inf)."""
    ndim = x.dim()
    dims = set(range(ndim)) if dim is None else {
        normalize_dim(d, ndim) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    split = any(isinstance(s, Split) and s.dim in dims for s in x.sbp)
    if not split or not (ord == math.inf or (isinstance(ord, (int, float)) and ord > 0)):
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    reduce_dims = sorted(dims)
    if ord == math.inf:
        return x.abs().amax(dim=reduce_dims, keepdim=keepdim)
    if ord == 2:
        return (x * x).sum(dim=reduce_dims, keepdim=keepdim).sqrt()
    return x.abs().pow(ord).sum(dim=reduce_dims, keepdim=keepdim).pow(1.0 / ord)


def _splits_a_reduced_dim(x, dim) -> bool:
    ndim = x.dim()
    dims = set(range(ndim)) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else {
        normalize_dim(d, ndim) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    return any(isinstance(s, Split) and s.dim in dims for s in x.sbp)


def _dims(dim) -> list | None:
    return None if dim is None else list(dim) if isinstance(dim, (list, tuple)) else [dim]


@register(aten.amin, aten.min.default, decompose=True)
def amin_decomposition(x, dim=(), keepdim=False):
    """A minimum over a split dim: the maximum of ``-x``, negated (the same gradient:
    amax and amin share ties evenly); of ``~x`` for signed integers, whose lowest value
    has no negative (``~x`` is ``-x - 1``, which orders them all). Unsigned and bool
    values take the op's rule."""
    if x.dtype == torch.bool or not x.dtype.is_signed or not _splits_a_reduced_dim(x, dim):
        return NotImplemented
    flip = torch.neg if x.is_floating_point() or x.is_complex() else torch.bitwise_not
    return flip(flip(x).amax(dim=_dims(dim) or [], keepdim=keepdim))


def _flag_maximum(is_all: bool):
    def decomposition(x, dim=None, keepdim=False):
        """``any`` / ``all`` over a split dim: the maximum of a 0/1 uint8 flag (which
        every backend all-reduces), "is nonzero" for ``any``; for ``all``, "is zero",
        negated."""
        if not _splits_a_reduced_dim(x, dim):
            return NotImplemented
        flag = ((x == 0) if is_all else (x != 0)).to(torch.uint8)
        found = flag.amax(dim=_dims(dim) or [], keepdim=keepdim)
        return found == 0 if is_all else found != 0
    return decomposition


register(aten.any, decompose=True)(_flag_maximum(is_all=False))
register(aten.all, decompose=True)(_flag_maximum(is_all=True))


@register(aten.histc)
def histc_rule(call):
    """(input) -> counts (bins,): over a fixed range (``min < max``) any split counts
    its part into a partial sum (Hugging Face's mixtures of experts count tokens per
    expert so); the default range is the data's own, which needs it whole."""
    cands = [((broadcast,), (broadcast,))]
    if call.arg("min", 0) < call.arg("max", 0):
        cands += [((Split(d),), (partial_sum,)) for d in range(len(call.in_shapes[0]))]
    return cands


@register(aten.trace)
def trace_rule(call):
    """The sum of a matrix's diagonal: a part split on either dim sums the stretch of
    the diagonal it holds (``_trace_local``), into a partial sum; linear."""
    return [((broadcast,), (broadcast,)), ((partial_sum,), (partial_sum,)),
            ((Split(0),), (partial_sum,)), ((Split(1),), (partial_sum,))]


def _trace_local(ctx, x):
    # Element (i, j) of a part is (i + row offset, j + column offset) of the whole: the
    # whole's diagonal runs along the part's diagonal shifted by their difference (an
    # offset past the part's edge is an empty diagonal, summing to 0).
    rows, cols = ctx.region(0).offsets
    return x.diagonal(rows - cols).sum()


register(aten.trace, local=_trace_local)(trace_rule)
