"""Redistribution: plan (plan.py, entry ``plan_route``), the step vocabulary (steps/,
one class per step), run with collectives (execute.py) or on per-rank tensors in one
process (simulate.py). Every boxing of the program runs through run.py (``box``,
``run``, ``start``), which logs it, checks it in check mode and names it in profiles."""
from .execute import execute
from .plan import Plan, plan_boxing, plan_route
from .simulate import local_part, materialize, scatter, simulate

__all__ = ["execute", "Plan", "plan_boxing", "plan_route", "local_part", "materialize",
           "scatter", "simulate"]
