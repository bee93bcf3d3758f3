"""Ops whose output shape depends on the values: x[mask], nonzero / argwhere /
where(cond), masked_select, unique (whole, along a dim, consecutive), bincount,
repeat_interleave, and mask assignment x[mask] = v; the members' metadata reaching
ranks outside the placement (also from_local's dtype).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from ops_battery import B, P, S, battery_tests, case, checked, expect, fail, line, placements, randint, randn

import globaltensor as gt

FLOAT = [B, S(0), S(1), P]
MASK = [B, S(0), S(1)]


def _mask(shape, seed):
    return randn(shape, seed) > 0


@checked
def check_boolean_mask_indexing():
    x = randn((5, 4), "dx")
    mask = _mask((5, 4), "dmask")
    rows = _mask((5,), "drows")
    cols = _mask((4,), "dcols")
    case("x[mask]", lambda x, m: x[m], [x, mask], choices=[FLOAT, MASK],
         must=[(S(0), S(0)), (S(1), S(1)), (P, B), (B, S(1))], places=placements(12, 2, 8))
    case("x[row mask]", lambda x, m: x[m], [x, rows], choices=[FLOAT, [B, S(0)]],
         places=placements(8, 1, 4))
    case("x[:, column mask]", lambda x, m: x[:, m], [x, cols], choices=[FLOAT, [B, S(0)]],
         places=placements(8, 1, 4))
    case("masked_select", torch.masked_select, [x, mask], choices=[FLOAT, MASK],
         places=placements(8, 1, 8))


@checked
def check_nonzero_family():
    mask = _mask((5, 4), "dnz")
    for name, fn in (("nonzero", torch.nonzero), ("argwhere", torch.argwhere),
                     ("where(cond)", torch.where),
                     ("nonzero(as_tuple=True)", lambda m: m.nonzero(as_tuple=True))):
        case(name, fn, [mask], places=placements(3, 1, 4))
    values = randn((5, 4), "dnzv")       # a float tensor's nonzero, partial too
    case("nonzero of floats", torch.nonzero, [values.relu()], places=placements(4, 0, 4))


@checked
def check_unique_and_counts():
    ints = randint(4, (6, 3), "duniq")
    case("unique inverse counts",
         lambda t: torch.unique(t, return_inverse=True, return_counts=True), [ints],
         places=placements(3, 1, 4))
    case("unique dim=0", lambda t: torch.unique(t, dim=0), [ints], places=placements(3, 0, 2))
    case("unique_consecutive counts",
         lambda t: torch.unique_consecutive(t, return_counts=True), [ints],
         places=placements(3, 0, 2))
    case("unique_consecutive dim=1", lambda t: torch.unique_consecutive(t, dim=1), [ints],
         places=placements(3, 0, 2))
    flat = randint(5, (7,), "dbin")
    case("bincount", torch.bincount, [flat], places=placements(2, 0, 2))
    case("repeat_interleave", torch.repeat_interleave, [flat], places=placements(2, 0, 2))
    case("unique of floats", torch.unique, [randn((4, 3), "duf").round()], grad=False,
         places=placements(4, 0, 4))


def _assign(value):
    def run(x, m, *v):
        y = x * 1           # a non-leaf: gradients flow around the assigned elements
        y[m] = v[0] if v else value
        return y
    return run


@checked
def check_mask_assignment():
    x = randn((5, 4), "dax")
    mask = _mask((5, 4), "damask")
    case("y[mask] = 0", _assign(0.0), [x, mask], choices=[FLOAT, MASK],
         must=[(S(0), S(0)), (S(1), S(1)), (S(1), B), (P, S(0))], places=placements(12, 2, 8))
    case("y[row mask] = 2", _assign(2.0), [x, _mask((5,), "darows")],
         choices=[FLOAT, [B, S(0)]], places=placements(8, 0, 4))
    values = randn((int(mask.sum()),), "davalues")
    case("y[mask] = v", _assign(None), [x, mask, values], choices=[FLOAT, MASK, [B, S(0), P]],
         places=placements(8, 1, 4))
    # A scalar into an alike-split mask stays local: no communication, x keeps its sbp.
    p = line()
    for sbp in (S(0), S(1)):
        y = gt.tensor(x, placement=p, sbp=sbp)
        m = gt.tensor(mask, placement=p, sbp=sbp)
        with gt.debug.comm_stats() as stats:
            y[m] = 0.0
        expect(stats.total_calls == 0 and y.sbp == (sbp,),
               f"y[mask] = 0 on {sbp}: {stats}, sbp {y.sbp}")
        want = x.clone()
        want[mask] = 0.0
        expect(torch.equal(y.full(), want), f"y[mask] = 0 on {sbp}: value")


@checked
def check_plain_masks_follow_the_plain_operand_rule():
    # A plain mask is taken as broadcast inside gt.implicit_broadcast() (a module's
    # forward), else it raises ValueError as for any op.
    x = randn((5, 4), "dpx")
    mask = _mask((5, 4), "dpmask")
    p = line()
    for sbp in (S(0), S(1)):
        g = gt.tensor(x, placement=p, sbp=sbp)
        with gt.implicit_broadcast():
            picked = g[mask]
        expect(torch.equal(picked.full(), x[mask]) and picked.sbp == (B,),
               f"x[plain mask] on {sbp}: {picked.sbp}")
        try:
            g[mask]
            fail(f"x[plain mask] on {sbp} outside implicit_broadcast did not raise")
        except ValueError as e:
            expect("plain tensor" in str(e), f"x[plain mask] on {sbp}: {e}")


def check_ranks_outside_learn_the_members_metadata():
    # Ranks 0 and 1 hold the tensors; the others learn the shape of x[mask] and the
    # dtype of from_local's tensor (members pass int32, the others a float placeholder).
    p = gt.placement("cpu", [0, 1])
    rank = gt.get_rank()
    inside = rank in p
    part = torch.arange(3, dtype=torch.int32) + 10 * rank if inside else torch.empty(0)
    t = gt.from_local(part, placement=p, sbp=S(0))
    x = gt.tensor(torch.arange(12.0).view(4, 3), placement=p, sbp=S(0))
    picked = x[x > 6.5]
    seen = [None] * gt.get_world_size()
    dist.all_gather_object(seen, (t.dtype, tuple(t.shape), tuple(picked.shape), picked.sbp))
    assert all(s == (torch.int32, (6,), (5,), (B,)) for s in seen), seen
    assert torch.equal(t.full(), torch.tensor([0, 1, 2, 10, 11, 12], dtype=torch.int32))
    assert torch.equal(picked.full(), torch.arange(7.0, 12.0))


CHECKS = ["check_boolean_mask_indexing", "check_nonzero_family", "check_unique_and_counts",
          "check_mask_assignment", "check_plain_masks_follow_the_plain_operand_rule"]
test_world2, test_world4, test_bystanders = battery_tests(
    __name__, CHECKS, bystander_checks=["check_ranks_outside_learn_the_members_metadata"])
