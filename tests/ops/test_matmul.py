"""The matmul family: @, mm, bmm, batched matmul, F.linear, addmm, baddbmm,
matrix-vector, F.grouped_mm (a mixture of experts' products); and the output sbp of
x @ w before any boxing (docs/DESIGN.md's matmul signatures). torch.einsum is in test_einsum.py.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from ops_battery import B, P, S, battery_tests, case, checked, describe, expect, guard, line, placements, randn

import globaltensor as gt

MM_MUST = [(S(0), B), (B, S(1)), (S(1), S(0)), (P, B), (B, B)]


MM_OUT = {(S(0), B): S(0), (B, S(1)): S(1), (S(1), S(0)): P, (P, B): P, (B, P): P, (B, B): B}


@checked
def check_matmul():
    x, w = randn((5, 4), "mx"), randn((4, 3), "mw")
    case("x @ w (5,4)@(4,3)", lambda x, w: x @ w, [x, w], must=MM_MUST,
         places=placements(16, 3, 8))
    case("torch.matmul 2-D", torch.matmul, [x, w], must=MM_MUST, places=placements(6, 0, 3))
    case("torch.mm", torch.mm, [x, w], places=placements(4, 0, 2))
    x3 = randn((2, 5, 4), "mx3")
    case("matmul (2,5,4)@(4,3)", torch.matmul, [x3, w], places=placements(10, 2, 6))
    a, b = randn((3, 5, 4), "ba"), randn((3, 4, 2), "bb")
    case("bmm (3,5,4)x(3,4,2)", torch.bmm, [a, b], places=placements(10, 2, 6))
    case("matmul (3,5,4)@(3,4,2)", torch.matmul, [a, b], places=placements(4, 0, 2))
    lw, lb = randn((3, 4), "lw"), randn((3,), "lb")
    case("F.linear bias", F.linear, [x, lw, lb], places=placements(12, 2, 6),
         must=[(S(0), B, B), (B, S(0), S(0)), (S(1), S(1), B), (B, B, B)])
    case("F.linear no bias", F.linear, [x, lw], places=placements(8, 1, 4))
    case("F.linear 3-D", F.linear, [x3, lw, lb], places=placements(8, 0, 4))
    case("addmm bias (3,)", torch.addmm, [lb, x, w], places=placements(10, 1, 5))
    full_bias = randn((5, 3), "fb")
    case("addmm bias (5,3) beta/alpha",
         lambda c, x, w: torch.addmm(c, x, w, beta=0.5, alpha=2.0), [full_bias, x, w],
         places=placements(10, 1, 5))
    bb = randn((3, 5, 2), "bbias")
    case("baddbmm", torch.baddbmm, [bb, a, b], places=placements(10, 1, 5))
    case("baddbmm bias (5,2) beta/alpha",
         lambda c, x, y: torch.baddbmm(c, x, y, beta=2.0, alpha=0.5),
         [randn((5, 2), "bb2"), a, b], places=placements(6, 0, 3))
    v = randn((4,), "mv")
    with warnings.catch_warnings(record=True) as seen:    # mv and dot have rules
        warnings.simplefilter("always")
        case("matmul (5,4)@(4,)", torch.matmul, [x, v], places=placements(6, 0, 3))
        case("torch.dot (4,).(4,)", torch.dot, [v, randn((4,), "dv")],
             places=placements(6, 0, 3))
        # A vector on the left: torch squeezes the product in place (squeeze_), which
        # raised "cannot box a tensor of shape (3,) to shape (1, 3)".
        case("matmul (4,)@(4,3)", torch.matmul, [v, w], places=placements(12, 1, 6))
        case("v @ v (4,)@(4,)", lambda a, b: a @ b, [v, randn((4,), "dv2")],
             places=placements(6, 0, 3))
        case("matmul (4,)@(2,4,3)", torch.matmul, [v, randn((2, 4, 3), "mw3")],
             places=placements(6, 0, 3))
    fallbacks = {str(w.message) for w in seen if issubclass(w.category, gt.debug.FallbackWarning)}
    expect(not fallbacks, f"mv/dot fell back: {fallbacks}")
    # the output sbp before any boxing (DESIGN: matmul signatures, 1-D)
    p = line()
    for (sx, sw), so in MM_OUT.items():
        where = describe("sbp of x @ w", (sx, sw), p)
        out = guard(where, lambda: (gt.tensor(x, placement=p, sbp=sx)
                                    @ gt.tensor(w, placement=p, sbp=sw)))
        if out is not None:
            expect(out.sbp == (so,), f"{where}: sbp {out.sbp}, expected {(so,)}")

    # torch.cdist keeps the batch's split and either operand's rows' (it gathered them)
    a, b = randn((2, 5, 3), "cd1"), randn((2, 4, 3), "cd2")
    for norm in (2.0, 1.0):
        case(f"cdist p={norm}", lambda x, y, norm=norm: torch.cdist(x, y, p=norm), [a, b],
             choices=[[B, S(0), S(1)], [B, S(0), S(1)]], places=placements(6, 1, 3))
    case("cdist (2,5,3) to (4,3), batch dims broadcast", torch.cdist, [a, randn((4, 3), "cd3")],
         choices=[[B, S(0), S(1)], [B, S(0)]], places=placements(4, 1, 3))
    for (sa, sb), so in (((S(0), S(0)), S(0)), ((S(1), B), S(1)), ((B, S(1)), S(2))):
        out = torch.cdist(gt.tensor(a, placement=p, sbp=sa), gt.tensor(b, placement=p, sbp=sb))
        expect(out.sbp == (so,), f"cdist of {sa}, {sb}: {out.sbp}, expected {so}")


@checked
def check_grouped_mm():
    # float32 (torch's CPU kernel takes no float64) of 16-byte rows, as the kernel needs;
    # uneven parts of a split lose that alignment and run group by group
    f32 = dict(rtol=1e-5, atol=1e-5)
    tokens, experts = randn((8, 4), "gma", torch.float32), randn((3, 4, 8), "gmb", torch.float32)
    offs = torch.tensor([2, 2, 8], dtype=torch.int32)    # an expert without tokens too
    grouped = lambda a, b, o: F.grouped_mm(a, b, offs=o)  # noqa: E731
    case("grouped_mm (8,4) x (3,4,8)", grouped, [tokens, experts, offs],
         choices=[[B, S(0), S(1), P], [B, S(0), S(1), S(2), P], [B, S(0)]],
         must=[(S(1), S(1), B), (B, S(2), B), (S(0), B, B), (P, B, B)], places=placements(10, 1, 4), **f32)
    # the weight gradient's form: (k, tokens) x (tokens, n), tokens cut into groups
    case("grouped_mm (4,8) x (8,8)", grouped,
         [tokens.t().contiguous(), randn((8, 8), "gmc", torch.float32), offs],
         choices=[[B, S(0), S(1)], [B, S(0), S(1)], [B]], must=[(S(0), B, B), (B, S(1), B)],
         places=placements(6, 1, 3), **f32)
    case("grouped_mm (3,5,4) x (3,4,8)", lambda a, b: F.grouped_mm(a, b),
         [randn((3, 5, 4), "gmd", torch.float32), experts], must=[(S(0), S(0)), (S(2), S(1))],
         places=placements(6, 1, 3), **f32)
    p = line()
    with gt.debug.comm_stats() as stats:
        out = F.grouped_mm(gt.tensor(tokens, placement=p, sbp=B), gt.tensor(experts, placement=p, sbp=S(2)),
                           offs=gt.tensor(offs, placement=p, sbp=B))
    expect(out.sbp == (S(1),) and stats.total_bytes == 0, f"grouped_mm of columns split: {out.sbp}, sent {stats}")


CHECKS = ["check_matmul", "check_grouped_mm"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
