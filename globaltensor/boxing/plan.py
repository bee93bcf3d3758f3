"""Planning: the cheapest sequence of boxing steps from one layout to another.

``plan_route`` is the entry point. On one placement, each step changes the sbp of one
axis; a search over nd-sbp states (``search.py``: Dijkstra, each step priced by its own
``cost``) finds the cheapest valid order (``plan_boxing``). The general route (``general_plan``)
reduces the source's partial axes on the source placement (to a split when possible,
so less is sent), then moves regions with one ``Transfer``; it works between any two
placements and is the fallback on one. A strided split is boxed on the refined view
where it is plain (``Layout.refined``, between two ``ViewAs``), or through broadcast
when the two layouts share no refined view. Plans are cached by (src, dst, element size).

Step planning prices tens of thousands of pairs on a 2-D placement, so nothing is
priced twice: the search from a source is kept and resumed for its next target (it
settles states in the order a search of its own would: the same path and cost), a
general route is skipped where a lower bound of its transfer cannot win
(``transfer_price.py``) and priced without making its moves, and ``route_cost`` gives
a plan's cost without making the plan, read from a table of every pair of layouts
of its shape and placement, made at once as arrays (``search.route_table``;
``route_costs`` reads a block of pairs at once); the same costs as pair by pair.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from ..layout import Layout, _whole_blocks
from ..sbp import Partial, Split, StridedSplit, broadcast
from . import search, transfer_price
from .execute import start
from .explain import format_plan
from .search import holds_max, route_table, search_from, state_of
from .steps import Handle
from .steps.reshape import ViewAs
from .steps.transfer import Transfer
from .transfer_price import transfer_cost, transfer_floor


@dataclass(frozen=True, repr=False)
class Plan:
    """Steps from layout ``src`` to ``dst`` with their estimated cost (seconds).

    >>> plan = plan_route(src, dst, itemsize=4)     # doctest: +SKIP
    >>> out = plan.start(x_local).wait()
    """
    src: Layout
    dst: Layout
    steps: tuple = ()
    cost: float = 0.0
    itemsize: int = 4
    route: str = "same-placement"

    def start(self, local: torch.Tensor, rank: int | None = None,
              donate: bool = False) -> Handle:
        """Start boxing this rank's ``local`` part (``execute.start``); ``wait()`` on
        the handle gives its part of ``dst``."""
        return start(self, local, rank, donate)

    @cached_property   # (asked per op-input boxing: boxing/reuse.py)
    def sends(self) -> bool:
        """Whether running it sends data between ranks (a local slice or a view does not:
        explicit mode allows those, and they need no meeting)."""
        return any(step.sends for step in self.steps)

    def sent_bytes(self) -> int:
        """Bytes the busiest rank sends, counted as ``gt.debug.comm_stats`` counts them."""
        return sum(step.sent_bytes(self.itemsize) for step in self.steps)

    def __str__(self) -> str:
        return format_plan(self)

    __repr__ = __str__


@lru_cache(maxsize=4096)
def plan_route(src: Layout, dst: Layout, itemsize: int = 4) -> Plan:
    """The cheapest plan from ``src`` to ``dst``: per-axis steps when both are on one
    placement, or the general point-to-point route, whichever costs less.

    >>> plan_route(Layout.make((8,), p, split(0)), Layout.make((8,), q, broadcast))  # doctest: +SKIP
    """
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst or src.same_parts(dst):
        return Plan(src, dst, (), 0.0, itemsize)
    if src.strided or dst.strided:
        return _strided_route(src, dst, itemsize)
    same = plan_boxing(src, dst, itemsize)
    # the general route only where it is cheaper (ties go to the collectives)
    general = general_plan(src, dst, itemsize, same.cost if same is not None else float("inf"))
    return same if general is None else general


@lru_cache(maxsize=65536)
def route_cost(src: Layout, dst: Layout, itemsize: int = 4) -> float:
    """``plan_route(src, dst, itemsize).cost``, without making the plan: step
    planning prices every pair of layouts two calls may hold (tens of thousands on
    a 2-D placement) and runs none of them.

    >>> route_cost(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst or src.same_parts(dst):
        return 0.0
    if _strided(src) or _strided(dst):
        fine = _refined_pair(src, dst)
        if fine is not None:
            return route_cost(fine[0], fine[1], itemsize)
        whole = _whole(src)
        return route_cost(src, whole, itemsize) + route_cost(whole, dst, itemsize)
    if src.placement == dst.placement:
        found = _table_cost(src, dst, itemsize)
        if found is not None:
            return found
    same = _boxing_cost(src, dst, itemsize)
    general = _general(src, dst, itemsize, same if same is not None else float("inf"))
    return same if general is None else general[0]


# A universe's table (``route_table``) prices every pair of its layouts at once. On a
# placement of a few ranks, and for a universe of a few states, that costs about what
# a few searched pairs do, and a first step asks about hundreds of pairs per shape: a
# 12-layer GPT's first step on 2 x 2 decides in 2.3 s with it against 3.5 s searched
# pair by pair, the same choices. On hundreds of ranks its transfers take seconds and
# GiBs (a simulated 1024-rank 2-D placement ran out of 24 GiB); a universe of hundreds
# of states (a 3-D placement) keeps megabytes per table until the next step planning
# forgets them. There each pair is searched.
TABLE_RANKS = 64
TABLE_STATES = 64   # (3 + the tensor's dims) ** the placement's: a 2-D one, up to 5 dims


def pair_cost(src: Layout, dst: Layout, itemsize: int = 4) -> float:
    """``plan_route(src, dst, itemsize).cost``: read from the universe's table on a
    placement of at most ``TABLE_RANKS`` ranks whose universe has at most
    ``TABLE_STATES`` states (``route_cost``), else searched (``plan_route``). What
    choosing one call's layouts asks for each pair it prices.

    >>> pair_cost(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    where = src.placement
    if (where == dst.placement and where.size <= TABLE_RANKS
            and (3 + len(src.shape)) ** where.ndim <= TABLE_STATES):
        return route_cost(src, dst, itemsize)
    return plan_route(src, dst, itemsize).cost


def route_costs(srcs: tuple, dsts: tuple, itemsize: int = 4, through: bool = True
                ) -> np.ndarray:
    """``[[route_cost(s, d, itemsize) for d in dsts] for s in srcs]`` as an array,
    read from the universes' tables a block at a time (the layouts of one shape,
    placement and strided blocks each, on the refined view the two blocks share;
    ``through``: the pairs that share none through broadcast, as arrays too)."""
    froms, intos = _by_view(srcs), _by_view(dsts)
    if len(froms) == len(intos) == 1:   # one block: the whole
        return _block(froms[0][2], intos[0][2], froms[0][0], intos[0][0], itemsize, through)
    out = np.empty((len(srcs), len(dsts)))
    for key, rows, group in froms:
        for other, cols, targets in intos:
            out[np.ix_(rows, cols)] = _block(group, targets, key, other, itemsize, through)
    return out


def _block(group: tuple, targets: tuple, key: tuple, other: tuple, itemsize: int,
           through: bool) -> np.ndarray:
    """``route_costs`` of layouts of one shape, placement and strided blocks each (NaN
    in a table: no route there, priced pair by pair)."""
    (blocks, placement, shape), (theirs, where, their_shape) = key, other
    found, alike = None, where == placement and shape == their_shape
    view = _joined(blocks, theirs) if alike else None
    unrefined = view is None and alike   # no refined view for any pair, or some: -1
    if view is not None:
        fine, a, a_all, a_fine = _group_states(group, view)
        _, b, b_all, b_fine = _group_states(targets, view)
        if not (a_fine and b_fine):
            unrefined = (a == -1)[:, None] | (b == -1)[None, :]
        if fine is not None:
            found = route_table(fine, placement, itemsize)[a[:, None], b[None, :]]
            if not (a_all and b_all):
                found[(a < 0)[:, None] | (b < 0)[None, :]] = np.nan
    if found is None:
        found = np.full((len(group), len(targets)), np.nan)
    if through and 1 not in placement.shape and np.any(unrefined):
        # boxed through broadcast (``route_cost``): the two halves' costs, summed
        found = np.where(unrefined, _through(group, itemsize, True)[:, None]
                         + _through(targets, itemsize, False)[None, :], found)
    for i, j in zip(*np.nonzero(np.isnan(found))):   # pair by pair where no table
        found[i, j] = route_cost(group[i], targets[j], itemsize)
    return found


@lru_cache(maxsize=4096)
def _through(group: tuple, itemsize: int, into: bool) -> np.ndarray:
    """``route_cost`` from each layout of ``group`` to broadcast (``into``), or from
    broadcast to each."""
    whole = (_whole(group[0]),)
    return route_costs(group, whole, itemsize, False)[:, 0] if into else \
        route_costs(whole, group, itemsize, False)[0]


@lru_cache(maxsize=4096)
def _by_view(layouts: tuple) -> list:
    """[((strided blocks, placement, shape), their indices in ``layouts``, those
    layouts)]: the layouts of each shape, placement and strided blocks."""
    groups: dict = {}
    for i, layout in enumerate(layouts):
        groups.setdefault((_blocks(layout), layout.placement, layout.shape), []).append(i)
    return [(key, rows, tuple(layouts[i] for i in rows)) for key, rows in groups.items()]


@lru_cache(maxsize=16384)
def _blocks(layout: Layout) -> tuple:
    return tuple(sorted({(s.dim, s.blocks) for s in layout.sbp if isinstance(s, StridedSplit)}))


def _joined(a: tuple, b: tuple):
    """The refined view of two layouts' strided blocks (``_refined_pair``), or None."""
    view = dict(a)
    for d, k in b:
        if view.setdefault(d, k) != k:
            return None
    return tuple(sorted(view.items()))


