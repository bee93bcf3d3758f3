"""The per-axis steps that communicate: AllGather, AllReduce, ReduceScatter, AllToAll."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import comm
from ...layout import balanced_split
from ...local_parts import padded_parts, padded_to, unpadded_parts
from ...partials import reduce_values
from ...sbp import Broadcast, Partial, Split
from .base import Handle, Locals, SbpChange, reduce_of


@dataclass(frozen=True)
class AllGather(SbpChange):
    """split(dim) -> broadcast: concatenate the members' parts along ``dim``."""
    dim: int
    widens = True

    takes = (Split, Broadcast)

    @staticmethod
    def fields(a, b):
        return (a.dim,)

    def sent_bytes(self, itemsize):
        return self.bytes_in(itemsize) * (self.group_size - 1)

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return k.launch + k.alpha * (n - 1) + k.beta * bytes_out * (n - 1) / n

    def start(self, x, rank, own=False):
        members, d = self.members(rank), self.dim
        sizes = [self.src.local_shape(m)[d] for m in members]
        n, biggest = len(members), max(sizes)
        if d == 0 and min(sizes) == biggest:
            # Even split along dim 0: the gathered buffer already is the result.
            out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
            comm.all_gather_into(out, x, members)
            return Handle.ready(out)
        x = padded_to(x, d, biggest)  # uneven: pad to the largest part, gather, cut out
        x = x.movedim(d, 0).contiguous()
        gathered = x.new_empty((n,) + tuple(x.shape))
        comm.all_gather_into(gathered, x, members)
        if tuple(sizes) == tuple(size for _, size in balanced_split(sum(sizes), n)):
            whole = unpadded_parts(gathered, sum(sizes))
        else:
            whole = torch.cat([gathered[k, :sizes[k]] for k in range(n)], dim=0)
        return Handle.ready(whole.movedim(0, d).contiguous())

    def simulate(self, locals_: Locals) -> Locals:
        return self.by_group(locals_, lambda ms, xs: [torch.cat(xs, self.dim)] * len(ms))


@dataclass(frozen=True)
class AllReduce(SbpChange):
    """partial -> broadcast: reduce the members' addends."""
    reduce: str
    widens = True

    takes = (Partial, Broadcast)

    @staticmethod
    def fields(a, b):
        return (a.reduce,)

    def sent_bytes(self, itemsize):
        return 2 * self.bytes_in(itemsize) * (self.group_size - 1) // self.group_size

    @staticmethod
    def cost_for(n, k, bytes_in, bytes_out):
        return k.launch + 2 * k.alpha * (n - 1) + 2 * k.beta * bytes_in * (n - 1) / n

    def start(self, x, rank, own=False):
        # one copy at most (contiguous() then clone() copied a strided part twice)
        out = x if own and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce_(out, reduce_of(self.reduce, x.dtype), self.members(rank))
        return Handle.ready(out)

    def simulate(self, locals_: Locals) -> Locals:
        def reduce(ms, xs):
            r = reduce_values(xs, self.reduce)
            return [r.clone() for _ in ms]
        return self.by_group(locals_, reduce)


