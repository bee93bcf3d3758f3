"""What a ``Transfer`` costs, without making its moves: the planner prices thousands
of candidate transfers (every reduction of every source, in step planning every pair
of layouts two calls may hold) and makes the moves of the one it keeps.

``transfer_cost(src, dst, itemsize)`` is ``Transfer.between(src, dst).cost(itemsize)``
to the last bit: the same integers (bytes per rank, messages per rank) in the same
formula, counted on arrays of the regions instead of one move at a time.
``transfer_floor`` is a lower bound of it from each receiver's own region alone.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..cost import costs_for, costs_of
from ..layout import Layout, balanced_split
from ..partials import identity_fill
from ..sbp import Split


@lru_cache(maxsize=16384)
def transfer_floor(src: Layout, dst: Layout, itemsize: int) -> float:
    """A lower bound of ``transfer_cost(src, dst, itemsize)``: the regions of a layout
    without partials are equal or disjoint, so a receiving rank gets from others
    exactly what its own region of ``src`` lacks. If some rank lacks anything, the
    transfer launches and sends at least one message of at least that much to the
    rank that lacks most; if none does, every rank copies its part locally, which is
    the whole cost."""
    lacking, whole = 0, 0
    ranks, want_lo, want_size = _wanted(dst)
    if len(ranks):   # per receiver, on arrays: its region, and what its own of src holds of it
        lo, size, _ = _sources(src)
        own = _holds_all(_holder_arrays(src)[2], ranks)   # -1: it holds none
        a = np.maximum(want_lo, lo[0][own])
        b = np.minimum(want_lo + want_size, (lo + size)[0][own])
        piece = np.where((b > a).all(axis=1) & (own >= 0), (b - a).prod(axis=1), 0)
        sizes = want_size.prod(axis=1)
        lacking, whole = int((sizes - piece).max()), int(sizes.max())
    k = costs_of(src, dst)
    if lacking:
        return k.launch + k.alpha + k.p2p_beta * (lacking * itemsize)
    return k.gamma * (whole * itemsize)


@lru_cache(maxsize=16384)
def transfer_cost(src: Layout, dst: Layout, itemsize: int) -> float:
    """``Transfer.between(src, dst).cost(itemsize)`` (``steps/transfer.py``): per
    receiver and source region the piece's elements, from the holder
    ``transfer_moves`` picks; a piece a rank holds itself is a local copy."""
    fast = _split_counts(src, dst)
    if fast is not None:
        messages, sent, received, copied, away = fast
        worst_bytes = max(int(sent.max()), int(received.max())) * itemsize
        k = costs_of(src, dst)
        return (k.launch * away + k.alpha * int(messages.max())
                + k.p2p_beta * worst_bytes + k.gamma * (int(copied.max()) * itemsize))
    lo, size, _ = _sources(src)
    ranks, want_lo, want_size = _wanted(dst)
    if not len(ranks):
        return 0.0
    elements = _overlaps_of(want_lo, want_lo + want_size, lo[0], (lo + size)[0])
    holder = _holders(src, dst)                        # [receiver][source region]
    moved = elements > 0
    here = holder == ranks[:, None]
    away = moved & ~here
    world = int(max(ranks.max(), holder.max())) + 1
    senders = holder[away]
    messages = np.bincount(senders, minlength=world)
    messages[ranks] += away.sum(axis=1)   # receivers are distinct ranks
    sent = np.bincount(senders, weights=elements[away], minlength=world)   # exact: < 2**53
    received = (elements * away).sum(axis=1)
    copied = (elements * (moved & here)).sum(axis=1)
    worst_bytes = max(int(sent.max()), int(received.max())) * itemsize
    k = costs_of(src, dst)
    return (k.launch * bool(away.any()) + k.alpha * int(messages.max())
            + k.p2p_beta * worst_bytes + k.gamma * (int(copied.max()) * itemsize))


def _split_counts(src: Layout, dst: Layout):
    """``transfer_cost``'s integers per rank (messages, elements sent, received, copied;
    whether anything moves) from one table per dim, where the source is split on every
    axis (each rank holds a region of its own) and the target has no partial axis, both
    on one placement; else None. Each axis splits one dim, so a rank's region is a
    product over dims of intervals, each chosen by the coordinates of the axes that
    split that dim: what a receiver gets from all regions, or a region gives all
    receivers, is a product over dims of sums (a 1024-rank transfer counts a few
    tables of at most 1024 entries instead of a million receiver-region pairs)."""
    placement = src.placement
    if dst.placement != placement or src.strided or dst.strided or dst.partial_axes \
            or not all(isinstance(s, Split) for s in src.sbp) \
            or len(_sources(src)[2]) != placement.size:
        return None
    coords = np.array([placement.coord(r) for r in placement], dtype=np.int64)
    n = placement.size
    total, count = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    given, giving = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    own = np.ones(n, dtype=np.int64)   # what a rank's region holds of its own target box
    spread = 1                         # ranks sharing each target box (unsplit axes)
    for a, s in enumerate(dst.sbp):
        if not isinstance(s, Split):
            spread *= placement.shape[a]
    for d, length in enumerate(src.shape):
        x, xl, xs = _combos(placement, coords, dst.sbp, d, length)
        y, yl, ys = _combos(placement, coords, src.sbp, d, length)
        part = np.clip(np.minimum((xl + xs)[:, None], (yl + ys)[None, :])
                       - np.maximum(xl[:, None], yl[None, :]), 0, None)   # [box][region]
        total *= part.sum(axis=1)[x]
        count *= (part > 0).sum(axis=1)[x]
        given *= part.sum(axis=0)[y]
        giving *= (part > 0).sum(axis=0)[y]
        own *= part[x, y]
    mine = (own > 0).astype(np.int64)
    messages = (count - mine) + (giving * spread - mine)
    return (messages, given * spread - own, total - own, own,
            bool((count - mine).any()))


def _combos(placement, coords: np.ndarray, sbp: tuple, d: int, length: int) -> tuple:
    """(per rank the number of its combination of coordinates on the axes that split
    dim ``d``, and per combination the interval (offsets, sizes) it holds of it, from
    ``_intervals``)."""
    axes = [a for a, s in enumerate(sbp) if isinstance(s, Split) and s.dim == d]
    number = np.zeros(len(coords), dtype=np.int64)
    for a in axes:
        number = number * placement.shape[a] + coords[:, a]
    lo, size = _intervals(length, placement)
    pattern = sum(1 << a for a in axes)
    _, first = np.unique(number, return_index=True)   # a rank of each combination
    return number, lo[pattern][first], size[pattern][first]


def _overlaps_of(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray,
                 b_hi: np.ndarray) -> np.ndarray:
    """[receiver][region]: the elements each receiver's box [a_lo, a_hi) shares with
    each region's [b_lo, b_hi) ([box][dim] each): a product over dims, where a dim
    that no box of either side cuts differently gives one number for every pair."""
    elements, same = None, 1
    for d in range(a_lo.shape[1]):
        x_lo, x_hi, y_lo, y_hi = a_lo[:, d], a_hi[:, d], b_lo[:, d], b_hi[:, d]
        if (x_lo == x_lo[0]).all() and (x_hi == x_hi[0]).all() and \
                (y_lo == y_lo[0]).all() and (y_hi == y_hi[0]).all():
            same *= max(0, int(min(x_hi[0], y_hi[0])) - int(max(x_lo[0], y_lo[0])))
            continue
        part = np.clip(np.minimum(x_hi[:, None], y_hi[None, :])
                       - np.maximum(x_lo[:, None], y_lo[None, :]), 0, None)
        elements = part if elements is None else elements * part
    if elements is None:
        return np.full((len(a_lo), len(b_lo)), same, dtype=np.int64)
    return elements * same if same != 1 else elements


@lru_cache(maxsize=4096)
def _sources(layout: Layout) -> tuple:
    """(offsets, sizes) per distinct region as [1, region, dim] arrays, and each
    region's holders in rank order of the placement (as ``transfer_moves`` groups)."""
    groups: dict = {}
    for r in layout.placement:
        region = layout.region(r)
        groups.setdefault((region.offsets, region.sizes), []).append(r)
    shape = (1, len(groups), len(layout.shape))
    lo = np.array([k[0] for k in groups], dtype=np.int64).reshape(shape)
    size = np.array([k[1] for k in groups], dtype=np.int64).reshape(shape)
    return lo, size, tuple(tuple(g) for g in groups.values())


