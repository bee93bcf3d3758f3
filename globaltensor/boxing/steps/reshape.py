"""ViewAs: a rank's part seen on another global shape, for strided splits.

A strided split's parts are no boxes, so no step moves them as they are. Boxing to or
from one views the tensor with each strided dim as ``(blocks, length // blocks)``
(``Layout.refined``), where the split is plain, boxes there with the ordinary steps and
views the result back: ``ViewAs`` is that change of view, on every rank's part alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...layout import Layout
from .base import Handle, Locals, Step


@dataclass(frozen=True)
class ViewAs(Step):
    """The same elements on every rank, seen as ``dst`` (same placement, a reshaped
    global shape whose parts are this rank's part reshaped); no communication."""

    sends = False
    src: Layout
    dst: Layout

    def cost(self, itemsize: int) -> float:
        return 0.0

    def start(self, x, rank, own=False):
        return Handle.ready(x.reshape(self.dst.local_shape(rank)))

    def simulate(self, locals_: Locals) -> Locals:
        return {r: t.reshape(self.dst.local_shape(r)) for r, t in locals_.items()}

    def describe(self, itemsize: int) -> list[str]:
        return [f"{self.src.shape} {self.src.sbp} seen as {self.dst.shape} {self.dst.sbp}"]

    def __str__(self) -> str:
        return f"ViewAs({self.src.sbp} -> {self.dst.shape} {self.dst.sbp})"
