"""Sparse row optimizers: update only the rows a gradient touches.

Servers run them on their table shards; a geo-mode worker runs the same ones on its
local copy of the rows it touched. The formulas are torch's for sparse gradients
(``torch.optim.SGD`` without momentum, ``torch.optim.Adagrad``), so a table trained
here matches an ``nn.Embedding(sparse=True)`` trained by torch on the same gradients.

>>> import torch
>>> w = torch.zeros(4, 2)
>>> opt = RowOptimizer("sgd", lr=0.5, shape=(4, 2))
>>> opt.apply(w, torch.tensor([1]), torch.ones(1, 2))
>>> w[1].tolist(), w[0].tolist()
([-0.5, -0.5], [0.0, 0.0])
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RowOptimizer", "coalesce", "OPTIMIZERS"]

OPTIMIZERS = ("sgd", "adagrad")


def coalesce(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated rows: (unique sorted rows, their summed gradients).

    Adagrad must see one summed gradient per row (as torch coalesces a sparse
    gradient), not one update per occurrence.
    """
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    if unique.numel() == rows.numel():
        order = torch.argsort(rows)
        return rows[order], grads[order]
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype)
    summed.index_add_(0, inverse, grads)
    return unique, summed


class RowOptimizer:
    """``kind`` ("sgd" or "adagrad") with learning rate ``lr`` over a (rows, dim) weight.

    ``apply(weight, rows, grad)`` updates ``weight[rows]`` in place; ``rows`` must be
    unique (see ``coalesce``). Adagrad keeps a per-element sum of squared gradients,
    grown with ``grow`` when a geo worker's local copy gains rows.
    """

    def __init__(self, kind: str, lr: float, shape: tuple[int, int], eps: float = 1e-10):
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.kind, self.lr, self.eps = kind, float(lr), eps
        self.state: Optional[torch.Tensor] = torch.zeros(shape) if kind == "adagrad" else None

    def grow(self, rows: int) -> None:
        """Add ``rows`` zero-state rows at the end (a local copy gained rows)."""
        if self.state is not None:
            self.state = torch.cat([self.state, self.state.new_zeros(rows, self.state.shape[1])])

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        if self.kind == "sgd":
            weight.index_add_(0, rows, grad, alpha=-self.lr)
            return
        # torch's sparse Adagrad: sum += g^2 on the rows; w -= lr * g / (sqrt(sum) + eps)
        assert self.state is not None
        self.state.index_add_(0, rows, grad * grad)
        std = self.state.index_select(0, rows).sqrt_().add_(self.eps)
        weight.index_add_(0, rows, grad / std, alpha=-self.lr)
