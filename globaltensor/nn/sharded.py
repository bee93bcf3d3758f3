"""``fully_shard``: ZeRO-3 / FSDP expressed in sbp.

Every parameter is stored split(0) on the placement's data axis (other axes keep their
sbp: tensor parallelism composes). Each module owning parameters is a unit: before
its forward, its parameters are gathered (S -> B on the data axis, a differentiable
``to_global``) and put in place of the shards; after its forward the shards are put
back and the gathered copies are dropped. Autograd does not keep them either: a
saved-tensor hook packs any view of a gathered copy as (shard, view geometry) and
gathers again when backward unpacks it. A unit's parameters are gathered in one
bucket (one all-gather), and the next unit's gather starts before this unit computes
(prefetch, in the order of the previous forward). The gradient of a gathered parameter is
partial on the data axis (split batch) and goes back to the shard as P -> S, one
all-to-all and a local sum, so each rank's ``.grad`` and optimizer state are its part.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..layout import Layout, balanced_split
from ..placement import Placement, check_placement
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
    check_placement(placement)
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
    root = _Root()
    module.register_forward_pre_hook(root.before_forward)
    module.register_forward_hook(root.after_forward)
    for sub in _unique_modules(module):
        names = [n for n, p in sub._parameters.items() if p is not None]
        if names and not hasattr(sub, "_gt_shard_unit"):
            sub._gt_shard_unit = _Unit(sub, names, data_axis, root)
            sub.register_forward_pre_hook(_before_forward)
            sub.register_forward_hook(_after_forward)
    return module


def _unique_modules(module):
    seen = set()
    for sub in module.modules():
        if id(sub) not in seen:
            seen.add(id(sub))
            yield sub


class _Root:
    """One ``fully_shard`` call: the order its units ran in the last forward, so each
    unit starts the next one's gather (prefetch) before it computes, as FSDP2 does."""

    def __init__(self):
        self.order: list = []       # units of the last forward, in order
        self.running: list = []     # units of this forward so far
        self.pending: dict = {}     # unit -> its started _Fetch

    def before_forward(self, module, args):
        self.running = []

    def after_forward(self, module, args, output):
        for fetch in self.pending.values():   # a prefetch no unit used: finish it
            fetch.wait()
        self.pending.clear()
        self.order, self.running = self.running, []

    def next_after(self, unit):
        order = self.order
        for i, u in enumerate(order[:-1]):
            if u is unit:
                return order[i + 1]
        return None


class _Unit:
    """The parameters one module owns, gathered together for its forward."""

    def __init__(self, module: torch.nn.Module, names: list, data_axis: int, root: _Root):
        self.module, self.names, self.data_axis, self.root = module, names, data_axis, root
        self.shards: dict = {}
        self.hooks: list = []

    def gathered_layout(self, shard: GlobalTensor) -> Layout:
        sbp = list(shard.sbp)
        sbp[self.data_axis] = broadcast
        return shard.global_layout.with_sbp(tuple(sbp))

    def start(self) -> "_Fetch":
        params = self.module._parameters
        return _Fetch(self, {n: params[n] for n in self.names})

    def gather(self) -> None:
        root = self.root
        root.running.append(self)
        fetch = root.pending.pop(self, None)
        if fetch is None or fetch.stale():
            if fetch is not None:
                fetch.wait()
            fetch = self.start()
        following = root.next_after(self)
        if following is not None and following not in root.pending:
            root.pending[following] = following.start()   # overlaps this unit's compute
        params = self.module._parameters
        self.shards = fetch.shards
        for name, full in fetch.finish().items():
            if full.local_part.numel():
                _gathered[full.local_part.untyped_storage().data_ptr()] = \
                    _Regather(self, self.shards[name])
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
            if full is not shard and isinstance(full, GlobalTensor) and full.local_part.numel():
                _gathered.pop(full.local_part.untyped_storage().data_ptr(), None)
            params[name] = shard
        self.shards = {}