@dataclass(frozen=True)
class ReduceScatter(SbpChange):
    """partial -> split(dim): member k gets the reduction of everyone's part k."""
    dim: int
    reduce: str
    widens = True

    takes = (Partial, Split)

    @staticmethod
    def fields(a, b):
        return (b.dim, a.reduce)

    def sent_bytes(self, itemsize):
        return self.bytes_in(itemsize) * (self.group_size - 1) // self.group_size

    @staticmethod
    def cost_for(n, k, b_in, bytes_out):
        moved = k.launch + k.alpha * (n - 1) + k.beta * b_in * (n - 1) / n
        # the exchange's local sum reads every part once more; a native reduce_scatter
        # reduces as the bytes arrive
        return moved if k.native_reduce_scatter else moved + k.gamma * b_in

    def start(self, x, rank, own=False):
        members, d = self.members(rank), self.dim
        parts = self.parts(x.shape[d])
        me = members.index(rank)
        if self.costs.native_reduce_scatter:
            return Handle.ready(self._native(x, members, parts, me))
        # gloo: an exchange of parts plus a local reduction beats its reduce_scatter
        # (measured, docs/DESIGN.md). Point-to-point rather than all_to_all_single: our
        # own part never travels or is copied into the exchange buffer, and it is one
        # operand of the sum, which writes the result in one pass (for 2 ranks one add).
        if comm.tracing():
            return Handle.ready(self._traced(x, members, parts, me))
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
        work = comm.start_p2p(sends, recvs, kind="all_to_all")

        def combine() -> torch.Tensor:
            if not len(bufs):
                return mine.clone()
            op = torch.add if reduce_of(self.reduce, x.dtype) == "sum" else torch.maximum
            out = op(mine, bufs[0], out=x.new_empty(mine.shape))  # contiguous, x's dtype
            for buf in bufs[1:]:
                op(out, buf, out=out)
            return out
        return Handle(work, combine)

    def _native(self, x, members, parts, me):
        # One reduce_scatter (NCCL's is a single kernel): parts padded to the largest and
        # laid end to end along dim 0 (x itself when the split is even on dim 0).
        d, n, biggest = self.dim, len(members), parts[0][1]
        if d == 0 and all(size == biggest for _, size in parts) and x.is_contiguous():
            sent = x
        else:
            sent = padded_parts(x, d, n)
        out = sent.new_empty((sent.shape[0] // n,) + tuple(sent.shape[1:]))
        comm.reduce_scatter_into(out, sent, reduce_of(self.reduce, x.dtype), members)
        if sent is x:
            return out
        return out[:parts[me][1]].movedim(0, d).contiguous()

    def _traced(self, x, members, parts, me):
        # The form a graph can hold, as the eager exchange: parts padded to the largest
        # and laid end to end, exchanged with one all-to-all, then summed here (on gloo
        # twice as fast as its reduce_scatter).
        d, n, biggest = self.dim, len(members), parts[0][1]
        even = padded_parts(x, d, n)
        sent = even.reshape(-1)
        got = torch.empty_like(sent)
        each = sent.numel() // n
        comm.all_to_all_single(got, sent, [each] * n, [each] * n, members)
        got = got.view((n, biggest) + tuple(even.shape[1:]))
        out = got.sum(0) if reduce_of(self.reduce, x.dtype) == "sum" else got.amax(0)
        return out[:parts[me][1]].movedim(0, d).contiguous()

    def simulate(self, locals_: Locals) -> Locals:
        def rs(ms, xs):
            r = reduce_values(xs, self.reduce)
            return [r.narrow(self.dim, o, s).clone() for o, s in self.parts(xs[0].shape[self.dim])]
        return self.by_group(locals_, rs)


@dataclass(frozen=True)
class AllToAll(SbpChange):
    """split(src_dim) -> split(dst_dim): member k gets part k along ``dst_dim`` of
    every member's local, concatenated along ``src_dim``."""
    src_dim: int
    dst_dim: int

    takes = (Split, Split)

    @staticmethod
    def fields(a, b):
        return (a.dim, b.dim)

    def sent_bytes(self, itemsize):
        return self.bytes_in(itemsize) * (self.group_size - 1) // self.group_size

    @staticmethod
    def cost_for(n, k, b_in, bytes_out):
        return k.launch + k.alpha * (n - 1) + k.beta * b_in * (n - 1) / n + k.gamma * b_in

    def start(self, x, rank, own=False):
        # Point-to-point instead of all_to_all_single: our own part never travels, each
        # outgoing part is packed once, and incoming parts land in place when contiguous
        # (always for src_dim 0), so there is no pack/unpack of the whole tensor.
        members, i, j = self.members(rank), self.src_dim, self.dst_dim
        parts = self.parts(x.shape[j])
        me = members.index(rank)
        rows = [self.src.local_shape(m)[i] for m in members]
        shape = list(x.shape)
        shape[j], shape[i] = parts[me][1], sum(rows)
        if comm.tracing():
            return Handle.ready(self._traced(x, members, parts, rows, me, shape))
        if self.costs.backend == "nccl" and len(set(rows)) == 1 and \
                len({size for _, size in parts}) == 1:
            return Handle.ready(self._native(x, members, parts, rows, me))
        if comm.stats.dry():
            return self._counted(x, members, parts, rows, me, shape)
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
        out.narrow(i, sum(rows[:me]), rows[me]).copy_(x.narrow(j, *parts[me]))

        def land() -> torch.Tensor:
            for dest, buf in unpack:
                dest.copy_(buf)
            return out
        return Handle(work, land)

    def _counted(self, x, members, parts, rows, me, shape) -> Handle:
        """``start`` in a dry run (``gt.debug.simulate_step``), where nothing travels:
        each send counted by its bytes and the receive buffers of the parts that do not
        land in place held as one, until ``wait()``, without a view per member (2 x 1023
        ops on fake tensors per call at 1024 ranks, most of such a simulation's time)."""
        i, j = self.src_dim, self.dst_dim
        out = x.new_empty(shape)
        per = math.prod(x.shape) // x.shape[j] if x.shape[j] else 0   # elements per slice
        for k, m in enumerate(members):
            if k != me and parts[k][1] * per:
                comm.stats.record("all_to_all", parts[k][1] * per * x.element_size(), (m,))
        in_place = {r: out.narrow(i, 0, r).is_contiguous() for r in set(rows)}
        buffered = sum(rows[k] for k in range(len(members)) if k != me and rows[k]
                       and not in_place[rows[k]]) * (math.prod(shape) // shape[i] if shape[i] else 0)
        buffer = torch.empty(buffered, dtype=x.dtype, device=x.device) if buffered else None
        out.narrow(i, sum(rows[:me]), rows[me]).copy_(x.narrow(j, *parts[me]))

        def land(kept=buffer) -> torch.Tensor:   # (the buffer lives until then)
            return out
        return Handle(None, land)

    def _native(self, x, members, parts, rows, me):
        # NCCL, parts even along both dims: one all_to_all_single, in a few ops whatever
        # the number of members (the exchange above posts 2(n - 1) messages, and as many
        # ops, from Python: seconds per call at 1024 ranks). Uneven parts stay with the
        # exchange, which sends no padding (8 key/value heads over 64 ranks would send
        # eight times their bytes padded).
        i, j, n = self.src_dim, self.dst_dim, len(members)
        others = [d for d in range(x.dim()) if d != j]
        at = 1 + others.index(i)                        # dim i's place once dim j is first
        sent = x.movedim(j, 0).contiguous()             # [member's part of j][others]
        got = torch.empty_like(sent)
        each = sent.numel() // n
        comm.all_to_all_single(got, sent, [each] * n, [each] * n, members)
        got = got.view((n, parts[me][1]) + tuple(sent.shape[1:]))
        # [member][dim i][dim j][the rest]: the members' rows end to end
        got = got.movedim((0, 1 + at), (0, 1)).reshape((sum(rows),) + tuple(
            got.shape[k] for k in range(1, got.dim()) if k != 1 + at))
        order = [i, j] + [d for d in others if d != i]
        return got.permute([order.index(d) for d in range(x.dim())]).contiguous()

    def _traced(self, x, members, parts, rows, me, shape):
        # The collective form a graph can hold: flat chunks in member order.
        i, j = self.src_dim, self.dst_dim
        inp = torch.cat([x.narrow(j, *p).reshape(-1) for p in parts])
        pieces = []
        for k in range(len(members)):
            piece_shape = list(x.shape)
            piece_shape[i], piece_shape[j] = rows[k], parts[me][1]
            pieces.append(piece_shape)
        out_splits = [math.prod(p) for p in pieces]
        out = x.new_empty(sum(out_splits))
        comm.all_to_all_single(out, inp, out_splits, [x.narrow(j, *p).numel() for p in parts],
                               members)
        return torch.cat([c.view(p) for c, p in zip(out.split(out_splits), pieces)], dim=i)

    def simulate(self, locals_: Locals) -> Locals:
        def a2a(ms, xs):
            parts = self.parts(xs[0].shape[self.dst_dim])
            return [torch.cat([x.narrow(self.dst_dim, o, s) for x in xs], self.src_dim)
                    for o, s in parts]
        return self.by_group(locals_, a2a)
