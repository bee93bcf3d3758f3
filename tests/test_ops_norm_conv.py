"""Normalisation (layer_norm, group_norm, batch_norm with running stats), convolution
and pooling.

Run in the shared worlds of tests/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch.nn.functional as F

from ops_battery import (B, P, S, as_tuple, battery_tests, case, checked, close, combos,
                         describe, expect, placements, randn, run_case)


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
    for name, op in (("max_pool2d(2)", lambda x: F.max_pool2d(x, 2)),
                     ("max_pool2d(3,2,1)", lambda x: F.max_pool2d(x, 3, stride=2, padding=1)),
                     ("avg_pool2d(2)", lambda x: F.avg_pool2d(x, 2))):
        case(name, op, [img], choices=[[B, S(0), S(1), P]], places=placements(4, 0, 3))
    case("max_pool2d batch 2", lambda x: F.max_pool2d(x, 2), [small],
         choices=[[B, S(0)]], places=placements(2, 0, 2))


CHECKS = ["check_norm_conv_pool"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
