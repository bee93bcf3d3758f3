"""What a decision keeps for the warm path: the callable a repeated call runs on its
local parts as they are, and how each output is wrapped, looked up once per decision.

A decision runs directly when its inputs hold their targets' parts (no boxing), nothing
is reduced and its outputs are one tensor or a flat tuple or list of tensors (layer
norm's three, attention's two): the op's C++ callable, or its local implementation
with the decision's ``LocalCtx``; a local implementation may make a callable of its own
for one decision (``registry.with_direct``: a view's local size computed once).

>>> runner(aten.mm.default, None, None)   # doctest: +SKIP
<built-in method mm of PyCapsule object ...>
"""
from __future__ import annotations

import functools

import torch

from ..tensor import wrapping


def flat_outputs(out) -> "type | None":
    """``tuple`` or ``list`` when the meta run's output ``out`` is a flat sequence of
    tensors (each output wrapped alone, no pytree), else None."""
    if out.__class__ not in (tuple, list) or not out:
        return None
    return out.__class__ if all(isinstance(o, torch.Tensor) for o in out) else None


def runner(func, local, ctx):
    """What a direct decision calls with the local parts: the op's C++ callable, its
    local implementation's own callable for ``ctx`` (``with_direct``), or the local
    implementation with ``ctx`` (through ``_run`` a view would cost about as much
    again)."""
    if local is None:
        return func._op
    make = getattr(local, "direct", None)
    return make(ctx) if make is not None else functools.partial(local, ctx)


def wraps_of(out_leaves: list, out_layouts: list, strides: tuple) -> tuple:
    """Per output: ``tensor.wrapping`` of its layout, meta dtype and global strides."""
    return tuple(wrapping(layout, o.dtype, s)
                 for o, layout, s in zip(out_leaves, out_layouts, strides))
