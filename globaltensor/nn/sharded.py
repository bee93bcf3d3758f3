"""``fully_shard``: ZeRO-3 / FSDP expressed in sbp.

Every parameter is stored split(0) on the placement's data axis (other axes keep their
sbp: tensor parallelism composes). Each module owning parameters is a unit: before
its forward, its parameters are gathered (S -> B on the data axis, a differentiable
``to_global``) and put in place of the shards; after its forward the shards are put
back and the gathered copies are dropped. Autograd does not keep them either: a
saved-tensor hook packs any view of a gathered copy as (shard, view geometry) and
gathers again when backward unpacks it. The gradient of a gathered parameter is
partial on the data axis (split batch) and goes back to the shard as P -> S, one
all-to-all and a local sum, so each rank's ``.grad`` and optimizer state are its part.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from ..placement import Placement
from ..sbp import Split, broadcast
from ..tensor import GlobalTensor, to_layout
from .module import tensor_slots, to_global

__all__ = ["fully_shard"]


def fully_shard(module: torch.nn.Module, placement: Placement, *,
                data_axis: int = 0) -> torch.nn.Module:
    """Shard every parameter of ``module`` split(0) on ``placement``'s ``data_axis``;
    gather on use, free after forward, gather again in backward, reduce-scatter the
    gradient. Parameters already global on ``placement`` keep their other axes' sbp
    (tensor parallelism on a 2-D placement); plain and meta modules are converted as
    by ``gt.nn.to_global`` (buffers broadcast). Returns ``module``.

    >>> model = gt.nn.fully_shard(model, gt.placement.all("cpu"))       # doctest: +SKIP
    >>> opt = torch.optim.AdamW(model.parameters())   # steps on the parts  # doctest: +SKIP
    """
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a gt.placement, got {placement!r}")
    if not 0 <= data_axis < placement.ndim:
        raise ValueError(f"data_axis {data_axis} is not an axis of {placement} "
                         f"({placement.ndim}-D)")
    params = {id(t) for _, _, kind, _, t in tensor_slots(module) if kind == "_parameters"}

    def storage_sbp(name, t):
        if isinstance(t, GlobalTensor) and t.placement == placement:
            sbp = list(t.sbp)
        else:
            sbp = [broadcast] * placement.ndim
        if id(t) in params and t.dim() > 0:
            sbp[data_axis] = Split(0)
        return tuple(sbp)

    to_global(module, placement, storage_sbp)
    for sub in _unique_modules(module):
        names = [n for n, p in sub._parameters.items() if p is not None]
        if names and not hasattr(sub, "_gt_shard_unit"):
            sub._gt_shard_unit = _Unit(sub, names, data_axis)
            sub.register_forward_pre_hook(_before_forward)
            sub.register_forward_hook(_after_forward)
    return module


def _unique_modules(module):
    seen = set()
    for sub in module.modules():
        if id(sub) not in seen:
            seen.add(id(sub))
            yield sub


class _Unit:
    """The parameters one module owns, gathered together for its forward."""

    def __init__(self, module: torch.nn.Module, names: list, data_axis: int):
        self.module, self.names, self.data_axis = module, names, data_axis
        self.shards: dict = {}
        self.hooks: list = []

    def gathered_layout(self, shard: GlobalTensor) -> Layout:
        sbp = list(shard.sbp)
        sbp[self.data_axis] = broadcast
        return shard._layout.with_sbp(tuple(sbp))

    def gather(self) -> None:
        params = self.module._parameters
        self.shards = {n: params[n] for n in self.names}
        for name, shard in self.shards.items():
            if not isinstance(shard, GlobalTensor) or shard.dim() == 0:
                continue
            full = shard.to_global(sbp=self.gathered_layout(shard).sbp)
            full._local = _dense(full._local)  # saved views are replayed on a dense copy
            if full._local.numel():
                _gathered[full._local.untyped_storage().data_ptr()] = _Regather(self, shard)
            params[name] = full
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        self.hooks.append(hooks)

    def release(self) -> None:
        if self.hooks:
            self.hooks.pop().__exit__(None, None, None)
        params = self.module._parameters
        for name, shard in self.shards.items():
            full = params[name]
            if full is not shard and isinstance(full, GlobalTensor) and full._local.numel():
                _gathered.pop(full._local.untyped_storage().data_ptr(), None)
            params[name] = shard
        self.shards = {}


def _before_forward(module, args):
    module._gt_shard_unit.gather()


def _after_forward(module, args, output):
    module._gt_shard_unit.release()


# Storage address of each gathered copy alive in some forward -> how to gather it again.
_gathered: dict = {}


class _Regather:
    """Gathers a shard again (once per forward use, shared by every saved view of it)."""

    def __init__(self, unit: _Unit, shard: GlobalTensor):
        self.unit, self.shard = unit, shard
        self.full: torch.Tensor | None = None

    def local(self) -> torch.Tensor:
        if self.full is None:
            layout = self.unit.gathered_layout(self.shard)
            self.full = _dense(to_layout(self.shard.detach(), layout)._local)
        return self.full


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone in a contiguous storage from offset 0 (a copy only when it is not)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.is_contiguous() and t.storage_offset() == 0 and whole else t.clone()


def _pack(t):
    if type(t) is GlobalTensor and t._local.numel():
        regather = _gathered.get(t._local.untyped_storage().data_ptr())
        if regather is not None:
            local = t._local
            return (regather, t._layout, tuple(t.stride()), tuple(local.size()),
                    tuple(local.stride()), local.storage_offset())
    return t


def _unpack(packed):
    if type(packed) is not tuple:
        return packed
    regather, layout, strides, size, stride, offset = packed
    local = regather.local().as_strided(size, stride, offset)
    return GlobalTensor(local, layout, strides=None if strides == layout.strides else strides)

