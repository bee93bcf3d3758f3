"""Determinants and solves of views whose wrapper and local part differ in contiguity
(a column slice or a transpose of a split matrix): torch's det/slogdet factor A^T or A
by A's contiguity and their backward asks it again, so values, factors and gradients
must be torch's.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
from ops_battery import B, S, battery_tests, case, checked, placements, randn


@checked
def check_determinants_of_views():
    a = randn((5, 6), "linalg") + 3 * torch.eye(5, 6, dtype=torch.float64)
    views = {"column slice": lambda x: x[:, :5], "transposed slice": lambda x: x[:, :5].t(),
             "contiguous copy": lambda x: x[:, :5].contiguous()}
    for name, view in views.items():
        for op, fn in (("det", torch.linalg.det), ("slogdet", torch.linalg.slogdet),
                       ("_linalg_det (with its factors)", torch.ops.aten._linalg_det),
                       ("inv", torch.linalg.inv)):
            case(f"{op} of a {name}", lambda x, fn=fn, view=view: fn(view(x)), [a],
                 choices=[[B, S(0), S(1)]], places=placements(3, 1, 3))
        case(f"solve with A a {name}", lambda x, view=view: torch.linalg.solve(view(x), x[:, 5:]),
             [a], choices=[[B, S(0), S(1)]], places=placements(3, 1, 3))


CHECKS = ["check_determinants_of_views"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
