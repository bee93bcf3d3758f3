"""fully_shard's own transfers: gathering a unit's parameters and reducing their
gradients to parts, each holding no more than the result and one part besides.

A parameter "concatenates" when only the data axis splits its dim 0 and nothing is
partial: gathering the data axis is then an all-gather of the members' parts in
order. Large such parameters (``OWN_GATHER_BYTES`` gathered or more) are gathered
each straight into their gathered storage (point to point: gloo's all_gather would
stage the whole result in a buffer of its own, one more gathered copy); small ones
share one all-gather per unit (a bucket) and are cut out of its buffer; on gloo all of
a unit's go as one batch of point-to-point messages (``_Batch``); the rest are boxed.
Gradients that come back partial on the data axis go to the parts a unit at a time
(``reduce_to_parts``): where the backend has a native reduce_scatter (NCCL) the large
ones by one each and the small ones by one shared (a bucket, as the gather's), else all
of them by one exchange of pieces: in each round every member sends the others their
rows of every gradient at once (cast to the reduction dtype; the small ones packed in
one message) and adds what it receives to its own rows.

>>> fetch = Fetch(shards, layouts, data_axis=0, dtype=torch.bfloat16)   # doctest: +SKIP
>>> gathered = fetch.finish()      # name -> this rank's local of the gathered parameter
"""
from __future__ import annotations

import math
import types

import torch

from .. import comm
from ..comm import stats
from ..cost import costs_for, costs_of
from ..layout import Layout, balanced_split
from ..local_parts import padded_parts, padded_to, unpadded_parts
from ..sbp import Partial, Split
from ..tensor import GlobalTensor, to_layout

__all__ = ["OWN_GATHER_BYTES", "Fetch", "gather_rows", "reduce_to_parts", "concatenates"]

# A parameter this large (gathered, in bytes) gets an all-gather of its own.
OWN_GATHER_BYTES = 1 << 20


def concatenates(layout: Layout, data_axis: int) -> bool:
    """Gathering ``data_axis`` of ``layout`` concatenates the members' parts along dim 0:
    only that axis splits dim 0 and nothing is partial."""
    return bool(layout.shape) and not layout.partial_axes and all(
        (a == data_axis) == (s == Split(0)) for a, s in enumerate(layout.sbp))


def gather_rows(part: torch.Tensor, group: tuple, shape: tuple, dtype: torch.dtype,
                batch: "_Batch | None" = None):
    """Start gathering ``shape`` (dim 0 in ``balanced_split`` parts over ``group``, this
    rank's being ``part``) in ``dtype``, each member's rows received in place (no staging
    buffer, no padding); returns a function that waits and gives the gathered tensor.
    ``batch``: point-to-point messages join it (posted by its ``start``)."""
    n = len(group)
    parts = balanced_split(shape[0], n)
    send = part.to(dtype).contiguous()
    if comm.tracing():
        return _Ready(_gather_rows_traced(send, group, shape, parts))
    if not _by_messages(part.device):
        return _gather_padded(send, group, shape, parts)
    out = torch.empty(shape, dtype=dtype, device=part.device)
    pieces = [out.narrow(0, *p) for p in parts]
    wait = batch.add(group, pieces, send) if batch is not None else \
        comm.all_gather_p2p(pieces, send, group).wait

    def finish() -> torch.Tensor:
        wait()
        return out
    return finish


def _by_messages(device: torch.device) -> bool:
    """Whether gathers on ``device`` go point to point (gloo, not traced), else as one
    all-gather (NCCL stages nothing; a traced graph holds only collectives)."""
    return not comm.tracing() and costs_for(device.type).backend != "nccl"


class _Batch:
    """The point-to-point gathers of one ``Fetch`` (gloo), per group: posted together by
    ``start`` (one round of messages per peer for the unit, instead of one per large
    parameter and one all_gather for the small ones), waited for once."""

    def __init__(self):
        self.gathers: dict = {}   # group -> [(pieces, mine)]
        self.works: dict = {}     # group -> its posted messages, until waited for

    def add(self, group: tuple, pieces: list, mine: torch.Tensor):
        self.gathers.setdefault(group, []).append((pieces, mine))
        return lambda: self.wait(group)

    def start(self) -> None:
        for group, gathers in self.gathers.items():
            self.works[group] = comm.all_gather_p2p_batch(gathers, group)
        self.gathers = {}

    def wait(self, group: tuple) -> None:
        work = self.works.pop(group, None)
        if work is not None:
            work.wait()


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
        batch = _Batch()
        for name, shard in shards.items():
            layout = layouts[name]
            if rank not in layout.placement or not concatenates(shard.global_layout, data_axis):
                self.boxed.append(name)
                continue
            want = dtype or shard.dtype
            shape = layout.local_shape(rank)
            group = layout.placement.group(rank, data_axis)
            if len(group) == 1 and want == shard.dtype:   # the part is the whole
                self.own[name] = _Ready(shard.local_part.detach())
                continue
            if math.prod(shape) * want.itemsize >= OWN_GATHER_BYTES or (
                    bucket and want != bucket[0][1]):
                self.own[name] = gather_rows(shard.local_part, group, shape, want, batch)
            else:
                bucket.append((name, want, shape, group))
        self.bucket = _Bucket(shards, bucket, batch) if bucket else None
        batch.start()
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
    gathered buffer. On gloo the buffer travels with the unit's other gathers
    (``_Batch``), each member's part straight into its rows."""

    def __init__(self, shards: dict, members: list, batch: _Batch):
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
        if not _by_messages(first.device):
            self.handle = comm.all_gather_async(self.recv, send, group, what="fully_shard gather")
        else:
            self.handle = types.SimpleNamespace(wait=batch.add(group, list(self.recv.view(
                len(group), total)), send))

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


