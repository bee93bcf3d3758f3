"""fully_shard's own transfers: gathering a unit's parameters and reducing their
gradients to parts, each holding no more than the result and one part besides.

A parameter "concatenates" when only the data axis splits its dim 0 and nothing is
partial: gathering the data axis is then an all-gather of the members' parts in
order. Large such parameters (``OWN_GATHER_BYTES`` gathered or more) are gathered
each straight into their gathered storage (point to point: gloo's all_gather would
stage the whole result in a buffer of its own, one more gathered copy); small ones
share one all-gather per unit (a bucket) and are cut out of its buffer; the rest are
boxed. Gradients that come back partial on the data axis go to the parts by one
reduce_scatter where the backend has a native one (NCCL), else by an exchange of
pieces: each member sends the others their rows (cast to the reduction dtype piece by
piece) and adds what it receives to its own rows in the receive buffer.

>>> fetch = Fetch(shards, layouts, data_axis=0, dtype=torch.bfloat16)   # doctest: +SKIP
>>> gathered = fetch.finish()      # name -> this rank's local of the gathered parameter
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..cost import costs_for, costs_of
from ..layout import Layout, balanced_split
from ..local_parts import padded_to, unpadded_parts
from ..sbp import Partial, Split
from ..tensor import GlobalTensor, to_layout

__all__ = ["OWN_GATHER_BYTES", "Fetch", "gather_rows", "reduce_to_part", "concatenates"]

# A parameter this large (gathered, in bytes) gets an all-gather of its own.
OWN_GATHER_BYTES = 1 << 20


def concatenates(layout: Layout, data_axis: int) -> bool:
    """Gathering ``data_axis`` of ``layout`` concatenates the members' parts along dim 0:
    only that axis splits dim 0 and nothing is partial."""
    return bool(layout.shape) and not layout.partial_axes and all(
        (a == data_axis) == (s == Split(0)) for a, s in enumerate(layout.sbp))


def gather_rows(part: torch.Tensor, group: tuple, shape: tuple, dtype: torch.dtype):
    """Start gathering ``shape`` (dim 0 in ``balanced_split`` parts over ``group``, this
    rank's being ``part``) in ``dtype``, each member's rows received in place (no staging
    buffer, no padding); returns a function that waits and gives the gathered tensor."""
    n = len(group)
    parts = balanced_split(shape[0], n)
    send = part.to(dtype).contiguous()
    if comm.tracing():
        return _Ready(_gather_rows_traced(send, group, shape, parts))
    if costs_for(part.device.type).backend == "nccl":
        return _gather_padded(send, group, shape, parts)
    out = torch.empty(shape, dtype=dtype, device=part.device)
    work = comm.all_gather_p2p([out.narrow(0, *p) for p in parts], send, group)

    def finish() -> torch.Tensor:
        work.wait()
        return out
    return finish


def _gather_rows_traced(send, group, shape, parts) -> torch.Tensor:
    # the form a graph can hold: one all-gather of parts padded to the largest
    recv, padded = _padded_buffers(send, group, shape, parts)
    comm.all_gather_into(recv, padded, group)
    return unpadded_parts(recv, shape[0])


def _gather_padded(send, group, shape, parts):
    # NCCL: one all-gather (NCCL stages nothing) of parts padded to the largest,
    # straight into the result where the parts are even, else cut out of the buffer
    recv, padded = _padded_buffers(send, group, shape, parts)
    work = comm.all_gather_async(recv, padded, group, what="fully_shard gather")

    def finish() -> torch.Tensor:
        work.wait()
        return unpadded_parts(recv, shape[0])
    return finish


def _padded_buffers(send, group, shape, parts) -> tuple:
    """(the gathered buffer [member][row][...], this rank's rows padded to the
    largest part's)."""
    biggest = parts[0][1]
    return (send.new_empty((len(group), biggest) + tuple(shape[1:])),
            padded_to(send, 0, biggest).contiguous())


class Fetch:
    """The gather of some parameters of a unit, in flight: ``shards`` name -> stored
    parameter, ``layouts`` name -> its gathered layout, gathered in ``dtype`` (None: each
    in its own). ``finish()`` gives name -> this rank's local of the gathered tensor
    (data only: the caller adds the autograd edge)."""

    def __init__(self, shards: dict, layouts: dict, data_axis: int, dtype=None):
        self.shards, self.layouts, self.data_axis = shards, layouts, data_axis
        self.versions = {n: s._version for n, s in shards.items()}
        self.own, self.boxed, bucket = {}, [], []
        rank = comm.get_rank()
        for name, shard in shards.items():
            layout = layouts[name]
            if rank not in layout.placement or not concatenates(shard.global_layout, data_axis):
                self.boxed.append(name)
                continue
            want = dtype or shard.dtype
            shape = layout.local_shape(rank)
            group = layout.placement.group(rank, data_axis)
            if math.prod(shape) * want.itemsize >= OWN_GATHER_BYTES or (
                    bucket and want != bucket[0][1]):
                self.own[name] = gather_rows(shard.local_part, group, shape, want)
            else:
                bucket.append((name, want, shape, group))
        self.bucket = _Bucket(shards, bucket) if bucket else None
        self.dtype = dtype

    def stale(self) -> bool:
        """True if a shard changed since the gather started (an optimizer step)."""
        return any(s._version != self.versions[n] for n, s in self.shards.items())

    def wait(self) -> None:
        if self.bucket is not None:
            self.bucket.wait()
        for name, finish in list(self.own.items()):
            self.own[name] = _Ready(finish())

    def finish(self) -> dict:
        out = {name: finish() for name, finish in self.own.items()}
        if self.bucket is not None:
            out.update(self.bucket.finish())
        for name in self.boxed:
            shard = self.shards[name].detach()
            if self.dtype is not None and shard.dtype != self.dtype:
                shard = shard.to(self.dtype)
            out[name] = _dense(to_layout(shard, self.layouts[name]).local_part)
        self.own, self.bucket = {}, None
        return out


class _Ready:
    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


class _Bucket:
    """Small parameters of one dtype in one all-gather: each member packs its parts
    (padded to the largest part) into one flat buffer; each parameter is cut out of the
    gathered buffer."""

    def __init__(self, shards: dict, members: list):
        self.members = members
        dtype, group = members[0][1], members[0][3]
        self.group, self.sizes = group, []
        for _, _, shape, _ in members:
            row = math.prod(shape[1:])
            parts = balanced_split(shape[0], len(group))
            self.sizes.append((row, parts, parts[0][1] * row))
        total = sum(size for _, _, size in self.sizes)
        first = shards[members[0][0]].local_part
        send = torch.zeros(total, dtype=dtype, device=first.device)
        offset = 0
        for (name, _, _, _), (_, _, size) in zip(members, self.sizes):
            local = shards[name].local_part.reshape(-1)
            send[offset:offset + local.numel()].copy_(local)
            offset += size
        self.recv = torch.empty(len(group) * total, dtype=dtype, device=first.device)
        self.handle = comm.all_gather_async(self.recv, send, group, what="fully_shard gather")

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def finish(self) -> dict:
        self.wait()
        per_member = self.recv.view(len(self.group), -1)
        out, offset = {}, 0
        for (name, _, shape, _), (row, parts, size) in zip(self.members, self.sizes):
            padded = per_member[:, offset:offset + size].view(len(self.group), parts[0][1], row)
            # each in a storage of its own (the saved-tensor hooks know them by it)
            out[name] = _dense(unpadded_parts(padded, shape[0]).view(shape))
            offset += size
        self.recv = None
        return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone in a contiguous storage from offset 0 (a copy only when it is not)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.is_contiguous() and t.storage_offset() == 0 and whole else t.clone()


def reduce_to_part(grad: GlobalTensor, part: Layout, data_axis: int,
                   reduce_dtype: torch.dtype, dtype: torch.dtype) -> GlobalTensor:
    """The gradient of a gathered parameter (any layout; typically partial on the data
    axis) in the layout ``part`` of its stored parameter, reduced in ``reduce_dtype``
    and returned in ``dtype``."""
    layout, rank = grad.global_layout, comm.get_rank()
    # Where the backend reduce-scatters natively (NCCL: one kernel, as FSDP2 uses), the
    # boxing's reduce_scatter serves; gloo's is slower than this exchange of parts.
    if _exchanges(layout, part, data_axis) and rank in part.placement and not comm.tracing() \
            and not costs_of(part).native_reduce_scatter:
        return GlobalTensor(_exchange(grad.local_part, part.placement.group(rank, data_axis),
                                      reduce_dtype).to(dtype), part)
    if grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    out = to_layout(grad, part.without_partials(), donate=True)
    return out if out.dtype == dtype else out.to(dtype)


def _exchanges(layout: Layout, part: Layout, data_axis: int) -> bool:
    """The gradient is partial (sum) on the data axis and otherwise laid out as the
    gathered parameter whose part concatenates."""
    sbp = layout.sbp
    return (layout.placement == part.placement and layout.shape == part.shape
            and concatenates(part, data_axis) and isinstance(sbp[data_axis], Partial)
            and sbp[data_axis].reduce == "sum"
            and all(s == t for a, (s, t) in enumerate(zip(sbp, part.sbp)) if a != data_axis))


def _exchange(local: torch.Tensor, group: tuple, reduce_dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of the sum over ``group`` of each member's ``local``. In n - 1
    rounds, round k sends the rows of the member k after this one and receives from the
    member k before it: the first part received becomes the sum, the others arrive in
    one buffer that is added and reused, so at most two parts are held instead of n - 1
    (a gradient's reduction is the peak of a sharded backward)."""
    parts = balanced_split(local.shape[0], len(group))
    n, me = len(group), group.index(comm.get_rank())
    mine = local.narrow(0, *parts[me])
    out = buf = None
    for k in range(1, n):
        to, source = (me + k) % n, (me - k) % n
        if buf is None and mine.numel():
            buf = torch.empty(mine.shape, dtype=reduce_dtype, device=local.device)
        piece = local.narrow(0, *parts[to])
        sends = [(piece.to(reduce_dtype).contiguous(), group[to])] if piece.numel() else []
        recvs = [(buf, group[source])] if buf is not None else []
        comm.start_p2p(sends, recvs, kind="all_to_all").wait()
        if buf is None:
            continue
        if out is None:    # the first part received becomes the sum (on 2 ranks: the only)
            out, buf = buf, None
            out.add_(mine)
        else:
            out.add_(buf)
    return mine.to(reduce_dtype, copy=True) if out is None else out
