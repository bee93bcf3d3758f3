"""The losses: nll (so cross_entropy), and the elementwise ones (mse, binary cross
entropy, smooth_l1, huber, soft_margin).

nll_loss with logits split on the class dim (vocab parallel) picks each target's logit
on the rank that holds it: the result is a partial_sum, without gathering logits;
nll_loss2d (cross_entropy on (N, C, d...)) follows the same rules, with any sample dim
split. Targets are checked against the class count (an out-of-range class would
silently count as another rank's). A mean reduction divides a partial sum by a global
count or total weight.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import comm
from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor, to_layout
from .indices import check_index_range
from .pointwise import aligned_sbp
from .registry import register, with_direct

aten = torch.ops.aten
B, P = broadcast, partial_sum


# --- nll_loss (2-D logits) and nll_loss2d ((N, C, H, W); cross_entropy on (N, C, d...)) --
_NONE, _MEAN, _SUM = 0, 1, 2


def _sample_dims(ndim: int) -> dict:
    """Logit dims other than the class dim (1) -> the target's matching dim."""
    return {d: d - (d > 1) for d in range(ndim) if d != 1}


@register(aten.nll_loss_forward, aten.nll_loss2d_forward)
def nll_rule(call):
    """(logits, target[, weight]) -> (loss, total_weight)."""
    reduction = call.arg("reduction")
    ndim = len(call.in_shapes[0])
    w = (B,) if len(call.inputs) == 3 else ()
    if ndim < 2:
        return [((B,) * len(call.inputs), (B, B))]
    # Class split: each rank adds the logits it holds -> a partial loss per sample.
    cands = [((B, B) + w, (B, B)), ((Split(1), B) + w, (P, B))]
    if reduction != _MEAN:  # a split mean needs the global total weight (decomposition)
        for d, t in _sample_dims(ndim).items():
            cands.append(((Split(d), Split(t)) + w, (Split(t) if reduction == _NONE else P, P)))
    return cands


_targets_checked = False  # the sum a mean decomposes into comes back here: checked already


def _one_rank(t) -> bool:
    return isinstance(t, GlobalTensor) and t.placement.size == 1


def _splits_samples(x) -> bool:
    """Whether an axis of more than one rank splits a sample dim of the logits (on an
    axis of one rank a split part is the whole dim)."""
    samples = _sample_dims(x.dim())
    return any(isinstance(s, Split) and s.dim in samples and n > 1
               for s, n in zip(x.sbp, x.placement.shape))


def _nll_decomposition(func):
    def decomposition(x, target, weight, reduction, ignore_index):
        """Checks the targets (an out-of-range class would silently count as held by
        another rank; on one rank torch's kernel gets them all, and checks them); a
        mean over split samples is a sum over the global weight."""
        global _targets_checked
        if not _targets_checked and not _one_rank(target):  # a collective: once per loss
            check_index_range(target, x.shape[1] if x.dim() > 1 else x.shape[0],
                              "nll_loss target", ignore_index)
        if reduction != _MEAN or x.dim() < 2 or not _splits_samples(x):
            return NotImplemented
        _targets_checked = True
        try:
            total, total_weight = func(x, target, weight, _SUM, ignore_index)
        finally:
            _targets_checked = False
        total_weight = to_layout(total_weight, sbp=(B,) * len(total_weight.sbp), donate=True)
        return total / total_weight, total_weight
    return decomposition


register(aten.nll_loss_forward, decompose=True)(_nll_decomposition(aten.nll_loss_forward.default))
register(aten.nll_loss2d_forward, decompose=True)(
    _nll_decomposition(aten.nll_loss2d_forward.default))


def _nll_parts(ctx, x, target, weight, ignore_index, logits: int = 0):
    """Per-sample (picked logit or 0, sample weight), with the class offset of x (the
    ``logits``-th GlobalTensor input); samples are every dim but the class dim 1."""
    n_classes = ctx.call.in_shapes[logits][1]
    region = ctx.region(logits)
    lo, size = region.offsets[1], region.sizes[1]
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    mine = valid & (safe >= lo) & (safe < lo + size)
    index = (safe - lo).clamp(0, max(size - 1, 0))
    picked = x.gather(1, index.unsqueeze(1)).squeeze(1) if size else \
        x.new_zeros(target.shape)
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    w = weight[safe.clamp(0, n_classes - 1)] if weight is not None else torch.ones_like(picked)
    w = torch.where(valid, w, torch.zeros_like(w))
    return picked, w, mine, index


