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

from ..layout import Layout
from ..partials import identity_fill
from .cost import costs_of


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
