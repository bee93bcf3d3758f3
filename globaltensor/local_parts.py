"""This rank's local parts: the device they live on, what a rank outside a placement
holds (an empty part of the right rank, so that shapes and dtypes still flow), uneven
parts padded for one collective, and ``traced_from`` for parts made from nothing in a
compiled graph.

>>> import globaltensor as gt
>>> from globaltensor.layout import Layout
>>> layout = Layout.make((4, 2), gt.placement("cpu", [0]), gt.sbp.split(0))
>>> empty_local(layout, torch.float32).shape
torch.Size([0, 0])
"""
from __future__ import annotations

import functools

import torch

from . import comm
from .layout import Layout
from .placement import Placement


@functools.lru_cache(maxsize=None)
def device_of(placement: Placement) -> torch.device:
    """This rank's device for tensors of ``placement``."""
    return comm.local_device(placement.type)


def empty_local(layout: Layout, dtype: torch.dtype, like: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The local tensor of a rank outside the placement: no elements, same ndim
    (a 0-d tensor's is shape (0,), since a 0-d tensor cannot be empty). Made from
    ``like`` (an operand's local part) when given, so that while torch.compile traces
    it is a fake tensor of the trace as the operand is."""
    shape = (0,) * layout.ndim if layout.ndim else (0,)
    if like is not None:
        return like.new_empty(shape, dtype=dtype, device=device_of(layout.placement))
    return torch.empty(shape, dtype=dtype, device=device_of(layout.placement))


def empty_part_of(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``empty_local`` for ``t``, a part given on a rank outside the placement: cut from
    ``t`` when it requires grad, so that what is made of it requires grad there as on
    the members, and that rank's backward runs as theirs."""
    if not t.requires_grad:
        return empty_local(layout, t.dtype)
    return t.flatten()[:0].reshape(empty_local(layout, t.dtype).shape).to(device_of(layout.placement))


def traced_from(value: torch.Tensor, sources) -> torch.Tensor:
    """``value``, made in a graph that torch.compile traces from ``sources`` too.

    Where a rank holds an empty part it makes an op's output without running the op
    (the identity of its layout), or pads an empty part to send, from nothing; the
    other ranks compute theirs from the incoming values. AOTAutograd's partitioner puts
    a collective that depends on no backward input in the forward graph, so without
    this edge the ranks split one step's collectives differently between forward and
    backward, and the step hangs. An op of our own carries the edge: inductor folds
    arithmetic that reads nothing (the sum of an empty view) back into a constant, and
    drops an empty operand of a cat.

    >>> traced_from(torch.zeros(2), [torch.ones(3)]).tolist()
    [0.0, 0.0]
    """
    return _traced_from(value, list(sources))


@torch.library.custom_op("globaltensor::traced_from", mutates_args=(),
                         schema="(Tensor value, Tensor[] sources) -> Tensor")
def _traced_from(value, sources):
    return value.clone()


@_traced_from.register_fake
def _(value, sources):
    return torch.empty_like(value)


# Balanced parts (``layout.balanced_split``) padded to the largest and laid end to end:
# what one all-gather or reduce-scatter of uneven parts moves. Made and undone in a few
# ops whatever the number of parts (a cat of n slices launches n kernels, 1024 of them
# per parameter at 1024 ranks).

def padded_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (one uneven part made as
    long as the largest).

    >>> padded_to(torch.ones(2), 0, 3).tolist()
    [1.0, 1.0, 0.0]
    """
    if x.shape[dim] >= size:
        return x
    pad = list(x.shape)
    pad[dim] = size - x.shape[dim]
    if not x.numel() and comm.tracing():   # inductor drops an empty operand of a cat
        return traced_from(x.new_zeros(pad), [x])
    return torch.cat([x, x.new_zeros(pad)], dim=dim)


def padded_parts(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x``'s balanced parts of ``dim`` into ``n``, each padded with zeros to the
    largest and laid end to end along dim 0 (``dim`` moved first).

    >>> padded_parts(torch.arange(5), 0, 2).tolist()   # parts [0, 1, 2] and [3, 4]
    [0, 1, 2, 3, 4, 0]
    """
    y = x.movedim(dim, 0)
    base, extra = divmod(y.shape[0], n)
    if not extra:
        return y
    rest = tuple(y.shape[1:])
    head = y[:extra * (base + 1)]   # the larger parts: whole already
    tail = y[extra * (base + 1):].reshape((n - extra, base) + rest)
    tail = torch.cat([tail, tail.new_zeros((n - extra, 1) + rest)], dim=1)
    return torch.cat([head, tail.reshape(((n - extra) * (base + 1),) + rest)])


def unpadded_parts(padded: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of ``padded_parts`` along dim 0: ``padded`` [part][row][...] (n parts
    of the largest part's rows) back to the ``length`` rows of the balanced parts.

    >>> unpadded_parts(torch.tensor([[0, 1, 2], [3, 4, 0]]), 5).tolist()
    [0, 1, 2, 3, 4]
    """
    n, rest = padded.shape[0], tuple(padded.shape[2:])
    base, extra = divmod(length, n)
    if not extra:
        return padded.reshape((length,) + rest)
    head = padded[:extra].reshape((extra * (base + 1),) + rest)   # explicit: rest may hold a 0
    return torch.cat([head, padded[extra:, :base].reshape(((n - extra) * base,) + rest)])
