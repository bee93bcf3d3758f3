"""Ops that make a tensor like another one, copy it, or change only metadata.

``zeros_like``/``empty_like`` keep any layout (zeros are a fine partial); ``ones_like``
/``full_like`` keep splits and broadcast but not partials (a constant is not an addend);
``copy_`` keeps its target's layout and boxes the source to it; a plain source is the
whole value (as for ``gt.tensor``), so ``module.load_state_dict`` takes a full, plain
state dict. ``new_*`` of the source's own size follow the same rules; of another size
they keep a split of a dim whose size is the same, else are broadcast.
"""
from __future__ import annotations

import zlib

import torch

from .. import comm
from ..sbp import Split, broadcast, candidates, partial_max, partial_sum
from ..tensor import GlobalTensor, from_full
from .pointwise import aligned_sbp
from .registry import register

aten = torch.ops.aten


def _same_layout_cands(call, partials: bool):
    n_out = len(call.out_shapes)
    cands = [((s,) * len(call.inputs), (s,) * n_out) for s in candidates(len(call.in_shapes[0]))]
    if partials:
        cands += [((s,) * len(call.inputs), (s,) * n_out) for s in (partial_sum, partial_max)]
    else:
        # The values do not matter, only the region: a partial input's local already
        # covers the whole region, so the new tensor is broadcast with no communication.
        cands += [((s,), (broadcast,) * n_out) for s in (partial_sum, partial_max)
                  if len(call.inputs) == 1]
    return cands


@register(aten.zeros_like)
def zeros_like_rule(call):
    return _same_layout_cands(call, partials=True)


@register(aten.empty_like)
def empty_like_rule(call):
    return _same_layout_cands(call, partials=True)


@register(aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.new_empty_strided)
def new_tensor_rule(call):
    """A new tensor of a given global size: broadcast, whatever the source's layout;
    of the source's own size, it takes the source's layout (listed first, so it wins
    the tie). Autograd makes such tensors when it copies a gradient into the memory
    order of its leaf; a broadcast one would gather the gradient."""
    source, out = call.in_shapes[0], call.out_shapes[0]
    sources = candidates(len(source), partials=(partial_sum, partial_max))
    cands = [((s,), (broadcast,)) for s in sources]
    if source == out:
        values = call.func.overloadpacket in (aten.new_ones, aten.new_full)
        return _same_layout_cands(call, partials=not values) + cands
    if len(source) == len(out):
        # a dim of the source's size keeps its split: the FFTs' and slices' backwards
        # make a larger gradient of zeros and copy the split gradient into part of it
        cands = [((Split(d),), (Split(d),)) for d in range(len(out)) if source[d] == out[d]] + cands
    return cands


def _new_tensor_local(ctx, x, size, *args, **kwargs):
    # ``size`` (and new_empty_strided's ``stride``) are global; the part is this rank's.
    local_size = ctx.out_layouts[0].local_shape(ctx.rank)
    func = ctx.call.func
    if func.overloadpacket is aten.new_empty_strided:
        stride, args = args[0], args[1:]
        return func(x, local_size, _dense_strides(local_size, stride), *args, **kwargs)
    return func(x, local_size, *args, **kwargs)


def _dense_strides(sizes, like) -> list:
    """Dense strides for ``sizes`` in the memory order of the strides ``like``."""
    strides, acc = [0] * len(sizes), 1
    for d in sorted(range(len(sizes)), key=lambda d: like[d]):
        strides[d] = acc
        acc *= max(sizes[d], 1)
    return strides


register(aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.new_empty_strided,
         local=_new_tensor_local)(new_tensor_rule)


@register(aten.ones_like, aten.full_like, aten.fill_, aten.fill, aten.zero_)
def constant_like_rule(call):
    if call.func.overloadpacket is aten.zero_:
        return _same_layout_cands(call, partials=True)
    return _same_layout_cands(call, partials=False)


