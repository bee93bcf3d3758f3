"""The registry of boxing step kinds (a leaf: it imports nothing of the package).

Every concrete step class registers itself on definition (``Step.__init_subclass__``);
the planner asks the per-axis kinds, in registration order, which one serves a change
of one placement axis.
"""
from __future__ import annotations

AXIS_STEPS: list = []   # classes whose ``for_axis`` the planner tries
ALL_STEPS: list = []    # every concrete step class, per-axis or not


def register(cls: type, per_axis: bool) -> None:
    ALL_STEPS.append(cls)
    if per_axis:
        AXIS_STEPS.append(cls)