@lru_cache(maxsize=16384)
def _group_states(group: tuple, view: tuple) -> tuple:
    """(the universe of ``group``'s layouts (one shape) refined on ``view``, or None;
    the number of each one's refined state there: -1 where it has no refined layout,
    -2 where that has no state; whether all have a state; whether all refine)."""
    found = [_fine_state(layout, view) for layout in group]
    shapes = {f[0] for f in found if f}
    shape = shapes.pop() if len(shapes) == 1 else None
    numbers = np.array([-1 if f is False else -2 if f is None or f[0] != shape else f[1]
                        for f in found])
    return shape, numbers, bool(numbers.min() >= 0), False not in found


@lru_cache(maxsize=65536)
def _fine_state(layout: Layout, view: tuple):
    """``state_of(layout.refined(dict(view)))`` (of ``layout`` itself for no view),
    made without making the refined layout; False where that is None."""
    if not view:
        return state_of(layout.shape, layout.placement.ndim, layout.sbp)
    blocks = dict(view)
    shape, where = _refined_shape(layout.shape, view)
    dims = []   # per axis: the dim of the refined shape it splits, or its sbp
    plain = [s.dim for s in layout.sbp if isinstance(s, Split)]
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, StridedSplit):
            if blocks.get(s.dim) != s.blocks:
                return False
            dims.append(where[s.dim] + 1)
        elif isinstance(s, Split):
            if s.dim in blocks and (plain.count(s.dim) > 1 or not _whole_blocks(
                    layout.shape[s.dim], blocks[s.dim], layout.placement.shape[axis])):
                return False   # nested splits of a dim, or parts that are no whole blocks
            dims.append(where[s.dim])
        else:
            dims.append(s)
    return state_of(shape, layout.placement.ndim, tuple(_split(d) if type(d) is int else d
                                                      for d in dims))


