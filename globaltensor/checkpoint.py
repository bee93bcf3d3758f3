"""Checkpoints through torch.distributed.checkpoint (DCP), and conversion to/from DTensor.

DCP asks a tensor subclass three questions (torch/distributed/checkpoint/
planner_helpers.py and utils.py); GlobalTensor answers them with the functions here:

* ``__create_write_items__`` (save planning, every rank, every tensor in one order):
  the chunk this rank holds, i.e. its region of the layout. Replicas of a region (a
  broadcast axis) offer the same chunk and DCP's dedup keeps one writer per chunk,
  balancing bytes between ranks, so every element is written once. A partial tensor
  is reduced first (a collective, fine here: planning runs on every rank in the same
  order) and one rank per region writes the value.
* ``__create_chunk_list__`` (load planning): the region this rank holds; DCP reads
  into it the pieces of whatever chunks were saved, so a checkpoint loads into any
  layout, placement or world size without building whole tensors.
* ``__get_tensor_shard__``: the local tensor the chunk lives in.

``torch.save`` opens (and truncates) its file before it pickles, so a ``__reduce_ex__``
that raises would destroy a good file. ``torch.save`` is therefore wrapped: it first
pickles the object into a sink that discards bytes, with a ``persistent_id`` that stops
at every plain tensor (cheap) and raises a TypeError naming DCP at a GlobalTensor.

>>> import torch.distributed.checkpoint as dcp                     # doctest: +SKIP
>>> dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt/step_100")
>>> dcp.load({"model": other_layout_model.state_dict()}, checkpoint_id="ckpt/step_100")
"""
from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass

import torch

from . import comm, env
from .boxing import Plan, execute
from .boxing.steps import Transfer
from .layout import Layout, Region
from .parts import identity_fill, keep_on_first
from .placement import Placement
from .sbp import Broadcast, Partial, Split, broadcast
from .tensor import GlobalTensor, to_layout, wrap_local

__all__ = ["from_dtensor", "to_dtensor", "rng_state", "set_rng_state", "is_complete",
           "latest", "DCP_HINT"]

DCP_HINT = ("save global tensors with torch.distributed.checkpoint "
            "(dcp.save(state_dict, checkpoint_id=path); dcp.load reads them back into any "
            "layout or world size); x.to_local() would save one rank's part only")


# --- DCP's tensor-subclass protocol ---------------------------------------------------

def _value_layout(layout: Layout) -> Layout:
    """The layout saved for ``layout``: partial axes reduced to broadcast."""
    if not layout.partial_axes:
        return layout
    return layout.with_sbp(tuple(broadcast if isinstance(s, Partial) else s
                                 for s in layout.sbp))


def _is_region_writer(layout: Layout, rank: int) -> bool:
    """The first rank (coordinate 0) along every axis that replicates its region."""
    coord = layout.placement.coord(rank)
    return all(c == 0 for c, s in zip(coord, layout.sbp) if not isinstance(s, Split))


def _chunk(region: Region):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    return ChunkStorageMetadata(offsets=torch.Size(region.offsets),
                                sizes=torch.Size(region.sizes))


def create_write_items(x: GlobalTensor, fqn: str) -> list:
    """DCP save planning: the write item of the chunk this rank holds (none outside)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    rank = comm.get_rank()
    layout = _value_layout(x.layout_)
    local = x.local_
    stash = _stash(x)
    if layout is not x.layout_:
        local = to_layout(x.detach(), layout).local_  # every rank: a collective
        if rank not in layout.placement or not _is_region_writer(layout, rank):
            return []  # replicas drop their copy now: only the writer offers the chunk
    region = layout.region(rank)
    if region is None:
        return []
    if x.numel() == 0:
        # No rank holds an element; one rank writes the empty tensor so that its
        # metadata (shape, dtype) is in the checkpoint.
        if rank != layout.placement.flat_ranks[0]:
            return []
        region = Region((0,) * x.dim(), tuple(x.shape))
        local = torch.empty(x.shape, dtype=x.dtype, device=local.device)
    elif region.numel == 0:
        return []
    if local is not x.local_:
        stash[fqn] = local
    chunk = _chunk(region)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk,
                                                  properties=TensorProperties(dtype=x.dtype),
                                                  size=x.size()))]


def create_chunk_list(x: GlobalTensor) -> list:
    """DCP load planning: the chunk this rank reads into. On a partial axis only the
    first member reads the value; the others hold the reduction's identity (set here,
    as this planning step is the load's first touch of the tensor)."""
    _stash(x).clear()
    rank = comm.get_rank()
    layout = x.layout_
    region = layout.region(rank)
    if region is None or region.numel == 0:
        return []
    if identity_fill(layout, rank) is not None:
        keep_on_first(x.local_, layout, rank)  # the first members hold the value
        return []
    return [_chunk(region)]


def get_tensor_shard(x: GlobalTensor, index) -> torch.Tensor:
    """The local tensor holding the chunk at ``index`` (a reduced copy, once, for a
    partial tensor being saved)."""
    stashed = _stash(x).pop(index.fqn, None)
    return x.local_ if stashed is None else stashed


def _stash(x: GlobalTensor) -> dict:
    """Tensors made during save planning for the writes that follow, by fqn."""
    stash = getattr(x, "_dcp_stash", None)
    if stash is None:
        stash = x._dcp_stash = {}
    return stash


# --- torch.save refuses GlobalTensors before it opens the file ---------------------------

