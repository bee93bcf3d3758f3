"""What a call's choice of layouts leaves for the calls after it, which ``decide.py``
adds to the boxing the choice costs now: choosing one call at a time, without these
prices, takes what is cheapest now and pays more later (a partial output reduced by
a later call, a value that its next readers each box back).

>>> return_cost(out_meta, placement, (split(0),), ((broadcast_layout,), ()))  # doctest: +SKIP
0.00028   # the all-gather back to the residual stream's layout
"""
from __future__ import annotations

import functools

from ..boxing.plan import pair_cost
from ..layout import Layout
from ..placement import Placement
from ..sbp import Partial, Split, broadcast


def stream_layouts(current: list, parameters: list) -> tuple:
    """Where a call reduces a partial input (a row-parallel projection's output added
    to the residual stream), the layouts the value it makes is likely read in next:
    (its settled activation inputs' layouts (no partial axis, not a parameter:
    ``parameters``, per input), each partial input's layout with its partial axes
    broadcast). The second is for a value that joins no settled input of its shape (a
    post-norm's ``pow`` of the projection's output, a norm's variance summed over a
    split dim plus ``eps``): it is read next against whole or differently split values
    (the norm's ``x * rsqrt(variance)``), so a reduce-scatter now is an all-gather
    later, where Megatron all-reduces once. Empty where no input is partial (most
    calls)."""
    partial = [bool(c.partial_axes) for c in current]
    if not any(partial):
        return ()
    return (tuple(c for c, parameter, p in zip(current, parameters, partial)
                  if not parameter and not p),
            tuple(c.with_sbp(tuple(broadcast if isinstance(s, Partial) else s for s in c.sbp))
                  for c, p in zip(current, partial) if p))


def return_cost(out, placement: Placement, sbp: tuple, streams: tuple) -> float:
    """What an output of the shape of a settled input costs to bring back to that
    input's layout (the cheapest of them); one that reduced a partial input and joins
    no settled input of its shape, to that input's layout reduced (``stream_layouts``).
    Choosing op by op, the reduction of ``residual + partial`` priced alone takes the
    reduce-scatter (half an all-reduce's bytes) and the next projections each gather its
    output again: two collectives where Megatron runs one all-reduce, in every step the
    whole-step plan does not cover (the first ones, ``generate()``'s tokens). Charging
    the way back makes the reduction that keeps the stream's layout win unless another
    is cheaper even so. An output left partial is charged only against a settled input
    (its reduction is charged where it happens)."""
    shape = tuple(out.shape)
    if not all(type(n) is int for n in shape):
        return 0.0
    settled, reduced = streams
    found = [c for c in settled if c.shape == shape]
    if not found and not any(isinstance(s, Partial) for s in sbp):
        found = [c for c in reduced if c.shape == shape]
    if not found:
        return 0.0
    made = Layout.make(shape, placement, tuple(sbp))
    return min(0.0 if made == c else pair_cost(made, c, out.element_size()) for c in found)


def padded_partial_cost(out, placement: Placement, sbp: tuple, current: list,
                        targets: tuple) -> float:
    """What a partial output costs later when the signature makes an input partial
    (a split or broadcast input boxed to a partial addend, for free): the cheapest
    reduction out of it. Without it, greedy choice per op pads a batch-split activation
    into a full-size partial (no communication now, duplicated work) and gathers the
    weight instead of the activation, leaving a large reduction behind. Partials an op
    makes itself (a sum over a split dim) or passes on are not charged."""
    axes = [a for a, s in enumerate(sbp) if isinstance(s, Partial)
            and any(isinstance(t.sbp[a], Partial) and not isinstance(c.sbp[a], Partial)
                    for c, t in zip(current, targets))]
    if not axes:
        return 0.0
    shape = tuple(out.shape)
    # (a traced dynamic size is a SymInt, which no cache can key on)
    price = _cheapest_reductions if all(type(n) is int for n in shape) \
        else _cheapest_reductions.__wrapped__
    return price(shape, placement, tuple(sbp), tuple(axes), out.element_size())


@functools.lru_cache(maxsize=8192)
def _cheapest_reductions(shape: tuple, placement: Placement, sbp: tuple, axes: tuple,
                         size: int) -> float:
    """The cheapest reduction out of each partial axis of ``axes``, summed. Cached: a
    2-D placement's signatures ask about the same few outputs thousands of times in a
    first step (two thirds of it, priced afresh)."""
    src = Layout.make(shape, placement, sbp)
    cost = 0.0
    for a in axes:
        ends = [broadcast] + [Split(d) for d in range(len(shape))
                              if shape[d] >= placement.shape[a]]
        found = []
        for e in ends:
            try:
                found.append(pair_cost(src, Layout.make(shape, placement,
                                                        sbp[:a] + (e,) + sbp[a + 1:]),
                                       size))
            except ValueError:   # a split of a dim another axis splits strided
                continue
        cost += min(found)
    return cost
