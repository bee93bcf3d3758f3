"""Factory-likes (zeros_like, new_full, empty_like, ...), clone, detach and dtype casts.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
from ops_battery import F64, battery_tests, case, checked, close, combos, describe, expect, guard, placements, randn

import globaltensor as gt


@checked
def check_likes_and_casts():
    x = randn((5, 3), "lx")
    x32 = x.float()
    for p, limit in placements(4, 1, 6):
        for (s,) in combos(p, [x], limit, "likes"):
            where = describe("likes", (s,), p)

            def likes():
                g = gt.tensor(x, placement=p, sbp=s)
                made = {"zeros_like": (torch.zeros_like(g), torch.zeros(5, 3, dtype=F64)),
                        "ones_like": (torch.ones_like(g), torch.ones(5, 3, dtype=F64)),
                        "full_like": (torch.full_like(g, 3.5), torch.full((5, 3), 3.5, dtype=F64)),
                        "zeros_like f32": (torch.zeros_like(g, dtype=torch.float32),
                                           torch.zeros(5, 3)),
                        "new_zeros((2,3))": (g.new_zeros((2, 3)), torch.zeros(2, 3, dtype=F64)),
                        "new_ones(4)": (g.new_ones(4), torch.ones(4, dtype=F64)),
                        "new_full((2,2),7)": (g.new_full((2, 2), 7.0),
                                              torch.full((2, 2), 7.0, dtype=F64)),
                        # of the source's own size: the source's layout (a partial only
                        # where the values are zeros)
                        "new_zeros(own size)": (g.new_zeros((5, 3)), torch.zeros(5, 3, dtype=F64)),
                        "new_ones(own size)": (g.new_ones((5, 3)), torch.ones(5, 3, dtype=F64)),
                        "new_full(own size)": (g.new_full((5, 3), 2.0),
                                               torch.full((5, 3), 2.0, dtype=F64)),
                        "new_empty_strided(own).zero_()": (
                            g.new_empty_strided((5, 3), (1, 5)).zero_(),
                            torch.zeros(5, 3, dtype=F64)),
                        "detach": (g.detach(), x)}
                for name, (got, want) in made.items():
                    if not expect(gt.is_global(got), f"{where} {name}: not a GlobalTensor"):
                        continue
                    expect(got.placement == p, f"{where} {name}: placement {got.placement}")
                    expect(tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype,
                           f"{where} {name}: {tuple(got.shape)} {got.dtype}")
                    close(got.full(), want, f"{where} {name}")
                e = torch.empty_like(g)
                expect(gt.is_global(e) and e.placement == p and tuple(e.shape) == (5, 3)
                       and e.sbp == g.sbp and e.dtype == F64,
                       f"{where} empty_like: {type(e).__name__} {tuple(e.shape)} "
                       f"{getattr(e, 'sbp', None)}")
                expect(not g.detach().requires_grad, f"{where} detach requires grad")
                n = g.new_empty((5, 3))
                expect(n.sbp == g.sbp and tuple(n.to_local().shape) == tuple(g.to_local().shape),
                       f"{where} new_empty(own size): {n.sbp}, local {tuple(n.to_local().shape)}")

            guard(where, likes)
    case("clone", lambda t: t.clone(), [x], places=placements(4, 1, 4))
    casts = {"to(float64)": lambda t: t.to(torch.float64), "double()": lambda t: t.double(),
             "type(float64)": lambda t: t.type(torch.float64),
             "to(dtype=float64)*2": lambda t: t.to(dtype=torch.float64) * 2}
    for name, op in casts.items():
        case(name, op, [x32], places=placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    case("float()", lambda t: t.float(), [x], places=placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    # to complex and back to its real part: sums stay partial, maxima cannot (complex
    # numbers have none)
    case("to(complex64)", lambda t: t.to(torch.complex64), [x32], grad=False,
         places=placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    case("(to(complex64) * 1j).imag", lambda t: (t.to(torch.complex64) * 1j).imag, [x32],
         places=placements(4, 1, 3), rtol=1e-6, atol=1e-6)
    whole = gt.placement.all("cpu")
    for kind in (gt.sbp.partial_sum, gt.sbp.partial_max):
        def to_complex():
            g = gt.tensor(x32, placement=whole, sbp=gt.sbp.broadcast).to_global(sbp=kind)
            with gt.debug.comm_stats() as stats:
                c = g.to(torch.complex64)
            kept = kind == gt.sbp.partial_sum     # a sum stays, no complex maximum
            expect((c.sbp == (kind,)) == kept and (stats.total_bytes == 0) == kept,
                   f"{kind} to complex64: {c.sbp}, sent {stats}")
            close(c.full(), x32.to(torch.complex64), f"{kind} to complex64")
        guard(f"{kind} to complex64", to_complex)
    case("long()", lambda t: (t * 3).long(), [x], grad=False, places=placements(4, 0, 3))
    # (a partial maximum's -inf, where a rank holds nothing, is 0 in int8: not kept)
    case("char()", lambda t: (t * 3).char(), [x], grad=False, places=placements(4, 0, 3))
    case("short()", lambda t: (t * 3).short(), [x], grad=False, places=placements(4, 0, 3))
    case("detach()+y", lambda t, u: t.detach() * u, [x, randn((5, 3), "ly")],
         places=placements(4, 0, 2))


CHECKS = ["check_likes_and_casts"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
