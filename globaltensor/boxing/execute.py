"""Run a boxing plan on this rank's local tensor with real collectives (``comm``)."""
from __future__ import annotations

import torch

from .. import comm
from . import steps as S
from .plan import Plan


def execute(plan: Plan, local: torch.Tensor, rank: int | None = None,
            donate: bool = False) -> torch.Tensor:
    """This rank's local tensor in ``plan.dst``, from its local tensor in ``plan.src``.

    The result never aliases ``local`` when it holds different data, so the source
    tensor stays valid, unless ``donate`` says that no one else holds ``local`` (a
    temporary): then a reduction may run in place in it. The dtype never changes;
    dtypes that a backend cannot reduce or gather (int16) travel widened. Only the
    ranks a step involves take part in it (process groups are made by their members),
    so ranks outside both placements may skip the call.

    >>> out = execute(plan_route(src, dst, 4), x_local)     # doctest: +SKIP
    """
    if rank is None:
        rank = comm.get_rank()
    out = local
    for step in plan.steps:
        if isinstance(step, S.Transfer):
            out = _transfer(step, out, rank)
        elif rank in step.src.placement:
            wide = _WIDER.get(out.dtype) if type(step) in _COLLECTIVES else None
            if wide is None:
                # A step may reuse its input's memory when that is not the caller's.
                own = donate or not _shares_storage(out, local)
                out = _RUN[type(step)](step, out, rank, own)
            else:
                out = _RUN[type(step)](step, out.to(wide), rank, True).to(out.dtype)
    if plan.steps and out.numel() and not donate and _shares_storage(out, local):
        out = out.clone()
    return out


# Collectives of gloo and NCCL lack these dtypes (point-to-point carries any): they
# travel as the next wider integer type, which holds every value and sums alike.
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _reduce_of(reduce: str, dtype: torch.dtype) -> str:
    # A sum of bools is their "or" (as torch adds bools), which is their max.
    return "max" if dtype == torch.bool else reduce


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _all_gather(step: S.AllGather, x: torch.Tensor, rank: int,
                donate: bool = False) -> torch.Tensor:
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


def _all_reduce(step: S.AllReduce, x: torch.Tensor, rank: int,
                donate: bool = False) -> torch.Tensor:
    out = x if donate and x.is_contiguous() else x.contiguous().clone()
    comm.all_reduce_(out, _reduce_of(step.reduce, x.dtype), step.members(rank))
    return out


def _reduce_scatter(step: S.ReduceScatter, x: torch.Tensor, rank: int,
                    donate: bool = False) -> torch.Tensor:
    # On gloo an exchange of parts plus a local reduction beats reduce_scatter
    # (DESIGN.md). Point-to-point rather than all_to_all_single: our own part never
    # travels or is copied into the exchange buffer, and it is one operand of the sum,
    # which writes the result in one pass (for 2 ranks a single add).
    members, d = step.members(rank), step.dim
    parts = step.parts(x.shape[d])
    me = members.index(rank)
    mine = x.narrow(d, *parts[me])
    bufs = x.new_empty((len(members) - 1,) + tuple(mine.shape))
    sends, recvs = [], []
    k = 0
    for j, m in enumerate(members):
        if j == me:
            continue
        piece = x.narrow(d, *parts[j])
        if piece.numel():
            sends.append((piece, m))
        if mine.numel():
            recvs.append((bufs[k], m))
        k += 1
    comm.start_p2p(sends, recvs, kind="all_to_all").wait()
    if not len(bufs):
        return mine.clone()
    combine = torch.add if _reduce_of(step.reduce, x.dtype) == "sum" else torch.maximum
    out = combine(mine, bufs[0], out=x.new_empty(mine.shape))  # contiguous, x's dtype
    for buf in bufs[1:]:
        combine(out, buf, out=out)
    return out


def _all_to_all(step: S.AllToAll, x: torch.Tensor, rank: int,
                donate: bool = False) -> torch.Tensor:
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


def _local_slice(step: S.LocalSlice, x: torch.Tensor, rank: int,
                 donate: bool = False) -> torch.Tensor:
    c = step.src.placement.coord(rank)[step.axis]
    offset, size = step.parts(x.shape[step.dim])[c]
    return x.narrow(step.dim, offset, size)


def _zero_non_root(step: S.ZeroNonRoot, x: torch.Tensor, rank: int,
                   donate: bool = False) -> torch.Tensor:
    if step.src.placement.coord(rank)[step.axis] == 0:
        return x
    return torch.zeros_like(x)


def _relabel(step: S.Relabel, x: torch.Tensor, rank: int, donate: bool = False) -> torch.Tensor:
    return x


def _pad_to_partial(step: S.PadToPartial, x: torch.Tensor, rank: int,
                    donate: bool = False) -> torch.Tensor:
    shape = step.dst.local_shape(rank)
    out = x.new_full(shape, S.identity_value(step.reduce, x.dtype))
    c = step.src.placement.coord(rank)[step.axis]
    offset, size = step.parts(shape[step.dim])[c]
    out.narrow(step.dim, offset, size).copy_(x)
    return out


def _transfer(step: S.Transfer, x: torch.Tensor, rank: int) -> torch.Tensor:
    return start_transfer(step, x, rank).wait()


class PendingTransfer:
    """The posted messages of one rank's part in a ``Transfer``; ``wait()`` returns its
    local tensor in the destination layout (empty outside it)."""

    def __init__(self, work, out: torch.Tensor, landing: list):
        self._work, self._out, self._landing = work, out, landing

    def wait(self) -> torch.Tensor:
        self._work.wait()
        for dest, buf in self._landing:
            dest.copy_(buf)
        self._landing = []
        return self._out

    def is_completed(self) -> bool:
        """True when every message is done (never blocks)."""
        return self._work.is_completed()


def start_transfer(step: S.Transfer, x: torch.Tensor, rank: int) -> PendingTransfer:
    """Post this rank's sends and receives of ``step`` and return at once (pipeline
    hand-offs overlap them with compute). ``x`` is the local source tensor (on a rank
    that only receives: any tensor of the dtype, device and ndim, e.g. empty)."""
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
    work = comm.start_p2p(sends, recvs)
    return PendingTransfer(work, out if out is not None else x.new_empty((0,) * x.dim()),
                           landing)


def _device(layout) -> torch.device:
    # This rank's device of the destination's type (not the "current" cuda device,
    # which a program that made its own process group may never have set).
    return comm.local_device(layout.placement.type)


_COLLECTIVES = (S.AllGather, S.AllReduce, S.ReduceScatter)
_RUN = {
    S.AllGather: _all_gather, S.AllReduce: _all_reduce, S.ReduceScatter: _reduce_scatter,
    S.AllToAll: _all_to_all, S.LocalSlice: _local_slice, S.ZeroNonRoot: _zero_non_root,
    S.Relabel: _relabel, S.PadToPartial: _pad_to_partial,
}
