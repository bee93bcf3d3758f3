"""torch.einsum as one op with its own rule (rules/einsum.py): equations of one to
three operands, complex operands and their gradients, and what einsum moves (no more
than matmul would; bad operands refused before any communication).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import F64, B, P, S, battery_tests, case, checked, close, expect, line, nd, placements, raises, randn

import globaltensor as gt
from globaltensor.testing import no_fallback

EINSUMS = [  # (equation, operand shapes, sbp combinations on the line, and on the mesh)
    ("ij,jk->ik", [(5, 4), (4, 3)], 10, 4),
    ("bij,bjk->bik", [(3, 5, 4), (3, 4, 2)], 8, 0),
    ("bhqd,bhkd->bhqk", [(2, 3, 5, 4), (2, 3, 6, 4)], 8, 4),   # 3 heads: uneven parts
    ("i,i->", [(5,), (5,)], 6, 0),
    ("ij->ji", [(5, 4)], 4, 0),                                # torch's permute
    ("i,j->ij", [(5,), (3,)], 6, 0),                           # outer product
    ("...ij,...jk", [(2, 5, 4), (4, 3)], 6, 0),                # ellipsis, implicit output
    ("ij,j->ij", [(5, 1), (3,)], 4, 0),                        # a size-1 dim broadcast
    ("bij,jk->k", [(2, 5, 4), (4, 3)], 6, 0),                  # letters summed in one operand
    ("ij,jk,kl->il", [(4, 5), (5, 3), (3, 2)], 6, 4),          # three operands, in pairs
    ("ii,ij->j", [(4, 4), (4, 3)], 4, 0),                      # a diagonal: torch's ops
]


@checked
def check_einsum():
    for eq, shapes, limit, on_mesh in EINSUMS:
        inputs = [randn(shape, f"ein{eq}{k}") for k, shape in enumerate(shapes)]
        case(f"einsum {eq}", lambda *xs, eq=eq: torch.einsum(eq, *xs), inputs,
             places=placements(limit, 1, on_mesh))
    a, b = randn((5, 4), "el0"), randn((4, 3), "el1")
    case("einsum operands as a list", lambda x, y: torch.einsum("ij,jk", [x, y]), [a, b],
         places=placements(4, 0, 0))
    case("einsum with a plain scalar", lambda x: torch.einsum(",ij->ji", torch.tensor(
         2.0, dtype=F64), x), [a], places=placements(4, 0, 0))
    z = randn((5, 4), "ec", dtype=torch.complex128)
    case("einsum complex", lambda x, y: torch.einsum("ij,kj->ik", x, y), [z, z.conj()],
         places=placements(4, 0, 0), choices=[[B, S(0), S(1)]] * 2)
    _check_complex_einsum_grads()


def _check_complex_einsum_grads():
    # the battery takes no complex gradients: the gradient of an operand conjugates the
    # other, as torch's does
    values = [randn((5, 4), f"ecg{k}", dtype=torch.complex128) for k in range(2)]
    p = line()
    for sbps in [(S(0), B), (S(1), S(1))]:
        gs = [gt.tensor(v, placement=p, sbp=nd(s, p)).requires_grad_()
              for v, s in zip(values, sbps)]
        plains = [v.clone().requires_grad_() for v in values]
        for xs in (gs, plains):
            torch.view_as_real(torch.einsum("ij,kj->ik", *xs)).sum().backward()
        for k, (g, v) in enumerate(zip(gs, plains)):
            close(g.grad.full(), v.grad, f"complex einsum {sbps}: grad of operand {k}")


@checked
def check_einsum_under_autocast_computes_as_torchs():
    # torch's einsum runs a bmm, which autocast casts: the result is in autocast's dtype,
    # and its gradients in the operands' own, equal to torch's on the whole value where
    # no rank's bf16 partial sums are added (else within bf16's rounding); fp64
    # operands are left as they are
    p = line()
    values = [randn(shape, f"ac{k}", dtype=torch.float32) for k, shape in enumerate([(4, 6), (6, 3)])]
    for sbps in [(S(0), B), (S(1), S(0))]:
        gs = [gt.tensor(v, placement=p, sbp=nd(s, p)).requires_grad_() for v, s in zip(values, sbps)]
        plains = [v.clone().requires_grad_() for v in values]
        outs = []
        for xs in (gs, plains):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(torch.einsum("ij,jk->ik", *xs))
            (outs[-1].float() * 1.5).sum().backward()
        expect(outs[0].dtype == outs[1].dtype == torch.bfloat16, f"autocast einsum {sbps}: {outs[0].dtype}")
        exact = 0 if sbps[0] == S(0) else BF16   # (the contraction split: partial sums)
        close(outs[0].full(), outs[1], f"autocast einsum {sbps}", rtol=exact, atol=exact)
        for k, (g, v) in enumerate(zip(gs, plains)):
            expect(g.grad.dtype == torch.float32, f"autocast einsum {sbps}: grad {k} {g.grad.dtype}")
            close(g.grad.full(), v.grad, f"autocast einsum {sbps}: grad of operand {k}",
                  rtol=BF16, atol=BF16)
    wide = gt.tensor(randn((4, 6), "ac64"), placement=p, sbp=nd(S(0), p))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = torch.einsum("ij,kj->ik", wide, wide)
    expect(kept.dtype == torch.float64, f"autocast einsum of fp64: {kept.dtype}")


BF16 = 2e-2   # a few roundings of bfloat16 (8 bits of mantissa)


def _moved(fn):
    """What fn() communicates on this rank: {kind: bytes}."""
    with gt.debug.comm_stats() as stats:
        out = fn()
    return out, dict(stats.bytes)


@checked
def check_einsum_moves_what_matmul_would():
    # einsum runs as one op whose rule reads the equation: a split that the contraction
    # keeps (here 3 heads, uneven parts) stays split with no communication, forward and
    # backward, where torch's decomposition merged batch and heads into bmm's batch, made
    # partials, all-reduced them and ran all_to_alls in backward; a split contracted dim
    # makes a partial, not a gather, also when the contraction merges two dims
    p = line()
    part = nd(S(1), p)
    q = gt.tensor(randn((2, 3, 6, 8), "mq"), placement=p, sbp=part).requires_grad_()
    k = gt.tensor(randn((2, 3, 5, 8), "mk"), placement=p, sbp=part).requires_grad_()
    scores, moved = _moved(lambda: no_fallback(
        lambda: torch.einsum("bhqd,bhkd->bhqk", q, k), "einsum"))
    expect(scores.sbp == part and not moved,
           f"einsum over split heads: sbp {scores.sbp}, moved {moved}")
    w = gt.tensor(randn(tuple(scores.shape), "mw"), placement=p, sbp=part)
    loss = (scores * w).sum()
    _, moved = _moved(loss.backward)
    expect(q.grad.sbp == part and k.grad.sbp == part and not moved,
           f"einsum over split heads, backward: moved {moved}")
    close(q.grad.full(), torch.einsum("bhqk,bhkd->bhqd", w.full(), k.full()), "q.grad")
    x = gt.tensor(randn((4, 6, 5), "mx"), placement=p, sbp=nd(S(2), p))
    y = gt.tensor(randn((6, 5, 3), "my"), placement=p, sbp=nd(S(1), p))
    out, moved = _moved(lambda: torch.einsum("ijk,jkl->il", x, y))
    expect(out.sbp == nd(P, p) and not moved,
           f"einsum over a split contracted dim: sbp {out.sbp}, moved {moved}")
    close(out.full(), torch.einsum("ijk,jkl->il", x.full(), y.full()), "ijk,jkl->il")
    scaled, moved = _moved(lambda: torch.einsum(",ijk->kij", torch.tensor(2.0, dtype=F64), y))
    expect(scaled.sbp == nd(S(2), p) and not moved,
           f"einsum with a plain scalar: sbp {scaled.sbp}, moved {moved}")
    # bad operands are refused before any communication, naming the problem
    rows = gt.tensor(randn((6, 8), "mr"), placement=p, sbp=nd(S(0), p))
    raises("einsum of a GlobalTensor and a plain (8, 5) tensor",
           lambda: torch.einsum("ij,jk", rows, torch.ones(8, 5)), ValueError, "(8, 5)")
    other = gt.tensor(randn((8, 5), "mo"), placement=line(reverse=True), sbp=nd(B, p))
    raises("einsum over two placements", lambda: torch.einsum("ij,jk", rows, other),
           ValueError, "different placements")


@checked
def check_bilinear_keeps_splits():
    # nn.Bilinear's aten._trilinear, an einsum of three operands: a split batch (data
    # parallel) or split output features (the weight's dim 0) stay split and a split
    # contracted dim makes a partial, with no communication, where the op gathered
    # every operand
    p = line()
    x1, x2, w = randn((5, 3), "bl1"), randn((5, 4), "bl2"), randn((6, 3, 4), "blw")
    case("bilinear", lambda a, b, c: F.bilinear(a, b, c), [x1, x2, w], places=placements(8, 1, 2))
    plain = [t.clone().requires_grad_() for t in (x1, x2, w)]
    want_grads = torch.autograd.grad(F.bilinear(*plain).sum(), plain)
    for sbps, out_sbp in (((S(0), S(0), B), S(0)), ((B, B, S(0)), S(1)), ((S(1), B, S(1)), P)):
        ins = [gt.tensor(t, placement=p, sbp=nd(s, p)).requires_grad_() for t, s in zip((x1, x2, w), sbps)]
        out, moved = _moved(lambda: no_fallback(lambda: F.bilinear(*ins), "_trilinear"))
        expect(out.sbp == nd(out_sbp, p) and not moved,
               f"bilinear of {sbps}: sbp {out.sbp}, moved {moved}")
        close(out.full(), F.bilinear(x1, x2, w), f"bilinear of {sbps}")
        for k, (g, want) in enumerate(zip(torch.autograd.grad(out.sum(), ins), want_grads)):
            close(g.full(), want, f"bilinear of {sbps}: gradient {k}")


CHECKS = ["check_einsum", "check_einsum_moves_what_matmul_would",
          "check_einsum_under_autocast_computes_as_torchs", "check_bilinear_keeps_splits"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
