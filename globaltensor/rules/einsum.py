"""``torch.einsum`` of GlobalTensors as one op with its own sbp rule.

torch's einsum is CompositeImplicitAutograd: on GlobalTensors it reaches dispatch as the
ops it is made of, for "ij,jk->ik" 11 views and a bmm forward and 17 ops backward (mm:
one, and four), each dispatched, and for new shapes or layouts decided, on its own;
and bmm's batch dim merges the batch and head dims, where an uneven head split (3 heads
on 2 ranks) cannot stay a split, so "bhqd,bhkd->bhqk" over split heads made partials,
all-reduced them and ran all-to-alls and an all-gather in backward. Here an einsum of
two GlobalTensors runs as one op, ``globaltensor::einsum_pair``, whose rule reads the
equation (more operands contract left to right in pairs, as torch's einsum does
without opt_einsum). Per placement axis, with each operand's subscripts
(``pair_signatures``, which the matmul rules share):

- everything broadcast -> broadcast;
- a letter split: each operand that holds the letter whole (not as a size-1 dim it
  broadcasts) is split on its dim, the others are broadcast; the output is split on
  the letter's dim, or partial when the letter is summed;
- one operand partial, the others broadcast -> partial (einsum is linear in each).

The gradient of a pair's einsum with respect to one operand is an einsum of the
output's gradient with the other, so backward runs the same op and rule (and double
backward works). torch's decomposition still takes one operand (a permute or a sum,
one op already), a letter repeated in an operand (a diagonal) and the sublist form.
``nn.Bilinear``'s ``aten._trilinear``, an einsum of three operands, takes the same
signatures (``signatures``).

>>> torch.einsum("bhqd,bhkd->bhqk", q, k).sbp    # q, k split(1)      # doctest: +SKIP
(split(dim=1),)
"""
from __future__ import annotations

import functools
import string
from dataclasses import dataclass

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import GlobalTensor
from .registry import register

aten = torch.ops.aten
B, P = broadcast, partial_sum

# The op's definition lives as long as this module (a Library drops its registrations
# when collected). Its kernel is torch's einsum, on local parts and on meta tensors.
_LIBRARY = torch.library.Library("globaltensor", "FRAGMENT")
# Two tensor arguments, not a list: a call without a list skips pytree flattening and,
# needing no boxing, runs the kernel directly (dispatch's fast path).
_LIBRARY.define("einsum_pair(str equation, Tensor left, Tensor right) -> Tensor")
_LIBRARY.impl("einsum_pair",
              lambda equation, left, right: aten.einsum.default(equation, [left, right]),
              "CompositeExplicitAutograd")
einsum_pair = torch.ops.globaltensor.einsum_pair.default


@dataclass(frozen=True)
class Equation:
    """An einsum equation with explicit subscripts: one letter per dim, no ellipsis."""
    inputs: tuple   # per operand, its subscripts
    output: str

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output


@functools.lru_cache(maxsize=1024)
def explicit_equation(equation: str, shapes: tuple) -> "Equation | None":
    """``equation`` for operands of ``shapes`` with its ellipses as letters and its
    output written out (torch's implicit output: the ellipsis dims, then the letters
    that appear once, in order, capitals first); None for an equation this op does not
    take (a letter repeated in an operand) or that torch will refuse.

    >>> explicit_equation("...ij,jk", ((2, 3, 4), (4, 5)))
    Equation(inputs=('aij', 'jk'), output='aik')
    """
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    used = set(equation) - set(".,->")
    if len(terms) != len(shapes) or any(t.count("...") > 1 for t in terms):
        return None
    fresh = [c for c in string.ascii_letters if c not in used]
    spans = [len(shape) - len(t.replace("...", "")) for t, shape in zip(terms, shapes)]
    width = max([s for t, s in zip(terms, spans) if "..." in t], default=0)
    if width > len(fresh) or any(s < 0 or (s and "..." not in t) for t, s in zip(terms, spans)):
        return None
    dots = "".join(fresh[:width])
    inputs = tuple(t.replace("...", dots[width - s:] if s else "") for t, s in zip(terms, spans))
    if arrow:
        output = rhs.replace("...", dots)
    else:
        once = sorted(c for c in used if lhs.count(c) == 1)
        output = dots + "".join(once)
    letters = set("".join(inputs))
    if any(len(set(s)) != len(s) for s in (*inputs, output)) or not set(output) <= letters \
            or not letters <= set(string.ascii_letters):
        return None
    return Equation(inputs, output)


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> Equation:
    lhs, _, output = text.partition("->")
    return Equation(tuple(lhs.split(",")), output)


