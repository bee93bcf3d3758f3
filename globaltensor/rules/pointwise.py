"""Pointwise ops (aten's "pointwise" tag), with broadcasting, scalars and partials.

Per axis: everything broadcast; or the output split on dim d with every input that
spans d split on its aligned dim (inputs broadcast along d stay broadcast); or, for
ops linear in their inputs, partial in -> partial out.
"""
from __future__ import annotations

import torch

from ..sbp import Partial, Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from . import register

aten = torch.ops.aten

# Linear in every tensor argument together: partial_sum inputs (all of them) give a
# partial_sum output, provided no constant is added.
_LINEAR_ALL = {aten.add, aten.sub, aten.neg, aten.clone, aten.positive, aten.alias,
               aten.detach, aten._to_copy, aten.add_, aten.sub_, aten.neg_}
# Linear in one argument when the others are broadcast: x * b, x / b.
_LINEAR_ONE = {aten.mul: (0, 1), aten.mul_: (0, 1), aten.div: (0,), aten.div_: (0,)}


def _aligned(in_shape, out_shape, d):
    """The input dim that maps to output dim ``d``, or None if broadcast along it."""
    k = d - (len(out_shape) - len(in_shape))
    if k < 0 or in_shape[k] != out_shape[d]:
        return None
    return k


def pointwise_rule(call, axis):
    out = call.out_shapes[0]
    n_in, n_out = len(call.inputs), len(call.out_shapes)
    cands = [((broadcast,) * n_in, (broadcast,) * n_out)]
    for d in range(len(out)):
        ins = []
        for shape in call.in_shapes:
            k = _aligned(shape, out, d)
            ins.append(broadcast if k is None else Split(k))
        if any(isinstance(s, Split) for s in ins):
            if all(len(o) == len(out) for o in call.out_shapes):
                cands.append((tuple(ins), (Split(d),) * n_out))
    packet = call.func.overloadpacket
    constants = [x for x in call.leaves if isinstance(x, (int, float, complex, bool))
                 and not isinstance(x, bool)]
    plain = [x for x in call.leaves if isinstance(x, torch.Tensor) and not isinstance(x, GlobalTensor)]
    if packet in _LINEAR_ALL and n_out == 1:
        nonzero = [c for c in constants if c != 0 and c != 1]  # alpha=1, 0 shifts allowed
        if packet in (aten.add, aten.sub, aten.add_, aten.sub_):
            extra = _count_operands(call) - n_in  # scalar operand x + 2 is not linear
            if extra == 0:
                cands.append(((partial_sum,) * n_in, (partial_sum,)))
        elif not nonzero or packet in (aten.clone, aten._to_copy, aten.detach, aten.alias):
            cands.append(((partial_sum,) * n_in, (partial_sum,)))
    if packet in _LINEAR_ONE and n_out == 1 and not plain or packet in _LINEAR_ONE and n_in == 1:
        positions = _LINEAR_ONE[packet]
        for k in range(n_in):
            if n_in == 1 or k in positions:
                ins = tuple(partial_sum if j == k else broadcast for j in range(n_in))
                cands.append((ins, (partial_sum,)))
    return cands


def _count_operands(call) -> int:
    """Tensor or number operands among the positional arguments (not alpha)."""
    args, _ = call.args_kwargs
    return sum(1 for a in args[:2] if isinstance(a, (torch.Tensor, int, float)))
