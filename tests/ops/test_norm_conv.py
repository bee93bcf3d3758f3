"""Normalisation (layer_norm, group_norm, batch_norm with running stats), convolution
and pooling.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from ops_battery import (
    F64,
    B,
    P,
    S,
    as_tuple,
    battery_tests,
    case,
    checked,
    close,
    combos,
    describe,
    expect,
    guard,
    make_global,
    nd,
    placements,
    randn,
    run_case,
)

import globaltensor as gt


@checked
def check_norm_conv_pool():
    x, w, b = randn((5, 6), "lnx"), randn((6,), "lnw"), randn((6,), "lnb")
    case("layer_norm (5,6) w,b", lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, w, b],
         places=placements(8, 1, 4), must=[(S(0), B, B), (S(1), S(0), S(0))])
    x3 = randn((2, 3, 6), "lnx3")
    case("layer_norm (2,3,6) no affine", lambda x: F.layer_norm(x, (6,)), [x3],
         places=placements(5, 0, 3))
    case("layer_norm over (3,6)", lambda x: F.layer_norm(x, (3, 6), eps=1e-3), [x3],
         places=placements(4, 0, 2))
    gx, gw, gb = randn((5, 4, 3), "gnx"), randn((4,), "gnw"), randn((4,), "gnb")
    case("group_norm 2 groups w,b", lambda x, w, b: F.group_norm(x, 2, w, b), [gx, gw, gb],
         places=placements(5, 0, 3), must=[(S(0), B, B)])
    # batch norm, training mode, batch split; running stats as GlobalTensors
    bx = randn((5, 3, 4), "bnx")
    bw, bb = randn((3,), "bnw", lo=0.5), randn((3,), "bnb")
    rm, rv = randn((3,), "bnrm"), randn((3,), "bnrv", lo=0.5)

    def bn(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)

    for placement, limit in placements(6, 1, 3):
        choices = [[B, S(0), S(2)], [B], [B], [B, S(0)], [B, S(0)]]
        sbp_sets = combos(placement, [bx, bw, bb, rm, rv], limit, "batch_norm", choices,
                          must=[(S(0), B, B, B, B)])
        for sbps in sbp_sets:
            got = run_case(bn, [bx, bw, bb, rm, rv], sbps, placement, label="batch_norm",
                           nograd=(3, 4))
            if got is None:
                continue
            gins, plains = got[0], got[1]
            where = describe("batch_norm running stats", sbps, placement)
            for k, name in ((3, "running_mean"), (4, "running_var")):
                expect(gins[k].sbp == as_tuple(sbps[k]),
                       f"{where}: {name} sbp changed to {gins[k].sbp}")
                close(gins[k].full(), plains[k], f"{where} {name}")
    case("batch_norm 2-D input no stats",
         lambda x: F.batch_norm(x, None, None, training=True), [randn((6, 3), "bn2")],
         choices=[[B, S(0), S(1)]], places=placements(3, 0, 3))
    img = randn((5, 3, 6, 6), "img")
    cw, cb = randn((4, 3, 3, 3), "cw"), randn((4,), "cb")
    case("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), [img, cw, cb],
         choices=[[B, S(0), P], [B, S(0)], [B, S(0)]], must=[(S(0), B, B)],
         places=placements(5, 0, 3))
    small = randn((2, 3, 6, 6), "img2")
    case("conv2d stride 2 no bias", lambda x, w: F.conv2d(x, w, stride=2), [small, cw],
         choices=[[B, S(0)], [B]], places=placements(2, 0, 2))
    # fewer output channels than ranks: a split weight leaves some rank an empty one,
    # which torch's kernel refuses (on that rank only: the others waited)
    case("conv2d 1 output channel", lambda x, w: F.conv2d(x, w), [small, randn((1, 3, 3, 3), "cw1")],
         choices=[[B, S(0)], [B, S(0)]], must=[(B, S(0))], places=placements(2, 0, 2))
    for name, op in (("max_pool2d(2)", lambda x: F.max_pool2d(x, 2)),
                     ("max_pool2d(3,2,1)", lambda x: F.max_pool2d(x, 3, stride=2, padding=1)),
                     ("avg_pool2d(2)", lambda x: F.avg_pool2d(x, 2))):
        case(name, op, [img], choices=[[B, S(0), S(1), P]], places=placements(4, 0, 3))
    # average pooling of integers rounds each window's mean: not linear, so a split of a
    # pooled dim is not made partial (addends pooled apart were each rounded)
    ints = torch.randint(-9, 10, (1, 3, 9, 9), generator=torch.Generator().manual_seed(4))
    case("avg_pool2d(2) of integers", lambda x: F.avg_pool2d(x, 2), [ints], grad=False,
         choices=[[S(3), S(2)]], places=placements(2, 0, 2))
    case("max_pool2d batch 2", lambda x: F.max_pool2d(x, 2), [small],
         choices=[[B, S(0)]], places=placements(2, 0, 2))
    # an unbatched (C, H, W) input pools its dims 1 and 2: only a channel split stays (a
    # split of H stayed, and each part pooled its own rows)
    chw = randn((3, 6, 6), "chw")
    for name, op in (("adaptive_max_pool2d unbatched", lambda x: F.adaptive_max_pool2d(x, (2, 3))),
                     ("adaptive_avg_pool2d unbatched", lambda x: F.adaptive_avg_pool2d(x, (4, 3))),
                     ("max_pool2d(3,2,1) unbatched", lambda x: F.max_pool2d(x, 3, stride=2, padding=1)),
                     ("avg_pool2d(3,2,1) unbatched", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1))):
        case(name, op, [chw], choices=[[B, S(0), S(1), S(2)]], must=[(S(1),)], places=placements(4, 0, 3))
    whole = gt.placement.all("cpu")
    # fewer channels than ranks: some rank's part of the channels is empty, where torch's
    # batch norm backward kernel divides by zero (the process died of SIGFPE)
    if gt.get_world_size() == 4:
        value, seed = randn((2, 2, 3), "bnfew"), randn((2, 2, 3), "bnfeww")
        ref_in = value.clone().requires_grad_()
        ref = F.batch_norm(ref_in, None, None, training=True)
        (ref * seed).sum().backward()
        for sbp in (P, S(1)):
            x = make_global(value, whole, sbp, requires_grad=True)
            out = F.batch_norm(x, None, None, training=True)
            (out * gt.tensor(seed, placement=whole, sbp=B)).sum().backward()
            close(out.full(), ref.detach(), f"batch_norm of 2 channels on 4 ranks, {sbp}")
            close(x.grad.full(), ref_in.grad, f"batch_norm of 2 channels on 4 ranks, {sbp}: gradient")
    # 3-D adaptive max pooling and a GRU cell's gates (unsafe_split) keep a split batch,
    # forward and backward: they gathered it
    vol = randn((4, 3, 4, 4, 4), "vol")
    case("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), [vol],
         choices=[[B, S(0), S(1)]], places=placements(3, 0, 3))
    cell = gt.nn.to_global(torch.nn.GRUCell(3, 4).double(), whole, B).requires_grad_(False)  # (no sync)
    hx = gt.tensor(randn((4, 4), "hx"), placement=whole, sbp=S(0))   # (a default one is broadcast)
    for name, fn, value in (("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, 2), vol),
                            ("GRUCell", lambda x: cell(x, hx), randn((4, 3), "gru"))):
        batch = gt.tensor(value, placement=whole, sbp=S(0), requires_grad=True)
        with gt.debug.comm_stats() as stats:
            out = fn(batch)
            out.backward(gt.tensor(torch.ones(out.shape, dtype=F64), placement=whole, sbp=S(0)))
        expect(stats.total_bytes == 0, f"{name} of a split batch: sent {stats.total_bytes} bytes")
    # max_unpool2d places each value at its index, per sample and channel (it gathered)
    unpool = lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)  # noqa: E731
    case("max_unpool2d", unpool, [img], choices=[[B, S(0), S(1)]], places=placements(3, 0, 3))
    if gt.get_world_size() == 2:
        out = unpool(gt.tensor(img, placement=gt.placement.all("cpu"), sbp=S(0)))
        expect(out.sbp == (S(0),), f"max_unpool2d of split(0): {out.sbp}")
    # reflection / replication padding (padding_mode="reflect") keep a batch or channel
    # split and partial sums, forward and backward (they gathered the batch)
    for mode in ("reflect", "replicate"):
        for pad, x in (((1, 2), randn((5, 3, 6), "pad1d")), ((1, 2, 2, 1), img),
                       ((1, 1, 2, 0, 1, 1), randn((2, 3, 4, 4, 4), "pad3d"))):
            case(f"pad {mode} {len(pad) // 2}-D", lambda x, pad=pad, mode=mode: F.pad(x, pad, mode=mode),
                 [x], choices=[[B, S(0), S(1), P]], places=placements(4, 0, 3))
            if gt.get_world_size() == 2:
                batch = gt.tensor(x, placement=gt.placement.all("cpu"), sbp=S(0))
                out = F.pad(batch, pad, mode=mode)
                expect(out.sbp == (S(0),), f"pad {mode} {pad}: {out.sbp}, expected split(0)")


_BN_KINDS = ((torch.nn.BatchNorm1d, (6, 3)), (torch.nn.BatchNorm1d, (4, 3, 5)),
             (torch.nn.BatchNorm2d, (4, 3, 2, 3)))
# The channel split and partial first: the signature boxes the running statistics to
# their layout, where the kernel's update once stayed in the boxed copies.
_BN_LINE_SBPS = tuple((s,) for s in (S(1), P, S(0), B, S(2), S(3)))
_BN_MESH_SBPS = ((S(1), P), (P, S(1)), (B, S(1)), (S(0), S(1)), (S(1), S(1)), (P, P))


def _bn_cases(placement):
    """(module class, input shape, input sbp, momentum): every input sbp with every
    kind, in rounds that pair each sbp with another kind (a short prefix, all the
    worlds of 4 and 3 run, covers the first sbps on different kinds). Momentum
    alternates between 0.1 and None (cumulative average)."""
    sbps = _BN_MESH_SBPS if placement.ndim == 2 else _BN_LINE_SBPS
    n = len(_BN_KINDS)
    cases = [_BN_KINDS[(j + r) % n] + (sbp,) for r in range(n) for j, sbp in enumerate(sbps)]
    cases = [c for c in cases if all(getattr(s, "dim", 0) < len(c[1]) for s in c[2])]
    return [c + (None if k % 2 else 0.1,) for k, c in enumerate(cases)]


def _bn_steps(kind, shape, sbp, momentum, placement, where):
    """Two training steps and one eval step of ``kind`` made global (everything
    broadcast) on inputs laid out as ``sbp``, against the plain module: each step's
    output and input gradient, then the buffers (running statistics, batch count) and
    the accumulated parameter gradients. The eval output depends on the statistics of
    the training steps."""
    plain = kind(shape[1], momentum=momentum, dtype=F64)
    with torch.no_grad():
        plain.weight.copy_(randn(shape[1], "bn module w", lo=0.5))
        plain.bias.copy_(randn(shape[1], "bn module b"))
    ours = gt.nn.to_global(copy.deepcopy(plain), placement, nd(B, placement))
    for step in range(3):
        if step == 2:
            plain.eval()
            ours.eval()
        value = randn(shape, f"bn step {step}") * (step + 1) + step   # the stats move
        x, xp = make_global(value, placement, sbp, requires_grad=True), \
            value.clone().requires_grad_(True)
        out, ref = ours(x), plain(xp)
        close(out.full(), ref.detach(), f"{where} step {step} output")
        w = randn(shape, f"bn weight {step}")
        (out * gt.tensor(w, placement=placement, sbp=nd(B, placement))).sum().backward()
        (ref * w).sum().backward()
        close(x.grad.full(), xp.grad, f"{where} step {step} input grad")
    for name, buf in ours.named_buffers():      # eval normalised with them, unchanged
        expect(buf.sbp == nd(B, placement), f"{where}: {name} sbp became {buf.sbp}")
        close(buf.full(), plain.get_buffer(name), f"{where} {name}")
    for name, param in ours.named_parameters():
        close(param.grad.full(), plain.get_parameter(name).grad, f"{where} {name} grad")


def _bn_eval_saved_parts(placement):
    """Without training the CPU kernel saves no statistics (empty outputs) where the
    meta kernel, whose shapes the output layouts take, saves one per channel: each
    rank's parts must still make up the layout (a backward signature may box them)."""
    x = randn((4, 3, 5), "bn eval x")
    rm, rv = randn((3,), "bn eval rm"), randn((3,), "bn eval rv", lo=0.5)
    for sbp in (S(1), B, P):
        where = describe("native_batch_norm eval saved statistics", (sbp,), placement)
        gx, grm, grv = (make_global(t, placement, nd(s, placement))
                        for t, s in ((x, sbp), (rm, B), (rv, B)))
        outs = torch.ops.aten.native_batch_norm(gx, None, None, grm, grv, False, 0.1, 1e-5)
        for k, o in enumerate(outs[1:], 1):
            full = guard(f"{where} output {k}", o.full)
            expect(tuple(full.shape) == tuple(o.shape), f"{where} output {k}: the parts "
                   f"make {tuple(full.shape)}, the layout {tuple(o.shape)}")


