"""Matrix products: mm, addmm, bmm, baddbmm, mv, dot (torch.matmul, @ and F.linear
reach these), and the grouped product of mixtures of experts (``F.grouped_mm``).

For C = A @ B with A (m, k) and B (k, n), per placement axis, as einsum's rule gives
them for "mk,kn->mn" (``einsum.pair_signatures``): (B, B) -> B, (S0, B) -> S0 (rows),
(B, S1) -> S1 (columns), (S1, S0) -> P (the contracted dim), (P, B) -> P,
(B, P) -> P. Batched products ("bmk,bkn->bmn") add (S0, S0) -> S0 on the batch dim;
mv is "mk,k->m", dot "k,k->". A bias (addmm's ``self``) follows the output, except
that under a partial output it must be partial too, so it is added once. ``torch.cdist``
(where it does not run as a product) keeps the splits of the batch and of either
operand's rows.
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from .einsum import pair_rule, pair_signatures
from .pointwise import aligned_sbp
from .registry import register, register_meta

aten = torch.ops.aten
B, P = broadcast, partial_sum

# Each product as the einsum it is, with the schema names of its two factors: einsum's
# rule says, in one place, how rows, columns, contracted and batch dims map to splits
# and partial sums (DTensor's _mm_like_strategy asks its einsum strategy the same way).
_EINSUMS = {aten.mm: ("mk,kn->mn", "self", "mat2"), aten.bmm: ("bmk,bkn->bmn", "self", "mat2"),
            aten.mv: ("mk,k->m", "self", "vec"), aten.dot: ("k,k->", "self", "tensor"),
            aten.addmm: ("mk,kn->mn", "mat1", "mat2"),
            aten.baddbmm: ("bmk,bkn->bmn", "batch1", "batch2")}


def _bias_sbp(bias_shape, out_shape, out_sbp):
    """The sbp a bias of ``bias_shape`` needs so that bias + product has ``out_sbp``."""
    if out_sbp == P:
        return P
    if isinstance(out_sbp, Split):
        return aligned_sbp(bias_shape, out_shape, out_sbp.dim)
    return B


@register(aten.mm, aten.bmm, aten.mv, aten.dot)
def product_rule(call):
    equation, left, right = _EINSUMS[call.func.overloadpacket]
    return pair_rule(equation, call.arg(left), call.arg(right))


@register(aten.addmm, aten.baddbmm)
def biased_product_rule(call):
    if len(call.inputs) != 3:
        return []  # a plain-tensor operand: let the fallback handle it
    equation = _EINSUMS[call.func.overloadpacket][0]
    bias_shape, out_shape = call.in_shapes[0], call.out_shapes[0]
    return [((_bias_sbp(bias_shape, out_shape, o), a, b), (o,))
            for a, b, o in pair_signatures(equation, tuple(call.in_shapes[1:]))]


@register(aten._cdist_forward)
def cdist_rule(call):
    """(x1 (..., r1, c), x2 (..., r2, c)) -> distances (..., r1, r2): a batch split of
    both stays, a split of x1's rows or x2's rows gives a split of the output's."""
    n = len(call.out_shapes[0])
    if any(len(s) != n for s in call.in_shapes):   # batch dims broadcast: whole values
        return [((B, B), (B,))]
    cands = [((B, B), (B,)), ((Split(n - 2), B), (Split(n - 2),)), ((B, Split(n - 2)), (Split(n - 1),))]
    if call.in_shapes[0][:-2] == call.in_shapes[1][:-2]:
        cands += [((Split(d), Split(d)), (Split(d),)) for d in range(n - 2)]
    return cands


@register(aten._cdist_backward)
def cdist_backward_rule(call):
    """(grad, x1, x2, distances) -> x1's gradient: x1's rows split stay; x2's rows split
    leave a partial sum over them."""
    n = len(call.out_shapes[0])
    if any(len(s) != n for s in call.in_shapes):
        return [((B,) * 4, (B,))]
    rows, cols = Split(n - 2), Split(n - 1)
    cands = [((B,) * 4, (B,)), ((rows, rows, B, rows), (rows,)), ((cols, B, rows, cols), (P,))]
    if call.in_shapes[1][:-2] == call.in_shapes[2][:-2]:
        cands += [((Split(d),) * 4, (Split(d),)) for d in range(n - 2)]
    return cands


