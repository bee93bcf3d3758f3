"""torch.distributed.checkpoint (DCP) on GlobalTensors, and ``torch.save``'s refusal.

DCP asks a tensor subclass three questions (torch/distributed/checkpoint/
planner_helpers.py and utils.py); GlobalTensor answers them with the functions here,
installed as its methods at the bottom of this module:

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

A GlobalTensor cannot be pickled (``__reduce_ex__`` raises, naming DCP). ``torch.save``
opens (and truncates) its file before it pickles, so that error would destroy a good
file: ``refuse_global_tensors`` runs first (``interop/torch_patches.py`` wraps
``torch.save`` with it). It pickles the object into a sink that discards bytes, with a
``persistent_id`` that stops at every plain tensor (cheap) and raises a TypeError
naming DCP at a GlobalTensor.

>>> import torch.distributed.checkpoint as dcp                     # doctest: +SKIP
>>> dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt/step_100")
>>> dcp.load({"model": other_layout_model.state_dict()}, checkpoint_id="ckpt/step_100")
"""
from __future__ import annotations

import pickle

import torch

from .. import comm
from ..layout import Layout, Region
from ..partials import identity_fill, keep_on_first
from ..sbp import Split, StridedSplit
from ..tensor import GlobalTensor, install_methods, to_layout
from .dcp_reads import install as install_lean_reads

__all__ = ["DCP_HINT", "create_write_items", "create_chunk_list", "get_tensor_shard",
           "refuse_global_tensors"]

DCP_HINT = ("save global tensors with torch.distributed.checkpoint "
            "(dcp.save(state_dict, checkpoint_id=path); dcp.load reads them back into any "
            "layout or world size); for a plain .pt file of whole values, "
            "torch.save(gt.nn.full_state_dict(model), path) (a collective: call it on every "
            "rank); x.to_local() would save one rank's part only")


def _is_region_writer(layout: Layout, rank: int) -> bool:
    """The first rank (coordinate 0) along every axis that replicates its region."""
    coord = layout.placement.coord(rank)
    return all(c == 0 for c, s in zip(coord, layout.sbp)
               if not isinstance(s, (Split, StridedSplit)))


def _strided_pieces(layout: Layout, rank: int) -> list:
    """A strided split's part as boxes: (region, dim, start, size) per block, where the
    block's piece is ``local.narrow(dim, start, size)``. Its refined view is a plain
    split; each block of the strided dim is one box there."""
    (axis, s), = [(a, s) for a, s in enumerate(layout.sbp) if isinstance(s, StridedSplit)]
    fine = layout.refined({s.dim: s.blocks})
    region = fine.region(rank)
    block = layout.shape[s.dim] // s.blocks
    offset, size = region.offsets[s.dim + 1], region.sizes[s.dim + 1]
    pieces = []
    for j in range(s.blocks):
        offsets = region.offsets[:s.dim] + (j * block + offset,) + region.offsets[s.dim + 2:]
        sizes = region.sizes[:s.dim] + (size,) + region.sizes[s.dim + 2:]
        pieces.append((Region(offsets, sizes), s.dim, j * size, size))
    return pieces


def _chunk(region: Region):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    return ChunkStorageMetadata(offsets=torch.Size(region.offsets),
                                sizes=torch.Size(region.sizes))


