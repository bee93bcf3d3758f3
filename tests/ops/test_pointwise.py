"""Pointwise ops on GlobalTensors: binary ops with broadcasting, scalars and one-element
plain operands, unary ops, where, in-place ops, comparisons.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import ops_battery as battery
import torch
import torch.nn.functional as F
from ops_battery import F64, B, P, S, battery_tests, case, checked, expect, placements, randn

import globaltensor as gt


@checked
def check_pointwise():
    a, d = randn((5, 3), "pa"), randn((5, 3), "pd")
    row, col = randn((3,), "prow"), randn((5, 1), "pcol")
    pos, pos_row = randn((5, 3), "ppos", lo=0.5), randn((3,), "pposrow", lo=0.5)
    binary = {"add": torch.add, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
              "div": lambda x, y: x / y}
    pairs = ((a, d, "(5,3)x(5,3)"), (a, row, "(5,3)x(3,)"), (col, a, "(5,1)x(5,3)"),
             (row, col, "(3,)x(5,1)"))
    for name, op in binary.items():
        for lhs, rhs, tag in pairs if name in ("add", "mul") else pairs[1:3]:
            if name == "div":
                rhs = {(5, 3): pos, (3,): pos_row}.get(tuple(rhs.shape), rhs.abs() + 0.5)
            case(f"{name} {tag}", op, [lhs, rhs], places=placements(6, 1, 3))
    scalar_ops = {
        "x+2": lambda x: x + 2, "2-x": lambda x: 2 - x, "x*3.5": lambda x: x * 3.5,
        "x/4": lambda x: x / 4, "x*plain0d": lambda x: x * torch.tensor(3.0, dtype=F64),
        "plain(1,)+x": lambda x: torch.tensor([0.5], dtype=F64) + x,
        "x-plain0d_f32": lambda x: x - torch.tensor(1.5),
        "add alpha": lambda x: torch.add(x, x, alpha=2.0),
    }
    for name, op in scalar_ops.items():
        case(name, op, [a], places=placements(4, 1, 3))
    case("1/x", lambda x: 1 / x, [pos], places=placements(4, 1, 3))
    # rounding division is not linear: a partial sum is reduced first (it was divided
    # and rounded addend by addend)
    for mode in ("floor", "trunc"):
        case(f"div(3x, 2, {mode})", lambda x, mode=mode: torch.div(x * 3, 2, rounding_mode=mode),
             [a], grad=False, must=[(P,)], places=placements(4, 1, 3))
    unary = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
             "exp": torch.exp, "neg": torch.neg, "-x": lambda x: -x, "abs": torch.abs,
             "pow(2)": lambda x: x.pow(2), "x**2": lambda x: x ** 2,
             "where(x>0,x,0)": lambda x: torch.where(x > 0, x, 0.0),
             # elementwise, though torch does not tag them pointwise
             "hardswish": F.hardswish, "logsigmoid": F.logsigmoid}
    for name, op in unary.items():
        case(name, op, [a], places=placements(4, 1, 3))
    rows = gt.tensor(a, placement=gt.placement.all("cpu"), sbp=S(0), requires_grad=True)
    for op in (F.hardswish, F.logsigmoid):    # (they gathered the rows, backward too)
        out = op(rows)
        out.sum().backward()
        expect(out.sbp == rows.grad.sbp == (S(0),), f"{op.__name__}: {out.sbp}, {rows.grad.sbp}")
        rows.grad = None
    # activations whose backward (and PReLU's kernel) torch does not tag pointwise: their
    # backward gathered the batch; now nothing is sent
    acts = {"leaky_relu": lambda x: F.leaky_relu(x, 0.1), "elu": F.elu, "hardtanh": F.hardtanh,
            "relu6": F.relu6, "softplus": F.softplus, "hardshrink": F.hardshrink,
            "softshrink": F.softshrink, "mish": F.mish}
    prelu_w = randn((3,), "prelu_w")
    for name, op in acts.items():
        case(name, op, [a], places=placements(4, 1, 3))
    case("prelu", F.prelu, [a, prelu_w], places=placements(6, 1, 3))
    acts["prelu"] = lambda x: F.prelu(x, gt.tensor(prelu_w, placement=x.placement, sbp=gt.sbp.broadcast))
    for name, op in acts.items():
        rows = gt.tensor(a, placement=gt.placement.all("cpu"), sbp=S(0), requires_grad=True)
        seed = gt.tensor(torch.ones_like(a), placement=rows.placement, sbp=S(0))
        with gt.debug.comm_stats() as stats:
            op(rows).backward(seed)
        expect(stats.total_bytes == 0, f"{name} of split rows, backward: sent {stats.total_bytes} bytes")
    # elementwise, not tagged pointwise by torch: they gathered a split operand
    untagged = {"masked_fill(x>0, tensor)": lambda x, y: x.masked_fill(x > 0, torch.tensor(2.0, dtype=F64)),
                "x // y": lambda x, y: torch.floor_divide(x, y.abs() + 0.5),
                "complex(x, y)": torch.complex, "polar(|x|, y)": lambda x, y: torch.polar(x.abs(), y)}
    for name, op in untagged.items():
        case(name, op, [a, d], grad=False, places=placements(4, 1, 3))
        xs, ys = (gt.tensor(t, placement=gt.placement.all("cpu"), sbp=S(0)) for t in (a, d))
        with gt.debug.comm_stats() as stats:
            op(xs, ys)
        expect(stats.total_bytes == 0, f"{name} of split rows: sent {stats.total_bytes} bytes")
    case("where(x>y,x,y)", lambda x, y: torch.where(x > y, x, y), [a, row],
         places=placements(6, 1, 3))

    def inplace(x, y):
        z = x * 1.5
        z.add_(y)
        z.mul_(2)
        return z

    def inplace_alpha(x, y):
        z = x.clone()
        z.add_(y, alpha=-0.5)
        return z.mul_(2)

    case("inplace add_/mul_ (5,3)+(5,3)", inplace, [a, d], places=placements(8, 1, 4))
    case("inplace add_/mul_ (5,3)+(3,)", inplace, [a, row], places=placements(6, 1, 3))
    case("inplace add_(alpha) on clone", inplace_alpha, [a, d], places=placements(6, 0, 3))
    ia = torch.randint(0, 3, (5, 3), generator=torch.Generator().manual_seed(1)).to(F64)
    ib = torch.randint(0, 3, (5, 3), generator=torch.Generator().manual_seed(2)).to(F64)
    ir = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    for name, op, ins in (("eq", torch.eq, [ia, ib]), ("gt", torch.gt, [ia, ib]),
                          ("x==row", lambda x, y: x == y, [ia, ir]),
                          ("x>1", lambda x: x > 1, [ia])):
        case(name, op, ins, grad=False, places=placements(6, 1, 3))


@checked
def check_plain_one_element_targets_of_in_place_ops():
    # A plain one-element tensor written in place with a GlobalTensor operand (a running
    # total += loss, a buffer inside torch's own code) holds the whole value on every
    # rank of the placement; a partial operand left each rank its own addend (mul_,
    # copy_) or raised AttributeError (add_, addcmul_).
    value = torch.tensor(3.0, dtype=F64)
    ops = {"add_": (lambda o, g: o.add_(g), 5.0), "mul_": (lambda o, g: o.mul_(g), 6.0),
           "copy_": (lambda o, g: o.copy_(g), 3.0), "addcmul_": (lambda o, g: o.addcmul_(g, g), 11.0),
           "+=": (lambda o, g: o.__iadd__(g), 5.0), "sub_(2g)": (lambda o, g: o.sub_(g * 2), -4.0)}
    places = [battery.line()] + ([battery.mesh()] if gt.get_world_size() == 4 else [])
    for placement in places:
        for s in (gt.sbp.broadcast, P):
            for name, (op, want) in ops.items():
                g = battery.make_global(value, placement, battery.nd(s, placement))
                target = torch.tensor(2.0, dtype=F64)
                out = op(target, g)
                where = f"plain target {name} of {s} on {placement.ranks}"
                expect(out is target and type(out) is torch.Tensor, f"{where}: returned {type(out).__name__}")
                if gt.get_rank() in placement:
                    expect(float(target) == want, f"{where}: {float(target)} != {want}")


@checked
def check_in_place_ops_write_their_partial_target():
    # A partial target multiplied in place by a partial operand: one of the two is reduced
    # first. Where the operand weighed more (a leaf that requires grad, or wider
    # elements) the target was the one reduced, into a copy that the op then wrote, the
    # target left as it was. In-place ops that run as their functional op on the whole
    # value (a partial target of a non-linear op) raised where the two overloads' names
    # or argument orders differ (pow_, square_, floor_divide_, ldexp_, polygamma_).
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(5, 3, generator=gen, dtype=F64), torch.randn(5, 3, generator=gen, dtype=F64) + 3
    places = [battery.line()] + ([battery.mesh()] if gt.get_world_size() == 4 else [])
    for placement in places:
        sx, sy = ((P,), (P,)) if placement.ndim == 1 else ((S(0), P), (B, P))
        ops = {"mul_ by a leaf that requires grad": (lambda x, y: x.mul_(y), a * b, True, F64),
               "mul_ by a wider dtype": (lambda x, y: x.mul_(y), a * b, False, torch.float32),
               "div_": (lambda x, y: x.div_(y), a / b, False, F64),
               "pow_(2)": (lambda x, y: x.pow_(2), a ** 2, False, F64),
               "square_": (lambda x, y: x.square_(), a ** 2, False, F64),
               "floor_divide_": (lambda x, y: x.floor_divide_(y), torch.floor_divide(a, b), False, F64),
               "ldexp_": (lambda x, y: x.ldexp_(y.round()), torch.ldexp(a, b.round()), False, F64),
               "polygamma_(1)": (lambda x, y: x.abs_().polygamma_(1), torch.polygamma(1, a.abs()), False, F64)}
        for name, (op, want, leaf, dtype) in ops.items():
            x = battery.make_global(a.to(dtype), placement, sx) * 1   # (not a leaf: writable)
            y = battery.make_global(b, placement, sy, requires_grad=leaf)
            out = op(x, y)
            where = f"{name} of {x.sbp} by {y.sbp} on {placement.ranks}"
            expect(out is x and x.sbp == sx, f"{where}: returned {type(out).__name__} {out.sbp}")
            got = x.full().double()
            expect(torch.allclose(got, want.to(dtype).double(), rtol=1e-5, atol=1e-5), f"{where}: {got} != {want}")


CHECKS = ["check_pointwise", "check_plain_one_element_targets_of_in_place_ops",
          "check_in_place_ops_write_their_partial_target"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
