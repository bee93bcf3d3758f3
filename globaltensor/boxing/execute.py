"""Run a boxing plan on this rank's local tensor with real collectives (``comm``)."""
from __future__ import annotations

import math

import torch

from .. import comm
from . import steps as S
from .plan import Plan


def execute(plan: Plan, local: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This rank's local tensor in ``plan.dst``, from its local tensor in ``plan.src``.

    The result never aliases ``local`` when it holds different data, so the source
    tensor stays valid. Only the ranks a step involves take part in it (process groups
    are made by their members), so ranks outside both placements may skip the call.
    """
    if rank is None:
        rank = comm.get_rank()
    out = local
    for step in plan.steps:
        if isinstance(step, S.Transfer):
            out = _transfer(step, out, rank)
        elif rank in step.src.placement:
            out = _RUN[type(step)](step, out, rank)
    if plan.steps and out.numel() and _shares_storage(out, local):
        out = out.clone()
    return out


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _all_gather(step: S.AllGather, x: torch.Tensor, rank: int) -> torch.Tensor:
    members, d = step.members(rank), step.dim
    sizes = [step.src.local_shape(m)[d] for m in members]
    n, biggest = len(members), max(sizes)
    if d == 0 and min(sizes) == biggest:
        # Even split along dim 0: the gathered buffer already is the result.
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        comm.all_gather_into(out, x, members)
        return out
    if x.shape[d] < biggest:
        pad = list(x.shape)
        pad[d] = biggest - x.shape[d]
        x = torch.cat([x, x.new_zeros(pad)], dim=d)
    x = x.movedim(d, 0).contiguous()
    gathered = x.new_empty((n,) + tuple(x.shape))
    comm.all_gather_into(gathered, x, members)
    parts = [gathered[k, :sizes[k]] for k in range(n)]
    return torch.cat(parts, dim=0).movedim(0, d).contiguous()


def _all_reduce(step: S.AllReduce, x: torch.Tensor, rank: int) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce_(out, step.reduce, step.members(rank))
    return out


def _chunks_to_buffer(x: torch.Tensor, dim: int, parts) -> tuple[torch.Tensor, list[int]]:
    """Lay the parts of ``x`` along ``dim`` out one after another in a flat buffer."""
    if dim == 0:
        x = x.contiguous()
        row = x[0].numel() if x.shape[0] else math.prod(x.shape[1:])
        return x.view(-1), [size * row for _, size in parts]
    buf = x.new_empty(x.numel())
    splits, pos = [], 0
    for offset, size in parts:
        piece = x.narrow(dim, offset, size)
        buf[pos:pos + piece.numel()].view(piece.shape).copy_(piece)
        splits.append(piece.numel())
        pos += piece.numel()
    return buf, splits



def _reduce_scatter(step: S.ReduceScatter, x: torch.Tensor, rank: int) -> torch.Tensor:
    # On gloo an all-to-all plus a local reduction beats reduce_scatter (DESIGN.md).
    members, d = step.members(rank), step.dim
    parts = step.parts(x.shape[d])
    me = members.index(rank)
    inp, in_splits = _chunks_to_buffer(x, d, parts)
    mine = list(x.shape)
    mine[d] = parts[me][1]
    n = len(members)
    out = x.new_empty(n * math.prod(mine))
    comm.all_to_all_single(out, inp, [math.prod(mine)] * n, in_splits, members)
    stacked = out.view([n] + mine)
    if step.reduce == "sum":
        return stacked.sum(0)
    return stacked.amax(0)


def _all_to_all(step: S.AllToAll, x: torch.Tensor, rank: int) -> torch.Tensor:
    # Point-to-point instead of all_to_all_single: our own part never travels, each
    # outgoing part is packed once, and incoming parts land in place when contiguous
    # (always for src_dim 0), so there is no pack/unpack of the whole tensor.
    members, i, j = step.members(rank), step.src_dim, step.dst_dim
    parts = step.parts(x.shape[j])
    me = members.index(rank)
    rows = [step.src.local_shape(m)[i] for m in members]
    shape = list(x.shape)
    shape[j], shape[i] = parts[me][1], sum(rows)
    out = x.new_empty(shape)
    sends, recvs, unpack = [], [], []
    offset = 0
    for k, m in enumerate(members):
        dest = out.narrow(i, offset, rows[k])
        offset += rows[k]
        if k == me:
            continue
        piece = x.narrow(j, *parts[k])
        if piece.numel():
            sends.append((piece, m))
        if not dest.numel():
            continue
        if dest.is_contiguous():
            recvs.append((dest, m))
        else:
            buf = torch.empty(dest.shape, dtype=x.dtype, device=x.device)
            recvs.append((buf, m))
            unpack.append((dest, buf))
    work = comm.start_p2p(sends, recvs, kind="all_to_all")
    mine = out.narrow(i, sum(rows[:me]), rows[me])
    mine.copy_(x.narrow(j, *parts[me]))
    work.wait()
    for dest, buf in unpack:
        dest.copy_(buf)
    return out


def _local_slice(step: S.LocalSlice, x: torch.Tensor, rank: int) -> torch.Tensor:
    c = step.src.placement.coord(rank)[step.axis]
    offset, size = step.parts(x.shape[step.dim])[c]
    return x.narrow(step.dim, offset, size)


def _zero_non_root(step: S.ZeroNonRoot, x: torch.Tensor, rank: int) -> torch.Tensor:
    if step.src.placement.coord(rank)[step.axis] == 0:
        return x
    return torch.zeros_like(x)


def _relabel(step: S.Relabel, x: torch.Tensor, rank: int) -> torch.Tensor:
    return x


def _pad_to_partial(step: S.PadToPartial, x: torch.Tensor, rank: int) -> torch.Tensor:
    shape = step.dst.local_shape(rank)
    out = x.new_full(shape, S.identity_value(step.reduce, x.dtype))
    c = step.src.placement.coord(rank)[step.axis]
    offset, size = step.parts(shape[step.dim])[c]
    out.narrow(step.dim, offset, size).copy_(x)
    return out


def _transfer(step: S.Transfer, x: torch.Tensor, rank: int) -> torch.Tensor:
    src_region = step.src.region(rank)
    dst_region = step.dst.region(rank)
    out = None
    if dst_region is not None:
        fill = step.fill_of(rank)
        out = x.new_empty(dst_region.sizes, device=_device(step.dst)) if fill is None else \
            x.new_full(dst_region.sizes, S.identity_value(fill, x.dtype), device=_device(step.dst))
    # Across device types the pieces travel through host memory, on one backend.
    wire = torch.device("cpu") if step.src.placement.type != step.dst.placement.type else None
    sends, recvs, landing = [], [], []
    for m in step.moves:
        if m.src == rank and m.dst == rank:
            out[m.region.slices(dst_region)] = x[m.region.slices(src_region)]
        elif m.src == rank:
            piece = x[m.region.slices(src_region)]
            sends.append((piece.to(wire) if wire else piece, m.dst))
        elif m.dst == rank:
            dest = out[m.region.slices(dst_region)]
            if wire is None and dest.is_contiguous():
                recvs.append((dest, m.src))  # lands in place
            else:
                buf = torch.empty(m.region.sizes, dtype=x.dtype, device=wire or out.device)
                recvs.append((buf, m.src))
                landing.append((dest, buf))
    comm.batched_p2p(sends, recvs)
    for dest, buf in landing:
        dest.copy_(buf)
    return out if out is not None else x.new_empty((0,) * x.dim())


def _device(layout) -> torch.device:
    # This rank's device of the destination's type (not the "current" cuda device,
    # which a program that made its own process group may never have set).
    return comm.local_device(layout.placement.type)


_RUN = {
    S.AllGather: _all_gather, S.AllReduce: _all_reduce, S.ReduceScatter: _reduce_scatter,
    S.AllToAll: _all_to_all, S.LocalSlice: _local_slice, S.ZeroNonRoot: _zero_non_root,
    S.Relabel: _relabel, S.PadToPartial: _pad_to_partial,
}
