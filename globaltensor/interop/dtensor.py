"""GlobalTensor <-> DTensor: ``x.to_dtensor()`` and ``gt.from_dtensor(d)``.

The mesh is the placement's ranks (its shape), on our own process groups; split(d) <->
Shard(d), broadcast <-> Replicate(), partial_sum/max <-> Partial("sum"/"max"). DTensor
cuts an uneven split as torch.chunk does (parts of ceil(L / n)) where ours are
balanced: where the two differ, the data moves point to point (a rechunk, run as any
other boxing by ``boxing/run.py``); elsewhere the local part is shared, not copied.

>>> d = gt.randn(4, 6, placement=p, sbp=gt.sbp.split(1)).to_dtensor()   # doctest: +SKIP
>>> gt.from_dtensor(d).sbp                                              # doctest: +SKIP
(split(dim=1),)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from ..boxing import Plan
from ..boxing.run import run
from ..boxing.steps import Transfer
from ..layout import Layout, Region
from ..placement import Placement
from ..sbp import Broadcast, Split, StridedSplit, broadcast, partial_max, partial_sum
from ..tensor import GlobalTensor, from_local_part, install_methods

__all__ = ["to_dtensor", "from_dtensor"]


@dataclass(frozen=True, eq=False)
class _ChunkLayout:
    """DTensor's layout of the same (shape, placement, sbp): a split part has
    ``ceil(L / n)`` elements (torch.chunk), where ours are balanced. Duck-types the
    part of ``Layout`` that a ``Transfer`` step reads."""

    layout: Layout

    @property
    def placement(self) -> Placement:
        return self.layout.placement

    @property
    def sbp(self) -> tuple:
        return self.layout.sbp

    @property
    def shape(self) -> tuple:
        return self.layout.shape

    @property
    def partial_axes(self) -> tuple:
        return self.layout.partial_axes

    def region(self, rank: int) -> Region | None:
        from torch.distributed.tensor import Shard
        coord = self.placement.coord(rank)
        if coord is None:
            return None
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for axis, s in enumerate(self.sbp):
            if isinstance(s, Split):
                size, offset = Shard.local_shard_size_and_offset(
                    sizes[s.dim], self.placement.shape[axis], coord[axis])
                offsets[s.dim] += int(offset)
                sizes[s.dim] = int(size)
        return Region(tuple(offsets), tuple(sizes))

    def coincides(self) -> bool:
        """True when every rank's region is the same as in the balanced layout."""
        return all(self.region(r) == self.layout.region(r) for r in self.placement)


def _move(local: torch.Tensor, src, dst, why: str) -> torch.Tensor:
    """This rank's local tensor of ``dst`` from its local tensor of ``src`` (two layouts
    of one value without partial axes): the pieces travel point to point."""
    step = Transfer.between(src, dst)
    return run(Plan(src, dst, (step,), 0.0, local.element_size(), "rechunk"), local, why)


class _Rechunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, src, dst, why: str):
        ctx.src, ctx.dst, ctx.why = src, dst, why
        return _move(local, src, dst, why)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad.contiguous(), ctx.dst, ctx.src, f"{ctx.why} (backward)"), \
            None, None, None


_meshes: dict = {}