@lru_cache(maxsize=4096)
def _wanted(layout: Layout) -> tuple:
    """The receiving ranks of ``layout`` and their regions' (offsets, sizes)."""
    got = _receivers(layout)
    ranks = np.array([r for r, _ in got], dtype=np.int64)
    lo = np.array([w.offsets for _, w in got], dtype=np.int64).reshape(len(got), len(layout.shape))
    size = np.array([w.sizes for _, w in got], dtype=np.int64).reshape(len(got), len(layout.shape))
    return ranks, lo, size


def _holders(src: Layout, dst: Layout) -> np.ndarray:
    """[receiver][source region]: the rank each receiver of ``dst`` takes each region
    of ``src`` from: itself where it holds it, else its holders in turn (holder
    ``d % len(holders)`` for rank d), as arrays (a placement of 1024 ranks has a
    million receiver-region pairs)."""
    table, count, region_of = _holder_arrays(src)
    ranks = _wanted(dst)[0]
    if not len(ranks):
        return np.zeros((0, len(count)), dtype=np.int64)
    if count.max() == 1:   # each region held by one rank (fully split): that rank, for all
        return np.broadcast_to(table[:, 0], (len(ranks), len(count)))
    turn = table[np.arange(len(count))[None, :], ranks[:, None] % count[None, :]]
    mine = _holds_all(region_of, ranks)
    return np.where(mine[:, None] == np.arange(len(count))[None, :], ranks[:, None], turn)


