"""sbp signature rules, one file per op family.

A rule takes a ``Call`` and a placement axis and returns the 1-D signatures valid on
that axis:
a list of ``(input sbps, output sbps)``, one sbp per GlobalTensor input and one per
tensor output. The dispatcher combines them across axes and picks the cheapest. Rules
never communicate.
"""
from __future__ import annotations

from dataclasses import dataclass

_RULES: dict = {}


@dataclass
class Call:
    func: object
    inputs: list          # the GlobalTensor arguments, in flattened order
    in_shapes: list       # their global shapes
    out_shapes: list      # global shapes of the tensor outputs
    leaves: list          # every flattened argument (tensors and constants)
    spec: object          # pytree spec to rebuild (args, kwargs) from leaves
    mesh: tuple           # the placement's hierarchy shape

    @property
    def args_kwargs(self):
        from torch.utils._pytree import tree_unflatten
        return tree_unflatten(self.leaves, self.spec)


def register(*funcs):
    """Decorator: ``@register(aten.mm.default, ...)`` makes the function their rule.
    An OpOverloadPacket registers every overload."""
    def wrap(rule):
        for f in funcs:
            _RULES[f] = rule
        return rule
    return wrap


def lookup(func):
    rule = _RULES.get(func)
    if rule is None:
        rule = _RULES.get(func.overloadpacket)
    if rule is None and _is_pointwise(func):
        from .pointwise import pointwise_rule
        rule = pointwise_rule
    return rule


def _is_pointwise(func) -> bool:
    import torch
    return torch.Tag.pointwise in func.tags


from . import like, matmul, pointwise, view  # noqa: E402,F401  (registration)