@lru_cache(maxsize=1024)
def _refined_shape(shape: tuple, view: tuple) -> tuple:
    """(``shape`` with each dim d of ``view`` ((d, k), ...) as (k, length // k), the
    place of each of its dims there)."""
    blocks, out, where = dict(view), [], []
    for d, length in enumerate(shape):
        where.append(len(out))
        k = blocks.get(d)
        out += [length] if k is None else [k, length // k]
    return tuple(out), tuple(where)


@lru_cache(maxsize=256)
def _split(dim: int) -> Split:
    return Split(dim)


def _table_cost(src: Layout, dst: Layout, itemsize: int):
    """``route_cost`` of two layouts of one placement from their universe's table, or
    None where it has none."""
    a = state_of(src.shape, src.placement.ndim, src.sbp)
    b = state_of(dst.shape, dst.placement.ndim, dst.sbp)
    if a is None or b is None:
        return None
    found = route_table(a[0], src.placement, itemsize)[a[1], b[1]]
    return found.item() if found < float("inf") else None


def _strided_route(src: Layout, dst: Layout, itemsize: int) -> Plan:
    """Box on the refined view both layouts share, or else through broadcast on the
    source's placement (each half then has one)."""
    fine = _refined_pair(src, dst)
    if fine is not None:
        fine_src, fine_dst = fine
        inner = plan_route(fine_src, fine_dst, itemsize)
        steps = (ViewAs(src, fine_src),) + inner.steps + (ViewAs(fine_dst, dst),)
        return Plan(src, dst, steps, inner.cost, itemsize, inner.route)
    whole = _whole(src)
    first, second = plan_route(src, whole, itemsize), plan_route(whole, dst, itemsize)
    return Plan(src, dst, first.steps + second.steps, first.cost + second.cost, itemsize,
                "through broadcast")


@lru_cache(maxsize=16384)
def _refined_pair(src: Layout, dst: Layout):
    """(src, dst) on the refined view both share (``Layout.refined``), or None."""
    blocks: dict = {}
    for s in src.sbp + dst.sbp:
        if isinstance(s, StridedSplit):
            blocks.setdefault(s.dim, set()).add(s.blocks)
    if all(len(k) == 1 for k in blocks.values()):
        view = tuple(sorted((d, k.pop()) for d, k in blocks.items()))
        fine_src, fine_dst = _refined(src, view), _refined(dst, view)
        if fine_src is not None and fine_dst is not None:
            return fine_src, fine_dst
    return None


@lru_cache(maxsize=4096)
def _refined(layout: Layout, view: tuple):
    return layout.refined(dict(view))


@lru_cache(maxsize=16384)
def _strided(layout: Layout) -> bool:
    return layout.strided


def _whole(layout: Layout) -> Layout:
    return Layout.make(layout.shape, layout.placement, (broadcast,) * layout.placement.ndim)


@lru_cache(maxsize=8192)
def plan_boxing(src: Layout, dst: Layout, itemsize: int = 4) -> Plan | None:
    """The cheapest same-placement plan from ``src`` to ``dst``, or None when the
    per-axis steps cannot get there (the caller then uses the general route).

    >>> plan_boxing(Layout.make((8,), p, split(0)), Layout.make((8,), p, broadcast))  # doctest: +SKIP
    """
    found = _boxing(src, dst, itemsize)
    return None if found is None else Plan(src, dst, found[1], found[0], itemsize)


def _boxing(src: Layout, dst: Layout, itemsize: int):
    """(cost, steps) of ``plan_boxing``, or None."""
    if src.placement != dst.placement or src.shape != dst.shape:
        return None
    if src.sbp == dst.sbp:
        return 0.0, ()
    return search_from(src, itemsize, holds_max(src) or holds_max(dst)).reach(dst)


def _boxing_cost(src: Layout, dst: Layout, itemsize: int) -> float | None:
    found = _boxing(src, dst, itemsize)
    return None if found is None else found[0]


def clear_caches() -> None:
    """Forget every plan and search edge (a new step kind was registered, or a test
    counts the layouts still held)."""
    for cached in (plan_route, plan_boxing, _transfer):
        cached.cache_clear()
    forget_searches()


def forget_searches() -> None:
    """Forget the searches and prices kept for pricing many pairs, not the plans
    (step planning's working set: a 12-layer GPT on 2 x 4 keeps about 150 MiB of them;
    what runs later needs only its plans)."""
    for cached in (route_cost, _refined_pair, _refined, _strided, _blocks, _by_view,
                   _group_states, _fine_state, _refined_shape, _through, _reduced_sources):
        cached.cache_clear()
    search.clear_caches()
    transfer_price.clear_caches()


@lru_cache(maxsize=16384)
def _reduced_sources(src: Layout) -> tuple:
    """Source layouts without partial axes that the source can reach by itself."""
    options = []
    for s in src.sbp:
        if isinstance(s, Partial):
            options.append([broadcast] + [Split(d) for d in range(src.ndim)])
        else:
            options.append([s])
    return tuple(Layout.interned(src.shape, src.placement, tuple(combo))
                 for combo in itertools.product(*options))


def general_plan(src: Layout, dst: Layout, itemsize: int,
                 bound: float = float("inf")) -> Plan | None:
    """The general route: reduce the source's partials, then one ``Transfer``; None
    when every such route costs ``bound`` or more (the caller has one that cheap)."""
    found = _general(src, dst, itemsize, bound)
    if found is None:
        return None
    cost, mid = found
    pre = () if mid == src else plan_boxing(src, mid, itemsize).steps
    return Plan(src, dst, pre + (_transfer(mid, dst),), cost, itemsize, "general (p2p)")


def _general(src: Layout, dst: Layout, itemsize: int, bound: float):
    """(cost, the reduced source it sends from) of the cheapest general route under
    ``bound``, or None. A route is priced only where a lower bound of its transfer
    (``transfer_floor``) leaves it a chance, and its transfer without its moves."""
    best, best_cost = None, bound
    for mid in _reduced_sources(src):
        floor = transfer_floor(mid, dst, itemsize)
        if floor >= best_cost:
            continue
        pre = 0.0
        if mid != src:
            pre = _boxing_cost(src, mid, itemsize)
            if pre is None or pre + floor >= best_cost:
                continue
        moved = transfer_cost(mid, dst, itemsize)
        if moved >= best_cost or pre + moved >= best_cost:
            continue
        best, best_cost = mid, pre + moved
    return None if best is None else (best_cost, best)


@lru_cache(maxsize=1024)
def _transfer(mid: Layout, dst: Layout) -> Transfer:
    return Transfer.between(mid, dst)