def _letter_sizes(subscripts, shapes) -> dict:
    """Each letter's size in the product: the largest among the operands that have it
    (the others have it as a size-1 dim broadcast to it)."""
    sizes: dict = {}
    for sub, shape in zip(subscripts, shapes):
        for c, n in zip(sub, shape):
            sizes[c] = n if sizes.get(c, 1) == 1 else sizes[c]
    return sizes


def pair_signatures(equation: str, shapes: tuple) -> tuple:
    """The (left sbp, right sbp, output sbp) of one placement axis for the einsum of
    two operands of ``shapes`` (``equation`` written out: no ellipsis, an output), in
    matmul's order: everything broadcast; a split of each output letter one operand
    holds (a product's rows, then its columns); of each summed letter; one operand
    partial; a split of each output letter both operands hold (a batch). The matmul
    rules take theirs from here (``matmul.py``), and dispatch breaks cost ties by this
    order, so an einsum and the product it spells choose alike. (``signatures``: the
    same for any number of operands.)

    >>> pair_signatures("mk,kn->mn", ((4, 3), (3, 2)))[:4]   # doctest: +NORMALIZE_WHITESPACE
    ((broadcast, broadcast, broadcast), (split(dim=0), broadcast, split(dim=0)),
     (broadcast, split(dim=1), split(dim=1)), (split(dim=1), split(dim=0), partial_sum))
    """
    return signatures(equation, shapes)


@functools.lru_cache(maxsize=1024)
def signatures(equation: str, shapes: tuple) -> tuple:
    """``pair_signatures`` for any number of operands: (each operand's sbp, the
    output's) per signature."""
    eq = _parsed(equation)
    free, summed, batch = [], [], []
    for c, size in _letter_sizes(eq.inputs, shapes).items():
        # an operand that has the letter as a size-1 dim broadcasts it: it stays whole
        ins = tuple(Split(sub.index(c)) if c in sub and shape[sub.index(c)] == size else B
                    for sub, shape in zip(eq.inputs, shapes))
        if c not in eq.output:
            summed.append((*ins, P))
        else:
            (free if B in ins else batch).append((*ins, Split(eq.output.index(c))))
    n = len(eq.inputs)
    partial = [(*(P if k == j else B for k in range(n)), P) for j in range(n)]
    return ((B,) * (n + 1), *free, *summed, *partial, *batch)


def pair_rule(equation: str, left, right) -> list:
    """The rule's ``(input sbps, output sbps)`` for the einsum of ``left`` and
    ``right``: ``pair_signatures``, with an sbp for each GlobalTensor operand only (a
    plain operand, of one element, is whole on every rank: it cannot be partial)."""
    return operands_rule(equation, (left, right))


def operands_rule(equation: str, operands: tuple) -> list:
    """``pair_rule`` for any number of operands."""
    shapes = tuple(tuple(t.shape) for t in operands)
    cands = signatures(equation, shapes)
    held = [k for k, t in enumerate(operands) if isinstance(t, GlobalTensor)]
    return [(tuple(c[k] for k in held), (c[-1],)) for c in cands
            if all(c[k] != P or k in held for k in range(len(operands)))]


@register(aten._trilinear.default)
def trilinear_rule(call):
    """``nn.Bilinear``'s op: the three operands, each unsqueezed at its ``expand`` dims,
    multiplied and summed over ``sumdim``: an einsum of three, ruled as one."""
    operands = tuple(call.arg(f"i{k}") for k in (1, 2, 3))
    expands = tuple(tuple(call.arg(f"expand{k}")) for k in (1, 2, 3))
    return operands_rule(_trilinear_equation(operands[0].dim() + len(expands[0]), expands,
                                             tuple(call.arg("sumdim"))), operands)


