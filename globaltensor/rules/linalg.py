"""Determinants keep torch's contract with their backward.

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

from ..tensor import GlobalTensor
from .registry import register

aten = torch.ops.aten


def _factors_of_a_itself(op):
    def decomposition(A):
        if (not isinstance(A, GlobalTensor) or A.is_contiguous() or A.is_complex()
                or A.dim() < 2):
            return NotImplemented
        return op(A.mT.contiguous())
    return decomposition


register(aten._linalg_det, decompose=True)(_factors_of_a_itself(aten._linalg_det.default))
register(aten._linalg_slogdet, decompose=True)(_factors_of_a_itself(aten._linalg_slogdet.default))