def _whole(ctx, logits: int = 0) -> bool:
    """Whether this rank holds the whole logits and targets (the ``logits``-th input
    and the next; one rank, or broadcast): outside a trace, torch's kernel then
    computes exactly plain torch's values, and checks the targets. (A traced graph
    keeps the ops below, as before: the kernel's two outputs would add getitem nodes.)
    A plain target (a 0-d class of unbatched logits) is whole on every rank."""
    held = (logits, logits + 1) if isinstance(ctx.call.arg("target"), GlobalTensor) else (logits,)
    return all(ctx.in_layouts[i].local_shape(ctx.rank) == tuple(ctx.call.in_shapes[i]) for i in held)


def _kernel_if_whole(logits: int):
    """``with_direct``'s maker: the op itself where ``_whole`` (outside a trace), else
    the local implementation."""
    def make(ctx):
        local = functools.partial(_nll_backward_local if logits else _nll_forward_local, ctx)
        if not _whole(ctx, logits):
            return local
        op = ctx.call.func._op
        return lambda *args: local(*args) if comm.tracing() else op(*args)
    return make


@with_direct(_kernel_if_whole(0))
def _nll_forward_local(ctx, x, target, weight=None, reduction=_MEAN, ignore_index=-100):
    if x.dim() < 2 or (_whole(ctx) and not comm.tracing()):
        return ctx.call.func(x, target, weight, reduction, ignore_index)
    picked, w, _, _ = _nll_parts(ctx, x, target, weight, ignore_index)
    loss = -(picked * w)
    total_weight = w.sum()
    if reduction == _NONE:
        return loss, total_weight
    if reduction == _SUM:
        return loss.sum(), total_weight
    return loss.sum() / total_weight, total_weight


register(aten.nll_loss_forward, aten.nll_loss2d_forward, local=_nll_forward_local)(nll_rule)


