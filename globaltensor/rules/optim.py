"""Optimizer and mixed-precision kernels that take lists of tensors.

* Fused optimizer steps (``Adam(fused=True)``, AdamW, SGD, Adagrad): elementwise per
  parameter, so each rank runs the fused kernel once on its parts, after boxing every
  list's i-th tensor (gradient, moments) to the i-th parameter's layout.
* ``GradScaler``'s unscale (``_amp_foreach_non_finite_check_and_unscale_``): each rank
  unscales its parts; whether any part held an inf or nan is a max over every rank,
  so all ranks skip (or take) the step together.
* ``_foreach_norm`` (``clip_grad_norm_``): the local ``sum |x|^p`` (or max) of every
  split tensor are stacked per layout kind and reduced in one collective, instead of
  one all-reduce per tensor.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..layout import Layout
from ..placement import Placement
from ..sbp import Partial, Split, broadcast
from ..tensor import GlobalTensor, override_function, relayout, to_layout
from .registry import register

aten = torch.ops.aten


def _local(t, layout: Layout | None = None):
    """A GlobalTensor's part (boxed to ``layout`` first); anything else as it is."""
    if not isinstance(t, GlobalTensor):
        return t
    return (t if layout is None else to_layout(t, layout)).local_


def _fused_on_parts(packet):
    def step(*args, **kwargs):
        params = args[0]
        if not all(isinstance(p, GlobalTensor) for p in params):
            return NotImplemented
        layouts = [p.layout_ for p in params]
        local_args = [[_local(t, layouts[i]) for i, t in enumerate(a)]
                      if isinstance(a, (list, tuple)) and len(a) == len(params) else _local(a)
                      for a in args]
        packet(*local_args, **{k: _local(v) for k, v in kwargs.items()})
        return None
    return step


for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    if hasattr(aten, _name):
        register(getattr(aten, _name), decompose=True)(_fused_on_parts(getattr(aten, _name)))


@register(aten._amp_foreach_non_finite_check_and_unscale_, decompose=True)
def unscale_parts(grads, found_inf, inv_scale):
    """Unscale each part; found_inf becomes 1 on every rank if any rank found one."""
    if isinstance(found_inf, GlobalTensor):
        return NotImplemented
    found_here = torch.zeros_like(found_inf)
    torch._amp_foreach_non_finite_check_and_unscale_(
        [_local(g) for g in grads], found_here, _local(inv_scale))
    world = Placement(grads[0].placement.type, list(range(comm.get_world_size())))
    anywhere = GlobalTensor(found_here.reshape(()),
                            Layout.make((), world, (Partial("max"),)))
    reduced = relayout(anywhere, (broadcast,), donate=True).local_
    torch.maximum(found_inf, reduced.to(found_inf.device), out=found_inf)
    return None


@register(aten._foreach_norm, decompose=True)
def foreach_norm(tensors, ord=2, dtype=None):
    """Norms of many tensors with one reduction per layout kind (placement and which
    axes split), not one per tensor. Partial tensors and negative orders take the
    per-tensor path."""
    ord = float(ord)
    out: list = [None] * len(tensors)
    groups: dict = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, GlobalTensor) or t.layout_.partial_axes or ord < 0 \
                or not any(isinstance(s, Split) for s in t.sbp):
            out[i] = torch.linalg.vector_norm(t, ord, dtype=dtype)
            continue
        cut = tuple(isinstance(s, Split) for s in t.sbp)
        groups.setdefault((t.placement, cut), []).append(i)
    reduce = "max" if ord == math.inf else "sum"
    rank = comm.get_rank()
    for (placement, cut), members in groups.items():
        parts = [tensors[i].local_ for i in members]
        inside = rank in placement
        stats = torch.stack([_local_stat(x, ord, dtype) for x in parts]) if inside else \
            torch.empty(0, dtype=dtype or parts[0].dtype, device=parts[0].device)
        sbp = tuple(Partial(reduce) if c else broadcast for c in cut)
        total = relayout(GlobalTensor(stats, Layout.make((len(members),), placement, sbp)),
                         (broadcast,) * placement.ndim, donate=True)
        if ord not in (0.0, 1.0, math.inf):
            total = GlobalTensor(total.local_.pow(1.0 / ord), total.layout_)
        for i, norm in zip(members, total.unbind(0)):
            out[i] = norm
    return out


def _local_stat(x: torch.Tensor, ord: float, dtype) -> torch.Tensor:
    """What reduces across parts: max |x| for inf, else sum |x|^ord (a count for 0)."""
    if not x.numel():
        return torch.zeros((), dtype=dtype or x.dtype, device=x.device)
    norm = torch.linalg.vector_norm(x, ord, dtype=dtype)
    return norm if ord in (0.0, 1.0, math.inf) else norm.pow(ord)


def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``clip_grad_norm_`` / ``get_total_norm`` with ``foreach=False`` over GlobalTensors:
    the per-tensor path would reduce each split gradient's norm in its own collective;
    the ``_foreach_norm`` path gives the same values with one reduction (``foreach_norm``)."""
    if foreach is not False:
        return NotImplemented
    return _get_total_norm.__wrapped_by_globaltensor__(tensors, norm_type, error_if_nonfinite,
                                                       None)


_clip_grad = torch.nn.utils.clip_grad
override_function(_clip_grad, "_get_total_norm", total_norm)   # clip_grad_norm_ calls it
_get_total_norm = _clip_grad._get_total_norm
torch.nn.utils.get_total_norm = _get_total_norm