@functools.lru_cache(maxsize=256)
def _trilinear_equation(total: int, expands: tuple, sumdim: tuple) -> str:
    letters = string.ascii_letters[:total]
    expands = tuple({d % total for d in e} for e in expands)
    summed = {d % total for d in sumdim}
    inputs = ("".join(c for d, c in enumerate(letters) if d not in e) for e in expands)
    return ",".join(inputs) + "->" + "".join(c for d, c in enumerate(letters) if d not in summed)


@register(einsum_pair)
def einsum_rule(call):
    return pair_rule(call.arg("equation"), call.arg("left"), call.arg("right"))


class _EinsumPair(torch.autograd.Function):
    """The op, differentiable: each operand's gradient is again a pair's einsum."""

    @staticmethod
    def forward(ctx, eq: Equation, left, right):
        ctx.eq = eq
        ctx.save_for_backward(left, right)
        return einsum_pair(str(eq), left, right)

    @staticmethod
    def backward(ctx, grad):
        left, right = ctx.saved_tensors
        need_left, need_right = ctx.needs_input_grad[1:]
        return (None, _operand_grad(ctx.eq, 0, grad, left, right) if need_left else None,
                _operand_grad(ctx.eq, 1, grad, right, left) if need_right else None)


def _operand_grad(eq: Equation, k: int, grad, operand, other):
    """The gradient of operand ``k`` of the pair: the output's gradient contracted with
    the other operand (conjugated, as torch's complex gradients are), summed over the
    letters operand ``k`` broadcasts as size-1 dims, and expanded over the letters the
    other broadcasts and those only operand ``k`` has (summed away in forward)."""
    sub, other_sub, shape = eq.inputs[k], eq.inputs[1 - k], tuple(operand.shape)
    elsewhere = _letter_sizes((eq.output, other_sub), (tuple(grad.shape), tuple(other.shape)))
    kept = "".join(c for c, n in zip(sub, shape)
                   if c in elsewhere and (n != 1 or elsewhere[c] == 1))
    g = _EinsumPair.apply(Equation((eq.output, other_sub), kept), grad,
                          other.conj() if other.is_complex() else other)
    produced = tuple(elsewhere[c] if c in kept else 1 for c in sub)
    if kept != sub:
        g = g.reshape(produced)
    return g if produced == shape else g.expand(shape)


def _contract(eq: Equation, operands) -> GlobalTensor:
    """The operands contracted left to right in pairs; each intermediate keeps the
    letters that the output or a later operand has."""
    out, sub = operands[0], eq.inputs[0]
    for k in range(1, len(operands)):
        later = set(eq.output).union(*eq.inputs[k + 1:])
        pair_out = eq.output if k == len(operands) - 1 else \
            "".join(c for c in dict.fromkeys(sub + eq.inputs[k]) if c in later)
        out = _EinsumPair.apply(Equation((sub, eq.inputs[k]), pair_out), out, operands[k])
        sub = pair_out
    return out


def einsum(equation: "str | torch.Tensor", *operands) -> "GlobalTensor | NotImplemented":
    """``torch.einsum`` for GlobalTensor operands (``interop/torch_patches.py`` installs
    it): one ``globaltensor::einsum_pair`` per pair of operands forward, one per
    gradient backward (plain operands as in any op: one element, or any inside
    ``gt.implicit_broadcast()``); or NotImplemented for torch's decomposition (fewer
    than two operands, the sublist form, a letter repeated in an operand).

    >>> torch.einsum("ij,jk->ik", x, w)      # x split(0), w broadcast   # doctest: +SKIP
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) < 2 or \
            not all(isinstance(t, torch.Tensor) for t in operands):
        return NotImplemented
    eq = explicit_equation(equation, tuple(tuple(t.shape) for t in operands))
    if eq is None:
        return NotImplemented
    return _contract(eq, _autocast(operands))


def _autocast(operands: tuple) -> tuple:
    """``operands`` as autocast gives them to torch's einsum (whose bmm it casts): under
    ``torch.autocast`` for their device, floating ones other than fp64 in its dtype.
    (``einsum_pair`` is an op of ours, which autocast does not know.)"""
    device = operands[0].device.type
    if not torch.is_autocast_enabled(device):
        return operands
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64)
                 else t for t in operands)
