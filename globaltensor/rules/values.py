"""Ops that return a Python value: ``x.item()`` / ``float(x)`` / ``int(x)``
(``_local_scalar_dense``), ``torch.equal``, ``torch.allclose`` and ``bool(x)`` (``is_nonzero``).

They run as ``reads.py`` reads: a tensor broadcast on every rank reads its local copy,
any other is gathered by every rank of the world, which all need the value.

>>> if gt.get_rank() == 0:        # loss: broadcast   # doctest: +SKIP
...     print(loss.item())
"""
from __future__ import annotations

import torch

from .. import reads
from .registry import register

aten = torch.ops.aten


@register(aten._local_scalar_dense.default, decompose=True)
def local_scalar_dense(x):
    return reads.item(x, "float(x) (or int(x))")


register(aten.equal.default, decompose=True)(reads.equal)
register(aten.allclose.default, decompose=True)(reads.allclose)


@register(aten.is_nonzero.default, decompose=True)
def is_nonzero(x) -> bool:
    return bool(reads.item(x, "bool(x) (or `if x:`)"))