def reduce_to_parts(grads: tuple, parts: tuple, data_axis: int,
                    reduce_dtype: "torch.dtype | None", dtypes: tuple) -> list:
    """The gradients of a unit's gathered parameters (None where there is none), each in
    the layout ``parts[i]`` of its stored parameter, reduced in ``reduce_dtype`` (None:
    each in its own) and returned in ``dtypes[i]``. Those partial on the data axis and
    otherwise laid out as their part (``_exchanges``) are reduced together: one round of
    messages per member for all of them (gloo), or one reduce_scatter for the small
    ones and one for each large one (a native reduce_scatter: NCCL). The rest are boxed.

    >>> reduce_to_parts((gw, gb), (w.global_layout, b.global_layout), 0, None,  # doctest: +SKIP
    ...                 (torch.float32, torch.float32))
    """
    out, rank = [None] * len(grads), comm.get_rank()
    together: dict = {}       # (group, native reduce_scatter) -> indices reduced together
    for i, (grad, part) in enumerate(zip(grads, parts)):
        if grad is None:
            continue
        rdtype = reduce_dtype or grad.dtype
        native = costs_of(part).native_reduce_scatter
        if rank in part.placement and not comm.tracing() and _exchanges(
                grad.global_layout, part, data_axis) and not (
                native and grad.local_part.numel() * rdtype.itemsize >= OWN_GATHER_BYTES):
            together.setdefault((part.placement.group(rank, data_axis), native), []).append(i)
            continue
        # boxed: a large gradient by the native reduce_scatter, anything else as it comes
        moved = to_layout(grad if grad.dtype == rdtype else grad.to(rdtype),
                          part.without_partials(), donate=True)
        out[i] = moved if moved.dtype == dtypes[i] else moved.to(dtypes[i])
    for (group, native), members in together.items():
        locals_ = [grads[i].local_part for i in members]
        rdtypes = [reduce_dtype or t.dtype for t in locals_]
        reduced = _scattered(locals_, group, rdtypes) if native else \
            _exchange(locals_, group, rdtypes)
        for i, local in zip(members, reduced):
            out[i] = GlobalTensor(local if local.dtype == dtypes[i] else local.to(dtypes[i]),
                                  parts[i])
    return out


def _exchanges(layout: Layout, part: Layout, data_axis: int) -> bool:
    """The gradient is partial (sum) on the data axis and otherwise laid out as the
    gathered parameter whose part concatenates."""
    sbp = layout.sbp
    return (layout.placement == part.placement and layout.shape == part.shape
            and concatenates(part, data_axis) and isinstance(sbp[data_axis], Partial)
            and sbp[data_axis].reduce == "sum"
            and all(s == t for a, (s, t) in enumerate(zip(sbp, part.sbp)) if a != data_axis))


def _scattered(locals_: list, group: tuple, rdtypes: list) -> list:
    """This rank's rows of the sum over ``group`` of each member's ``locals_[i]`` (small
    gradients), by one native reduce_scatter per reduction dtype: each member's rows of
    each gradient, padded to the largest part, packed in one buffer (as the gather's
    bucket)."""
    n, me = len(group), group.index(comm.get_rank())
    out = [None] * len(locals_)
    for rdtype in dict.fromkeys(rdtypes):
        members = [i for i, d in enumerate(rdtypes) if d == rdtype]
        packed = torch.cat([padded_parts(locals_[i].to(rdtype), 0, n).reshape(n, -1)
                            for i in members], 1)
        got = packed.new_empty(packed.shape[1])
        comm.reduce_scatter_into(got, packed, "sum", group)
        offset = 0
        for i in members:
            shape = tuple(locals_[i].shape)
            parts = balanced_split(shape[0], n)
            size = parts[0][1] * math.prod(shape[1:])
            out[i] = got[offset:offset + size].view((parts[0][1],) + shape[1:])[:parts[me][1]]
            offset += size
    return out


