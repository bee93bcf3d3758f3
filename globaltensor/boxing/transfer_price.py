"""What a ``Transfer`` costs, without making its moves: the planner prices thousands
of candidate transfers (every reduction of every source, in step planning every pair
of layouts two calls may hold) and makes the moves of the one it keeps.

``transfer_cost(src, dst, itemsize)`` is ``Transfer.between(src, dst).cost(itemsize)``
to the last bit: the same integers (bytes per rank, messages per rank) in the same
formula, counted on arrays of the regions instead of one move at a time.
``transfer_floor`` is a lower bound of it from each receiver's own region alone.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..cost import costs_of
from ..layout import Layout
from ..partials import identity_fill


@lru_cache(maxsize=16384)
def transfer_floor(src: Layout, dst: Layout, itemsize: int) -> float:
    """A lower bound of ``transfer_cost(src, dst, itemsize)``: the regions of a layout
    without partials are equal or disjoint, so a receiving rank gets from others
    exactly what its own region of ``src`` lacks. If some rank lacks anything, the
    transfer launches and sends at least one message of at least that much to the
    rank that lacks most; if none does, every rank copies its part locally, which is
    the whole cost."""
    lacking, whole = 0, 0
    held = _regions(src)
    for rank, want in _receivers(dst):
        size = want.numel
        own = held.get(rank)
        piece = None if own is None else want.intersect(own)
        lacking = max(lacking, size - (0 if piece is None else piece.numel))
        whole = max(whole, size)
    k = costs_of(src, dst)
    if lacking:
        return k.launch + k.alpha + k.p2p_beta * (lacking * itemsize)
    return k.gamma * (whole * itemsize)


@lru_cache(maxsize=16384)
def transfer_cost(src: Layout, dst: Layout, itemsize: int) -> float:
    """``Transfer.between(src, dst).cost(itemsize)`` (``steps/transfer.py``): per
    receiver and source region the piece's elements, from the holder
    ``transfer_moves`` picks; a piece a rank holds itself is a local copy."""
    lo, size, _ = _sources(src)
    ranks, want_lo, want_size = _wanted(dst)
    if not len(ranks):
        return 0.0
    ends = np.minimum(want_lo[:, None, :] + want_size[:, None, :], lo + size)
    elements = np.clip(ends - np.maximum(want_lo[:, None, :], lo), 0, None).prod(axis=2)
    holder = _holders(src, dst)                        # [receiver][source region]
    moved = elements > 0
    here = holder == ranks[:, None]
    away = moved & ~here
    world = int(max(ranks.max(), holder.max())) + 1
    messages = np.zeros(world, dtype=np.int64)
    np.add.at(messages, ranks, away.sum(axis=1))
    np.add.at(messages, holder[away], 1)
    sent = np.zeros(world, dtype=np.int64)
    np.add.at(sent, holder[away], elements[away])
    received = (elements * away).sum(axis=1)
    copied = (elements * (moved & here)).sum(axis=1)
    worst_bytes = max(int(sent.max()), int(received.max())) * itemsize
    k = costs_of(src, dst)
    return (k.launch * bool(away.any()) + k.alpha * int(messages.max())
            + k.p2p_beta * worst_bytes + k.gamma * (int(copied.max()) * itemsize))


@lru_cache(maxsize=4096)
def _sources(layout: Layout) -> tuple:
    """(offsets, sizes) per distinct region as [1, region, dim] arrays, and each
    region's holders in rank order of the placement (as ``transfer_moves`` groups)."""
    groups: dict = {}
    for r in layout.placement:
        region = layout.region(r)
        groups.setdefault((region.offsets, region.sizes), []).append(r)
    shape = (1, len(groups), layout.ndim)
    lo = np.array([k[0] for k in groups], dtype=np.int64).reshape(shape)
    size = np.array([k[1] for k in groups], dtype=np.int64).reshape(shape)
    return lo, size, tuple(tuple(g) for g in groups.values())


@lru_cache(maxsize=4096)
def _wanted(layout: Layout) -> tuple:
    """The receiving ranks of ``layout`` and their regions' (offsets, sizes)."""
    got = _receivers(layout)
    ranks = np.array([r for r, _ in got], dtype=np.int64)
    lo = np.array([w.offsets for _, w in got], dtype=np.int64).reshape(len(got), layout.ndim)
    size = np.array([w.sizes for _, w in got], dtype=np.int64).reshape(len(got), layout.ndim)
    return ranks, lo, size