@register(aten.copy_, aten.detach, aten.alias, aten.clone, aten.lift_fresh, aten.contiguous)
def copy_rule(call):
    if len(call.inputs) == 2 and call.in_shapes[1] != call.in_shapes[0]:
        return _broadcast_copy_cands(call)
    return _same_layout_cands(call, partials=True)


def _broadcast_copy_cands(call):
    """``dst.copy_(src)`` with a src that broadcasts to dst: per split of dst, the
    source's aligned dim (or broadcast where it has size 1 or is missing)."""
    dst, src = call.in_shapes
    cands = [((s, s), (s,)) for s in (broadcast, partial_sum, partial_max)]
    return cands + [((Split(d), aligned_sbp(src, dst, d)), (Split(d),)) for d in range(len(dst))]


@register(aten._to_copy)
def to_copy_rule(call):
    # A cast keeps partial sums only between floating or complex types (rounding to
    # integers or bool does not distribute over the sum; real to complex and complex's
    # real part do); partial maxima survive a cast that keeps the order of every value
    # (``_keeps_order``).
    src = call.inputs[0].dtype
    dst = call.arg("dtype") or src
    cands = _same_layout_cands(call, partials=False)[:len(call.in_shapes[0]) + 1]
    if all(t.is_floating_point or t.is_complex for t in (src, dst)):
        cands.append(((partial_sum,), (partial_sum,)))
    if _keeps_order(src, dst):
        cands.append(((partial_max,), (partial_max,)))
    return cands


def _keeps_order(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` to ``dst`` keeps the order of every value, the lowest
    too: a partial maximum's addends hold it where a rank has nothing (``-inf``, an
    integer type's minimum), and ``-inf`` cast to int8 is 0. To a floating type from
    any real one, and between integer types where ``dst`` holds all of ``src``'s range;
    not to bool, nor to or from complex (which has no order). (The lowest value itself:
    ``partials.identity_value``.)"""
    if dst == torch.bool or src.is_complex or dst.is_complex:
        return False
    if dst.is_floating_point:
        return True
    if src.is_floating_point:
        return False
    try:
        low, high = (0, 1) if src == torch.bool else (torch.iinfo(src).min, torch.iinfo(src).max)
        return torch.iinfo(dst).min <= low and high <= torch.iinfo(dst).max
    except TypeError:   # (a quantized type: no iinfo)
        return False


@register(aten.copy_.default, decompose=True)
def copy_from_whole_value(dst, src, non_blocking=False):
    """``global.copy_(plain)``: the plain tensor is the whole value, the same on every
    rank (what ``load_state_dict`` passes); each rank copies its part, no communication.
    A one-element source is taken so too where ``dst`` is partial (``w[i, j] = v`` on a
    partial view): copied into every rank's addend, it would count once per rank."""
    if not isinstance(dst, GlobalTensor) or isinstance(src, GlobalTensor) \
            or (src.numel() <= 1 and not dst._layout.partial_axes):
        return NotImplemented
    if not _broadcasts_to(tuple(src.shape), tuple(dst.shape)):
        raise ValueError(f"copy_: a plain source of shape {tuple(src.shape)} does not "
                         f"broadcast to the GlobalTensor's global shape {tuple(dst.shape)}")
    if comm.check_mode() and comm.get_rank() in dst.placement:
        # Check mode: the "whole value" must be the same on every rank of the placement
        # (a state dict loaded from per-rank files may not be).
        value = src.detach().cpu().contiguous()
        fingerprint = zlib.crc32(value.reshape(-1).view(torch.uint8).numpy().tobytes()) \
            if value.numel() else 0
        comm.agree(fingerprint, tuple(dst.placement),
                   f"copy_ of a plain whole value of shape {tuple(src.shape)} into a "
                   f"GlobalTensor on {dst.placement} (e.g. load_state_dict)",
                   "hold different values: each rank must pass the same whole value")
    return dst.copy_(from_full(src.expand(dst.shape), dst.global_layout))


def _broadcasts_to(src: tuple, dst: tuple) -> bool:
    if len(src) > len(dst):
        return False
    return all(s in (1, d) for s, d in zip(src[::-1], dst[::-1]))