@register(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_backward_rule(call):
    """(grad, logits, target[, weight], total_weight) -> grad_logits."""
    ndim = len(call.in_shapes[1])
    if ndim < 2:
        return [((B,) * len(call.inputs), (B,))]
    reduction = call.arg("reduction")
    w = (B,) if len(call.inputs) == 5 else ()
    cands = [((B, B, B) + w + (B,), (B,)), ((B, Split(1), B) + w + (B,), (Split(1),))]
    for d, t in _sample_dims(ndim).items():
        g = Split(t) if reduction == _NONE else B
        cands.append(((g, Split(d), Split(t)) + w + (B,), (Split(d),)))
    return cands


@with_direct(_kernel_if_whole(1))
def _nll_backward_local(ctx, grad, x, target, weight, reduction, ignore_index, total_weight):
    if x.dim() < 2 or (_whole(ctx, 1) and not comm.tracing()):
        return ctx.call.func(grad, x, target, weight, reduction, ignore_index, total_weight)
    _, w, mine, index = _nll_parts(ctx, x, target, weight, ignore_index, logits=1)
    scale = -w * grad if reduction == _NONE else -w * grad.reshape(())
    if reduction == _MEAN:
        scale = scale / total_weight
    out = torch.zeros_like(x)
    if x.shape[1]:
        out.scatter_(1, index.unsqueeze(1), torch.where(mine, scale, torch.zeros_like(scale))
                     .unsqueeze(1).to(x.dtype))
    return out


register(aten.nll_loss_backward, aten.nll_loss2d_backward,
         local=_nll_backward_local)(nll_backward_rule)


# --- elementwise losses: mse, binary cross entropy (with logits) -----------------------
# Inputs (and an optional weight) of one shape, split alike: the unreduced loss keeps
# the split; a sum or mean over a split becomes a partial (mean divides by the global
# element count). Backward ops scale the local gradient the same way.


@register(aten.mse_loss, aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits,
          aten.smooth_l1_loss, aten.huber_loss, aten.soft_margin_loss)
def elementwise_loss_rule(call):
    reduction = call.arg("reduction", _MEAN)
    shape = call.in_shapes[0]
    n = len(call.inputs)
    cands = [((B,) * n, (B,))]
    for d in range(len(shape)):
        ins = tuple(aligned_sbp(s, shape, d) for s in call.in_shapes)
        cands.append((ins, (Split(d) if reduction == _NONE else P,)))
    return cands


def _reduce_loss(ctx, loss, reduction, shape_index: int = 0):
    if reduction == _NONE:
        return loss
    if reduction == _SUM:
        return loss.sum()
    return loss.sum() / math.prod(ctx.call.in_shapes[shape_index])


def _mse_local(ctx, x, y, reduction=_MEAN):
    return _reduce_loss(ctx, (x - y) ** 2, reduction)


def _bce_local(ctx, x, y, weight=None, reduction=_MEAN):
    return _reduce_loss(ctx, aten.binary_cross_entropy(x, y, weight, _NONE), reduction)


def _bce_logits_local(ctx, x, y, weight=None, pos_weight=None, reduction=_MEAN):
    loss = aten.binary_cross_entropy_with_logits(x, y, weight, pos_weight, _NONE)
    return _reduce_loss(ctx, loss, reduction)


def _unreduced_then_reduced(op):
    """Local implementation of a loss ``op(x, y, reduction, *rest)``: the elementwise
    loss of the part, reduced with the global element count."""
    def local(ctx, x, y, reduction=_MEAN, *rest, **kwargs):
        return _reduce_loss(ctx, op(x, y, _NONE, *rest, **kwargs), reduction)
    return local


register(aten.mse_loss, local=_mse_local)(elementwise_loss_rule)
register(aten.binary_cross_entropy, local=_bce_local)(elementwise_loss_rule)
register(aten.binary_cross_entropy_with_logits, local=_bce_logits_local)(elementwise_loss_rule)
for _op in (aten.smooth_l1_loss, aten.huber_loss, aten.soft_margin_loss):
    register(_op, local=_unreduced_then_reduced(_op.default))(elementwise_loss_rule)


@register(aten.mse_loss_backward, aten.binary_cross_entropy_backward)
def elementwise_loss_backward_rule(call):
    """(grad, input, target[, weight]) -> grad_input."""
    reduction = call.arg("reduction", _MEAN)
    shape = call.in_shapes[1]
    n = len(call.inputs)
    cands = [((B,) * n, (B,))]
    for d in range(len(shape)):
        rest = tuple(aligned_sbp(s, shape, d) for s in call.in_shapes[1:])
        grad = rest[0] if reduction == _NONE else B
        cands.append(((grad,) + rest, (Split(d),)))
    return cands


def _scale_by_count(ctx, out, reduction):
    if reduction == _MEAN:
        out = out / math.prod(ctx.call.in_shapes[1])
    return out


def _mse_backward_local(ctx, grad, x, y, reduction=_MEAN):
    return _scale_by_count(ctx, 2 * (x - y) * grad, reduction)


def _bce_backward_local(ctx, grad, x, y, weight=None, reduction=_MEAN):
    local = aten.binary_cross_entropy_backward(grad, x, y, weight, _SUM if reduction != _NONE
                                               else _NONE)
    return _scale_by_count(ctx, local, reduction)


def _summed_then_scaled(op):
    """Local implementation of ``op(grad, x, y, reduction, *rest)``: a mean's gradient
    is the sum's divided by the global element count."""
    def local(ctx, grad, x, y, reduction, *rest, **kwargs):
        out = op(grad, x, y, _NONE if reduction == _NONE else _SUM, *rest, **kwargs)
        return _scale_by_count(ctx, out, reduction)
    return local


register(aten.mse_loss_backward, local=_mse_backward_local)(elementwise_loss_backward_rule)
register(aten.binary_cross_entropy_backward, local=_bce_backward_local)(
    elementwise_loss_backward_rule)
for _op in (aten.smooth_l1_loss_backward, aten.huber_loss_backward,
            aten.soft_margin_loss_backward):
    register(_op, local=_summed_then_scaled(_op.default))(elementwise_loss_backward_rule)
