"""Module helpers: turn a torch.nn.Module's parameters and buffers into GlobalTensors.

>>> import globaltensor as gt, torch
>>> model = torch.nn.Linear(4, 2)
>>> gt.nn.to_global(model, gt.placement.all("cpu"), gt.sbp.broadcast)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Callable, Union

import torch

from .. import comm
from ..layout import Layout
from ..placement import Placement
from ..tensor import GlobalTensor, from_full

__all__ = ["to_global"]

SbpChoice = Union[object, Callable[[str, torch.Tensor], object]]


def to_global(module: torch.nn.Module, placement: Placement, sbp: SbpChoice) -> torch.nn.Module:
    """Make every parameter and buffer of ``module`` (in place) a GlobalTensor of the
    same global shape on ``placement``. Its value is the one on the placement's first
    rank (sent once to every rank), and each rank keeps its part. ``sbp`` is one sbp (or
    tuple) for all, or a callable ``(qualified name, tensor) -> sbp``. Returns ``module``.

    >>> gt.nn.to_global(model, p, lambda name, t: gt.sbp.split(0) if name == "0.weight"
    ...                 else gt.sbp.broadcast)                          # doctest: +SKIP
    """
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a gt.placement, got {placement!r}")
    choose = sbp if callable(sbp) and not isinstance(sbp, (tuple, list)) else (lambda n, t: sbp)
    comm.init()
    root = placement.flat_ranks[0]
    owners = {}
    for prefix, sub in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(sub, kind).items():
                if t is not None:
                    owners[f"{prefix}.{name}" if prefix else name] = (sub, kind, name, t)
    for qualified, (sub, kind, name, t) in owners.items():
        layout_sbp = choose(qualified, t)
        if isinstance(t, GlobalTensor):
            value = t.detach().to_global(placement, layout_sbp)
        else:
            whole = t.detach().to("cpu").contiguous().clone()
            comm.broadcast_(whole, root, tuple(range(comm.get_world_size())))
            value = from_full(whole, Layout.make(whole.shape, placement, layout_sbp))
        if kind == "_parameters":
            sub._parameters[name] = torch.nn.Parameter(value, requires_grad=t.requires_grad)
        else:
            sub._buffers[name] = value
    return module
