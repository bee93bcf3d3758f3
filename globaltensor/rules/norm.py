"""layer_norm, group_norm and batch_norm.

layer_norm normalises the trailing dims: any split of a leading (batch) dim runs
locally; the weight and bias gradients are then partial sums. group_norm normalises
each sample on its own: a batch split runs locally the same way. batch_norm in training
normalises over every dim but channels: with the batch split it decomposes into
global mean/variance (partial sums, one small all-reduce each); with channels split it
runs locally.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import to_layout
from .registry import register, register_meta

aten = torch.ops.aten
B, P = broadcast, partial_sum


# The norms' CPU kernels keep a half-precision input's statistics (mean, rstd, the new
# running ones) in its dtype where their meta kernels (CUDA's convention) give float32.
# A GlobalTensor must say what its parts are: a rank holding an empty part makes its
# part from the wrapper's dtype, and boxing meets on the parts' (the ranks diverged).
@register_meta(aten.native_layer_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
               aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit_no_training,
               aten._batch_norm_with_update)
def statistics_as_cpu_keeps_them(func, placement, x, *args, **kwargs):
    """The meta outputs, the statistics (every float32 output after the first) in the
    input's dtype where the CPU kernel keeps them so."""
    outs = func(x, *args, **kwargs)
    if placement.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return outs
    return tuple(o.to(x.dtype) if k and o.dtype == torch.float32 else o for k, o in enumerate(outs))


@register(aten.native_layer_norm)
def layer_norm_rule(call):
    """(input, weight?, bias?) -> (out, mean, rstd)."""
    ndim = len(call.in_shapes[0])
    lead = ndim - len(call.arg("normalized_shape"))
    params = (B,) * (len(call.inputs) - 1)
    cands = [((B,) + params, (B, B, B))]
    cands += [((Split(d),) + params, (Split(d),) * 3) for d in range(lead)]
    return cands


@register(aten.native_layer_norm_backward)
def layer_norm_backward_rule(call):
    """(grad, input, mean, rstd, weight?, bias?) -> (grad_input?, grad_weight?, grad_bias?)."""
    ndim = len(call.in_shapes[0])
    lead = ndim - len(call.arg("normalized_shape"))
    mask = call.arg("output_mask")
    params = (B,) * (len(call.inputs) - 4)
    cands = [((B,) * 4 + params, (B,) * len(call.out_shapes))]
    for d in range(lead):
        outs = tuple(o for o, keep in zip((Split(d), P, P), mask) if keep)
        cands.append(((Split(d),) * 4 + params, outs))
    return cands


@register(aten.native_group_norm)
def group_norm_rule(call):
    """(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd), mean and rstd
    of shape (N, group)."""
    params = (B,) * (len(call.inputs) - 1)
    return [((B,) + params, (B, B, B)), ((Split(0),) + params, (Split(0),) * 3)]


@register(aten.native_group_norm_backward)
def group_norm_backward_rule(call):
    """(grad, input, mean, rstd, weight?, N, C, HxW, group, output_mask)."""
    mask = call.arg("output_mask")
    params = (B,) * (len(call.inputs) - 4)
    outs = tuple(o for o, keep in zip((Split(0), P, P), mask) if keep)
    return [((B,) * len(call.inputs), (B,) * len(outs)), ((Split(0),) * 4 + params, outs)]


def _group_norm_local(ctx, x, *args):
    # N, the batch size, is an argument: a part has its own.
    args = list(args)
    n_at = 2 if ctx.call.func.overloadpacket is aten.native_group_norm else 4
    args[n_at] = x.shape[0]
    return ctx.call.func(x, *args)


def _group_norm_backward_local(ctx, grad, *args):
    args = list(args)
    args[4] = grad.shape[0]  # (input, mean, rstd, weight, N, ...)
    return ctx.call.func(grad, *args)


register(aten.native_group_norm, local=_group_norm_local)(group_norm_rule)
register(aten.native_group_norm_backward, local=_group_norm_backward_local)(
    group_norm_backward_rule)


def _batch_norm_local(ctx, x, *args):
    # Without training the kernel saves no statistics (empty outputs) where the meta
    # kernel, whose shapes the output layouts take, gives one per channel; backward then
    # reads the running statistics, so zeros of the layout's part stand in (boxing them
    # to a backward signature needs parts of the layout's shape).
    outs = ctx.call.func(x, *args)
    shapes = [tuple(layout.local_shape(ctx.rank)) for layout in ctx.out_layouts]
    return tuple(o if tuple(o.shape) == shape else o.new_zeros(shape)
                 for o, shape in zip(outs, shapes))


