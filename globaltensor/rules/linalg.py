"""Batched matrix functions keep a split of their batch dims, and determinants keep
torch's contract with their backward.

A function of the last two dims (inverse, Cholesky, QR, SVD, eigendecomposition, the
matrix exponential, determinants, solves) runs on each matrix alone: a split of any dim
before them stays in every output whose leading dims are the batch's (the factors, the
``info`` codes), with no communication.

``torch.linalg.det`` / ``slogdet`` factor ``A^T`` when ``A`` is contiguous (an
optimisation: the LU kernel wants column-major input) and ``A`` itself when it is not,
and their backward asks ``A.is_contiguous()`` again to know which factors it was given.
A GlobalTensor's local part need not share its wrapper's contiguity: gathered to
broadcast, the part of a non-contiguous view (``x[:, :n]`` of a split ``x``) is
contiguous, so the factors would be of ``A^T`` while the backward takes them for
``A``'s: a transposed gradient. A non-contiguous ``A`` is therefore given to the op as
``A.mT.contiguous()``: contiguous, wrapper and part alike, so the kernel factors its
transpose, ``A``, as torch does for ``A`` itself (the same determinant).
"""
from __future__ import annotations

import torch

from ..sbp import Split, broadcast
from ..tensor import GlobalTensor
from .registry import register

aten = torch.ops.aten

_BATCHED = [getattr(aten, name) for name in (
    "linalg_inv_ex", "linalg_cholesky_ex", "linalg_qr", "_linalg_svd", "_linalg_eigh",
    "linalg_eig", "linalg_matrix_exp", "_linalg_det", "_linalg_slogdet", "_linalg_solve_ex",
    "linalg_lu_factor_ex", "linalg_lu", "linalg_solve_triangular", "cholesky_solve",
    "linalg_householder_product", "linalg_pinv") if hasattr(aten, name)]


@register(*_BATCHED)
def batched_matrix_rule(call):
    """Each matrix alone: a split of a batch dim (before the last two of the first
    input) stays, where every input and output starts with those batch dims."""
    batch = tuple(call.in_shapes[0][:-2])
    n_in, n_out = len(call.inputs), len(call.out_shapes)
    cands = [((broadcast,) * n_in, (broadcast,) * n_out)]
    if all(tuple(s[:len(batch)]) == batch for s in (*call.in_shapes, *call.out_shapes)):
        cands += [((Split(d),) * n_in, (Split(d),) * n_out) for d in range(len(batch))]
    return cands


def _factors_of_a_itself(op):
    def decomposition(A):
        if (not isinstance(A, GlobalTensor) or A.is_contiguous() or A.is_complex()
                or A.dim() < 2):
            return NotImplemented
        return op(A.mT.contiguous())
    return decomposition


register(aten._linalg_det, decompose=True)(_factors_of_a_itself(aten._linalg_det.default))
register(aten._linalg_slogdet, decompose=True)(_factors_of_a_itself(aten._linalg_slogdet.default))


@register(aten._linalg_check_errors)
def check_errors_rule(call):
    # a check of the info codes, which raises: on the whole codes, on every rank alike
    # (a rank raising alone would leave the others waiting)
    return [((broadcast,), ())]
