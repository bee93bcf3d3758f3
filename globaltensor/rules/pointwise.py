"""Pointwise ops (aten's "pointwise" tag), with broadcasting, scalars and partials.

Per axis: everything broadcast; or the output split on dim d with every input that
spans d split on its aligned dim (inputs broadcast along d stay broadcast); or, for
ops linear in their inputs, partial in -> partial out.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from .registry import register

aten = torch.ops.aten

# Linear in all their tensor operands together: partial inputs (all of them) give a
# partial output, provided no constant is added (x + 2 is not linear).
_LINEAR_ALL = {aten.add, aten.sub, aten.add_, aten.sub_, aten.neg, aten.neg_, aten.positive}
_UNARY = {aten.neg, aten.neg_, aten.positive}
# Linear in the operand at one of these argument positions when every other operand is
# broadcast or a constant: x * b, x / b, and activation backwards in their gradient.
_LINEAR_IN = {aten.mul: (0, 1), aten.mul_: (0, 1), aten.div: (0,), aten.div_: (0,),
              aten.threshold_backward: (0,), aten.gelu_backward: (0,),
              aten.sigmoid_backward: (0,), aten.tanh_backward: (0,),
              aten.silu_backward: (0,), aten.hardtanh_backward: (0,),
              aten.leaky_relu_backward: (0,), aten.elu_backward: (0,),
              aten.softplus_backward: (0,)}


def aligned_sbp(in_shape, out_shape, d):
    """The sbp an operand of ``in_shape``, broadcast against ``out_shape``, needs for a
    split(d) output: split on the dim that maps to ``d``, or broadcast when it is
    missing or of size 1 there."""
    k = d - (len(out_shape) - len(in_shape))
    if k < 0 or in_shape[k] != out_shape[d]:
        return broadcast
    return Split(k)


@register(torch.Tag.pointwise)
def pointwise_rule(call):
    out = call.out_shapes[0]
    n_in, n_out = len(call.inputs), len(call.out_shapes)
    cands = [((broadcast,) * n_in, (broadcast,) * n_out)]
    for d in range(len(out)):
        ins = [aligned_sbp(shape, out, d) for shape in call.in_shapes]
        if any(isinstance(s, Split) for s in ins):
            if all(len(o) == len(out) for o in call.out_shapes):
                cands.append((tuple(ins), (Split(d),) * n_out))
    if n_out == 1:
        cands += _partial_cands(call, n_in)
    return cands


# Elementwise ops that torch does not tag pointwise (hardswish in MobileNets, log_sigmoid
# in preference losses, PReLU, and the backwards of LeakyReLU, ELU, Hardtanh, ReLU6,
# Softplus, the shrinks and Mish; masked_fill with a tensor value, x // y, complex and
# polar), taken by the same rule instead of gathering
for _packet in (aten.hardswish, aten.hardswish_, aten.hardswish_backward,
                aten.hardsigmoid_backward, aten.log_sigmoid_forward, aten.log_sigmoid_backward,
                aten.leaky_relu_backward, aten.elu_backward, aten.hardtanh_backward,
                aten.softplus_backward, aten.hardshrink_backward, aten.softshrink_backward,
                aten.mish_backward, aten._prelu_kernel, aten.masked_fill, aten.masked_fill_,
                aten.floor_divide, aten.floor_divide_, aten.complex, aten.polar):
    register(_packet)(pointwise_rule)


@register(aten._prelu_kernel_backward)
def prelu_backward_rule(call):
    """(grad, input, weight) -> (grad of input, grad of weight): elementwise, the
    weight's gradient summed over the dims it broadcasts along (a split one: partial)."""
    out = call.in_shapes[1]
    weight = call.in_shapes[2]
    cands = [((broadcast,) * 3, (broadcast, broadcast)),
             ((partial_sum, broadcast, broadcast), (partial_sum, partial_sum))]
    for d in range(len(out)):
        w = aligned_sbp(weight, out, d)
        cands.append(((Split(d), Split(d), w), (Split(d), w if isinstance(w, Split) else partial_sum)))
    return cands


def _partial_cands(call, n_in):
    packet = call.func.overloadpacket
    args, _ = call.args_kwargs
    operands = [a for a in args[:2] if isinstance(a, (torch.Tensor, int, float))]
    if packet in _LINEAR_ALL and (len(operands) == n_in or packet in _UNARY):
        return [((partial_sum,) * n_in, (partial_sum,))]
    if packet in _LINEAR_IN:
        if call.arg("rounding_mode", None) is not None:   # div's floor / trunc: not linear
            return []
        where = [i for i, a in enumerate(args) if isinstance(a, GlobalTensor)]
        return [(tuple(partial_sum if j == k else broadcast for j in range(n_in)), (partial_sum,))
                for k, pos in enumerate(where) if pos in _LINEAR_IN[packet]]
    return []
