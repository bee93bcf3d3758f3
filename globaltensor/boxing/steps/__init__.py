"""The boxing step vocabulary: one class per step, each declaring the change it serves,
its cost, how it runs and how it is simulated (``base.py``). Every module of this
package is imported here, which defines and registers its kinds (``registry.py``), so a
new kind is a new module (or a class in an existing one) and nothing else: the planner
prices it against the others, and the simulator and ``explain`` pick it up. Each
registered class is also exported under its own name (``steps.AllGather``).
"""
import importlib
import pkgutil

from .base import AxisStep, Handle, SbpChange, Step
from .registry import ALL_STEPS, AXIS_STEPS
from .transfer import Move, transfer_moves

_INFRASTRUCTURE = {"base", "registry"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _INFRASTRUCTURE and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
globals().update({kind.__name__: kind for kind in ALL_STEPS})

__all__ = ["AxisStep", "Handle", "SbpChange", "Step", "ALL_STEPS", "AXIS_STEPS", "Move",
           "transfer_moves"] + [kind.__name__ for kind in ALL_STEPS]
