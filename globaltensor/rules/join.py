"""Joining ops: cat and stack. A split survives on every dim but the one joined along
(cat) or inserted (stack, whose dims after it move by one); partial sums join into a
partial sum (each rank's part is its addend of every input). Plain tensors in the list
make the output broadcast (each rank would put such a one into its part whole).
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, broadcast
from ..tensor import GlobalTensor
from ._dims import normalize_dim
from .registry import register
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
    # a skipped input holds nothing: broadcast where the others are split
    return [(tuple(broadcast if skip and isinstance(sbp, Split) else sbp
                   for sbp, skip in zip(ins, skipped)), outs) for ins, outs in cands]


@register(aten.stack)
def stack_rule(call):
    args, kwargs = _args(call)
    if _holds_plain(call, len(call.inputs)):
        return [((broadcast,) * len(call.inputs), (broadcast,))]
    ndim = len(call.out_shapes[0])
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim)
    return _same_sbp(len(call.inputs), 1, {d: d + (d >= dim) for d in range(ndim - 1)})
