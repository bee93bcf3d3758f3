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

import functools
import math

import torch

from .. import comm
from ..layout import Layout
from ..local_parts import device_of
from ..placement import Placement
from ..sbp import Broadcast, Partial, Split, broadcast
from ..tensor import GlobalTensor, from_local_part, to_layout
from .registry import register

aten = torch.ops.aten
# torch's own functions, which total_norm and clip_grads_with_norm (installed by
# interop/torch_patches.py in their place) call for what they do not handle themselves.
_clip_grad = torch.nn.utils.clip_grad
_torch_total_norm = getattr(_clip_grad._get_total_norm, "__wrapped_by_globaltensor__",
                            _clip_grad._get_total_norm)
_torch_clip_grads_with_norm = getattr(_clip_grad._clip_grads_with_norm_,
                                      "__wrapped_by_globaltensor__",
                                      _clip_grad._clip_grads_with_norm_)


def _local(t, layout: Layout | None = None):
    """A GlobalTensor's part (boxed to ``layout`` first); anything else as it is."""
    if not isinstance(t, GlobalTensor):
        return t
    return (t if layout is None else to_layout(t, layout)).local_part


def _parts(tensors, layouts: list) -> list:
    """Each tensor's part in its parameter's layout (a gradient or moment boxed there
    first): one look at a tensor already in it (every optimizer step has hundreds)."""
    return [t._local if t.__class__ is GlobalTensor and t._layout is layout else _local(t, layout)
            for t, layout in zip(tensors, layouts)]


def _fused_on_parts(packet):
    def step(*args, **kwargs):
        params = args[0]
        if not all(isinstance(p, GlobalTensor) for p in params):
            return NotImplemented
        layouts = [p._layout for p in params]
        local_args = [_parts(a, layouts) if isinstance(a, (list, tuple)) and len(a) == len(params)
                      else _local(a) for a in args]
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
    reduced = to_layout(anywhere, sbp=(broadcast,), donate=True).local_part
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
        if not isinstance(t, GlobalTensor) or t.global_layout.partial_axes or ord < 0 \
                or not any(isinstance(s, Split) for s in t.sbp):
            out[i] = torch.linalg.vector_norm(t, ord, dtype=dtype)
            continue
        cut = tuple(isinstance(s, Split) for s in t.sbp)
        groups.setdefault((t.placement, cut), []).append(i)
    reduce = "max" if ord == math.inf else "sum"
    rank = comm.get_rank()
    for (placement, cut), members in groups.items():
        parts = [tensors[i].local_part for i in members]
        inside = rank in placement
        stats = torch.stack([_local_stat(x, ord, dtype) for x in parts]) if inside else \
            torch.empty(0, dtype=dtype or parts[0].dtype, device=parts[0].device)
        sbp = tuple(Partial(reduce) if c else broadcast for c in cut)
        total = to_layout(GlobalTensor(stats, Layout.make((len(members),), placement, sbp)),
                          sbp=(broadcast,) * placement.ndim, donate=True)
        if ord not in (0.0, 1.0, math.inf):
            total = GlobalTensor(total.local_part.pow(1.0 / ord), total.global_layout)
        for i, norm in zip(members, total.unbind(0)):
            out[i] = norm
    return out


def _local_stat(x: torch.Tensor, ord: float, dtype) -> torch.Tensor:
    """What reduces across parts: max |x| for inf, else sum |x|^ord (a count for 0)."""
    if not x.numel():
        return torch.zeros((), dtype=dtype or x.dtype, device=x.device)
    norm = torch.linalg.vector_norm(x, ord, dtype=dtype)
    return norm if ord in (0.0, 1.0, math.inf) else norm.pow(ord)


