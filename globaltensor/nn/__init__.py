"""Module helpers: ``to_global`` (parameters and buffers become GlobalTensors, meta
modules allocate only their parts) and ``fully_shard`` (ZeRO-3 / FSDP as an sbp).

>>> import globaltensor as gt, torch
>>> model = torch.nn.Linear(4, 2)
>>> gt.nn.to_global(model, gt.placement.all("cpu"), gt.sbp.broadcast)   # doctest: +SKIP
"""
from __future__ import annotations

from .sharded import fully_shard
from .module import to_global

__all__ = ["to_global", "fully_shard"]
