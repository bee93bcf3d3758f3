"""Ops with out= arguments (``torch.add(a, b, out=c)``): the functional op computed
globally, then copied into each ``out``, which keeps its layout (the rule path would
write a boxed copy of it). A GlobalTensor ``out`` is not resized.

>>> torch.mul(x, 2, out=y)        # x split, y broadcast: y stays broadcast   # doctest: +SKIP
"""
from __future__ import annotations

from .registry import has_out_arguments, register_family


@register_family(has_out_arguments)
def out_variant(func):
    """The decomposition of ``func``, an overload with out= arguments."""
    names = [a.name for a in func._schema.arguments if a.is_out]

    def run(*args, **kwargs):
        outs = [kwargs.pop(name) for name in names]
        result = func.overloadpacket(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for o, r in zip(outs, results):
            if tuple(o.shape) != tuple(r.shape):
                raise ValueError(f"{func}: out= has shape {tuple(o.shape)}, the result "
                                 f"{tuple(r.shape)}; a GlobalTensor out= is not resized")
            o.copy_(r)
        return outs[0] if len(outs) == 1 else tuple(outs)
    return run