@lru_cache(maxsize=4096)
def _holder_arrays(src: Layout) -> tuple:
    """(per source region its holders [region][j], padded; how many; per rank the
    region it holds, -1 for none)."""
    holders = _sources(src)[2]
    count = np.array([len(g) for g in holders], dtype=np.int64)
    table = np.zeros((len(holders), int(count.max())), dtype=np.int64)
    region_of = np.full(max(max(g) for g in holders) + 1, -1, dtype=np.int64)
    for i, group in enumerate(holders):
        table[i, :len(group)] = group
        region_of[list(group)] = i
    return table, count, region_of


def rank_pieces(src: Layout, dst: Layout, rank: int) -> list:
    """[(holder, receiver, offsets, sizes)]: the pieces of ``transfer_moves(src, dst)``
    that ``rank`` sends or receives (its local copies too), in that order, found on
    arrays in time of the receivers plus the regions, not of their product: a rank
    holds one region of the source, so it sends each receiver one piece at most."""
    lo, size, _ = _sources(src)
    lo, size = lo[0], size[0]                          # [region][dim]
    table, count, region_of = _holder_arrays(src)
    ranks, want_lo, want_size = _wanted(dst)
    found = []                                         # (receiver's place, region, piece)
    mine = _holds(region_of, rank)
    place = np.flatnonzero(ranks == rank)
    if len(place):                                     # received: from every region
        i = int(place[0])
        a = np.maximum(want_lo[i], lo)
        b = np.minimum(want_lo[i] + want_size[i], lo + size)
        for g in np.flatnonzero((b > a).all(axis=1)).tolist():
            holder = rank if mine == g else int(table[g, rank % count[g]])
            found.append((i, g, (holder, rank, tuple(a[g].tolist()), tuple((b[g] - a[g]).tolist()))))
    g = mine
    if g >= 0:                                         # sent: its region, where taken from it
        a = np.maximum(want_lo, lo[g])
        b = np.minimum(want_lo + want_size, lo[g] + size[g])
        holder = np.where(_holds_all(region_of, ranks) == g, ranks, table[g, ranks % count[g]])
        for i in np.flatnonzero((b > a).all(axis=1) & (holder == rank) & (ranks != rank)).tolist():
            found.append((i, g, (rank, int(ranks[i]), tuple(a[i].tolist()),
                                 tuple((b[i] - a[i]).tolist()))))
    found.sort(key=lambda f: f[:2])
    return [f[2] for f in found]


def _holds(region_of: np.ndarray, rank: int) -> int:
    """The source region ``rank`` holds, -1 for none."""
    return int(region_of[rank]) if rank < len(region_of) else -1