def _exchange(locals_: list, group: tuple, rdtypes: list) -> list:
    """This rank's rows of the sum over ``group`` of each member's ``locals_[i]``. In
    n - 1 rounds, round k sends the rows of every gradient of the member k after this
    one and receives from the member k before it, in one batch of messages (counted as
    one all_to_all): the first part received becomes the sum, the others arrive in
    receive buffers that are added and reused, so at most two parts of each are held
    instead of n - 1 (a gradient's reduction is the peak of a sharded backward). Small
    gradients (under ``OWN_GATHER_BYTES``) travel packed, one message per reduction
    dtype each way and round (gloo posts each message at a cost of its own, which a
    unit's many small gradients paid once each), at the price of a third part of each
    held while a round's pack is sent; large ones in messages of their own."""
    n, me = len(group), group.index(comm.get_rank())
    if n == 1:   # a data axis of one rank: each gradient is its own sum, whole
        return [t if t.dtype == d else t.to(d) for t, d in zip(locals_, rdtypes)]
    splits = [balanced_split(t.shape[0], n) for t in locals_]
    mine = [t.narrow(0, *parts[me]) for t, parts in zip(locals_, splits)]
    out, bufs = [None] * len(locals_), [None] * len(locals_)
    packs = _Packs(locals_, rdtypes, mine)
    for k in range(1, n):
        to, source = (me + k) % n, (me - k) % n
        sends, recvs = packs.messages(locals_, splits, to, group[to], group[source])
        for i in packs.own:
            local, rdtype = locals_[i], rdtypes[i]
            if bufs[i] is None and mine[i].numel():
                bufs[i] = torch.empty(mine[i].shape, dtype=rdtype, device=local.device)
            piece = local.narrow(0, *splits[i][to])
            if piece.numel():
                sends.append((piece.to(rdtype).contiguous(), group[to]))
            if bufs[i] is not None:
                recvs.append((bufs[i], group[source]))
        if sends:
            stats.record("all_to_all", sum(t.numel() * t.element_size() for t, _ in sends),
                         (group[to],), len(sends) + len(recvs))
        comm.start_p2p(sends, recvs, kind=None).wait()
        for i, got in [(i, bufs[i]) for i in packs.own] + packs.received():
            if got is None:
                continue
            if out[i] is None:    # the first part received becomes the sum (2 ranks: the only)
                if got is bufs[i]:   # (a large gradient's own receive buffer)
                    out[i], bufs[i] = got, None
                    out[i].add_(mine[i])
                else:   # (a storage of its own: the receive buffer is reused)
                    out[i] = torch.add(got, mine[i]) if got.dtype == mine[i].dtype else \
                        got.clone().add_(mine[i])
            else:
                out[i].add_(got)
    return [m.to(d, copy=True) if o is None else o for m, o, d in zip(mine, out, rdtypes)]


class _Packs:
    """The small gradients of an exchange, packed per reduction dtype: each round's
    pieces for one member copied into one send buffer, the rows received from another
    into one receive buffer (reused from round to round), cut into each gradient's."""

    def __init__(self, locals_: list, rdtypes: list, mine: list):
        self.own, self.by_dtype = [], {}
        for i, (local, rdtype) in enumerate(zip(locals_, rdtypes)):
            if local.numel() * rdtype.itemsize >= OWN_GATHER_BYTES:
                self.own.append(i)
            elif local.numel():
                self.by_dtype.setdefault(rdtype, []).append(i)
        self.mine, self.device = mine, locals_[0].device if locals_ else None
        self.recv = {d: torch.empty(sum(mine[i].numel() for i in members), dtype=d,
                                    device=self.device)
                     for d, members in self.by_dtype.items()}

    def messages(self, locals_: list, splits: list, k: int, to: int, source: int) -> tuple:
        """(sends, receives) of one round: the packed gradients' rows of member ``k``
        (``splits``: each gradient's parts) to rank ``to``, theirs from ``source``."""
        sends, recvs = [], []
        for rdtype, members in self.by_dtype.items():
            pieces = [locals_[i].narrow(0, *splits[i][k]) for i in members]
            total = sum(piece.numel() for piece in pieces)
            if total:
                send = torch.empty(total, dtype=rdtype, device=self.device)
                offset = 0
                for piece in pieces:
                    send[offset:offset + piece.numel()].view(piece.shape).copy_(piece)
                    offset += piece.numel()
                sends.append((send, to))
            if self.recv[rdtype].numel():
                recvs.append((self.recv[rdtype], source))
        return sends, recvs

    def received(self) -> list:
        """(gradient index, its rows received this round) of the packed gradients."""
        got = []
        for rdtype, members in self.by_dtype.items():
            offset = 0
            for i in members:
                size = self.mine[i].numel()
                if size:
                    got.append((i, self.recv[rdtype][offset:offset + size]
                                .view(self.mine[i].shape)))
                offset += size
        return got
