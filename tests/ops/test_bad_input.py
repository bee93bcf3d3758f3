"""Bad input: operands on different placements and multi-element plain tensors raise
ValueError naming the problem (one-element plain tensors are fine).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import F64, B, S, battery_tests, checked, close, guard, line, mesh, nd, raises, randn

import globaltensor as gt


@checked
def check_bad_input():
    n = gt.get_world_size()
    p, rev, first = line(), line(reverse=True), gt.placement("cpu", [0])
    v = randn((5, 3), "bad")
    x = gt.tensor(v, placement=p, sbp=S(0))
    for other in (rev, first) + ((mesh(),) if n == 4 else ()):
        y = gt.tensor(v, placement=other, sbp=nd(B, other))
        w = gt.tensor(randn((3, 2), "badw"), placement=other, sbp=nd(B, other))
        tag = f"placements {p.ranks} and {other.ranks}"
        raises(f"x + y on {tag}", lambda: x + y, ValueError, "placement")
        raises(f"torch.mul(y, x) on {tag}", lambda: torch.mul(y, x), ValueError, "placement")
        raises(f"x @ w on {tag}", lambda: x @ w, ValueError, "placement")
        raises(f"F.linear on {tag}", lambda: F.linear(x, w.t()), ValueError, "placement")
        raises(f"torch.cat on {tag}", lambda: torch.cat([x, y]), ValueError, "placement")
    for label, fn in (("x + plain (5,3)", lambda: x + torch.ones(5, 3, dtype=F64)),
                      ("x * plain (3,)", lambda: x * torch.ones(3, dtype=F64)),
                      ("plain (5,1) - x", lambda: torch.ones(5, 1, dtype=F64) - x),
                      ("x @ plain (3,2)", lambda: x @ torch.ones(3, 2, dtype=F64)),
                      ("F.linear(x, plain)", lambda: F.linear(x, torch.ones(2, 3, dtype=F64))),
                      ("torch.cat([x, plain])",
                       lambda: torch.cat([x, torch.ones(1, 3, dtype=F64)]))):
        raises(label, fn, ValueError, "")
    # and one-element plain tensors are fine
    where = f"[world {n}] x + plain one-element"
    got = guard(where, lambda: (x + torch.ones(1, dtype=F64)) * torch.tensor(2.0, dtype=F64))
    if got is not None:
        close(got.full(), (v + 1) * 2, where)
    # torch's own functions that build plain tensors inside: the error names them,
    # and under implicit_broadcast they compute the plain value
    r = gt.tensor(torch.arange(4, dtype=F64), placement=p, sbp=S(0))
    raises("torch.combinations(x split)", lambda: torch.combinations(r), ValueError, "torch.combinations")
    with gt.implicit_broadcast():
        got = guard(f"[world {n}] combinations under implicit_broadcast", lambda: torch.combinations(r))
        flat = guard(f"[world {n}] unravel_index under implicit_broadcast",
                     lambda: torch.unravel_index(gt.tensor(torch.tensor([5, 7]), placement=p, sbp=S(0)), (3, 4)))
    if got is not None and flat is not None:
        close(got.full(), torch.combinations(torch.arange(4, dtype=F64)), f"[world {n}] combinations")
        for g, w in zip(flat, torch.unravel_index(torch.tensor([5, 7]), (3, 4))):
            close(g.full(), w, f"[world {n}] unravel_index")
    # one sbp for a whole module that a tensor cannot take names that tensor
    raises("to_global(BatchNorm1d, split(0))", lambda: gt.nn.to_global(torch.nn.BatchNorm1d(4), p, S(0)),
           ValueError, "buffer 'num_batches_tracked' of shape ()")
    raises("to_global(Linear, split(1))", lambda: gt.nn.to_global(torch.nn.Linear(4, 4), p, S(1)),
           ValueError, "parameter 'bias' of shape (4,)")


CHECKS = ["check_bad_input"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