# F.grouped_mm (``aten._grouped_mm``): per expert group, a product. A 2-D operand's
# jagged dim is cut into groups at ``offs`` (global positions, so it never splits), and
# the groups of a 3-D operand are its dim 0 (a split there would need each rank's
# tokens routed to it: an all-to-all of its own, ``nn/moe.py``). Each case as the
# einsum it is, with the letters that may not split.
_GROUPED = {(2, 3): ("mk,ekn->mn", "me"), (3, 2): ("emk,kn->mn", "en"),
            (2, 2): ("kt,tn->ekn", "t"), (3, 3): ("bmk,bkn->bmn", "")}


@register_meta(aten._grouped_mm)
def grouped_mm_meta(func, placement, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output on meta tensors: torch's meta kernel holds every device to CUDA's
    limits (bfloat16, 16-byte strides), which the CPU kernel does not."""
    if (mat_a.dim(), mat_b.dim()) not in _GROUPED:
        raise ValueError(f"{func}: multiplicands must be 2-D or 3-D, got {mat_a.dim()}-D and {mat_b.dim()}-D")
    k_a, k_b = mat_a.shape[-1], mat_b.shape[-2 if mat_b.dim() == 3 else 0]
    if k_a != k_b:
        raise ValueError(f"{func}: contracted sizes differ: {tuple(mat_a.shape)} and {tuple(mat_b.shape)}")
    if (offs is None) != (mat_a.dim() == mat_b.dim() == 3):
        raise ValueError(f"{func}: offs is needed exactly when an operand is 2-D")
    shape = {(2, 3): (mat_a.shape[0], mat_b.shape[-1]), (3, 2): (mat_a.shape[1], mat_b.shape[1]),
             (2, 2): (0 if offs is None else offs.shape[0], mat_a.shape[0], mat_b.shape[1]),
             (3, 3): (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])}[mat_a.dim(), mat_b.dim()]
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device="meta")


def _grouped_mm_local(ctx, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    # A part of a split operand can miss the kernel's 16-byte stride alignment that the
    # whole value met (a (m, 6) float32 part of (m, 12)): then the groups one by one.
    try:
        return ctx.call.func(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    except RuntimeError as refused:
        try:
            return _grouped_by_loop(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
        except RuntimeError:
            raise refused from None


def _grouped_by_loop(a, b, offs, dtype):
    if offs is None:
        return torch.bmm(a, b).to(dtype)
    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1], dtype=dtype)
        for i, (s, e) in enumerate(spans):
            out[s:e] = a[s:e] @ b[i]
    elif a.dim() == 3:
        out = a.new_zeros(a.shape[1], b.shape[1], dtype=dtype)
        for i, (s, e) in enumerate(spans):
            out[:, s:e] = a[i] @ b[:, s:e]
    else:
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in spans]).to(dtype)
    return out


@register(aten._grouped_mm, local=_grouped_mm_local)
def grouped_mm_rule(call):
    """(mat_a, mat_b, offs?) -> out: the product's signatures (``pair_signatures``) but
    those that split a jagged or a group dim; offs whole. A bias: the fallback."""
    if call.arg("bias") is not None:
        return []
    shapes = tuple(call.in_shapes[:2])
    equation, fixed = _GROUPED[len(shapes[0]), len(shapes[1])]
    subscripts = equation.split("->")[0].split(",")
    whole_offs = (B,) * (len(call.inputs) - 2)
    return [((a, b, *whole_offs), (o,)) for a, b, o in pair_signatures(equation, shapes)
            if not any(isinstance(x, Split) and sub[x.dim] in fixed for x, sub in zip((a, b), subscripts))]
