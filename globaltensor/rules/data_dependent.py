"""Ops whose output shape depends on the values: boolean-mask indexing ``x[mask]``,
``nonzero`` (and ``argwhere``, ``where(cond)``, ``nonzero(as_tuple=True)``, which reach
it), ``masked_select``, ``unique`` / ``unique_consecutive`` (whole or along a dim),
``bincount``, ``repeat_interleave`` with a tensor of repeats, ``pack_padded_sequence``
(a recurrent layer then runs on the packed whole batch); and mask assignment
``x[mask] = v`` (``index_put_`` with a boolean mask), whose shape is known.

Dispatch infers output shapes on meta tensors, which cannot run these ops. They run
here instead: every input is gathered to broadcast on the op's placement, each member
runs the op on the whole values (so every member computes the same result) and the
result is broadcast, with the shape of that run. A split result would need the parts'
sizes and a re-balancing on top of them (split parts are balanced); the gathered inputs
are the cost. Ranks outside the placement learn the outputs' shapes from the members
with one small all-gather of integers over the world (as ``from_local`` with
``shape=None`` does), so, like ``x.full()``, these ops are called on every rank when the
placement leaves some out. Gradients come from torch's own formulas (``index_put``,
``masked_scatter``), which dispatch runs like any op.

``x[mask] = v`` with a scalar ``v`` and ``mask`` covering ``x``'s leading dims keeps
``x``'s split (each rank sets its own elements; ``indexing.py``); other assignments gather.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import comm
from ..factory import members_metadata
from ..layout import Layout
from ..local_parts import device_of, empty_local
from ..placement import common_placement
from ..sbp import broadcast
from ..tensor import GlobalTensor, hidden_from_dynamo, to_layout, wrap_part
from .random import watch_leaves
from .registry import register

aten = torch.ops.aten

@hidden_from_dynamo
def run_on_whole_values(func, args, kwargs):
    """``func`` on the whole values of its operands, gathered to broadcast; the outputs
    broadcast with the shapes of the real run (on every rank of the world).

    Hidden from dynamo: after the graph break such an op causes, it runs eagerly, and
    dynamo would otherwise compile the frames it calls (``comm.tracing()`` included,
    which compiled says True).

    >>> run_on_whole_values(aten.nonzero.default, (mask,), {})   # doctest: +SKIP
    """
    if comm.tracing():
        # What fake tensors raise for such an op in plain torch: dynamo breaks the
        # graph there and the op runs eagerly.
        raise DynamicOutputShapeException(func)
    leaves, spec = tree_flatten((args, kwargs))   # (a rare op: torch's pytree will do)
    placement = common_placement((x.placement for x in leaves if isinstance(x, GlobalTensor)),
                                 func)
    everywhere = (broadcast,) * placement.ndim
    # Plain operands first: one that is not allowed raises before any communication.
    leaves = [_as_dispatch_takes_it(x, placement) if isinstance(x, torch.Tensor)
              and not isinstance(x, GlobalTensor) and x.numel() > 1 else x for x in leaves]
    for i, x in enumerate(leaves):
        if isinstance(x, GlobalTensor):
            watch_leaves(x)
            leaves[i] = to_layout(x, sbp=everywhere).local_part
    inside = comm.get_rank() in placement
    n_out = len(func._schema.returns)
    outs = None
    if inside:
        local_args, local_kwargs = tree_unflatten(leaves, spec)
        out = func(*local_args, **local_kwargs)
        outs = [out] if n_out == 1 else list(out)
    if placement.size < comm.get_world_size():
        shapes = members_metadata(outs, placement)[next(iter(placement))]
    else:
        shapes = [(tuple(o.shape), o.dtype) for o in outs]
    results = []
    for k, (shape, dtype) in enumerate(shapes):
        layout = Layout.make(shape, placement, everywhere)
        results.append(wrap_part(outs[k] if inside else empty_local(layout, dtype), layout))
    return results[0] if n_out == 1 else tuple(results)


def _as_dispatch_takes_it(t: torch.Tensor, placement) -> GlobalTensor:
    """A plain operand of more than one element, taken as dispatch takes one (broadcast
    inside ``gt.implicit_broadcast()`` and in backward, else its ValueError): through
    an op that dispatch runs, a product with a broadcast one."""
    layout = Layout.make((), placement, (broadcast,) * placement.ndim)
    one = torch.ones((), dtype=t.dtype, device=device_of(placement)) \
        if comm.get_rank() in placement else empty_local(layout, t.dtype)
    return aten.mul.Tensor(t, GlobalTensor(one, layout))


def _whole(func):
    def run(*args, **kwargs):
        return run_on_whole_values(func, args, kwargs)
    return run


for _op in (aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
            aten._unique.default, aten.unique_dim.default, aten.unique_consecutive.default,
            aten.unique_dim_consecutive.default, aten.bincount.default,
            aten.repeat_interleave.Tensor):
    register(_op, decompose=True)(_whole(_op))


@register(aten._pack_padded_sequence.default, decompose=True)
def pack_padded_sequence(input, lengths, batch_first):
    """``nn.utils.rnn.pack_padded_sequence``'s op: where each row goes depends on the
    lengths, so it runs on the whole values. Its ``batch_sizes`` stays a plain tensor
    (the same on every rank): torch's recurrent layers and ``pad_packed_sequence`` read
    it on the host, which a GlobalTensor's values are not. A rank outside the placement
    holds no values: it runs the op itself on plain lengths (the same on every rank) and
    an input of one feature (torch refuses an empty one), which has the sizes."""
    data, batch_sizes = run_on_whole_values(aten._pack_padded_sequence.default,
                                            (input, lengths, batch_first), {})
    if comm.get_rank() in data.placement or isinstance(lengths, GlobalTensor):
        return data, batch_sizes.local_part
    sizes = aten._pack_padded_sequence.default(torch.empty(*input.shape[:2], 1), lengths, batch_first)[1]
    return data, sizes


@register(aten.masked_scatter)
def masked_scatter_rule(call):
    """The backward of ``masked_select``: its source's elements go to the mask's places in
    order, so which element lands where depends on the whole mask: broadcast only."""
    return [((broadcast,) * len(call.inputs), (broadcast,))]
