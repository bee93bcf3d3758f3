"""The general route between any two layouts, and the choice among routes by cost.

General route: reduce the source's partial axes on the source placement (to a split
when possible, so less is sent), then one ``Transfer`` in which every destination rank
receives exactly the intersection of its region with what the sources hold. Where a
region is replicated (broadcast axes) the holder is chosen round-robin per receiver,
and a receiver that holds a piece itself copies it locally.
"""
from __future__ import annotations

import itertools
from functools import lru_cache

from ..layout import Layout
from ..sbp import Partial, Split, broadcast
from . import steps as S
from .plan import ALPHA, BETA, Plan, plan_boxing

# Point-to-point messages are slower per byte than tuned collectives on gloo; the
# penalty makes collectives win ties on one placement.
P2P_BETA = BETA * 1.25


def transfer_moves(src: Layout, dst: Layout) -> tuple:
    """Every piece each receiving destination rank needs, with its chosen holder."""
    assert not src.partial_axes
    holders: dict = {}
    for r in src.placement:
        region = src.region(r)
        holders.setdefault((region.offsets, region.sizes), (region, []))[1].append(r)
    moves = []
    probe = S.Transfer(src, dst, ())
    for d in dst.placement:
        if probe.fill_of(d) is not None:
            continue
        want = dst.region(d)
        for region, ranks in holders.values():
            piece = want.intersect(region)
            if piece is None:
                continue
            holder = d if d in ranks else ranks[d % len(ranks)]
            moves.append(S.Move(holder, d, piece))
    return tuple(moves)


def transfer_cost(step: S.Transfer, itemsize: int) -> float:
    sent, received, messages = {}, {}, {}
    for m in step.moves:
        if m.src == m.dst:
            continue
        nbytes = m.region.numel * itemsize
        sent[m.src] = sent.get(m.src, 0) + nbytes
        received[m.dst] = received.get(m.dst, 0) + nbytes
        messages[m.src] = messages.get(m.src, 0) + 1
        messages[m.dst] = messages.get(m.dst, 0) + 1
    worst_bytes = max(list(sent.values()) + list(received.values()) + [0])
    return ALPHA * max(list(messages.values()) + [0]) + P2P_BETA * worst_bytes


def _reduced_sources(src: Layout):
    """Source layouts without partial axes that the source can reach by itself."""
    options = []
    for axis, s in enumerate(src.sbp):
        if isinstance(s, Partial):
            options.append([broadcast] + [Split(d) for d in range(src.ndim)])
        else:
            options.append([s])
    for combo in itertools.product(*options):
        yield Layout(src.shape, src.placement, tuple(combo))


def general_plan(src: Layout, dst: Layout, itemsize: int) -> Plan:
    best = None
    for mid in _reduced_sources(src):
        pre = plan_boxing(src, mid, itemsize)
        if pre is None:
            continue
        transfer = S.Transfer(mid, dst, transfer_moves(mid, dst))
        cost = pre.cost + transfer_cost(transfer, itemsize)
        if best is None or cost < best.cost:
            best = Plan(src, dst, pre.steps + (transfer,), cost, itemsize, "general (p2p)")
    return best


@lru_cache(maxsize=2048)
def plan_route(src: Layout, dst: Layout, itemsize: int = 4) -> Plan:
    """The cheapest plan from ``src`` to ``dst``: per-axis collectives when both are on
    one placement, or the general point-to-point route, whichever costs less."""
    if src.shape != dst.shape:
        raise ValueError(f"cannot box a tensor of shape {src.shape} to shape {dst.shape}")
    if src == dst:
        return Plan(src, dst, (), 0.0, itemsize)
    same = plan_boxing(src, dst, itemsize)
    general = general_plan(src, dst, itemsize)
    if same is not None and same.cost <= general.cost:
        return same
    return general
