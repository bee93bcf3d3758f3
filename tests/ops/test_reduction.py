"""Reductions: sum, mean, amax/amin, max/min (with indices), var, std, vector norms,
any/all, over all dims or some, keepdim, on dims smaller than the rank count; a reduced
split dim gives a partial, and amin, min(), any and all over one all-reduce one value
per output element.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
from mp import world_test
from ops_battery import P, S, battery_tests, case, checked, describe, expect, guard, line, placements, randn

import globaltensor as gt


@checked
def check_reductions():
    x = randn((5, 3), "rx")
    small = randn((3, 2), "rsmall")      # both dims smaller than 4 ranks
    ops = {
        "sum()": lambda x: x.sum(), "sum(0)": lambda x: x.sum(0), "sum(1)": lambda x: x.sum(1),
        "sum(1,keepdim)": lambda x: x.sum(1, keepdim=True),
        "sum((0,1))": lambda x: torch.sum(x, (0, 1)),
        "mean()": lambda x: x.mean(), "mean(0)": lambda x: x.mean(0),
        "mean(1,keepdim)": lambda x: x.mean(-1, keepdim=True),
        "amax(0)": lambda x: x.amax(0), "amin(1)": lambda x: x.amin(1),
        "amax()": lambda x: torch.amax(x), "max()": lambda x: x.max(),
        "max(dim=0)": lambda x: tuple(x.max(dim=0)), "min(dim=1)": lambda x: tuple(x.min(1)),
        "max(dim=1,keepdim)": lambda x: tuple(torch.max(x, 1, keepdim=True)),
        "var()": lambda x: x.var(), "var(0)": lambda x: x.var(0),
        "var(1,unbiased=False)": lambda x: x.var(1, unbiased=False),
        "var_mean(1)": lambda x: torch.var_mean(x, 1), "std_mean(0)": lambda x: torch.std_mean(x, 0),
        "aminmax(dim=1)": lambda x: tuple(torch.aminmax(x, dim=1)),
        "std(0)": lambda x: x.std(0), "std(unbiased=False)": lambda x: x.std(unbiased=False),
        "std(1,keepdim)": lambda x: x.std(1, keepdim=True),
        "vector_norm": torch.linalg.vector_norm,
        "vector_norm(dim=1)": lambda x: torch.linalg.vector_norm(x, dim=1),
        "vector_norm(ord=1,dim=0)": lambda x: torch.linalg.vector_norm(x, ord=1, dim=0),
        "x.norm()": lambda x: x.norm(), "x.norm(dim=0)": lambda x: x.norm(dim=0),
        "trace()": torch.trace,
        "amin()": lambda x: x.amin(), "min()": lambda x: torch.min(x),
        "amin((0,1),keepdim)": lambda x: x.amin((0, 1), keepdim=True),
        "any()": lambda x: (x > 1).any(), "all()": lambda x: (x > -1).all(),
        "any(0)": lambda x: (x > 0).any(0), "all(1,keepdim)": lambda x: (x > 0).all(1, True),
        "all((0,1))": lambda x: torch.all(x > -1, dim=(0, 1)),
        "any(int)": lambda x: (x > 0).to(torch.int32).any(),
        # int8's lowest value has no negative: the minimum of [-128, 5] is -128
        "amin(int8)": lambda x: torch.where(x > 0, 5, -128).to(torch.int8).amin(),
        "min(int64,0)": lambda x: x.mul(100).to(torch.int64).amin(0),
    }
    for name, op in ops.items():
        case(name, op, [x], places=placements(4, 1, 3))
    for name in ("sum(0)", "mean()", "amax(0)", "max(dim=1,keepdim)", "var(0)",
                 "vector_norm(dim=1)"):
        case(f"{name} on (3,2)", ops[name], [small], places=placements(4, 0, 3))
    # prod()'s backward concatenates a plain one-element tensor with a slice of the
    # flattened input; the slice of a split input was partial, and the plain 1 counted
    # once per rank (the gradient came out times the ranks)
    for name, op in (("prod()", lambda x: x.prod()), ("prod(0)", lambda x: x.prod(0)),
                     ("cat(plain 1, x.view(-1)[:-1])",
                      lambda x: torch.cat([torch.ones(1, dtype=x.dtype), x.reshape(-1)[:-1]]))):
        case(name, op, [x], places=placements(4, 1, 3))
    # counts in fixed bins (tokens per expert): a split counts into a partial sum
    ids = torch.tensor([[3.0, 0.0, 1.0], [3.0, 2.0, 9.0], [0.0, 3.0, 3.0]], dtype=torch.float64)
    case("histc(bins=4, min=0, max=3)", lambda t: torch.histc(t, bins=4, min=0, max=3), [ids],
         choices=[[gt.sbp.broadcast, S(0), S(1)]], grad=False, places=placements(3, 1, 3))
    case("histc() over the data's range", lambda t: torch.histc(t, bins=3), [ids],
         choices=[[gt.sbp.broadcast, S(0), S(1)]], grad=False, places=placements(3, 1, 3))
    counted = torch.histc(gt.tensor(ids, placement=line(), sbp=S(0)), bins=4, min=0, max=3)
    expect(counted.sbp == (P,), f"histc of split(0): {counted.sbp}")
    x3 = randn((2, 5, 3), "rx3")
    # a split part sums its stretch of the diagonal (no gather; the 0-d result reduced)
    with gt.debug.comm_stats() as stats:
        traced = torch.trace(gt.tensor(x, placement=line(), sbp=S(1)))
    expect(traced.sbp == (gt.sbp.broadcast,) and (set(stats.calls) == {"all_reduce"}
                                                   or gt.get_rank() not in line()),
           f"trace of split(1): {traced.sbp}, sent {stats}")
    case("sum(1) 3-D", lambda x: x.sum(1), [x3], places=placements(5, 0, 3))
    case("mean((0,2)) 3-D", lambda x: x.mean((0, 2)), [x3], places=placements(5, 0, 3))
    # DESIGN: reducing a split dim gives a partial; a scalar result is then reduced at
    # once (API: a loss is broadcast, read on any one rank)
    p = line()
    for label, op, want in (("x.sum(0)", lambda t: t.sum(0), (P,)),
                            ("x.sum()", lambda t: t.sum(), (gt.sbp.broadcast,))):
        where = describe(f"sbp of {label}", (S(0),), p)
        out = guard(where, lambda: op(gt.tensor(x, placement=p, sbp=S(0))))
        if out is not None:
            expect(out.sbp == want, f"{where}: sbp {out.sbp}, expected {want}")
    # two results over the other dim keep the split (they gathered it)
    rows = gt.tensor(x, placement=p, sbp=S(0))
    for name, op in (("var_mean", torch.var_mean), ("std_mean", torch.std_mean),
                     ("aminmax", lambda t, d: tuple(torch.aminmax(t, dim=d)))):
        outs = guard(describe(name, (S(0),), p), lambda: op(rows, 1))
        expect(outs is None or all(o.sbp == (S(0),) for o in outs), f"{name}(1) of split(0) rows")
    # a minimum, any or all over a split dim reduces the result (at most 4 values here,
    # all-reduced or reduce-scattered), not the input (512 B gathered)
    big = gt.tensor(torch.arange(-64.0, 64.0).reshape(32, 4), placement=p, sbp=S(0))
    for label, op, want in (("amin()", lambda t: t.amin(), -64.0),
                            ("min()", lambda t: t.min(), -64.0),
                            ("amin(0)", lambda t: t.amin(0), [-64.0, -63.0, -62.0, -61.0]),
                            ("all()", lambda t: (t > -65).all(), True),
                            ("any(0)", lambda t: (t > 62).any(0), [False] * 3 + [True])):
        where = describe(f"communication of {label}", (S(0),), p)
        with gt.debug.comm_stats() as stats:
            out = guard(where, lambda: op(big))
        expect(out is None or out.tolist() == want, f"{where}: {out}, expected {want}")
        expect("all_gather" not in stats.calls and stats.total_bytes <= 16,
               f"{where}: {stats}")

def check_maxima_keep_nan():
    # gloo's MAX of floats kept whichever operand its comparison favoured: a NaN held by
    # rank 1 was dropped (x.amax() gave 3.0 where torch gives nan), so a non-finite check
    # on a maximum, or an inf-norm of gradients, missed it. Real gloo: in processes.
    p, n = gt.placement.all("cpu"), gt.get_world_size()
    ops = {"amax()": lambda t: t.amax(), "max()": lambda t: t.max(),
           "amin()": lambda t: t.amin(), "max(0).values": lambda t: t.max(0).values,
           "amax(0)": lambda t: t.amax(0), "inf-norm": lambda t: torch.linalg.vector_norm(t, float("inf"))}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for holder in range(n):
            whole = torch.arange(4.0 * n, dtype=dtype).view(2 * n, 2)
            whole[2 * holder + 1, 0] = float("nan")
            x = gt.tensor(whole, placement=p, sbp=S(0))
            for name, op in ops.items():
                torch.testing.assert_close(op(x).full(), op(whole), equal_nan=True,
                                           msg=f"{name} {dtype} nan on rank {holder}")
            # partial maxima reduced and reduce-scattered
            parts = torch.zeros(n, 2 * n, dtype=dtype)
            parts[holder, 1] = float("nan")
            pmax = gt.from_local(parts[gt.get_rank()], placement=p, sbp=gt.sbp.partial_max)
            for sbp in (gt.sbp.broadcast, S(0)):
                torch.testing.assert_close(pmax.to_global(sbp=sbp).full(), parts.amax(0),
                                           equal_nan=True, msg=f"partial_max -> {sbp}")


CHECKS = ["check_reductions"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
# gloo's own MAX, not the simulated world's
test_nan_world2 = world_test(__name__, 2, ["check_maxima_keep_nan"],
                             in_processes=["check_maxima_keep_nan"])
