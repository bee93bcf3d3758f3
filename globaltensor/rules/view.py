"""Views and shape ops: transpose/permute/t, view/reshape, unsqueeze/squeeze, expand,
slice/select (and their backward), constant padding; the in-place view ops (squeeze_,
unsqueeze_, t_, transpose_). cat and stack, split and unbind: ``join.py``.

A split survives when the split dim keeps its identity (it may move); a dim that is
sliced, concatenated along, squeezed or expanded cannot stay split. A reshape keeps a
split when every part stays one contiguous block of the reshaped dim (always when the
dim is untouched; across a merge or split of dims, when the parts divide evenly); a
split dim merged under outer dims becomes a strided split, which the reverse reshape
makes plain again, so attention's head reshapes never communicate.
Every op here is linear, so partial in -> partial out.
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..layout import balanced_split
from ..sbp import Split, StridedSplit, broadcast, partial_max, partial_sum
from ..tensor import GlobalTensor
from ._dims import normalize_dim
from .registry import register, with_direct

aten = torch.ops.aten


def _same_sbp(n_in, n_out, moved: dict, partial_ok=True, max_ok=True):
    """Candidates: broadcast, partials, and split(d) -> split(moved[d]) per mapped dim."""
    cands = [((broadcast,) * n_in, (broadcast,) * n_out)]
    if partial_ok:
        cands.append(((partial_sum,) * n_in, (partial_sum,) * n_out))
    if max_ok:
        cands.append(((partial_max,) * n_in, (partial_max,) * n_out))
    for d, e in moved.items():
        cands.append(((Split(d),) * n_in, (Split(e),) * n_out))
    return cands


def _args(call):
    return call.args_kwargs


@register(aten.t, aten.transpose, aten.permute)
def permute_rule(call):
    args, kwargs = _args(call)
    ndim = len(call.in_shapes[0])
    if call.func.overloadpacket is aten.permute:
        perm = [normalize_dim(d, ndim) for d in args[1]]
    else:
        d0, d1 = (0, 1) if call.func.overloadpacket is aten.t else \
            (normalize_dim(args[1], ndim), normalize_dim(args[2], ndim))
        perm = list(range(ndim))
        if ndim >= 2 or call.func.overloadpacket is not aten.t:
            perm[d0], perm[d1] = perm[d1], perm[d0]
    return _same_sbp(1, 1, {src: dst for dst, src in enumerate(perm)})


@register(aten.as_strided)
def as_strided_rule(call):
    # Sizes and strides address the global tensor's memory: only a whole copy has it
    # (compiled autograd reshapes gradients this way; they are broadcast already).
    return _same_sbp(1, 1, {}, partial_ok=False, max_ok=False)


@register(aten.unsqueeze)
def unsqueeze_rule(call):
    args, _ = _args(call)
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(args[1], ndim + 1)
    return _same_sbp(1, 1, {d: d + (d >= dim) for d in range(ndim)})


@register(aten.squeeze)
def squeeze_rule(call):
    in_shape, out_shape = call.in_shapes[0], call.out_shapes[0]
    kept = _kept_after_squeeze(call, in_shape)
    assert len(kept) == len(out_shape)
    return _same_sbp(1, 1, {d: i for i, d in enumerate(kept)})


def _squeeze_local(ctx, x, *args, **kwargs):
    # Squeeze the dims that are size 1 globally, not a part that happens to be size 1.
    kept = _kept_after_squeeze(ctx.call, ctx.call.in_shapes[0])
    gone = [d for d in range(len(ctx.call.in_shapes[0])) if d not in kept]
    return aten.squeeze.dims(x, gone) if gone else aten.alias(x)


register(aten.squeeze, local=_squeeze_local)(squeeze_rule)


def _kept_after_squeeze(call, in_shape):
    args, _ = _args(call)
    ndim = len(in_shape)
    if len(args) == 1:
        dims = {d for d in range(ndim) if in_shape[d] == 1}
    else:
        given = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        dims = {d for d in (normalize_dim(g, ndim) for g in given) if d < ndim and in_shape[d] == 1}
    return [d for d in range(ndim) if d not in dims]


def _inplace_view(func, functional):
    """``x.squeeze_(0)`` and the other in-place view ops change a tensor's shape (torch's
    matmul of a vector by a matrix squeezes its result in place): the GlobalTensor takes
    the functional op's layout and part, then its wrapper's sizes and strides change as
    torch changes a subclass's."""
    def run(self, *args, **kwargs):
        if not isinstance(self, GlobalTensor):
            return NotImplemented
        out = functional(self, *args, **kwargs)
        self._local, self._layout, self._key = out._local, out._layout, out._key
        return return_and_correct_aliasing(func, (self, *args), kwargs, self)
    return run


