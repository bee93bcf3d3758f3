"""Determinants and solves of views whose wrapper and local part differ in contiguity
(a column slice or a transpose of a split matrix): torch's det/slogdet factor A^T or A
by A's contiguity and their backward asks it again, so values, factors and gradients
must be torch's. Batched matrix functions keep a split of the batch.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
from ops_battery import B, S, battery_tests, case, checked, expect, placements, randn

import globaltensor as gt


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


@checked
def check_batched_matrix_functions():
    # a function of each matrix keeps a split of the batch (it gathered the batch)
    spd = randn((4, 3, 3), "spd")
    spd = spd @ spd.transpose(1, 2) + 3 * torch.eye(3, dtype=torch.float64)
    rhs = randn((4, 3, 2), "rhs")
    batch = gt.tensor(spd, placement=gt.placement.all("cpu"), sbp=S(0))
    for name, fn in (("inv", torch.linalg.inv), ("cholesky", torch.linalg.cholesky),
                     ("qr R", lambda x: torch.linalg.qr(x)[1]), ("svdvals", torch.linalg.svdvals),
                     ("slogdet", lambda x: torch.linalg.slogdet(x)[1]),
                     ("eigvalsh", torch.linalg.eigvalsh), ("matrix_exp", lambda x: torch.linalg.matrix_exp(x / 9))):
        case(f"batched {name}", fn, [spd], choices=[[B, S(0)]], must=[(S(0),)],
             places=placements(2, 1, 2))
        expect(fn(batch).sbp == (S(0),), f"batched {name} of a split batch: {fn(batch).sbp}")
    case("batched solve", torch.linalg.solve, [spd, rhs], choices=[[B, S(0)], [B, S(0)]],
         must=[(S(0), S(0))], places=placements(2, 1, 2))


CHECKS = ["check_determinants_of_views", "check_batched_matrix_functions"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