def _device_mesh(placement: Placement):
    """The DeviceMesh of ``placement``, on our own process groups (made by members)."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = _meshes.get(placement)
    if mesh is not None:
        return mesh
    ranks = torch.tensor(placement.ranks, dtype=torch.int).reshape(placement.shape)
    rank = comm.get_rank()
    if rank not in placement:
        # A rank outside the mesh only needs its shape (DTensor gives it no data).
        mesh = DeviceMesh(placement.type, ranks, _init_backend=False)
    else:
        groups = [comm.get_group(placement.group(rank, axis)) for axis in range(placement.ndim)]
        if placement.ndim == 1:
            mesh = DeviceMesh.from_group(groups[0], placement.type)
        else:
            names = tuple(f"axis{a}" for a in range(placement.ndim))
            mesh = DeviceMesh.from_group(groups, placement.type, ranks, mesh_dim_names=names)
    _meshes[placement] = mesh
    return mesh


def _dtensor_placement(s):
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if isinstance(s, Split):
        return Shard(s.dim)
    if isinstance(s, StridedSplit):
        return _StridedShard(s.dim, split_factor=s.blocks)
    if isinstance(s, Broadcast):
        return Replicate()
    return DPartial(s.reduce)


def _sbp_of(p):
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if type(p) is Shard:
        return Split(p.dim)
    if isinstance(p, _StridedShard):
        return StridedSplit(p.dim, int(p.split_factor))
    if isinstance(p, Replicate):
        return broadcast
    if isinstance(p, DPartial) and p.reduce_op in ("sum", "max"):
        return partial_sum if p.reduce_op == "sum" else partial_max
    raise ValueError(f"DTensor placement {p!r} has no sbp: globaltensor takes Shard(d), "
                     f"Replicate() and Partial('sum'/'max')")


def to_dtensor(x: GlobalTensor):
    """``x`` as a DTensor with the same value: the mesh is the placement's ranks (its
    shape), split(d) -> Shard(d), broadcast -> Replicate(), partial_sum/max ->
    Partial("sum"/"max"). The local part is shared, not copied, when DTensor's layout
    equals ours; an uneven split DTensor cuts differently (torch.chunk: parts of
    ceil(L/n)) moves the data point to point. Differentiable. Call on every rank.

    >>> d = gt.randn(4, 6, placement=p, sbp=gt.sbp.split(1)).to_dtensor()   # doctest: +SKIP
    >>> d.placements
    (Shard(dim=1),)
    """
    from torch.distributed.tensor import DTensor
    if x.global_layout.strided:
        return _strided_to_dtensor(x)
    mesh = _device_mesh(x.placement)
    placements = tuple(_dtensor_placement(s) for s in x.sbp)
    chunked = _ChunkLayout(x.global_layout)
    if chunked.coincides():
        local = x.to_local()
    elif x.global_layout.partial_axes:
        # Move the reduced value, then let DTensor make its own partial (a local step).
        value = x.to_global(sbp=x.global_layout.without_partials().sbp).to_dtensor()
        return value.redistribute(mesh, placements)
    else:
        local = _Rechunk.apply(x.to_local(), x.global_layout, chunked, "to_dtensor")
    if comm.get_rank() not in x.placement and local.requires_grad:
        return _ToDTensorOutside.apply(local, mesh, placements, x.shape, x.stride())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape,
                              stride=x.stride())


# On a rank outside the mesh, DTensor's ``from_local`` makes a new leaf (so the
# GlobalTensor got no gradient there, None, while the members' got one) and its
# ``to_local`` backward fails (it gives the empty part's one-dim stride to a gradient of
# the tensor's ndim); these two keep that rank's graph as the members'.
class _ToDTensorOutside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride):
        from torch.distributed.tensor import DTensor
        ctx.part = (local.shape, local.dtype, local.device)
        return DTensor.from_local(local.detach(), mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.part
        return torch.zeros(shape, dtype=dtype, device=device), None, None, None, None


class _PartOutside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, d):
        ctx.dtensor = (d.device_mesh, d.placements, d.shape, d.stride())
        return d._local_tensor.view_as(d._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor
        mesh, placements, shape, stride = ctx.dtensor
        return DTensor.from_local(grad.new_empty(0), mesh, placements, run_check=False,
                                  shape=shape, stride=stride)


def from_dtensor(d) -> GlobalTensor:
    """A GlobalTensor with the value of DTensor ``d`` (the inverse of ``x.to_dtensor()``):
    placement from the mesh's ranks and shape, Shard(d)/Replicate()/Partial("sum"/"max")
    -> split(d)/broadcast/partial. Shares the local part where the layouts coincide;
    an uneven Shard moves the data into the balanced split. Differentiable; call on
    every rank.

    >>> from torch.distributed.tensor import distribute_tensor, Shard    # doctest: +SKIP
    >>> x = gt.from_dtensor(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    """
    from torch.distributed.tensor import DTensor
    if not isinstance(d, DTensor):
        raise ValueError(f"from_dtensor needs a DTensor, got {type(d).__name__}")
    mesh = d.device_mesh
    placement = Placement(mesh.device_type, mesh.mesh.tolist())
    layout = Layout.make(d.shape, placement, tuple(_sbp_of(p) for p in d.placements))
    if layout.strided:
        if not _even_strided(layout):
            raise ValueError(f"from_dtensor: {d.placements} of shape {tuple(d.shape)} cut "
                             f"blocks unevenly; redistribute it to Shard first")
        return from_local_part(_local_of(d, placement), layout)
    chunked = _ChunkLayout(layout)
    if chunked.coincides():
        return from_local_part(_local_of(d, placement), layout)
    if layout.partial_axes:
        reduced = d.redistribute(mesh, [_dtensor_placement(s) for s in
                                        layout.without_partials().sbp])
        value = from_dtensor(reduced)
        return value.to_global(sbp=layout.sbp)
    return from_local_part(_Rechunk.apply(_local_of(d, placement), chunked, layout, "from_dtensor"), layout)


def _local_of(d, placement: Placement) -> torch.Tensor:
    """``d.to_local()``, by ``_PartOutside`` on a rank outside the mesh."""
    if comm.get_rank() in placement or not d.requires_grad:
        return d.to_local()
    return _PartOutside.apply(d)


def _even_strided(layout: Layout) -> bool:
    """Every strided block divides evenly among its axis' ranks: then DTensor's
    ``_StridedShard`` cuts it as we do."""
    return all(layout.shape[s.dim] // s.blocks % layout.placement.shape[a] == 0
               for a, s in enumerate(layout.sbp) if isinstance(s, StridedSplit))


def _strided_to_dtensor(x: GlobalTensor):
    """A strided split as DTensor's ``_StridedShard`` (local part shared) when blocks
    divide evenly, else boxed to a plain split first."""
    from torch.distributed.tensor import DTensor
    if not _even_strided(x.global_layout):
        plain = tuple(Split(s.dim) if isinstance(s, StridedSplit) else s for s in x.sbp)
        return x.to_global(sbp=plain).to_dtensor()
    placements = tuple(_dtensor_placement(s) for s in x.sbp)
    return DTensor.from_local(x.to_local(), _device_mesh(x.placement), placements,
                              run_check=False, shape=x.shape, stride=x.stride())


install_methods(to_dtensor=to_dtensor)  # tensor.py sits below this module