for _name in ("squeeze_", "unsqueeze_", "t_", "transpose_"):
    _packet = getattr(aten, _name)
    for _overload in _packet.overloads():
        register(getattr(_packet, _overload), decompose=True)(
            _inplace_view(getattr(_packet, _overload), getattr(aten, _name[:-1])))


@register(aten.expand)
def expand_rule(call):
    in_shape, out_shape = call.in_shapes[0], call.out_shapes[0]
    lead = len(out_shape) - len(in_shape)
    moved = {d: d + lead for d in range(len(in_shape)) if in_shape[d] == out_shape[d + lead]}
    return _same_sbp(1, 1, moved)


# (narrow.Tensor reads its start tensor's value: torch's own definition of it by
# narrow.default runs, also under inference mode, where it reaches dispatch whole)
@register(aten.slice, aten.select, aten.narrow.default)
def slice_rule(call):
    args, kwargs = _args(call)
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim)
    drops = call.func.overloadpacket is aten.select
    moved = {d: d - (drops and d > dim) for d in range(ndim) if d != dim}
    return _same_sbp(1, 1, moved)


@register(aten.constant_pad_nd)
def pad_rule(call):
    # pad holds (before, after) pairs from the last dim backwards; a padded dim changes
    # size, so only the others keep a split. Zero padding keeps a partial sum.
    ndim = len(call.in_shapes[0])
    pad = call.arg("pad")
    padded = {ndim - 1 - k // 2 for k, amount in enumerate(pad) if amount}
    zero = call.arg("value", 0) == 0
    return _same_sbp(1, 1, {d: d for d in range(ndim) if d not in padded},
                     partial_ok=zero, max_ok=False)


@register(aten.slice_backward, aten.select_backward)
def slice_backward_rule(call):
    # The gradient of a slice or select, placed into zeros of the input's shape: a split
    # on another dim carries over, and zeros keep a partial sum (not a partial max).
    ndim = len(call.out_shapes[0])
    dim = normalize_dim(call.arg("dim"), ndim)
    if call.func.overloadpacket is aten.select_backward:
        moved = {d: d + (d >= dim) for d in range(ndim - 1)}
    else:
        moved = {d: d for d in range(ndim) if d != dim}
    return _same_sbp(1, 1, moved, max_ok=False)


def _slice_backward_local(ctx, grad, input_sizes, *args):
    # input_sizes is the global shape; the sliced dim is whole on every part.
    return ctx.call.func(grad, list(ctx.out_layouts[0].local_shape(ctx.rank)), *args)


register(aten.slice_backward, aten.select_backward,
         local=_slice_backward_local)(slice_backward_rule)


@register(aten.diagonal, aten.diagonal_backward)
def diagonal_rule(call):
    """The diagonal of two dims, a view appended last (and its backward, zeros with the
    gradient on the diagonal): a split of any other dim stays."""
    backward = call.func.overloadpacket is aten.diagonal_backward
    ndim = len(call.out_shapes[0] if backward else call.in_shapes[0])
    pair = {normalize_dim(call.arg("dim1", 0), ndim), normalize_dim(call.arg("dim2", 1), ndim)}
    rest = [d for d in range(ndim) if d not in pair]   # in order, then the diagonal
    moved = {k: d for k, d in enumerate(rest)} if backward else {d: k for k, d in enumerate(rest)}
    return _same_sbp(1, 1, moved, partial_ok=True, max_ok=not backward)


register(aten.diagonal_backward, local=_slice_backward_local)(diagonal_rule)


@register(aten.diag_embed)
def diag_embed_rule(call):
    """A last dim laid on the diagonal of two new dims: a split of any other dim stays."""
    ndim = len(call.out_shapes[0])
    pair = {normalize_dim(call.arg("dim1", -2), ndim), normalize_dim(call.arg("dim2", -1), ndim)}
    rest = [d for d in range(ndim) if d not in pair]
    return _same_sbp(1, 1, dict(enumerate(rest)), partial_ok=True, max_ok=False)


def _view_check(call, in_layouts, out_layouts) -> bool:
    """Whether every rank's part, read in its memory order, holds the elements that its
    part of the output holds in the output's order: then the local view is the global
    one. Exact, and needed where two placement axes split one dim (the second axis cuts
    the first one's part, which no one axis's rule can see). One-axis placements keep
    the per-axis conditions of ``_view_splits``, which are exact there."""
    if len(call.axis_sizes) == 1:
        return True
    return _read_alike(in_layouts[0], out_layouts[0])


@lru_cache(maxsize=4096)   # the layers of a model ask it again for the same layouts
def _read_alike(src, dst) -> bool:
    """``_view_check`` of two layouts: the ranks' parts compared over the coordinates
    of the axes that cut either layout (an axis that splits neither gives every rank
    along it the same part: a 128 x 8 placement with one axis splitting has 8 parts to
    compare, not 1024)."""
    a, b = _plain(src), _plain(dst)
    if a is None or b is None:
        return False
    cuts = [range(n) if isinstance(x, (Split, StridedSplit)) or isinstance(y, (Split, StridedSplit))
            else range(1) for n, x, y in zip(a.placement.shape, a.sbp, b.sbp)]
    return all(_row_major_runs(a, c) == _row_major_runs(b, c) for c in itertools.product(*cuts))


def _plain(layout):
    """The layout with each strided dim viewed as (blocks, length / blocks), where its
    parts are boxes (in the same memory order); None where a strided dim is also split
    by another axis, whose parts nothing here computes."""
    if not layout.strided:
        return layout
    blocks = {}
    for s in layout.sbp:
        if isinstance(s, StridedSplit):
            if blocks.setdefault(s.dim, s.blocks) != s.blocks:
                return None
    cut = [s.dim for s in layout.sbp if isinstance(s, (Split, StridedSplit)) and s.dim in blocks]
    return None if len(cut) != len(set(cut)) else layout.refined(blocks)


def _row_major_runs(layout, coord) -> tuple:
    """The global flat indices of a rank's box in row-major order, as the first one and
    (count, stride) runs from the innermost out, runs that continue each other merged:
    two boxes read alike exactly when these are equal."""
    region = layout.region_at(coord)
    if 0 in region.sizes:
        return ()
    first = sum(o * st for o, st in zip(region.offsets, layout.strides))
    runs: list = []
    for size, stride in zip(reversed(region.sizes), reversed(layout.strides)):
        if size == 1:
            continue
        if runs and runs[-1][0] * runs[-1][1] == stride:
            runs[-1] = (runs[-1][0] * size, runs[-1][1])
        else:
            runs.append((size, stride))
    return first, tuple(runs)


# per_axis: which splits survive a reshape depends on the axis's rank count, and a
# strided split the input holds on that axis may become a plain one again.
@register(aten.view, aten._unsafe_view, aten._reshape_alias, check=_view_check, per_axis=True)
def view_rule(call, axis):
    if call.func is aten.view.dtype:
        return []
    a, b = call.in_shapes[0], call.out_shapes[0]
    held = call.inputs[0]._layout.sbp[axis] if isinstance(call.inputs[0], GlobalTensor) \
        else None
    cands = _same_sbp(1, 1, {})
    cands += [((s,), (t,)) for s, t in _view_splits(a, b, call.axis_sizes[axis],
                                                    math.prod(call.axis_sizes), held,
                                                    call.strided_blocks)]
    if len(call.axis_sizes) > 1:
        # Where another axis splits the same dim, this axis cuts that axis's part: a
        # split of any output dim of the group may be the one that lines up
        # (``_view_check`` keeps the combinations that do).
        known = set(cands)
        cands += [c for c in _nested_splits(a, b) if c not in known]
    return cands


def _nested_splits(a, b) -> list:
    """Every (split(d), split(e)) of a reshaped group of dims (``_view_check`` vets them)."""
    if 0 in a or 0 in b:
        return []
    return [((Split(d),), (Split(e),)) for in_dims, out_dims in _view_groups(a, b)
            for d in in_dims if a[d] > 1 for e in out_dims if b[e] > 1]


def _view_splits(a, b, n, total_mesh, held=None, blocks=()) -> list:
    """(input sbp, output sbp) pairs of splits that survive reshaping ``a`` to ``b``
    on an axis of ``n`` ranks: a split dim left untouched keeps its split (strided or
    not); a split dim merged under outer dims (``(B, H) -> B * H`` with ``H`` split)
    becomes a strided split with one block per outer index; a strided split (``held``,
    the input's sbp, or one of ``blocks`` that a planner asks about) whose blocks
    become their own dims becomes a plain split again. Parts must stay whole rows of
    the output dim, with balanced parts on both sides."""
    if 0 in a or 0 in b:
        return []
    pairs = []
    for in_dims, out_dims in _view_groups(a, b):
        in_big = [d for d in in_dims if a[d] > 1]
        out_big = [d for d in out_dims if b[d] > 1]
        if not in_big or not out_big:
            continue
        e = out_big[0]
        out_inner = math.prod(b[k] for k in out_dims if k > e)
        for d in in_big:
            outer = math.prod(a[k] for k in in_dims if k < d)
            inner = math.prod(a[k] for k in in_dims if k > d)
            if outer == 1 and a[d] == b[e] and inner == out_inner:
                pairs.append((Split(d), Split(e)))  # untouched: any split carries over
                if isinstance(held, StridedSplit) and held.dim == d:
                    pairs.append((held, StridedSplit(e, held.blocks)))
                continue
            if a[d] % total_mesh or (a[d] * inner) % out_inner:
                continue  # nested or uneven parts, or parts that are not whole rows
            if _same_parts(a[d], inner, a[d] * inner // out_inner, out_inner, n):
                pairs.append((Split(d), Split(e) if outer == 1 else StridedSplit(e, outer)))
        if isinstance(held, StridedSplit) and in_big == [held.dim]:
            pairs += _unblocked(held, a, b, out_dims, n)
        elif len(in_big) == 1:
            d = in_big[0]
            for k in blocks:
                if 1 < k < a[d] and a[d] % k == 0:
                    pairs += _unblocked(StridedSplit(d, k), a, b, out_dims, n)
    return pairs


def _same_parts(length_in: int, inner_in: int, length_out: int, inner_out: int,
                n: int) -> bool:
    """Whether balanced parts of ``length_in`` rows of ``inner_in`` elements are the
    balanced parts of ``length_out`` rows of ``inner_out``."""
    return ([(o * inner_in, s * inner_in) for o, s in balanced_split(length_in, n)]
            == [(o * inner_out, s * inner_out) for o, s in balanced_split(length_out, n)])


def _unblocked(held: StridedSplit, a, b, out_dims, n) -> list:
    """A strided split of a dim reshaped so that its blocks span the leading output
    dims: the output dim after them is split plainly."""
    block = a[held.dim] // held.blocks
    lead = 1
    for e in out_dims:
        if lead == held.blocks and b[e] > 1:
            inner = math.prod(b[k] for k in out_dims if k > e)
            return [(held, Split(e))] if _same_parts(block, 1, b[e], inner, n) else []
        lead *= b[e]
    return []


def _view_groups(a, b):
    """Pair runs of input dims with runs of output dims of equal element count."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(i)
                pa *= a[i]
                i += 1
            else:
                outs.append(j)
                pb *= b[j]
                j += 1
        groups.append((ins, outs))
    return groups


def _local_size_direct(ctx):
    """``_to_local_size`` for one decision: its local size and op looked up once."""
    local_size, op = list(ctx.out_layouts[0].local_shape(ctx.rank)), ctx.call.func._op
    if ctx.call.func is aten.expand.default:
        return lambda x, size, *args, **kwargs: op(x, local_size, *args, **kwargs)

    def view(x, size, *args, **kwargs):
        if x.is_contiguous():
            return op(x, local_size, *args, **kwargs)
        return x.reshape(local_size)
    return view


@with_direct(_local_size_direct)
def _to_local_size(ctx, x, size, *args, **kwargs):
    # The size argument is global; locally the op must produce this rank's part. A
    # wrapper can claim contiguity its local part lacks (a transposed part given to
    # from_local), so a view torch judged possible may need a copy locally.
    local_size = list(ctx.out_layouts[0].local_shape(ctx.rank))
    if ctx.call.func is aten.expand.default or x.is_contiguous():
        return ctx.call.func(x, local_size, *args, **kwargs)
    return x.reshape(local_size)


for _op in (aten.view.default, aten._unsafe_view.default):
    register(_op, local=_to_local_size, per_axis=True)(view_rule)
register(aten.expand.default, local=_to_local_size)(expand_rule)
