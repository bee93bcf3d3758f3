"""Ops that work along one dim: scans (cumsum, cumprod, logcumsumexp, cummax, cummin),
sorts and selections (sort, argsort, topk, kthvalue, median/mode over a dim), flip and
roll, rot90, gather and scatter, index_select, index_add, index_copy and index_fill,
the FFTs, ``F.glu`` (halves of its dim), renorm (each slice along its dim on its own);
bucketize / searchsorted against whole boundaries and isin against whole test
elements (each element on its own); and
tril/triu, which mask by position.

Each treats the slices across its dim independently, so a split on any other dim stays
local and the op runs on the parts as they are; a split on the dim itself is boxed to
broadcast first (a sort across ranks would need the whole dim). Partial inputs are
reduced first (only cumsum would be linear). tril/triu keep every split: a part's
diagonal is shifted by its global offsets.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ._dims import normalize_dim
from .indices import check_split_indices
from .registry import register

aten = torch.ops.aten
B = broadcast


def _split_elsewhere(call, n_in: int, n_out: int, busy: set, moved=lambda d: d):
    """Broadcast, plus split(d) -> split(moved(d)) on every dim d not in ``busy``."""
    ndim = len(call.in_shapes[0])
    return [((B,) * n_in, (B,) * n_out)] + [
        ((Split(d),) * n_in, (Split(moved(d)),) * n_out) for d in range(ndim) if d not in busy]


@register(aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin,
          aten.sort, aten.argsort, aten.topk)
def along_dim_rule(call):
    ndim = len(call.in_shapes[0])
    return _split_elsewhere(call, 1, len(call.out_shapes), {normalize_dim(call.arg("dim", -1), ndim)})


@register(aten.kthvalue, aten.median.dim, aten.nanmedian.dim, aten.mode)
def kthvalue_rule(call):
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(call.arg("dim", -1), ndim)
    drop = not call.arg("keepdim", False)
    return _split_elsewhere(call, 1, 2, {dim}, lambda d: d - (drop and d > dim))


@register(aten.glu, aten.glu_backward)
def glu_rule(call):
    """(x, dim) -> x's first half gated by its second, or (grad, x, dim) -> x's grad."""
    ndim = len(call.in_shapes[-1])
    return _split_elsewhere(call, len(call.inputs), 1, {normalize_dim(call.arg("dim", -1), ndim)})


@register(aten.rot90)
def rot90_rule(call):
    ndim = len(call.in_shapes[0])
    return _split_elsewhere(call, 1, 1, {normalize_dim(d, ndim) for d in call.arg("dims", [0, 1])})


@register(aten.renorm)
def renorm_rule(call):
    """Each slice along ``dim`` scaled by its own norm: a split of ``dim`` stays."""
    dim = normalize_dim(call.arg("dim"), len(call.in_shapes[0]))
    return [((B,), (B,)), ((Split(dim),), (Split(dim),))]


@register(aten.bucketize.Tensor, aten.searchsorted.Tensor)
def bucketize_rule(call):
    """Each element looked up in 1-D boundaries given whole: the elements' splits stay."""
    at = 0 if call.func.overloadpacket is aten.bucketize else 1   # the elements' operand
    if len(call.inputs) != 2 or len(call.in_shapes[1 - at]) != 1:
        return [((B,) * len(call.inputs), (B,))]   # (a sorter, or batches of sorted rows)
    order = (lambda s: (s, B)) if at == 0 else (lambda s: (B, s))
    return [((B, B), (B,))] + [(order(Split(d)), (Split(d),))
                               for d in range(len(call.in_shapes[at]))]


@register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin_rule(call):
    """Each element looked up among test elements given whole (``generate()``'s check
    of the new tokens against the stop tokens): the elements' splits stay."""
    if call.func is aten.isin.Scalar_Tensor:
        return [((B,), (B,))]
    rest = (B,) * (len(call.inputs) - 1)
    return [((B,) + rest, (B,))] + [((Split(d),) + rest, (Split(d),))
                                    for d in range(len(call.in_shapes[0]))]


@register(aten.flip)
def flip_rule(call):
    ndim = len(call.in_shapes[0])
    return _split_elsewhere(call, 1, 1, {normalize_dim(d, ndim) for d in call.arg("dims")})


@register(aten.roll)
def roll_rule(call):
    ndim = len(call.in_shapes[0])
    dims = call.arg("dims")
    if not dims:  # rolls the flattened tensor: every dim is involved
        return [((B,), (B,))]
    return _split_elsewhere(call, 1, 1, {normalize_dim(d, ndim) for d in dims})