class _Discard:
    def write(self, data) -> int:
        return len(data)


def _refuse_global_tensors(obj) -> None:
    """Raise TypeError if pickling ``obj`` would reach a GlobalTensor."""
    def persistent_id(o):
        if isinstance(o, GlobalTensor):
            raise TypeError(f"torch.save cannot save a GlobalTensor (shape "
                            f"{tuple(o.shape)}, {o.placement}, sbp {o.sbp}): {DCP_HINT}")
        if isinstance(o, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return 0  # plain tensors are fine; do not walk their data
        return None

    pickler = pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = persistent_id
    try:
        pickler.dump(obj)
    except TypeError as e:
        if DCP_HINT in str(e):
            raise
    except Exception:
        pass  # not our business: torch.save reports it as it always did


def _guard_torch_save() -> None:
    if getattr(torch.save, "_globaltensor_guard", False):
        return
    save = torch.save

    @functools.wraps(save)
    def guarded_save(obj, f, *args, **kwargs):
        _refuse_global_tensors(obj)
        return save(obj, f, *args, **kwargs)

    guarded_save._globaltensor_guard = True
    torch.save = guarded_save
    torch.serialization.save = guarded_save


_guard_torch_save()


# --- RNG state and complete checkpoints, for resuming ------------------------------------

def rng_state() -> dict:
    """The random state to save with a checkpoint: gt's generator (seed and draw count,
    the same on every rank) and torch's own CPU generator, as plain tensors (DCP saves
    them once and loads them in place).

    >>> state = {"model": model.state_dict(), "rng": gt.checkpoint.rng_state()}  # doctest: +SKIP
    """
    return {"gt": torch.tensor(env.get_draw(), dtype=torch.int64),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after ``dcp.load`` filled it in)."""
    torch.set_rng_state(state["torch"])
    # After torch's: torch.set_rng_state may also restore a draw number it carries on
    # the state tensor's Python object, which in a template filled by dcp.load is stale.
    env.set_draw(tuple(int(v) for v in state["gt"].tolist()))


def is_complete(path: str | os.PathLike) -> bool:
    """True when the DCP checkpoint directory ``path`` was fully written: DCP writes
    its ``.metadata`` last (to a temporary name, then renames it), after every rank's
    data, so a directory without it is a save that crashed."""
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directory under ``root`` (by name order of
    ``step_<n>``-style names, compared numerically), or None.

    >>> gt.checkpoint.latest("ckpt")                                    # doctest: +SKIP
    'ckpt/step_40'
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None

    def key(name: str):
        digits = "".join(ch for ch in name if ch.isdigit())
        return (int(digits) if digits else -1, name)

    done = [n for n in os.listdir(root) if is_complete(os.path.join(root, n))]
    return os.path.join(root, max(done, key=key)) if done else None


# --- DTensor ----------------------------------------------------------------------------

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


def _move(local: torch.Tensor, src, dst) -> torch.Tensor:
    """This rank's local tensor of ``dst`` from its local tensor of ``src`` (two layouts
    of one value without partial axes): the pieces travel point to point."""
    step = Transfer.between(src, dst)
    return execute(Plan(src, dst, (step,), 0.0, local.element_size(), "rechunk"), local)


class _Rechunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, src, dst):
        ctx.src, ctx.dst = src, dst
        return _move(local, src, dst)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad.contiguous(), ctx.dst, ctx.src), None, None


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
    from torch.distributed.tensor import Partial as DPartial, Replicate, Shard
    if isinstance(s, Split):
        return Shard(s.dim)
    if isinstance(s, Broadcast):
        return Replicate()
    return DPartial(s.reduce)


def _sbp_of(p):
    from torch.distributed.tensor import Partial as DPartial, Replicate, Shard
    from .sbp import partial_max, partial_sum
    if type(p) is Shard:
        return Split(p.dim)
    if isinstance(p, Replicate):
        return broadcast
    if isinstance(p, DPartial) and p.reduce_op in ("sum", "max"):
        return partial_sum if p.reduce_op == "sum" else partial_max
    raise ValueError(f"DTensor placement {p!r} has no sbp: globaltensor takes Shard(d), "
                     f"Replicate() and Partial('sum'/'max')")


def _without_partials(sbp: tuple) -> tuple:
    return tuple(broadcast if isinstance(s, Partial) else s for s in sbp)


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
    mesh = _device_mesh(x.placement)
    placements = tuple(_dtensor_placement(s) for s in x.sbp)
    chunked = _ChunkLayout(x.layout_)
    if chunked.coincides():
        local = x.to_local()
    elif x.layout_.partial_axes:
        # Move the reduced value, then let DTensor make its own partial (a local step).
        value = x.to_global(sbp=_without_partials(x.sbp)).to_dtensor()
        return value.redistribute(mesh, placements)
    else:
        local = _Rechunk.apply(x.to_local(), x.layout_, chunked)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape,
                              stride=x.stride())


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
    chunked = _ChunkLayout(layout)
    if chunked.coincides():
        return wrap_local(d.to_local(), layout)
    if layout.partial_axes:
        reduced = d.redistribute(mesh, [_dtensor_placement(s) for s in
                                        _without_partials(layout.sbp)])
        value = from_dtensor(reduced)
        return value.to_global(sbp=layout.sbp)
    return wrap_local(_Rechunk.apply(d.to_local(), chunked, layout), layout)
