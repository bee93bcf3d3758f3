"""The alpha-beta cost model every boxing step prices itself with.

The absolute numbers matter less than their ratios; these fit gloo on loopback TCP.
"""
from __future__ import annotations

import math
from functools import lru_cache

from ..layout import Layout

# One collective: seconds per message and per byte.
ALPHA = 30e-6
# Starting one collective from Python (planning, packing, the call, the wait) costs
# about this on top of its messages (a bare all-reduce of one element between two
# processes here: 0.22-0.28 ms with the machine loaded), so two collectives of half the
# bytes each (a reduce-scatter, then an all-gather) cost more than one all-reduce.
LAUNCH = 250e-6
BETA = 1.0 / 1.5e9
# Local copies cost memory bandwidth only; keep them cheap but not free so a route
# with fewer copies wins a tie.
GAMMA = BETA / 20
# Point-to-point messages are slower per byte than tuned collectives on gloo; the
# penalty makes collectives win ties on one placement.
P2P_BETA = BETA * 1.25


def max_local_bytes(layout: Layout, itemsize: int) -> int:
    """The largest local tensor of ``layout`` in bytes (the slowest rank sets the pace)."""
    return _max_local_numel(layout) * itemsize


@lru_cache(maxsize=16384)   # step planning on 2-D placements prices thousands of layouts
def _max_local_numel(layout: Layout) -> int:
    return max(math.prod(layout.local_shape(r)) for r in layout.placement)