def create_write_items(x: GlobalTensor, fqn: str) -> list:
    """DCP save planning: the write item of the chunk this rank holds (none outside)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    rank = comm.get_rank()
    layout = x.global_layout.without_partials()  # what is saved: the value
    local = x.local_part
    stash = _stash(x)
    if layout is not x.global_layout:
        local = to_layout(x.detach(), layout).local_part  # every rank: a collective
        if rank not in layout.placement or not _is_region_writer(layout, rank):
            return []  # replicas drop their copy now: only the writer offers the chunk
    if rank not in layout.placement:
        return []
    if layout.strided:
        return _strided_write_items(x, fqn, layout, local, stash)
    region = layout.region(rank)
    if x.numel() == 0:
        # No rank holds an element; one rank writes the empty tensor so that its
        # metadata (shape, dtype) is in the checkpoint.
        if rank != layout.placement.flat_ranks[0]:
            return []
        region = Region((0,) * x.dim(), tuple(x.shape))
        local = torch.empty(x.shape, dtype=x.dtype, device=local.device)
    elif region.numel == 0:
        return []
    if local is not x.local_part:
        stash[fqn] = local
    chunk = _chunk(region)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk,
                                                  properties=TensorProperties(dtype=x.dtype),
                                                  size=x.size()))]


def _strided_write_items(x: GlobalTensor, fqn: str, layout: Layout, local, stash) -> list:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    items = []
    for region, dim, start, size in _strided_pieces(layout, comm.get_rank()):
        if region.numel == 0:
            continue
        chunk = _chunk(region)
        stash[fqn, tuple(chunk.offsets)] = local.narrow(dim, start, size)
        items.append(WriteItem(index=MetadataIndex(fqn, chunk.offsets),
                               type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=chunk, properties=TensorProperties(dtype=x.dtype),
                                   size=x.size())))
    return items


def create_chunk_list(x: GlobalTensor) -> list:
    """DCP load planning: the chunk this rank reads into. On a partial axis only the
    first member reads the value; the others hold the reduction's identity (set here,
    as this planning step is the load's first touch of the tensor)."""
    _stash(x).clear()
    install_lean_reads()   # DCP reads only the overlap of each saved chunk into the part
    rank = comm.get_rank()
    layout = x.global_layout
    if layout.strided and rank in layout.placement:
        if identity_fill(layout, rank) is not None:
            keep_on_first(x.local_part, layout, rank)
            return []
        stash = _stash(x)
        chunks = []
        for region, dim, start, size in _strided_pieces(layout, rank):
            if region.numel:
                chunks.append(_chunk(region))
                stash[None, tuple(chunks[-1].offsets)] = x.local_part.narrow(dim, start, size)
        return chunks
    region = layout.region(rank)
    if region is None or region.numel == 0:
        return []
    if identity_fill(layout, rank) is not None:
        keep_on_first(x.local_part, layout, rank)  # the first members hold the value
        return []
    return [_chunk(region)]


def get_tensor_shard(x: GlobalTensor, index) -> torch.Tensor:
    """The local tensor holding the chunk at ``index`` (a reduced copy, once, for a
    partial tensor being saved)."""
    stash = _stash(x)
    if x.global_layout.strided:   # one piece per block, by its offsets (saved or loaded)
        offsets = tuple(index.offset)
        found = stash.get((index.fqn, offsets))
        return found if found is not None else stash[None, offsets]
    stashed = stash.pop(index.fqn, None)
    return x.local_part if stashed is None else stashed


def _stash(x: GlobalTensor) -> dict:
    """Tensors made during save planning for the writes that follow, by fqn."""
    stash = getattr(x, "_dcp_stash", None)
    if stash is None:
        stash = x._dcp_stash = {}
    return stash


# --- pickling: refused, and refused by torch.save before it opens the file -----------------

class _Discard:
    def write(self, data) -> int:
        return len(data)


def refuse_global_tensors(obj) -> None:
    """Raise TypeError if pickling ``obj`` would reach a GlobalTensor (``torch.save``
    calls it first: see ``interop/torch_patches.py``).

    >>> refuse_global_tensors({"w": gt.ones(2, placement=p, sbp=gt.sbp.broadcast)})  # doctest: +SKIP
    TypeError: torch.save cannot save a GlobalTensor (...): save global tensors with ...
    """
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


def _reduce_ex(self, protocol):
    raise TypeError(f"a GlobalTensor cannot be pickled: {DCP_HINT}")


def _write_items(self, fqn: str, object) -> list:
    return create_write_items(self, fqn)


# GlobalTensor's answers (tensor.py sits below this module, so they are installed here).
install_methods(__create_write_items__=_write_items, __create_chunk_list__=create_chunk_list,
                __get_tensor_shard__=get_tensor_shard, __reduce_ex__=_reduce_ex)
