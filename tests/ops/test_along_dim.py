"""Ops along one dim (scans, sort/topk/kthvalue/median, flip/roll, tril/triu, gather,
scatter_add, padding, slicing backward with split gradients) and fused attention
(batch or head split stays local; with dropout the value does not depend on the layout).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import B, S, battery_tests, case, checked, expect, line, nd, placements, randint, randn

import globaltensor as gt


@checked
def check_along_dim_and_attention():
    x3 = randn((2, 5, 4), "ad3")
    unary = [
        ("cumsum(1)", lambda x: x.cumsum(1)),
        ("logcumsumexp(2)", lambda x: x.logcumsumexp(2)),
        ("sort(1).values", lambda x: x.sort(1).values),
        ("argsort(2) as float", lambda x: x.argsort(2).to(x.dtype)),
        ("topk(2, dim=2).values", lambda x: x.topk(2, dim=2).values),
        ("kthvalue(2, 1).values", lambda x: x.kthvalue(2, 1).values),
        ("kthvalue keepdim", lambda x: x.kthvalue(3, 2, keepdim=True).values),
        ("flip(1, 2)", lambda x: x.flip(1, 2)),
        ("roll(2, 1)", lambda x: x.roll(2, 1)),
        ("roll(3) flattened", lambda x: x.roll(3)),
        ("tril()", lambda x: torch.tril(x)),
        ("triu(1)", lambda x: torch.triu(x, 1)),
        ("tril(-2)", lambda x: x.tril(-2)),
        ("gather(2, argsort)", lambda x: x.gather(2, x.argsort(2)[..., :3])),
        ("x[:, 1:4] backward", lambda x: x[:, 1:4] * 2),
        ("x[:, 2] backward", lambda x: x[:, 2] * 2),
        ("median(1).values", lambda x: x.median(1).values),
        ("F.pad last dim", lambda x: F.pad(x, (1, 2))),
        ("F.pad dims 1, 2 value 1", lambda x: F.pad(x, (1, 0, 0, 2), value=1.0)),
        # a gradient that arrives split (the weighted loss alone would send a broadcast one)
        ("x[:, 1:4] ** 2 backward", lambda x: x[:, 1:4] ** 2),
        ("x[:, 2] ** 2 backward", lambda x: x[:, 2] ** 2),
        # backward formulas that build plain helper tensors (zeros, indices)
        ("cummax(1).values", lambda x: x.cummax(1).values),
        ("cumprod(2)", lambda x: x.cumprod(2)),
        ("trace of x[0]", lambda x: x[0].trace()),
        ("glu(-1)", lambda x: torch.nn.functional.glu(x, -1)),
        ("glu(0)", lambda x: torch.nn.functional.glu(x[:4], 0)),
        ("diagonal(0,1,2)", lambda x: x.diagonal(0, 1, 2)),
        ("diagonal(1,0,2)", lambda x: x.diagonal(1, 0, 2)),
        ("diag_embed(x[0])", lambda x: torch.diag_embed(x[0])),
        ("rot90(1,(1,2))", lambda x: x.rot90(1, (1, 2))),
        ("renorm(2,0,1)", lambda x: x.renorm(2, 0, 1.0)), ("renorm(1,2,1)", lambda x: x.renorm(1, 2, 1.0)),
    ]
    for name, op in unary:
        case(name, op, [x3], places=placements(4, 1, 3))
    bounds = torch.tensor([-1.0, 0.0, 0.5], dtype=x3.dtype)
    split = gt.tensor(x3, placement=gt.placement.all("cpu"), sbp=S(0), requires_grad=True)
    for name, op, want in (("glu(-1)", lambda x: torch.nn.functional.glu(x, -1), S(0)),
                           ("diagonal(0,1,2)", lambda x: x.diagonal(0, 1, 2), S(0)),
                           ("diag_embed", torch.diag_embed, S(0)),
                           ("rot90", lambda x: x.rot90(1, (1, 2)), S(0)),
                           ("renorm(2,0,1)", lambda x: x.renorm(2, 0, 1.0), S(0))):   # (they gathered)
        out = op(split)
        out.sum().backward()
        expect(out.sbp == (want,) and split.grad.sbp == (S(0),),
               f"{name} of split(0): {out.sbp}, gradient {split.grad.sbp}")
        split.grad = None
    edges = gt.tensor(bounds, placement=split.placement, sbp=B)
    for name, found in (("bucketize", torch.bucketize(split.detach(), edges)),
                        ("searchsorted", torch.searchsorted(edges, split.detach()))):
        expect(found.sbp == (S(0),), f"{name} of split(0): {found.sbp}")
    shuffled = bounds[torch.tensor([2, 0, 1])]     # with a sorter: three operands
    found = torch.searchsorted(gt.tensor(shuffled, placement=split.placement, sbp=B), split.detach(),
                               sorter=gt.tensor(shuffled.argsort(), placement=split.placement, sbp=B))
    expect(torch.equal(found.full(), torch.searchsorted(shuffled, x3, sorter=shuffled.argsort())),
           "searchsorted with a sorter")
    tokens = torch.tensor([[1, 5, 3], [0, 2, 7], [5, 5, 1], [9, 0, 3]])
    stops = gt.tensor(torch.tensor([5, 3]), placement=split.placement, sbp=B)
    for sbp in (S(0), S(1), B):    # (isin gathered: generate()'s check for stop tokens)
        held = gt.tensor(tokens, placement=split.placement, sbp=sbp)
        for name, found, want in (("isin", torch.isin(held, stops), torch.isin(tokens, stops.full())),
                                  ("isin scalar", torch.isin(held, 5), torch.isin(tokens, 5))):
            expect(found.sbp == (sbp,) and torch.equal(found.full(), want), f"{name} of {sbp}: {found.sbp}")
    expect(torch.equal(torch.isin(3, stops).full(), torch.tensor(True)), "isin of a scalar")
    case("bucketize", lambda x, b: torch.bucketize(x, b), [x3, bounds], grad=False,
         choices=[[B, S(0), S(1), S(2)], [B]], places=placements(4, 1, 3))
    case("searchsorted", lambda x, b: torch.searchsorted(b, x), [x3, bounds], grad=False,
         choices=[[B, S(0), S(1), S(2)], [B]], places=placements(4, 1, 3))
    index = randint(5, (2, 3, 4), "adidx")

    def index_like(a, values=index):
        """``values`` (an index), broadcast beside a global ``a``; plain beside a plain one."""
        return gt.tensor(values, placement=a.placement, sbp=nd(B, a.placement)) \
            if gt.is_global(a) else values

    case("scatter_add(1)", lambda a, b: a.scatter_add(1, index_like(a), b),
         [randn((2, 5, 4), "adsa"), randn((2, 3, 4), "adsb")], places=placements(4, 0, 2))
    for reduce in ("amax", "mean"):
        case(f"scatter_reduce(1, {reduce})",
             lambda a, b, reduce=reduce: a.scatter_reduce(1, index_like(a), b, reduce),
             [randn((2, 5, 4), "adsa"), randn((2, 3, 4), "adsb")], places=placements(4, 0, 2))
    into, values = (gt.tensor(randn(shape, name), placement=gt.placement.all("cpu"), sbp=S(0))
                    for shape, name in (((2, 5, 4), "adsa"), ((2, 3, 4), "adsb")))
    reduced = into.scatter_reduce(1, index_like(into), values, "amax")
    expect(reduced.sbp == (S(0),), f"scatter_reduce of split(0): {reduced.sbp}")   # (gathered)

    # index_select and index_add (message passing, index_select's backward): rows split
    # elsewhere, a split index, partial sums; they gathered
    idx = torch.tensor([0, 5, 2, 2, 1, 3, 5, 0])
    case("index_select(0)", lambda x, i: x.index_select(0, i), [randn((6, 4), "isx"), idx],
         places=placements(6, 1, 3), must=[(B, S(0)), (S(1), B), (S(0), B)])
    case("index_add(0)", lambda x, i, y: x.index_add(0, i, y, alpha=0.5),
         [randn((6, 4), "iax"), idx, randn((8, 4), "iay")], places=placements(6, 1, 3),
         must=[(S(1), B, S(1)), (B, S(0), S(0))])
    whole = gt.placement.all("cpu")
    for x_sbp, i_sbp in ((S(1), B), (S(0), B), (B, S(0))):
        x = gt.tensor(randn((6, 4), "isx"), placement=whole, sbp=x_sbp, requires_grad=True)
        with gt.debug.comm_stats() as stats:
            rows = x.index_select(0, gt.tensor(idx, placement=whole, sbp=i_sbp))
            rows.backward(gt.tensor(torch.ones(8, 4, dtype=rows.dtype), placement=whole,
                                    sbp=B if rows.sbp == (gt.sbp.partial_sum,) else rows.sbp))
        # nothing moves but, for a split index, x.grad's one sum of the rows' gradients
        # and the checks of the index's range (forward, and backward's index_add)
        expect(str(stats) == ("CommCounter(no communication)" if i_sbp == B else
                              f"CommCounter(all_reduce: 3 call(s), {stats.total_bytes} B)"),
               f"index_select of {x_sbp} at {i_sbp}: sent {stats}")
    # index_copy_ and index_fill (a key-value cache's update at some positions) keep a
    # split of the other dims, head-split caches among them (they gathered the cache)
    pos = torch.tensor([1, 4])
    at = lambda c: index_like(c, pos)  # noqa: E731
    case("index_copy(2)", lambda c, k: c.index_copy(2, at(c), k),
         [randn((2, 4, 6, 3), "icc"), randn((2, 4, 2, 3), "ick")], places=placements(6, 1, 3),
         must=[(S(1), S(1)), (S(0), S(0))])
    case("index_fill(2)", lambda c: c.index_fill(2, at(c), -1.0), [randn((2, 4, 6, 3), "icc")],
         places=placements(4, 1, 3))
    cache = gt.tensor(randn((2, 4, 6, 3), "icc"), placement=whole, sbp=S(1))
    keys = gt.tensor(randn((2, 4, 2, 3), "ick"), placement=whole, sbp=S(1))
    with gt.debug.comm_stats() as stats:
        cache.index_copy_(2, gt.tensor(pos, placement=whole, sbp=B), keys)
        filled = cache.index_fill(2, gt.tensor(pos, placement=whole, sbp=B), 0.0)
    expect(stats.total_bytes == 0 and cache.sbp == filled.sbp == (S(1),),
           f"a head-split cache's update: {cache.sbp}, {filled.sbp}, sent {stats}")
    # the FFTs over some dims keep a split of the others, and partial sums (they gathered)
    for name, fft in (("rfft", lambda x: torch.fft.rfft(x, dim=-1)),
                      ("irfft(rfft)", lambda x: torch.fft.irfft(torch.fft.rfft(x), n=6)),
                      ("fft2 ortho", lambda x: torch.fft.fft2(x, norm="ortho").abs())):
        case(name, fft, [randn((4, 3, 6), "fftx")], places=placements(4, 0, 2), must=[(S(0),), (S(1),)])
        x = gt.tensor(randn((4, 3, 6), "fftx"), placement=whole, sbp=S(0), requires_grad=True)
        with gt.debug.comm_stats() as stats:
            y = fft(x)
            y.backward(gt.tensor(torch.ones(y.shape, dtype=y.dtype), placement=whole, sbp=S(0)))
        expect(stats.total_bytes == 0 and y.sbp == (S(0),), f"{name} of split(0): {y.sbp}, sent {stats}")
    q, k, v = (randn((2, 2, 5, 4), f"attn{c}", dtype=torch.float32) for c in "qkv")
    attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa
    same = [(s, s, s) for s in (B, S(0), S(1), S(2))]
    case("scaled_dot_product_attention", attention, [q, k, v], choices=None, must=same,
         places=placements(3, 0, 2), rtol=1e-5, atol=1e-6)
    # batch- and head-split attention runs where the parts are, forward and backward
    p = line()
    for d in (0, 1):
        qs, ks, vs = (gt.tensor(t, placement=p, sbp=S(d), requires_grad=True) for t in (q, k, v))
        with gt.debug.comm_stats() as stats:
            out = attention(qs, ks, vs)
            out.backward(gt.ones(out.shape, placement=p, sbp=S(d)))
        expect(stats.total_bytes == 0 and out.sbp == (S(d),),
               f"attention split({d}): moved {stats} and gave {out.sbp}")
    # with dropout, torch takes its math path; our dropout draws the same mask whatever
    # the layout (torch's own generators differ between ranks here on purpose)
    torch.manual_seed(gt.get_rank())
    outs = []
    for sbp in (B, S(0), S(1)):
        gt.manual_seed(5)
        qs, ks, vs = (gt.tensor(t, placement=p, sbp=sbp) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.5).full())
    expect(all(torch.equal(outs[0], o) for o in outs[1:]),
           "attention with dropout: the value depends on the layout")


CHECKS = ["check_along_dim_and_attention"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