@checked
def check_batch_norm_running_stats():
    """nn.BatchNorm1d/2d with broadcast running statistics update them as torch does
    for an input of any layout (split on the batch, on channels, elsewhere, broadcast,
    partial), momentum 0.1 or None, then normalise with them in eval."""
    for placement, limit in placements(16, 0, 8):
        for kind, shape, sbp, momentum in _bn_cases(placement)[:limit]:
            where = describe(f"{kind.__name__} {shape} momentum={momentum}", sbp, placement)
            guard(where, lambda: _bn_steps(kind, shape, sbp, momentum, placement, where))
    _bn_eval_saved_parts(placements()[0][0])


@checked
def check_half_precision_norms_with_an_empty_part():
    # In bfloat16 the norms' CPU kernels keep mean and rstd in bfloat16, where the meta
    # kernels say float32: a rank holding no row (or channel) made float32 statistics,
    # the others bfloat16, and boxing them diverged.
    placement = gt.placement.all("cpu")
    n = gt.get_world_size()
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(n - 1, 4, generator=gen).bfloat16(), torch.rand(4, generator=gen).bfloat16() + 0.5
    xs = gt.tensor(x, placement=placement, sbp=S(0), requires_grad=True)
    ws = gt.tensor(w, placement=placement, sbp=B, requires_grad=True)
    out = torch.native_layer_norm(xs, [4], ws, ws, 1e-5)
    want = torch.native_layer_norm(x, [4], w, w, 1e-5)
    for k, (o, r) in enumerate(zip(out, want)):
        what = f"bfloat16 layer norm of {n - 1} rows, output {k}"
        expect(o.dtype == r.dtype, f"{what}: {o.dtype}, torch gives {r.dtype}")
        expect(torch.allclose(o.full().float(), r.float(), atol=2e-2), f"{what}: {o.full()} != {r}")
    out[0].float().sum().backward()
    expect(xs.grad.dtype == torch.bfloat16 and xs.grad.full().shape == x.shape, f"layer norm gradient {xs.grad}")
    images = torch.randn(2, n - 1, 3, generator=gen).bfloat16()
    stats = [torch.zeros(n - 1, dtype=torch.bfloat16), torch.ones(n - 1, dtype=torch.bfloat16)]
    got = torch.native_batch_norm(gt.tensor(images, placement=placement, sbp=S(1)), None, None,
                                  *[gt.tensor(t, placement=placement, sbp=S(0)) for t in stats], True, 0.1, 1e-5)
    for k, (o, r) in enumerate(zip(got, torch.native_batch_norm(images, None, None, *stats, True, 0.1, 1e-5))):
        what = f"bfloat16 batch norm of {n - 1} channels, output {k}"
        expect(o.dtype == r.dtype, f"{what}: {o.dtype}, torch gives {r.dtype}")
        expect(torch.allclose(o.full().float(), r.float(), atol=2e-2), f"{what}: {o.full()} != {r}")


CHECKS = ["check_norm_conv_pool", "check_batch_norm_running_stats",
          "check_half_precision_norms_with_an_empty_part"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