@register(aten.gather, aten.scatter, aten.scatter_add, aten.scatter_reduce)
def gather_scatter_rule(call):
    # gather(self, dim, index); scatter(self, dim, index, src | value), scatter_add and
    # scatter_reduce(self, dim, index, src, reduce). Index and src may
    # be smaller than self on other dims: a split there only lines up when the sizes match.
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(call.arg("dim"), ndim)
    n_in = len(call.inputs)
    shape = call.in_shapes[0]
    busy = {dim} | {d for d in range(ndim)
                    if any(len(s) != ndim or s[d] != shape[d] for s in call.in_shapes)}
    return _split_elsewhere(call, n_in, 1, busy)


@register(aten.index_select)
def index_select_rule(call):
    """(self, dim, index): rows of ``self`` along ``dim``. A split elsewhere stays; a split
    index selects a split of the rows; linear in ``self``."""
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(call.arg("dim"), ndim)
    cands = [((B, B), (B,)), ((partial_sum, B), (partial_sum,))]
    cands += [((Split(d), B), (Split(d),)) for d in range(ndim) if d != dim]
    if len(call.in_shapes[1]) == 1:
        cands.append(((B, Split(0)), (Split(dim),)))
    return cands


def _checks_index(what: str):
    """A decomposition that checks a split index on every rank (a rank holding a bad
    index would raise alone), then lets the op take its rule."""
    def check(x, dim, index, *rest, **kwargs):
        check_split_indices([index], [x.shape[dim] if x.dim() else 1], what, negative=False)
        return NotImplemented
    return check


register(aten.index_select, decompose=True)(_checks_index("index_select"))
register(aten.index_add, aten.index_add_, decompose=True)(_checks_index("index_add"))


@register(aten.index_add, aten.index_add_)
def index_add_rule(call):
    """(self, dim, index, source): ``source``'s rows added into ``self`` at ``index``
    along ``dim``. A split elsewhere (of self and source alike) stays; linear in self and
    source together; a split index with its source rows adds each rank's rows into a
    partial sum (index_select's backward: the gradient of split rows)."""
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(call.arg("dim"), ndim)
    source = call.in_shapes[2]
    same = [d for d in range(ndim) if d != dim and len(source) == ndim and source[d] == call.in_shapes[0][d]]
    cands = [((B, B, B), (B,)), ((partial_sum, B, partial_sum), (partial_sum,))]
    cands += [((Split(d), B, Split(d)), (Split(d),)) for d in same]
    if len(call.in_shapes[1]) == 1 and len(source) == ndim:
        cands.append(((partial_sum, Split(0), Split(dim)), (partial_sum,)))
    return cands


@register(aten.index_copy, aten.index_copy_, aten.index_fill, aten.index_fill_)
def index_copy_rule(call):
    """index_copy(self, dim, index, source) and index_fill(self, dim, index, value): rows
    of ``self`` along ``dim`` replaced (a key-value cache's update). A split elsewhere
    stays (with the source's, which must match there); index_copy is linear in self and
    source together (a fill value is not)."""
    shape = call.in_shapes[0]
    ndim = len(shape)
    dim = normalize_dim(call.arg("dim"), ndim)
    copies = call.func.overloadpacket in (aten.index_copy, aten.index_copy_)
    extra = call.in_shapes[2:]   # index_copy's source, or index_fill's 0-d value tensor
    cands = [((B,) * len(call.inputs), (B,))]
    for d in range(ndim):
        if d == dim or (copies and any(len(s) != ndim or s[d] != shape[d] for s in extra)):
            continue
        cands.append(((Split(d), B) + ((Split(d),) if copies else (B,)) * len(extra), (Split(d),)))
    if copies:
        cands.append(((partial_sum, B, partial_sum), (partial_sum,)))
    return cands


@register(aten._fft_r2c, aten._fft_c2r, aten._fft_c2c)
def fft_rule(call):
    """``torch.fft``'s transforms over ``dim``: a split of any other dim stays; linear."""
    ndim = len(call.in_shapes[0])
    dims = {normalize_dim(d, ndim) for d in call.arg("dim")}
    return _split_elsewhere(call, 1, 1, dims) + [((partial_sum,), (partial_sum,))]


@register(aten.tril, aten.triu)
def triangle_rule(call):
    # Every split carries over; a part keeps the elements the whole would keep at the
    # part's global position (see _triangle_local). Zeros keep a partial sum.
    return _split_elsewhere(call, 1, 1, set()) + [((partial_sum,), (partial_sum,))]


def _triangle_local(ctx, x, diagonal=0):
    # Element (i, j) of a part is (i + row offset, j + column offset) of the whole.
    offsets = ctx.region(0).offsets
    shift = offsets[-2] - offsets[-1]
    return ctx.call.func(x, diagonal + shift)


register(aten.tril, aten.triu, local=_triangle_local)(triangle_rule)
