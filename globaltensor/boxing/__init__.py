"""Redistribution: plan (plan.py), step vocabulary (steps.py), run with collectives
(execute.py) or on per-rank tensors in one process (simulate.py)."""
from .execute import execute
from .plan import Plan, plan_boxing
from .simulate import materialize, scatter, simulate
