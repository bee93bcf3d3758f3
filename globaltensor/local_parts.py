"""This rank's local parts: the device they live on, and what a rank outside a placement
holds (an empty part of the right rank, so that shapes and dtypes still flow).

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