def _holders(src: Layout, dst: Layout) -> np.ndarray:
    """[receiver][source region]: the rank each receiver of ``dst`` takes each region
    of ``src`` from: itself where it holds it, else its holders in turn."""
    holders, ranks = _sources(src)[2], [r for r, _ in _receivers(dst)]
    return np.array([[d if d in group else group[d % len(group)] for group in holders]
                     for d in ranks], dtype=np.int64).reshape(len(ranks), len(holders))


@lru_cache(maxsize=4096)
def _regions(layout: Layout) -> dict:
    """{rank: its region} of a layout without strided splits."""
    return {r: layout.region(r) for r in layout.placement}


@lru_cache(maxsize=4096)
def _receivers(layout: Layout) -> tuple:
    """(rank, region) of each rank that a transfer into ``layout`` sends to (not one
    that holds the identity of a partial axis)."""
    return tuple((r, layout.region(r)) for r in layout.placement
                 if identity_fill(layout, r) is None)


def clear_caches() -> None:
    for cached in (transfer_floor, transfer_cost, _sources, _wanted,
                   _regions, _receivers):
        cached.cache_clear()


# --- every target at once --------------------------------------------------------------
# Step planning prices a source against nearly every layout of its shape and placement;
# the general route's transfers from one reduced source are priced against all of them
# in one pass over arrays [target][receiving rank][source region]: the integers of
# ``transfer_cost`` per target, then its formula on arrays (the same float operations,
# in the same order, so each entry equals ``transfer_cost`` to the last bit).

class Targets:
    """Layouts of one shape on one placement, none strided, as arrays: per layout and
    rank of the placement (in its order) the region's offsets and sizes, and whether
    the rank receives (``_receivers``)."""

    def __init__(self, layouts: tuple):
        self.layouts = layouts
        first = layouts[0]
        self.placement, self.ndim = first.placement, first.ndim
        self.ranks = np.array(list(first.placement), dtype=np.int64)
        n, ndim = len(self.ranks), first.ndim
        lo = np.zeros((len(layouts), n, ndim), dtype=np.int64)
        size = np.zeros((len(layouts), n, ndim), dtype=np.int64)
        receives = np.zeros((len(layouts), n), dtype=bool)
        for j, layout in enumerate(layouts):
            for i, r in enumerate(first.placement):
                region = layout.region(r)
                lo[j, i], size[j, i] = region.offsets, region.sizes
                receives[j, i] = identity_fill(layout, r) is None
        self.lo, self.hi, self.receives = lo, lo + size, receives
        self.size = size


def transfer_costs(src: Layout, targets: Targets, itemsize: int) -> np.ndarray:
    """``[transfer_cost(src, t, itemsize) for t in targets.layouts]`` as an array
    (``src``: no strided split, on the targets' placement)."""
    lo, size, groups = _sources(src)                  # [1, region, dim]
    ranks = targets.ranks
    ends = np.minimum(targets.hi[:, :, None, :], lo + size)
    elements = np.clip(ends - np.maximum(targets.lo[:, :, None, :], lo), 0, None).prod(axis=3)
    elements *= targets.receives[:, :, None]          # [target][rank][region]
    holder = np.array([[d if d in group else group[d % len(group)] for group in groups]
                       for d in ranks.tolist()], dtype=np.int64)   # [rank][region]
    here = holder == ranks[:, None]
    moved = elements > 0
    away = moved & ~here
    world = int(max(ranks.max(), holder.max())) + 1
    onto = np.zeros((holder.size, world), dtype=np.int64)   # (rank, region) -> its holder
    onto[np.arange(holder.size), holder.ravel()] = 1
    count = len(targets.layouts)
    messages = away.reshape(count, -1).astype(np.int64) @ onto
    messages[:, ranks] += away.sum(axis=2)
    shipped = elements * away
    sent = shipped.reshape(count, -1) @ onto
    received = shipped.sum(axis=2)
    copied = (elements * (moved & here)).sum(axis=2)
    worst_bytes = np.maximum(sent.max(axis=1), received.max(axis=1)) * itemsize
    k = costs_of(src, targets.layouts[0])
    return (k.launch * away.any(axis=(1, 2)) + k.alpha * messages.max(axis=1)
            + k.p2p_beta * worst_bytes + k.gamma * (copied.max(axis=1) * itemsize))