def _holds_all(region_of: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    out = np.full(len(ranks), -1, dtype=np.int64)
    known = ranks < len(region_of)
    out[known] = region_of[ranks[known]]
    return out


@lru_cache(maxsize=4096)
def _receivers(layout: Layout) -> tuple:
    """(rank, region) of each rank that a transfer into ``layout`` sends to (not one
    that holds the identity of a partial axis)."""
    return tuple((r, layout.region(r)) for r in layout.placement
                 if identity_fill(layout, r) is None)


def clear_caches() -> None:
    for cached in (transfer_floor, transfer_cost, _sources, _wanted, _holder_arrays,
                   _receivers, _intervals, _holder_table, _overlaps):
        cached.cache_clear()
    _priced.clear()


# --- every (source, target) pair of a universe at once ----------------------------------
# Step planning prices the general route from every source's reductions to nearly every
# layout of the shape and placement: ``transfer_table`` counts the integers of
# ``transfer_cost`` for every pair of states (``search.py``'s codes: 0 broadcast,
# 1 partial_sum, 2 partial_max, 3 + d split(d)) on arrays [source][target][receiving
# rank][region], then applies its formula (the same float operations, in the same
# order, so each entry equals ``transfer_cost`` to the last bit). A pair's elements are
# a product over dims, of which at most two per axis are split (by either end): the
# others each give their whole length.

@lru_cache(maxsize=1024)
def _intervals(length: int, placement) -> tuple:
    """(offsets, sizes) [pattern][rank]: the interval of a dim of ``length`` that each
    rank (in placement order) holds when the axes of the bit mask ``pattern`` split it,
    nested in axis order."""
    pshape = placement.shape
    lo = np.zeros((1 << len(pshape), placement.size), dtype=np.int64)
    size = np.zeros_like(lo)
    for q in range(1 << len(pshape)):
        for i, r in enumerate(placement):
            offset, part = 0, length
            for a, c in enumerate(placement.coord(r)):
                if q >> a & 1:
                    begin, part = balanced_split(part, pshape[a])[c]
                    offset += begin
            lo[q, i], size[q, i] = offset, part
    return lo, size


@lru_cache(maxsize=64)
def _holder_table(placement, split: int) -> tuple:
    """For a source whose axes in the bit mask ``split`` split it: ([receiver][region]
    the holder each receiver takes each region from, as ``_holders`` picks it: itself
    where it holds it, else its holders in turn; [region] whether that rank is the
    region's first holder, which stands for it), by placement order."""
    ranks = list(placement)
    coords = [placement.coord(r) for r in ranks]
    axes = [a for a in range(placement.ndim) if split >> a & 1]
    groups = {}
    for i, c in enumerate(coords):
        groups.setdefault(tuple(c[a] for a in axes), []).append(i)
    holder = np.zeros((len(ranks), len(ranks)), dtype=np.int64)
    first = np.zeros(len(ranks), dtype=bool)
    for s, c in enumerate(coords):
        group = groups[tuple(c[a] for a in axes)]
        first[s] = group[0] == s
        for r in range(len(ranks)):
            holder[r, s] = r if r in group else group[ranks[r] % len(group)]
    return holder, first


@lru_cache(maxsize=1024)
def _overlaps(length: int, placement) -> np.ndarray:
    """[source pattern * patterns + target pattern][receiver][region]: how much of a
    dim of ``length`` the two intervals share (``_intervals``)."""
    lo, size = _intervals(length, placement)
    hi = lo + size
    ends = np.minimum(hi[None, :, :, None], hi[:, None, None, :])
    begins = np.maximum(lo[None, :, :, None], lo[:, None, None, :])
    return np.clip(ends - begins, 0, None).reshape(len(lo) ** 2, *lo.shape[1:], -1)


def _pair_keys(shape: tuple, pndim: int, mids: np.ndarray, targets: np.ndarray) -> tuple:
    """(per pair (source * target): what its transfer cost depends on, as a row: per
    axis of the source the label of the dim it splits (-1: none), per axis of the
    target that label (-1: none, -2: partial), per label its dim's length, and the
    elements of the dims no axis splits; the same as one integer per pair, equal
    for equal rows of this shape). Labels number the split dims in order of
    appearance, so that pairs alike but for the place of their dims (in one shape or
    in two) share a row."""
    m, t = len(mids), len(targets)
    slots = [np.broadcast_to(mids[:, a, None] - 3, (m, t)) for a in range(pndim)]
    slots += [np.broadcast_to(targets[None, :, a] - 3, (m, t)) for a in range(pndim)]
    lengths = np.array(shape + (0,), dtype=np.int64)        # one more: no dim
    labels, count = [], np.zeros((m, t), dtype=np.int64)
    length = np.full((m, t, 2 * pndim), len(shape))       # per label: its dim
    for k, dim in enumerate(slots):
        new, label = dim >= 0, np.where(dim >= 0, count, -1)
        for j in range(k):
            same = new & (dim == slots[j])
            label, new = np.where(same, labels[j], label), new & ~same
        for c in range(k + 1):   # a new label's dim goes to its place
            length[..., c] = np.where(new & (count == c), dim, length[..., c])
        count = count + new
        labels.append(label)
    partial = (targets == 1) | (targets == 2)
    for a in range(pndim):
        labels[pndim + a] = np.where(partial[None, :, a], -2, labels[pndim + a])
    length = lengths[length]
    counted = np.where(np.arange(2 * pndim) < count[..., None], length, 1).prod(axis=2)
    numel = math.prod(shape)
    rest = np.where(counted > 0, numel // np.maximum(counted, 1), 0)
    code = np.zeros((m, t), dtype=np.int64)
    for label in labels:
        code = code * (2 * pndim + 2) + label + 2
    distinct = np.unique(lengths)
    for c in range(2 * pndim):   # the rest follows from the lengths
        code = code * len(distinct) + np.searchsorted(distinct, length[..., c])
    rows = np.concatenate([np.stack(labels, axis=2), length, rest[..., None]], axis=2)
    return rows.reshape(m * t, -1), code.reshape(-1)


_priced: dict = {}   # (placement, itemsize) -> {a pair's key row: its transfer cost}


def transfer_table(shape: tuple, placement, itemsize: int, mids: np.ndarray,
                   targets: np.ndarray) -> np.ndarray:
    """[source][target]: ``transfer_cost`` between the states ``mids`` (codes, no
    partial axis) and ``targets`` of the shape and placement; each distinct pair
    (``_pair_keys``) priced once while planning."""
    keys, code = _pair_keys(shape, placement.ndim, mids, targets)
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    unique = keys[first]
    known = _priced.setdefault((placement, itemsize), {})
    rows = [tuple(row) for row in unique.tolist()]
    values = np.array([known.get(row, np.nan) for row in rows])
    missing = np.flatnonzero(np.isnan(values))
    if len(missing):
        values[missing] = _key_costs(unique[missing], placement, itemsize)
        known.update((rows[i], values[i]) for i in missing.tolist())
    return values[inverse.reshape(-1)].reshape(len(mids), len(targets))


def _key_costs(keys: np.ndarray, placement, itemsize: int) -> np.ndarray:
    """``transfer_cost`` of each pair key (``_pair_keys``): the integers of
    ``transfer_cost`` on arrays [pair][receiving rank][region], then its formula."""
    p, q, n = placement.ndim, 1 << placement.ndim, placement.size
    source, target = keys[:, :p], keys[:, p:2 * p]
    length, rest = keys[:, 2 * p:4 * p], keys[:, 4 * p]
    distinct = sorted(set(length.ravel().tolist()))
    overlaps = np.concatenate([_overlaps(x, placement) for x in distinct]
                              + [np.ones((1, n, n), dtype=np.int64)])
    where = np.searchsorted(np.array(distinct), length)
    axes = np.arange(p)
    elements = rest[:, None, None]
    for i in range(2 * p):
        qm = ((source == i) << axes).sum(axis=1)
        qt = ((target == i) << axes).sum(axis=1)
        used = ((source == i) | (target == i)).any(axis=1)
        index = np.where(used, (where[:, i] * q + qm) * q + qt, len(overlaps) - 1)
        elements = elements * overlaps[index]
    coords = np.array([placement.coord(r) for r in placement], dtype=np.int64)
    receives = ~((target == -2)[:, None, :] & (coords[None, :, :] != 0)).any(axis=2)
    split = ((source >= 0) << axes).sum(axis=1)
    holder = np.empty((len(keys), n, n), dtype=np.int64)
    first = np.empty((len(keys), n), dtype=bool)
    for mask in np.unique(split).tolist():
        holder[split == mask], first[split == mask] = _holder_table(placement, mask)
    elements = elements * (receives[:, :, None] & first[:, None, :])
    here = holder == np.arange(n)[None, :, None]
    moved = elements > 0
    away = moved & ~here
    shipped = elements * away
    # per pair and holder, the sums over (receiving rank, region) that it holds: counted
    # by holder (a one-hot (rank, region) -> holder matrix would take pairs x n^3 floats:
    # 27 GiB at 256 ranks)
    by_holder = (holder + (np.arange(len(keys)) * n)[:, None, None]).ravel()

    def per_holder(values: np.ndarray) -> np.ndarray:
        return np.bincount(by_holder, weights=values.ravel().astype(np.float64),
                           minlength=len(keys) * n).reshape(len(keys), n)
    messages = (per_holder(away) + away.sum(axis=2)).astype(np.int64)
    sent = per_holder(shipped)
    received = shipped.sum(axis=2)
    copied = (elements * (moved & here)).sum(axis=2)
    worst_bytes = np.maximum(sent.max(axis=1).astype(np.int64), received.max(axis=1)) * itemsize
    k = costs_for(placement.type)
    return (k.launch * away.any(axis=(1, 2)) + k.alpha * messages.max(axis=1)
            + k.p2p_beta * worst_bytes + k.gamma * (copied.max(axis=1) * itemsize))
