"""Rules of rules/resample.py instead of the broadcast fallback (issue #10 item 4):
F.interpolate, pixel_shuffle / pixel_unshuffle, F.unfold / F.fold, Tensor.unfold and
repeat. Values and gradients are compared with plain torch on the whole tensors, in
worlds of 2 and 4 processes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from check_helpers import B, S, _close, _g, _gen
from mp import checks_in_worlds

from globaltensor.testing import no_fallback


def _against_torch(fn, value, sbps, what, expect=None, grad=True):
    """fn on each sbp of value: no fallback, output sbp as expected, value and gradient
    equal to plain torch."""
    want_x = value.clone().requires_grad_(grad)
    ref = fn(want_x)
    if grad:
        ref.square().sum().backward()
    for sbp in sbps:
        x = _g(value, sbp, grad=grad)
        out = no_fallback(lambda: fn(x), f"{what} {sbp}")
        if expect is not None:
            assert out.sbp == (expect(sbp),), f"{what} {sbp}: output {out.sbp}"
        _close(out, ref.detach(), f"{what} {sbp}")
        if grad:
            no_fallback(lambda: out.square().sum().backward(), f"{what} {sbp} backward")
            _close(x.grad, want_x.grad, f"{what} {sbp} gradient")


def check_resampling_rules():
    same = lambda s: s  # noqa: E731
    img = torch.randn(4, 16, 6, 6, generator=_gen(5))  # channel counts divide by 4 ranks
    for mode, kw in [("nearest", {}), ("bilinear", {"align_corners": False}),
                     ("bicubic", {"align_corners": True})]:
        _against_torch(lambda x: F.interpolate(x, scale_factor=2, mode=mode, **kw), img,
                       (S(0), S(1), B), f"interpolate {mode}", same)
    _against_torch(lambda x: F.interpolate(x, size=(5,), mode="linear"), img[:, :, 0],
                   (S(0), S(1)), "interpolate linear 1d", same)
    _against_torch(lambda x: F.pixel_shuffle(x, 2), img, (S(0), S(1), B), "pixel_shuffle", same)
    _against_torch(lambda x: F.pixel_unshuffle(x, 2), img, (S(0), S(1), B), "pixel_unshuffle",
                   same)
    _against_torch(lambda x: F.unfold(x, 3, padding=1), img, (S(0), S(1), B), "F.unfold", same)
    cols = torch.randn(4, 16 * 4, 25, generator=_gen(6))
    _against_torch(lambda x: F.fold(x, (6, 6), 2), cols, (S(0), S(1)), "F.fold", same)
    t = torch.randn(4, 10, 3, generator=_gen(7))
    _against_torch(lambda x: x.unfold(1, 3, 2), t, (S(0), S(2)), "Tensor.unfold", same)
    _against_torch(lambda x: x.repeat(1, 2, 1), t, (S(0), S(2)), "repeat", same)
    _against_torch(lambda x: x.repeat(2, 1, 1, 1), t, (S(1), S(2)),
                   "repeat with a new dim", lambda s: S(s.dim + 1))
    # A dim repeated more than once cannot stay split: the value is still right.
    _against_torch(lambda x: x.repeat(2, 1, 1), t, (S(0),), "repeat of a split dim")
    # grid_sample at a grid given whole: per sample and per channel (it gathered them)
    grid = torch.rand(4, 5, 5, 2, generator=_gen(8)) * 2 - 1
    whole = _g(grid, B)

    def sample(x):
        return F.grid_sample(x, grid if x.__class__ is torch.Tensor else whole, align_corners=False)
    _against_torch(sample, img, (S(0), S(1), B), "grid_sample", same)


CHECKS = ["check_resampling_rules"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
