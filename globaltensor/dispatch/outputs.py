"""The outputs of a run op (``entry._run``) as GlobalTensors: each rank's parts wrapped with
their layouts; on a rank outside the placement, empty parts with the right metadata; on
a rank holding an empty part of some input, the outputs' identities; 0-d partial
outputs (a loss) reduced to broadcast at once, outside backward."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import explicit_mode
from ..boxing.run import box
from ..layout import Layout
from ..local_parts import device_of, empty_local
from ..partials import identity_value
from ..propagation.decide import Decision
from ..tensor import wrap_part


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass now."""
    return torch._C._current_graph_task_id() != -1


def wrap_outputs(func, decision: Decision, out, inside: bool, first: torch.Tensor, why):
    """``_run``'s outputs wrapped with their layouts (``first``: the first global
    input's part, from which a rank outside the placement makes empty parts)."""
    like = None if inside else first
    if decision.reduced:
        return _wrap_reduced(why or func, decision, out, inside, like)
    if decision.single:  # one tensor out: skip the pytree round trip
        layout = decision.out_layouts[0]
        return wrap_part(out if inside else empty_local(layout, decision.out_dtypes[0], like),
                         layout, decision.out_strides[0])
    if inside:
        out_leaves, out_spec = tree_flatten(out)
    else:
        out_leaves, out_spec = [None] * len(decision.out_layouts), decision.out_spec
    return tree_unflatten(_wrap(decision, out_leaves, decision.out_layouts, inside, like),
                          out_spec)


def _wrap(decision: Decision, out_leaves: list, layouts, inside: bool, like) -> list:
    """The output leaves as GlobalTensors of ``layouts`` (non-tensors as they are); on a
    rank outside, empty parts made from ``like`` and the meta run's constants."""
    wrapped = []
    for o, layout, dtype, strides, const in zip(out_leaves, layouts, decision.out_dtypes,
                                                decision.out_strides, decision.out_consts):
        if layout is None or (inside and o is None):   # (an undefined tensor out: None,
            wrapped.append(o if inside else const)       # where its meta kernel gave one)
        else:
            wrapped.append(wrap_part(o if inside else empty_local(layout, dtype, like), layout,
                                     strides))
    return wrapped


def identities(decision: Decision, rank: int):
    """The outputs of a rank that holds no part of some input (``empty_shortcut``): the
    identity of each (partial or empty) output, which some kernels refuse to compute
    from nothing."""
    computed = decision.reduced or decision.out_layouts
    return tree_unflatten([None if layout is None else _identity(r or layout, dtype, rank)
                           for layout, r, dtype in zip(decision.out_layouts, computed, decision.out_dtypes)],
                          decision.out_spec)


def _identity(layout: Layout, dtype, rank: int) -> torch.Tensor:
    shape = layout.local_shape(rank)
    fill = 0
    for axis in layout.partial_axes:
        fill = identity_value(layout.sbp[axis].reduce, dtype)
        break
    return torch.full(shape, fill, dtype=dtype, device=device_of(layout.placement))


def _wrap_reduced(func, decision: Decision, out, inside: bool, like):
    """The outputs of a decision with 0-d partial outputs, those reduced to broadcast:
    one all-reduce per (layout, dtype) among them. In backward they stay partial: there
    a scalar's partial gradient (of a 0-d parameter) joins the bucketed gradient sync,
    or stays local under ``no_sync()``, as any other."""
    if inside:
        out_leaves = [out] if decision.single else tree_flatten(out)[0]
    else:
        out_leaves = [None] * len(decision.out_layouts)
    layouts = list(decision.out_layouts)
    if in_backward() or explicit_mode.active():   # explicit: the program reduces them
        layouts = [layout if r is None else r for layout, r in zip(layouts, decision.reduced)]
    elif inside:
        together: dict = {}
        for k, r in enumerate(decision.reduced):
            if r is not None:
                together.setdefault((r, decision.out_dtypes[k]), []).append(k)
        for (src, _), ks in together.items():
            for k, local in zip(ks, _reduce_together([out_leaves[k] for k in ks], src, func)):
                out_leaves[k] = local
    wrapped = _wrap(decision, out_leaves, layouts, inside, like)
    return wrapped[0] if decision.single else tree_unflatten(wrapped, decision.out_spec)


def _reduce_together(scalars: list, src: Layout, why) -> list:
    """0-d partial parts of one layout and dtype, reduced to broadcast in one collective
    (its ranks meet first, as a read's: one rank reducing alone fails, see box)."""
    dst = src.without_partials()
    if len(scalars) == 1:
        return [box(scalars[0], src, dst, donate=True, why=why, meet=True)]
    n = len(scalars)
    stacked = box(torch.stack(scalars), Layout.make((n,), src.placement, src.sbp),
                  Layout.make((n,), dst.placement, dst.sbp), donate=True, why=why, meet=True)
    return [stacked[k] for k in range(n)]  # selects: unbind would trace as getitem calls
