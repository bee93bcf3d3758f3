"""Advanced indexing with integer tensors (rules/indexing.py): ``x[i]``, ``x[:, i]``,
``x[i, j]`` with broadcasting indices, ``x[i, :, j]`` (the result's index dims in
front), ``index_put`` with and without accumulation and ``x[i] = v``, values and
gradients in every layout; which layouts stay where they are; an index out of range
raises on every rank. They gathered every input to broadcast before.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import B, P, S, battery_tests, case, checked, expect, placements, randn

import globaltensor as gt

FLOAT = [B, S(0), S(1), P]
INDEX = [B, S(0)]


@checked
def check_integer_indexing():
    x = randn((6, 4), "ixx")
    rows = torch.tensor([5, 0, -2, 2, 5])      # repeated and negative, as torch allows
    case("x[i]", lambda x, i: x[i], [x, rows], choices=[FLOAT, INDEX],
         must=[(S(1), B), (B, S(0)), (S(0), B), (P, B)], places=placements(8, 1, 4))
    x3 = randn((3, 6, 4), "ixx3")
    grid = torch.tensor([[1, 0, 5], [4, 4, 2]])
    case("x[:, i] (2-D i)", lambda x, i: x[:, i], [x3, grid], choices=[FLOAT, [B, S(0), S(1)]],
         must=[(S(0), B), (S(2), B), (B, S(1))], places=placements(8, 1, 4))
    pick = torch.tensor([[2], [0]])
    cols = torch.tensor([1, 5, 0])
    case("x[i, j] (broadcast)", lambda x, i, j: x[i, j], [x3, pick, cols],
         choices=[FLOAT, [B, S(0)], [B, S(0)]], must=[(S(2), B, B), (B, B, S(0)), (B, S(0), B)],
         places=placements(8, 1, 4))
    apart = torch.tensor([3, 1])
    case("x[i, :, j] (index dims in front)", lambda x, i, j: x[i, :, j],
         [randn((3, 5, 4), "ixa"), torch.tensor([2, 0]), apart],
         choices=[FLOAT, INDEX, INDEX], must=[(S(1), B, B), (B, S(0), S(0))], places=placements(8, 1, 4))


def _put(accumulate):
    return lambda x, i, v: x.index_put((i,), v, accumulate=accumulate)


def _setitem(x, i, v):
    y = x.clone()
    y[:, i] = v
    return y


@checked
def check_index_put():
    x = randn((6, 4), "ipx")
    once, twice = torch.tensor([4, 0, 2]), torch.tensor([4, 0, 4, 1, 0])
    case("index_put", _put(False), [x, once, randn((3, 4), "ipv")], choices=[FLOAT, INDEX, FLOAT],
         must=[(S(1), B, S(1)), (P, B, P)], places=placements(8, 1, 4))
    case("index_put accumulate", _put(True), [x, twice, randn((5, 4), "ipw")],
         choices=[FLOAT, INDEX, FLOAT], must=[(S(1), B, S(1)), (P, S(0), S(0)), (B, S(0), S(0))],
         places=placements(8, 1, 4))
    case("y[:, i] = v", _setitem, [randn((3, 6), "ips"), once, randn((3, 1), "ipr")],
         choices=[FLOAT, INDEX, FLOAT], must=[(S(0), B, S(0)), (S(0), B, B)], places=placements(8, 1, 4))


@checked
def check_indexing_stays_where_it_is():
    p = gt.placement.all("cpu")
    rows = torch.tensor([5, 0, 3, 3])
    # (x sbp, index sbp) -> the lookup's sbp; nothing is sent forward or backward but,
    # for a split index, the check of its range (one number reduced, here and in
    # backward's index_put) and the sum of the rows' gradients into x's
    for x_sbp, i_sbp, want in ((S(1), B, S(1)), (B, S(0), S(0)), (P, B, P), (S(0), B, P)):
        x = gt.tensor(randn((6, 4), "ixs"), placement=p, sbp=x_sbp, requires_grad=True)
        i = gt.tensor(rows, placement=p, sbp=i_sbp)
        with gt.debug.comm_stats() as forward:
            y = x[i]
        checks = 1 if i_sbp == S(0) else 0
        expect(y.sbp == (want,) and forward.calls.get("all_reduce", 0) == forward.total_calls == checks,
               f"x[i] of {x_sbp} at {i_sbp}: {y.sbp}, sent {forward}")
        if x_sbp == S(1) or i_sbp == S(0):
            with gt.debug.comm_stats() as backward:
                y.backward(gt.tensor(torch.ones(4, 4, dtype=y.dtype), placement=p, sbp=want))
            sums = backward.calls.get("all_reduce", 0)
            expect(sums == backward.total_calls == 2 * checks,
                   f"x[i]'s backward of {x_sbp} at {i_sbp}: sent {backward}")
    # an index out of range raises on every rank, also where only one rank's part of a
    # split index holds it (that rank alone raised, and the others waited for it)
    ones = gt.ones((4, 4), placement=p, sbp=B, dtype=torch.float64)
    lookups = {"x[i]": lambda x, i: x[i], "index_select": lambda x, i: x.index_select(0, i),
               "index_put": lambda x, i: x.index_put((i,), ones, accumulate=True),
               "index_add": lambda x, i: x.index_add(0, i, ones)}
    for name, lookup in lookups.items():
        for x_sbp, i_sbp in ((S(0), B), (B, S(0)), (S(1), S(0))):
            x = gt.tensor(randn((6, 4), "ixs"), placement=p, sbp=x_sbp)
            bad = gt.tensor(torch.tensor([1, 6, 0, 0]), placement=p, sbp=i_sbp)
            try:
                lookup(x, bad).full()
                expect(False, f"{name} of {x_sbp} at {i_sbp} with index 6 of 6 rows: no error")
            except (IndexError, RuntimeError) as e:
                expect("out of" in str(e), f"{name} of {x_sbp} at {i_sbp}: {e}")

@checked
def check_one_element_plain_operands():
    # A plain operand of one element in a dim, of an op outside the pointwise family (an
    # index (1,), nn.PReLU's weight, a conv's bias of one channel), and a 0-d plain
    # target of unbatched logits: whole on every rank. The rules misread them: index_copy
    # of a partial target copied the plain source into every addend (n times its value),
    # the others raised IndexError.
    one = torch.tensor([2])
    x = randn((4, 3), "opx")
    case("index_copy, plain index and source", lambda v: v.index_copy(0, one, torch.full((1,), 7.0,
         dtype=v.dtype)), [randn((4,), "opv")], choices=[[B, S(0), P]], places=placements(3, 1, 3))
    case("index_select, plain index", lambda x: x.index_select(1, one), [x], choices=[FLOAT],
         places=placements(4, 1, 3))
    case("index_add, plain index", lambda x, y: x.index_add(0, one, y), [x, randn((1, 3), "opy")],
         choices=[FLOAT, FLOAT], places=placements(6, 1, 3))
    case("index_fill, plain index", lambda x: x.index_fill(1, one, -1.0), [x], choices=[FLOAT],
         places=placements(4, 1, 3))
    weight = torch.tensor([0.25], dtype=torch.float64)
    case("prelu, a plain weight of one", lambda x: F.prelu(x, weight), [x], choices=[FLOAT],
         places=placements(4, 1, 3))
    bias = torch.tensor([0.5], dtype=torch.float64)
    case("conv1d, a plain bias of one channel", lambda x, w: F.conv1d(x, w, bias),
         [randn((2, 3, 5), "opc"), randn((1, 3, 2), "opw")], choices=[[B, S(0), S(1)], [B, S(1), P]],
         places=placements(6, 1, 3))
    case("cross_entropy, unbatched, a plain 0-d target", lambda x: F.cross_entropy(x, torch.tensor(1)),
         [randn((4,), "opl")], choices=[[B, S(0), P]], places=placements(3, 1, 3))


CHECKS = ["check_integer_indexing", "check_index_put", "check_indexing_stays_where_it_is",
          "check_one_element_plain_operands"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
