"""Cutting a batch into micro-batches on a stage's placement (``Pipeline.step``)."""
from __future__ import annotations

import torch

from .. import comm
from ..layout import Layout
from ..local_parts import device_of
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import GlobalTensor, from_full


def batch_rows(t) -> int:
    """The batch size (dim 0) of a stage input or target."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise ValueError(f"expected a tensor with a batch dim, got {describe(t)}")
    return t.shape[0]


def describe(t) -> str:
    """What ``t`` is, for error messages."""
    if isinstance(t, GlobalTensor):
        return f"GlobalTensor(shape={tuple(t.shape)}, placement={t.placement}, sbp={t.sbp})"
    if isinstance(t, torch.Tensor):
        return f"a plain tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def cut_micro_batches(x, sizes, placement: Placement, sbp) -> list:
    """Micro-batches of ``x`` (rows in order, ``sizes`` each) on ``placement``: a
    GlobalTensor is gathered there once and sliced locally; a plain tensor (the whole
    value, the same on every rank) is sliced and each rank keeps its part."""
    if isinstance(x, GlobalTensor):
        if sbp is None:
            sbp = x.sbp if x.placement.ndim == placement.ndim else None
        whole = x.to_global(placement, (broadcast,) * placement.ndim)
    else:
        whole = x
    sbp = sbp if sbp is not None else (broadcast,) * placement.ndim
    parts, offset = [], 0
    for size in sizes:
        part = whole[offset:offset + size]
        offset += size
        if isinstance(part, GlobalTensor):
            parts.append(part.to_global(placement, sbp))
            continue
        layout = Layout.make(part.shape, placement, sbp)
        if layout.partial_axes or comm.get_rank() not in placement:
            parts.append(from_full(part, layout))
        else:  # a view of the caller's batch, as plain torch would use it: no copy
            local = part[layout.region(comm.get_rank()).slices()]
            parts.append(GlobalTensor(local.to(device_of(placement)), layout))
    return parts
