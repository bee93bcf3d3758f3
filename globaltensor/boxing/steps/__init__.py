"""The boxing step vocabulary: one class per step, each declaring the change it serves,
its cost, how it runs and how it is simulated (``base.py``). Importing this package
defines and registers every kind; a new kind is a new class in a module imported here.
"""
from .base import AxisStep, Handle, Step
from .collectives import AllGather, AllReduce, AllToAll, ReduceScatter
from .local import LocalSlice, PadToPartial, Relabel, ZeroNonRoot
from .registry import ALL_STEPS, AXIS_STEPS
from .transfer import Move, Transfer, transfer_moves

__all__ = ["AxisStep", "Handle", "Step", "AllGather", "AllReduce", "AllToAll",
           "ReduceScatter", "LocalSlice", "PadToPartial", "Relabel", "ZeroNonRoot",
           "ALL_STEPS", "AXIS_STEPS", "Move", "Transfer", "transfer_moves"]
