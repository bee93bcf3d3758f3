"""Transfer: point-to-point redistribution between any two layouts (the general route).

The source has no partial axis. Every destination rank that holds data (the first
member along each partial axis) receives exactly the intersection of its region with
the regions the source ranks hold, piece by piece, from one holder each; where a region
is replicated (broadcast axes) the holder is chosen round-robin per receiver, and a
receiver that holds a piece itself copies it locally. The other destination ranks fill
the identity of the outermost partial axis they are not first on.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ... import comm
from ...layout import Layout, Region
from ...partials import identity_fill, identity_value
from ..transfer_price import rank_pieces
from .base import Handle, Locals, Step


@dataclass(frozen=True)
class Move:
    """One piece of a transfer: global ``region`` goes from rank ``src`` to rank ``dst``."""
    src: int
    dst: int
    region: Region


def transfer_moves(src: Layout, dst: Layout) -> tuple:
    """Every piece each receiving destination rank needs, with its chosen holder, in
    one global order that both sides follow."""
    assert not src.partial_axes
    holders: dict = {}
    for r in src.placement:
        region = src.region(r)
        holders.setdefault((region.offsets, region.sizes), (region, []))[1].append(r)
    moves = []
    for d in dst.placement:
        if identity_fill(dst, d) is not None:
            continue
        want = dst.region(d)
        for region, ranks in holders.values():
            piece = want.intersect(region)
            if piece is None:
                continue
            holder = d if d in ranks else ranks[d % len(ranks)]
            moves.append(Move(holder, d, piece))
    return tuple(moves)


@dataclass(frozen=True)
class Transfer(Step):
    """Point-to-point redistribution between any two placements (module docstring).

    >>> step = Transfer.between(src, dst)     # doctest: +SKIP
    """
    src: Layout
    dst: Layout

    @staticmethod
    def between(src: Layout, dst: Layout) -> "Transfer":
        return Transfer(src, dst)

    @cached_property
    def moves(self) -> tuple:
        """Every rank's moves (``transfer_moves``): up to n x n pieces on n ranks, made
        when first asked for (pricing, explaining, the one-process model); a rank runs
        its own, ``moves_of``."""
        return transfer_moves(self.src, self.dst)

    def moves_of(self, rank: int) -> tuple:
        """The moves ``rank`` sends or receives, in ``moves``' order, made in time of
        the ranks plus the regions (a transfer at 1024 ranks has a million moves), once
        per rank: a cached plan starts its transfer at every call."""
        mine = self.__dict__.setdefault("_moves_of", {})   # (frozen: beside its fields)
        found = mine.get(rank)
        if found is None:
            found = mine[rank] = tuple(
                Move(holder, to, Region(offsets, sizes))
                for holder, to, offsets, sizes in rank_pieces(self.src, self.dst, rank))
        return found

    def __str__(self) -> str:
        return f"Transfer({self.src.placement} {self.src.sbp} -> {self.dst.placement} {self.dst.sbp})"

    def fill_of(self, rank: int) -> str | None:
        """None when ``rank`` receives data, else the reduce whose identity it holds."""
        return identity_fill(self.dst, rank)

    def sent_bytes(self, itemsize: int) -> int:
        sent: dict = {}
        for m in self.moves:
            if m.src != m.dst:
                sent[m.src] = sent.get(m.src, 0) + m.region.numel * itemsize
        return max(sent.values(), default=0)

    def cost(self, itemsize: int) -> float:
        sent, received, messages, copied = {}, {}, {}, {}
        for m in self.moves:
            if m.src == m.dst:   # a local copy: cheap, but dearer than a view of the part
                copied[m.dst] = copied.get(m.dst, 0) + m.region.numel * itemsize
                continue
            nbytes = m.region.numel * itemsize
            sent[m.src] = sent.get(m.src, 0) + nbytes
            received[m.dst] = received.get(m.dst, 0) + nbytes
            messages[m.src] = messages.get(m.src, 0) + 1
            messages[m.dst] = messages.get(m.dst, 0) + 1
        worst_bytes = max(list(sent.values()) + list(received.values()) + [0])
        k = self.costs
        return (k.launch * bool(messages) + k.alpha * max(list(messages.values()) + [0])
                + k.p2p_beta * worst_bytes + k.gamma * max(list(copied.values()) + [0]))

    def start(self, x: torch.Tensor, rank: int, own: bool = False) -> Handle:
        """Post this rank's sends and receives and return at once (pipeline hand-offs
        overlap them with compute). ``x`` is the local source tensor (on a rank that
        only receives: any tensor of the dtype, device and ndim, e.g. empty); ``wait()``
        gives the local tensor in ``dst`` (empty outside it)."""
        src_region = self.src.region(rank)
        dst_region = self.dst.region(rank)
        out = None
        if dst_region is not None:
            fill = self.fill_of(rank)
            device = comm.local_device(self.dst.placement.type)  # not the "current" cuda
            out = x.new_empty(dst_region.sizes, device=device) if fill is None else \
                x.new_full(dst_region.sizes, identity_value(fill, x.dtype), device=device)
        # Across device types the pieces travel through host memory, on one backend.
        wire = torch.device("cpu") if self.src.placement.type != self.dst.placement.type else None
        sends, recvs, landing = [], [], []
        for m in self.moves_of(rank):
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
        if out is None:
            out = x.new_empty((0,) * x.dim())

        def land() -> torch.Tensor:
            for dest, buf in landing:
                dest.copy_(buf)
            return out
        return Handle(work, land)

    def simulate(self, locals_: Locals) -> Locals:
        any_local = next(iter(locals_.values()))
        out = {}
        for d in self.dst.placement:
            fill = self.fill_of(d) or "sum"
            out[d] = any_local.new_full(self.dst.region(d).sizes,
                                        identity_value(fill, any_local.dtype))
        for m in self.moves:
            src_region, dst_region = self.src.region(m.src), self.dst.region(m.dst)
            out[m.dst][m.region.slices(dst_region)] = locals_[m.src][m.region.slices(src_region)]
        return out

    def describe(self, itemsize: int) -> list[str]:
        sent = {}
        for m in self.moves:
            if m.src != m.dst:
                sent[m.src] = sent.get(m.src, 0) + m.region.numel
        msgs = sum(1 for m in self.moves if m.src != m.dst)
        per_rank = ", ".join(f"{r}: {n}" for r, n in sorted(sent.items())) or "none"
        return [f"{msgs} message(s), {len(self.moves) - msgs} local copy(ies)",
                f"elements sent per rank: {per_rank}"]