@register(aten.native_batch_norm, aten._native_batch_norm_legit_functional,
          local=_batch_norm_local)
def batch_norm_rule(call):
    """(input, weight?, bias?, running_mean?, running_var?) -> (out, save_mean, save_invstd)
    and, for the functional form, (..., running_mean_out, running_var_out)."""
    n_params = len(call.inputs) - 1
    n_stats = len(call.out_shapes) - 1
    ndim = len(call.in_shapes[0])
    cands = [((B,) * len(call.inputs), (B,) * (1 + n_stats)),
             ((Split(1),) + (Split(0),) * n_params, (Split(1),) + (Split(0),) * n_stats)]
    if not call.arg("training"):
        cands += [((Split(d),) + (B,) * n_params, (Split(d),) + (B,) * n_stats)
                  for d in range(ndim) if d != 1]
    return cands


@register(aten.native_batch_norm_backward)
def batch_norm_backward_rule(call):
    """(grad, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?)."""
    n_rest = len(call.inputs) - 2
    n_out = len(call.out_shapes)
    mask = call.arg("output_mask")
    channel = tuple(o for o, keep in zip((Split(1), Split(0), Split(0)), mask) if keep)
    cands = [((B,) * len(call.inputs), (B,) * n_out),
             ((Split(1), Split(1)) + (Split(0),) * n_rest, channel)]
    if not call.arg("train"):   # normalised by the running statistics: any dim but channels
        cands += [((Split(d), Split(d)) + (B,) * n_rest,
                   tuple(o for o, keep in zip((Split(d), P, P), mask) if keep))
                  for d in range(len(call.in_shapes[0])) if d != 1]
    return cands


def _splits_non_channel(x) -> bool:
    return any(isinstance(s, Split) and s.dim != 1 for s in x.sbp)


def _stat_shape(x):
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


@register(aten.native_batch_norm, decompose=True)
def batch_norm_training(x, weight, bias, running_mean, running_var, training, momentum,
                        eps):
    """Training-mode batch_norm: over a split batch with global statistics; otherwise
    (channels split, a partial or broadcast input) the kernel on each rank's channels,
    the new running statistics then copied into the buffers."""
    if not training:
        return NotImplemented
    if _splits_non_channel(x):
        return _batch_norm_over_split_batch(x, weight, bias, running_mean, running_var,
                                            momentum, eps)
    if running_mean is None or running_var is None:
        return NotImplemented
    # The kernel updates the running statistics in place, but the signature boxes them
    # (split on channels, as the input): the update would land in temporary parts. The
    # functional form returns the new statistics, which copy_ boxes back into the
    # buffers' own layouts.
    out, save_mean, save_invstd, new_mean, new_var = \
        aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var,
                                                 True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, save_mean, save_invstd


def _batch_norm_over_split_batch(x, weight, bias, running_mean, running_var, momentum, eps):
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // x.shape[1]
    everywhere = (B,) * x.placement.ndim
    mean = to_layout(x.mean(dims), sbp=everywhere)                  # one all-reduce of C sums
    centered = x - mean.view(_stat_shape(x))
    var = to_layout((centered * centered).mean(dims), sbp=everywhere)  # biased, as batch_norm
    invstd = (var + eps).rsqrt()
    out = centered * invstd.view(_stat_shape(x))
    if weight is not None:
        out = out * weight.view(_stat_shape(x))
    if bias is not None:
        out = out + bias.view(_stat_shape(x))
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean * momentum)
        if running_var is not None:
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased * momentum)
    return out, mean, invstd


@register(aten.native_batch_norm_backward, decompose=True)
def batch_norm_backward_over_split_batch(grad, x, weight, running_mean, running_var,
                                         save_mean, save_invstd, train, eps, output_mask):
    if not train or not _splits_non_channel(x):
        return NotImplemented
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // x.shape[1]
    shape = _stat_shape(x)
    xhat = (x - save_mean.view(shape)) * save_invstd.view(shape)
    grad_bias = grad.sum(dims)                             # partial_sum
    grad_weight = (grad * xhat).sum(dims)                  # partial_sum
    grad_input = None
    if output_mask[0]:
        everywhere = (B,) * x.placement.ndim
        gb, gw = to_layout(grad_bias, sbp=everywhere), to_layout(grad_weight, sbp=everywhere)
        scale = save_invstd if weight is None else save_invstd * weight
        grad_input = (grad - gb.view(shape) / count
                      - xhat * gw.view(shape) / count) * scale.view(shape)
    return (grad_input, grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] else None)
