"""Convolution and pooling (NC... layout).

The batch may be split (data parallel): everything runs locally and the weight/bias
gradients are partial sums. A convolution may also split its output channels (the
weight's dim 0), giving a channel-split output. Pooling works per sample and channel,
so a batch or channel split passes through (an unbatched ``(C, H, W)`` input has only its
channels before the pooled dims), and average pooling is linear. Padding by
reflection or replication (``F.pad(mode="reflect")``, ``padding_mode="reflect"``) fills
the last 1-3 dims from their own elements: the dims before them keep a split.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, broadcast, partial_sum
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum


def _splits_channels(call, weight_shape) -> bool:
    """Whether the output channels (the weight's dim 0) may be split: an ungrouped,
    untransposed convolution with a channel for every rank (torch refuses an empty
    weight, which an uneven split would leave some rank)."""
    return call.arg("groups") == 1 and not call.arg("transposed") and \
        weight_shape[0] >= math.prod(call.axis_sizes)


@register(aten.convolution)
def convolution_rule(call):
    """(input, weight, bias?) -> out."""
    bias = (B,) * (len(call.inputs) - 2)
    cands = [((B, B) + bias, (B,)), ((Split(0), B) + bias, (Split(0),))]
    if _splits_channels(call, call.in_shapes[1]):
        cands.append(((B, Split(0)) + (Split(0),) * len(bias), (Split(1),)))
    return cands


@register(aten.convolution_backward)
def convolution_backward_rule(call):
    """(grad, input, weight) -> (grad_input?, grad_weight?, grad_bias?)."""
    mask = call.arg("output_mask")
    pick = lambda outs: tuple(o for o, keep in zip(outs, mask) if keep)  # noqa: E731
    cands = [((B, B, B), pick((B, B, B))),
             ((Split(0), Split(0), B), pick((Split(0), P, P)))]
    if _splits_channels(call, call.in_shapes[2]):
        cands.append(((Split(1), B, Split(0)), pick((P, Split(0), Split(0)))))
    return cands


def _per_sample(call, spatial: int) -> tuple:
    """B and the splits that pooling over the last ``spatial`` dims keeps: the batch and
    channel dims of an ``(N, C, ...)`` input, the channels of an unbatched ``(C, ...)``
    one (its dim 1 is pooled)."""
    leading = len(call.in_shapes[-1]) - spatial
    return (B,) + tuple(Split(d) for d in range(leading))


def _spatial(call) -> int:
    return 3 if "3d" in call.func.overloadpacket.__name__ else 2


@register(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices)
def max_pool_rule(call):
    return [((s,), (s, s)) for s in _per_sample(call, _spatial(call))]


@register(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)
def max_pool_backward_rule(call):
    return [((s, s, s), (s,)) for s in _per_sample(call, _spatial(call))] + \
        [((P, B, B), (P,))]


@register(aten.max_unpool2d, aten.max_unpool3d)
def max_unpool_rule(call):
    """(values, indices) -> each value placed at its index within its sample's channel:
    a batch or channel split of both stays; linear in the values."""
    return [((s, s), (s,)) for s in _per_sample(call, _spatial(call))] + [((P, B), (P,))]


_ADAPTIVE_MAX = (aten.adaptive_max_pool2d, aten.adaptive_max_pool3d)


@register(aten.avg_pool2d, aten.avg_pool3d, aten._adaptive_avg_pool2d,
          aten._adaptive_avg_pool3d, *_ADAPTIVE_MAX)
def pool_rule(call):
    n_out = len(call.out_shapes)
    cands = [((s,), (s,) * n_out) for s in _per_sample(call, _spatial(call))]
    x = call.inputs[0]
    if call.func.overloadpacket not in _ADAPTIVE_MAX and (x.is_floating_point() or x.is_complex()):
        cands.append(((P,), (P,)))   # average pooling is linear (of integers it rounds)
    return cands


@register(aten.avg_pool2d_backward, aten.avg_pool3d_backward,
          aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
          aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward)
def pool_backward_rule(call):
    n_in = len(call.inputs)
    cands = [((s,) * n_in, (s,)) for s in _per_sample(call, _spatial(call))]
    if n_in == 2:   # average pooling's: linear in the gradient (max's takes indices too)
        cands.append(((P,) + (B,) * (n_in - 1), (P,)))
    return cands


# padded dims (the last k) of reflection / replication padding, and their backwards
_MIRROR_PADS = {getattr(aten, f"{kind}_pad{k}d{backward}"): k
                for kind in ("reflection", "replication") for k in (1, 2, 3)
                for backward in ("", "_backward")}


@register(*_MIRROR_PADS)
def mirror_pad_rule(call):
    """(input) -> padded, or (grad, input) -> grad of input: a split on a dim before the
    padded ones stays; copies of elements, so partial sums stay too (the gradient's)."""
    n_in = len(call.inputs)
    kept = len(call.in_shapes[-1]) - _MIRROR_PADS[call.func.overloadpacket]
    return [((B,) * n_in, (B,)), ((P,) + (B,) * (n_in - 1), (P,))] + \
        [((Split(d),) * n_in, (Split(d),)) for d in range(kept)]
