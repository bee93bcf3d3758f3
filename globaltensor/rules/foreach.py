"""The ``_foreach_*`` ops (optimizer steps, gradient clipping, AMP): one call on the
local parts when their per-tensor op is pointwise and the tensors at each index share
a layout without partials, as plain torch would make; else the per-tensor op on each
index, which dispatches on its own. ``_foreach_norm`` has its own decomposition
(``optim.py``: one collective for all partial norms).

>>> torch._foreach_mul_(params, 0.9)   # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor import GlobalTensor, wrap_part
from .registry import has_out_arguments, register_family

aten = torch.ops.aten

# _foreach ops pass as a trailing positional argument what the per-tensor op takes as
# a keyword: _foreach_addcmul_(self, t1, t2, value) -> addcmul_(self, t1, t2, value=value).
_KEYWORD = {"addcmul": "value", "addcdiv": "value"}


def _is_foreach(func) -> bool:
    return func.overloadpacket.__name__.startswith("_foreach_") and not has_out_arguments(func)


@register_family(_is_foreach)
def foreach(func):
    """The decomposition of ``func``, a ``_foreach_*`` op: ``op(lists, ...)`` on each
    index (lists zip, the rest repeat)."""
    name = func.overloadpacket.__name__[len("_foreach_"):]
    base = name.rstrip("_")
    packet = getattr(aten, base, None)
    pointwise = base in ("copy", "zero") or (
        packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags
                                   for o in packet.overloads()))

    def run(*args, **kwargs):
        if pointwise and _on_parts(args):
            return _run_on_parts(func, args, kwargs)
        return _each(name, args, kwargs)
    return run


def _run_on_parts(func, args, kwargs):
    """One call on the local parts, as plain torch would make (optimizer steps)."""
    local = [[t._local for t in a] if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], GlobalTensor) else a for a in args]
    out = func(*local, **kwargs)
    if out is None:
        return None
    return [wrap_part(o, t._layout) for o, t in zip(out, args[0])]


def _each(name: str, args, kwargs):
    """The per-tensor op ``name`` (``add_`` of ``_foreach_add_``) on each index."""
    base = name.rstrip("_")
    op = getattr(aten, "linalg_vector_norm" if base == "norm" else name)
    n = len(args[0])

    def pick(a, i):
        if isinstance(a, (list, tuple)) and len(a) == n:
            return a[i]
        if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() == 1 \
                and a.numel() == n:
            return a[i].item()  # a tensor of per-element scalars
        return a

    outs = []
    for i in range(n):
        each = [pick(a, i) for a in args]
        extra = dict(kwargs)
        if base in _KEYWORD and len(each) > 3:
            extra[_KEYWORD[base]] = each.pop(3)
        outs.append(op(*each, **extra))
    return None if name.endswith("_") else outs


def _on_parts(args) -> bool:
    """True when a _foreach op with a pointwise per-tensor op (or copy_/zero_) may run
    on the local parts in one call: every tensor is a GlobalTensor in a list, the
    tensors at each index share one layout without partials, this rank holds a part,
    and no gradient is recorded (gradient sync watches leaves op by op)."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], torch.Tensor)]  # not the lists of per-tensor scalars
    if any(isinstance(a, GlobalTensor) for a in args) or not lists:
        return False
    grad = torch.is_grad_enabled()
    rank = comm.get_rank()
    for row in zip(*lists):
        first = row[0]
        if type(first) is not GlobalTensor:
            return False
        layout = first._layout
        if layout.partial_axes or rank not in layout.placement:
            return False
        for t in row:
            if type(t) is not GlobalTensor or (t._layout is not layout and t._layout != layout) \
                    or (grad and t.requires_grad):
                return False
    return True
