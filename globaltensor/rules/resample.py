"""Ops that rearrange or resample the trailing dims: repeat, Tensor.unfold, im2col /
col2im (F.unfold / F.fold), pixel_shuffle / pixel_unshuffle, F.interpolate,
F.grid_sample (at points a grid gives per sample).

All are linear (copies, or weighted sums for interpolation), so partial sums pass
through. Dims the op leaves alone keep their split: the batch and channel dims of the
image ops, every dim but the windowed one of Tensor.unfold, every dim repeated once by
repeat. A channel split survives a change of the channel count (C -> C * k or C / k)
when every part stays one contiguous block, i.e. when the smaller channel count divides
evenly over the placement.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, broadcast, partial_sum
from ._dims import normalize_dim
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum


def _keep(n_in: int, n_out: int, moved: dict, partial: bool = True):
    """Candidates: broadcast, partial sum (linear ops), split(d) -> split(moved[d])."""
    cands = [((B,) * n_in, (B,) * n_out)]
    if partial:
        cands.append(((P,) + (B,) * (n_in - 1), (P,) * n_out))
    cands += [((Split(d),) + (B,) * (n_in - 1), (Split(e),) * n_out) for d, e in moved.items()]
    return cands


def _divides(call, channels: int) -> bool:
    return channels % math.prod(call.axis_sizes) == 0


@register(aten.repeat)
def repeat_rule(call):
    repeats = list(call.arg("repeats"))
    ndim = len(call.in_shapes[0])
    lead = len(repeats) - ndim
    return _keep(1, 1, {d: d + lead for d in range(ndim) if repeats[d + lead] == 1})


@register(aten.unfold)
def unfold_rule(call):
    """Tensor.unfold(dim, size, step): windows along ``dim`` in a new last dim."""
    ndim = len(call.in_shapes[0])
    dim = normalize_dim(call.arg("dimension"), ndim)
    return _keep(1, 1, {d: d for d in range(ndim) if d != dim})


@register(aten.unfold_backward)
def unfold_backward_rule(call):
    ndim = len(call.out_shapes[0])
    dim = normalize_dim(call.arg("dim"), ndim)
    return _keep(1, 1, {d: d for d in range(ndim) if d != dim})


def _input_sizes_local(ctx, grad, input_sizes, *args, **kwargs):
    # ``input_sizes`` is the global shape; this rank's gradient has its part's shape.
    local = list(ctx.out_layouts[0].local_shape(ctx.rank))
    return ctx.call.func(grad, local, *args, **kwargs)


register(aten.unfold_backward, local=_input_sizes_local)(unfold_backward_rule)


@register(aten.im2col)
def im2col_rule(call):
    """(N, C, H, W) -> (N, C * kh * kw, L), or unbatched (C, H, W) -> (C * k, L)."""
    shape = call.in_shapes[0]
    c = len(shape) - 3
    moved = {0: 0} if c == 1 else {}
    if _divides(call, shape[c]):
        moved[c] = c
    return _keep(1, 1, moved)


@register(aten.col2im)
def col2im_rule(call):
    """(N, C * kh * kw, L) -> (N, C, H, W) (F.fold, and im2col's backward)."""
    out = call.out_shapes[0]
    c = len(out) - 3
    moved = {0: 0} if c == 1 else {}
    if _divides(call, out[c]):
        moved[c] = c
    return _keep(1, 1, moved)


@register(aten.pixel_shuffle, aten.pixel_unshuffle)
def pixel_shuffle_rule(call):
    """(*, C * r^2, H, W) <-> (*, C, H * r, W * r): leading dims keep their split; the
    channel dim when C (the smaller count) divides evenly over the placement."""
    shape, out = call.in_shapes[0], call.out_shapes[0]
    c = len(shape) - 3
    moved = {d: d for d in range(c)}
    if _divides(call, min(shape[c], out[c])):
        moved[c] = c
    return _keep(1, 1, moved)


# F.interpolate: every mode is a weighted sum over spatial neighbours of one sample and
# channel, so the batch and channel dims (0 and 1) keep their split.
_UPSAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
             "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
             "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
             "_upsample_bilinear2d_aa", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
             "upsample_trilinear3d"]
_UPSAMPLE_OPS = [getattr(aten, n) for n in _UPSAMPLE if hasattr(aten, n)]
_UPSAMPLE_BACKWARD = [getattr(aten, n + "_backward") for n in _UPSAMPLE
                      if hasattr(aten, n + "_backward")]


@register(*_UPSAMPLE_OPS, *_UPSAMPLE_BACKWARD)
def upsample_rule(call):
    return _keep(1, 1, {0: 0, 1: 1})


def _upsample_backward_local(ctx, grad, output_size, input_size, *args, **kwargs):
    # ``input_size`` is the global (N, C, ...) shape; this rank computes its part.
    local = list(ctx.out_layouts[0].local_shape(ctx.rank))
    return ctx.call.func(grad, output_size, local, *args, **kwargs)


register(*_UPSAMPLE_BACKWARD, local=_upsample_backward_local)(upsample_rule)


@register(aten.grid_sampler_2d, aten.grid_sampler_3d)
def grid_sampler_rule(call):
    """(input, grid) -> samples: per sample (the batch split on both), per channel (the
    input's channels split, the grid whole); linear in the input."""
    return [((B, B), (B,)), ((Split(0), Split(0)), (Split(0),)), ((Split(1), B), (Split(1),)),
            ((P, B), (P,))]


@register(aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward)
def grid_sampler_backward_rule(call):
    """(grad, input, grid) -> (grad of input, grad of grid; both made whatever the
    output mask): per sample; a channel split leaves the grid's gradient a partial sum
    over the channels."""
    return [((B, B, B), (B, B)), ((Split(0),) * 3, (Split(0), Split(0))),
            ((Split(1), Split(1), B), (Split(1), P))]