def total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    """``clip_grad_norm_`` / ``get_total_norm`` over GlobalTensors. On one placement:
    torch's own code, whose ``_foreach_norm`` reduces every split tensor's statistic in
    one collective (``foreach_norm``; also for ``foreach=False``, whose per-tensor path
    would reduce each in its own). On several placements (pipeline stages): each
    tensor's norm on its placement, then one all-reduce of them all among every rank of
    the world, so the result is a 0-d broadcast GlobalTensor on the world: every rank
    reads it and clips by it (a collective: call it on every rank).

    >>> norm = torch.nn.utils.clip_grad_norm_(stage0_params + stage1_params, 1.0)  # doctest: +SKIP
    >>> norm.item()          # the whole model's norm, on every rank              # doctest: +SKIP
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    original = _torch_total_norm
    if len({t.placement for t in tensors if isinstance(t, GlobalTensor)}) > 1:
        return _total_across_placements(tensors, float(norm_type), error_if_nonfinite)
    return original(tensors, norm_type, error_if_nonfinite, None if foreach is False else foreach)


def _total_across_placements(tensors, ord: float, error_if_nonfinite: bool) -> GlobalTensor:
    """The norm of the norms of ``tensors`` (GlobalTensors on several placements, or
    plain ones), as torch computes it, on every rank: the first rank of each tensor's
    placement contributes its norm, the other ranks zeros, to one all-reduce."""
    glob = [t for t in tensors if isinstance(t, GlobalTensor)]
    world = Placement.all(glob[0].placement.type)
    norms = {id(t): to_layout(n, sbp=(broadcast,) * n.placement.ndim)
             for t, n in zip(glob, foreach_norm(glob, ord))}
    dtype = functools.reduce(torch.promote_types, (n.dtype for n in norms.values()))
    mine = torch.zeros(len(tensors), dtype=dtype, device=device_of(world))
    rank = comm.get_rank()
    for i, t in enumerate(tensors):
        if not isinstance(t, GlobalTensor):  # the same whole value on every rank
            if rank == world.flat_ranks[0]:
                mine[i] = torch.linalg.vector_norm(t, ord)
        elif rank == t.placement.flat_ranks[0]:
            mine[i] = norms[id(t)].local_part
    every = to_layout(GlobalTensor(mine, Layout.make(mine.shape, world, (Partial("sum"),))),
                      sbp=(broadcast,), donate=True).local_part
    total = torch.linalg.vector_norm(every, ord)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {ord} for gradients from `parameters` is non-finite, "
            f"so it cannot be clipped. To disable this error and scale the gradients by "
            f"the non-finite norm anyway, set `error_if_nonfinite=False`")
    return GlobalTensor(total, Layout.make((), world, (broadcast,)))


def clip_grads_with_norm(parameters, max_norm: float, total_norm: torch.Tensor,
                         foreach: bool | None = None) -> None:
    """``clip_grads_with_norm_`` (and ``clip_grad_norm_``'s clipping step) with gradients
    on several placements, or on another placement than ``total_norm``: torch's own
    clipping runs once per placement, with ``total_norm`` there (taken from this rank's
    copy where it holds the whole value, else boxed)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    original = _torch_clip_grads_with_norm
    groups: dict = {}
    for p in params:
        g = p.grad
        if g is not None:
            groups.setdefault(g.placement if isinstance(g, GlobalTensor) else None, []).append(p)
    here = total_norm.placement if isinstance(total_norm, GlobalTensor) else None
    if set(groups) <= {here}:
        return original(params, max_norm, total_norm, foreach)
    for placement, members in groups.items():
        original(members, max_norm, _norm_on(total_norm, placement), foreach)
    return None


def _norm_on(norm, placement: Placement | None):
    """``norm`` (a 0-d tensor) where gradients on ``placement`` (None: plain ones) can
    use it: a plain norm as it is (the same on every rank); a GlobalTensor's copy on
    this rank when every rank of ``placement`` holds the whole value, else boxed."""
    if not isinstance(norm, GlobalTensor):
        return norm
    whole = all(isinstance(s, Broadcast) for s in norm.sbp)
    if placement is None:
        if not whole or comm.get_rank() not in norm.placement:
            raise ValueError(f"plain gradients cannot be clipped on rank {comm.get_rank()} "
                             f"by a total norm it does not hold whole ({norm.placement}, "
                             f"{norm.sbp})")
        return norm.local_part
    layout = Layout.make((), placement, (broadcast,) * placement.ndim)
    if whole and set(placement.flat_ranks) <= set(norm.placement.flat_ranks):
        return from_local_part(norm.local_part, layout)
    return to_layout(to_layout(norm, sbp=(broadcast,) * norm.placement.ndim), layout)
