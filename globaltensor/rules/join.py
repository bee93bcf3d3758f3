"""Joining and parting along a dim: cat and stack, split and unbind. A split survives
on every dim but the one joined along or parted (cat, split), inserted (stack) or
removed (unbind); partial sums join into a partial sum (each rank's part is its addend
of every input). Plain tensors in the list make the output broadcast (each rank would
put such a one into its part whole).

Along the dim itself, blocks: splits of equal block lengths concatenate into a strided
split of their blocks together (each rank's parts side by side are its part of every
block), and a strided split parts into chunks of whole blocks, each a split of its
blocks (a fused query-key-value projection split ``split(dim, blocks=3)`` parts into
the query, key and value, each split by heads, as Megatron lays them out).
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, StridedSplit, broadcast
from ..tensor import GlobalTensor
from ._dims import normalize_dim
from .registry import register, with_direct
from .view import _args, _same_sbp

aten = torch.ops.aten


def _holds_plain(call, n_in: int) -> bool:
    """Whether cat's or stack's list holds plain (one-element) tensors besides the
    ``n_in`` GlobalTensors: each rank puts such a one into its part whole, so only a
    broadcast output holds it once (a partial sum counted it on every rank: the
    gradient of ``x.prod()`` of a split tensor came out times the ranks). A plain
    ``(0,)`` tensor adds nothing (torch's cat skips it)."""
    skips = call.func.overloadpacket is aten.cat
    return any(not isinstance(t, GlobalTensor) and not (skips and _skipped(t.shape))
               for t in _args(call)[0][0])


def _skipped(shape) -> bool:
    """torch's cat skips a 1-D tensor of no elements, whatever the others' rank (the
    empty start of a key-value cache, ``torch.cat([torch.tensor([]), k], dim=-2)``)."""
    return tuple(shape) == (0,)


@register(aten.cat)
def cat_rule(call):
    args, kwargs = _args(call)
    n_in = len(call.inputs)
    if _holds_plain(call, n_in):
        return [((broadcast,) * n_in, (broadcast,))]
    ndim = len(call.out_shapes[0])
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim)
    # An empty input makes dispatch take the output for an identity (zeros) when it is
    # partial, but the other inputs still fill it: no partial signature then.
    empty = any(math.prod(s) == 0 for s in call.in_shapes)
    skipped = [_skipped(s) and ndim > 1 for s in call.in_shapes]
    if any(len(s) != ndim for s, skip in zip(call.in_shapes, skipped) if not skip):
        return _same_sbp(n_in, 1, {}, partial_ok=not empty, max_ok=not empty)
    cands = _same_sbp(n_in, 1, {d: d for d in range(ndim) if d != dim},
                      partial_ok=not empty, max_ok=not empty)
    if not any(skipped):
        cands += _joined_blocks(call, dim)
    # a skipped input holds nothing: broadcast where the others are split
    return [(tuple(broadcast if skip and isinstance(sbp, Split) else sbp
                   for sbp, skip in zip(ins, skipped)), outs) for ins, outs in cands]


def _blocks_of(call, dim: int) -> set:
    """``Call.strided_counts`` of ``dim``, and 1 (a plain split)."""
    return call.strided_counts(dim=dim) | {1}


def _joined_blocks(call, dim: int) -> list:
    """cat along ``dim`` of inputs each split there in blocks of one length (plain
    splits are one block): the output split in all their blocks. Each input takes the
    block count its length gives, if it holds it; every count seen for them is tried."""
    lengths = [s[dim] for s in call.in_shapes]
    found = []
    for block in {n // k for n in lengths for k in _blocks_of(call, dim) if n % k == 0}:
        if block == 0 or any(n % block for n in lengths):
            continue
        counts = [n // block for n in lengths]
        if sum(counts) > 1 and 0 not in counts:
            ins = tuple(Split(dim) if k == 1 else StridedSplit(dim, k) for k in counts)
            found.append((ins, (StridedSplit(dim, sum(counts)),)))
    return found


@register(aten.stack)
def stack_rule(call):
    args, kwargs = _args(call)
    if _holds_plain(call, len(call.inputs)):
        return [((broadcast,) * len(call.inputs), (broadcast,))]
    ndim = len(call.out_shapes[0])
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim)
    return _same_sbp(len(call.inputs), 1, {d: d + (d >= dim) for d in range(ndim - 1)})


def _parted_sizes(ctx) -> list:
    """Each output's local length along the parted dim: where the input holds a strided
    split of it, a chunk of whole blocks is this rank's part of each of them."""
    dim = _parted_dim(ctx.call)
    return [layout.local_shape(ctx.rank)[dim] for layout in ctx.out_layouts]


def _part_direct(ctx):
    """``with_direct``'s maker: the op itself where the parted dim is not strided-split
    (the local chunks are the global ones), else the local lengths computed once."""
    dim = _parted_dim(ctx.call)
    if not any(isinstance(s, StridedSplit) and s.dim == dim for s in ctx.in_layouts[0].sbp):
        return ctx.call.func._op
    sizes, op = _parted_sizes(ctx), _sized_op(ctx.call.func)
    return lambda x, *args, **kwargs: op(x, sizes, dim)


@with_direct(_part_direct)
def _part_local(ctx, x, *args, **kwargs):
    """split / unbind on the local part: by the local lengths of the chunks."""
    if ctx.call.func.overloadpacket is aten.unbind:
        return ctx.call.func(x, *args, **kwargs)
    return _sized_op(ctx.call.func)(x, _parted_sizes(ctx), _parted_dim(ctx.call))


def _sized_op(func):
    unsafe = func.overloadpacket in (aten.unsafe_split, aten.unsafe_split_with_sizes)
    return (aten.unsafe_split_with_sizes if unsafe else aten.split_with_sizes).default


def _parted_dim(call) -> int:
    args, kwargs = _args(call)
    at = 1 if call.func.overloadpacket is aten.unbind else 2
    return normalize_dim(args[at] if len(args) > at else kwargs.get("dim", 0),
                         len(call.in_shapes[0]))


@register(aten.split, aten.split_with_sizes, aten.unbind, aten.unsafe_split,
          aten.unsafe_split_with_sizes, local=_part_local)   # (unsafe_: GRU and LSTM gates)
def split_rule(call):
    """Chunks along a dim: a split of any other dim stays (strided ones too: with a
    local implementation, decide adds none itself); a strided split of the dim itself
    parts into chunks of whole blocks."""
    ndim = len(call.in_shapes[0])
    n_out = len(call.out_shapes)
    dim = _parted_dim(call)
    if call.func.overloadpacket is aten.unbind:
        moved = {d: d - (d > dim) for d in range(ndim) if d != dim}
    else:
        moved = {d: d for d in range(ndim) if d != dim}
    cands = _same_sbp(1, n_out, moved)
    for d, e in moved.items():
        for k in _blocks_of(call, d) - {1}:
            if call.in_shapes[0][d] % k == 0:
                cands.append(((StridedSplit(d, k),), (StridedSplit(e, k),) * n_out))
    if call.func.overloadpacket is aten.unbind:
        return cands
    length = call.in_shapes[0][dim]
    for k in _blocks_of(call, dim) - {1}:
        block = length // k
        if not block or length % k or any(not s[dim] or s[dim] % block for s in call.out_shapes):
            continue
        outs = tuple(Split(dim) if s[dim] == block else StridedSplit(dim, s[dim] // block)
                     for s in call.out_shapes)
        cands.append(((StridedSplit(dim, k),), outs))
    return cands
