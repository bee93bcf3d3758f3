"""Stage hand-off: boxing between two stage placements, split into a non-blocking send
half and receive half that the two stages post at different moments.

Between disjoint placements boxing is a source-side reduction of partials (among the
source ranks only) followed by one point-to-point ``Transfer``; the sender runs the
first part and posts its messages, the receiver posts its receives early and waits
only when it needs the tensor. Two stages on one placement (one worker) box locally.

Both halves run through ``boxing/run.py`` (debug log, check mode among the ranks of
each half, profiler ranges), as every boxing does.

>>> h = Handoff(out_layout, in_layout, torch.float32, "stage 0 -> 1")   # doctest: +SKIP
>>> work = h.send(out.local_part)      # on the sending stage's ranks
>>> pending = h.receive()          # on the receiving stage's ranks, posted early
>>> local = pending.wait()         # this rank's part of ``in_layout``
"""
from __future__ import annotations

import torch

from ..boxing import Plan, plan_route
from ..boxing.run import box, start
from ..boxing.steps import Handle, Transfer
from ..layout import Layout
from ..local_parts import device_of


class Handoff:
    """How one tensor moves from layout ``src`` (a stage's output, or the gradient of a
    stage's input) to layout ``dst`` (the next stage's input, or the previous stage's
    output gradient). ``why`` names it in logs, errors and profiles."""

    def __init__(self, src: Layout, dst: Layout, dtype: torch.dtype,
                 why: str = "pipeline hand-off"):
        self.src, self.dst, self.dtype, self.why = src, dst, dtype, why
        self.local = src.placement == dst.placement
        self.plan = self.receiving = None
        if self.local:
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.plan = plan_route(src, dst, itemsize)
        *pre, last = self.plan.steps
        if not isinstance(last, Transfer) or any(isinstance(s, Transfer) for s in pre):
            raise AssertionError(f"a hand-off between placements should end in one "
                                 f"transfer, got {self.plan}")
        # The receiving ranks take part in the transfer only.
        self.receiving = Plan(last.src, dst, (last,), last.cost(itemsize), itemsize,
                              self.plan.route)

    def send(self, local: torch.Tensor) -> Handle:
        """Post this rank's part of the move of its ``local`` part of ``src`` (the
        source-side reduction runs first). For a local hand-off the result is ready at
        once (the receiver is this rank)."""
        if self.local:
            return Handle.ready(box(local, self.src, self.dst, why=self.why))
        return start(self.plan, local, self.why, self.src.placement.flat_ranks)

    def receive(self) -> Handle:
        """Post this rank's receives; ``wait()`` on the result gives its part of ``dst``."""
        assert not self.local, "a local hand-off is received from its send"
        empty = torch.empty((0,) * len(self.src.shape), dtype=self.dtype,
                            device=device_of(self.src.placement))
        return start(self.receiving, empty, self.why, self.dst.placement.flat_ranks)