class _Fetch:
    """A unit's gather in flight. Parameters whose dim 0 only the data axis splits go in
    one bucket: each member packs its parts (padded to the largest part) into one flat
    buffer, one asynchronous all-gather moves them, and each parameter is cut out of
    the result. Others (dim 0 split by a second axis too) are boxed one by one."""

    def __init__(self, unit: _Unit, shards: dict):
        self.unit, self.shards = unit, shards
        self.versions = {n: s._version for n, s in shards.items()}
        self.bucket, self.handle, self.recv = [], None, None
        rank = comm.get_rank()
        for name, shard in shards.items():
            if isinstance(shard, GlobalTensor) and shard.dim() > 0 and rank in shard.placement \
                    and self._concatenates(shard) and shard.dtype == _first_dtype(shards):
                self.bucket.append(name)
        if not self.bucket:
            return
        group = shards[self.bucket[0]].placement.group(rank, unit.data_axis)
        sizes = []
        for name in self.bucket:
            shard = shards[name]
            gathered = unit.gathered_layout(shard).local_shape(rank)
            row = math.prod(gathered[1:])
            parts = balanced_split(gathered[0], len(group))
            sizes.append((row, parts, max(p for _, p in parts) * row))
        self.group, self.sizes = group, sizes
        total = sum(size for _, _, size in sizes)
        first = shards[self.bucket[0]].local_part
        send = torch.zeros(total, dtype=first.dtype, device=first.device)
        offset = 0
        for name, (_, _, size) in zip(self.bucket, sizes):
            local = shards[name].local_part.reshape(-1)
            send[offset:offset + local.numel()].copy_(local)
            offset += size
        self.recv = torch.empty(len(group) * total, dtype=first.dtype, device=first.device)
        self.handle = comm.all_gather_async(self.recv, send, group, what="fully_shard gather")
        self.send = send

    def _concatenates(self, shard: GlobalTensor) -> bool:
        # Gathering the data axis concatenates parts along dim 0 only if no other axis
        # splits dim 0, and nothing is partial.
        return not shard.global_layout.partial_axes and all(
            (a == self.unit.data_axis) == (s == Split(0)) for a, s in enumerate(shard.sbp))

    def stale(self) -> bool:
        """True if a shard changed since the gather started (an optimizer step)."""
        return any(s._version != self.versions[n] for n, s in self.shards.items())

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def finish(self) -> dict:
        """name -> gathered parameter (differentiable in its shard)."""
        self.wait()
        out = {}
        if self.bucket:
            per_member = self.recv.view(len(self.group), -1)
            offset = 0
            for name, (row, parts, size) in zip(self.bucket, self.sizes):
                shard = self.shards[name]
                layout = self.unit.gathered_layout(shard)
                shape = layout.local_shape(comm.get_rank())
                pieces = [per_member[j, offset:offset + rows * row]
                          for j, (_, rows) in enumerate(parts)]
                local = torch.cat(pieces).view(shape)
                out[name] = _Gathered.apply(shard, local, layout)
                offset += size
            self.recv = self.send = None
        for name, shard in self.shards.items():
            if name in out or not isinstance(shard, GlobalTensor) or shard.dim() == 0:
                continue
            full = shard.to_global(sbp=self.unit.gathered_layout(shard).sbp)
            full._local = _dense(full._local)  # saved views are replayed on a dense copy
            out[name] = full
        return out


def _first_dtype(shards: dict):
    return next(s.dtype for s in shards.values() if isinstance(s, GlobalTensor) and s.dim() > 0)


class _Gathered(torch.autograd.Function):
    """A gathered parameter whose gradient goes back to its shard's layout (P -> S)."""

    @staticmethod
    def forward(ctx, shard: GlobalTensor, local: torch.Tensor, layout: Layout):
        ctx.src = shard.global_layout
        return GlobalTensor(local, layout)

    @staticmethod
    def backward(ctx, grad):
        return to_layout(grad, ctx.src.without_partials()), None, None


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
            self.full = _dense(to_layout(self.shard.detach(), layout).local_part)
        return self.full


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone in a contiguous storage from offset 0 (a copy only when it is not)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.is_contiguous() and t.storage_offset() == 0 and whole else t.clone()


def _pack(t):
    if type(t) is GlobalTensor and t.local_part.numel():
        regather = _gathered.get(t.local_part.untyped_storage().data_ptr())
        if regather is not None:
            local = t.local_part
            return (regather, t.global_layout, tuple(t.stride()), tuple(local.size()),
                    tuple(local.stride()), local.storage_offset())
    return t


def _unpack(packed):
    if type(packed) is not tuple:
        return packed
    regather, layout, strides, size, stride, offset = packed
    local = regather.local().as_strided(size, stride, offset)
    return GlobalTensor(local, layout, strides=None if strides == layout.strides else strides)

