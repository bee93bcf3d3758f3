"""Sparse row optimizers: update only the rows a gradient touches.

Servers run them on their table shards; a geo-mode worker runs the same ones on its
local copy of the rows it holds. Every optimizer keeps its state per row, so a row
that is evicted and admitted again, or updated by one worker while another waits,
needs nothing global:

- ``sgd``: torch's ``SGD`` without momentum (``w -= lr * g``);
- ``adagrad``: torch's sparse ``Adagrad`` (``sum += g^2; w -= lr * g / (sqrt(sum) + eps)``);
- ``adam``: lazy Adam: torch's ``Adam`` formulas on the touched rows only, with a step
  count per row (as Paddle's sparse Adam rule and TensorFlow's LazyAdam: a row's moments
  and bias correction advance only when the row gets a gradient);
- ``ftrl``: FTRL-Proximal (McMahan et al. 2013, per coordinate; ``lr`` is alpha,
  options ``l1``, ``l2``, ``beta``): the weight is recomputed from the accumulated
  ``z`` and ``n``, exactly zero while ``|z| <= l1`` (sparse models).

A table trained with sgd/adagrad here matches an ``nn.Embedding(sparse=True)`` trained
by torch on the same gradients.

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

__all__ = ["RowOptimizer", "coalesce", "add_rows", "OPTIMIZERS", "check_options"]

OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")
# Options each optimizer takes, with their defaults (torch's, and McMahan's beta = 1).
DEFAULTS = {"sgd": {}, "adagrad": {"eps": 1e-10},
            "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
            "ftrl": {"l1": 0.0, "l2": 0.0, "beta": 1.0}}
# Per-row state tensors of each optimizer (names; every one is (rows, dim) but "step").
STATE = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq", "step"),
         "ftrl": ("z", "n")}


def check_options(kind: str, lr: float, options: Optional[dict]) -> dict:
    """The optimizer's options with defaults filled in; raises ValueError on bad input.

    >>> check_options("ftrl", 0.1, {"l1": 1.0})
    {'l1': 1.0, 'l2': 0.0, 'beta': 1.0}
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be > 0, got {lr!r}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULTS[kind]))
    if unknown:
        raise ValueError(f"optimizer {kind!r} takes options {sorted(DEFAULTS[kind])}, got {unknown}")
    full = {**DEFAULTS[kind], **{k: float(v) for k, v in options.items()}}
    if any(v < 0 for v in full.values()) or any(full.get(b, 0) >= 1 for b in ("beta1", "beta2")):
        raise ValueError(f"optimizer {kind!r} options must be >= 0 (betas < 1), got {full}")
    return full


def add_rows(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
    """``t[rows] += alpha * values`` for distinct ``rows`` (a gather and a scatter: several
    times faster on CPU than ``index_add_`` with ``alpha``)."""
    t.index_copy_(0, rows, t.index_select(0, rows).add_(values, alpha=alpha))


def coalesce(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated rows: (unique sorted rows, their summed gradients).

    Adagrad must see one summed gradient per row (as torch coalesces a sparse
    gradient), not one update per occurrence.
    """
    if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):  # sorted and distinct already
        return rows, grads
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    if unique.numel() == rows.numel():
        order = torch.argsort(rows)
        return rows[order], grads[order]
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_put_((inverse,), grads, accumulate=True)
    return unique, summed


class RowOptimizer:
    """``kind`` (one of ``OPTIMIZERS``) with learning rate ``lr`` over a (rows, dim) weight.

    ``apply(weight, rows, grad)`` updates ``weight[rows]`` in place; ``rows`` must be
    unique (see ``coalesce``). The per-row state lives in ``state`` (name -> tensor of
    ``rows`` rows); ``grow`` adds zero-state rows, ``reset(rows)`` zeroes the state of
    rows that are given to new ids.
    """

    def __init__(self, kind: str, lr: float, shape: tuple[int, int], options: Optional[dict] = None,
                 device: Optional[torch.device] = None):
        self.options = check_options(kind, lr, options)
        self.kind, self.lr = kind, float(lr)
        rows, dim = shape
        self.state: dict[str, torch.Tensor] = {
            name: torch.zeros(rows, 1 if name == "step" else dim, device=device) for name in STATE[kind]}

    def grow(self, rows: int) -> None:
        """Add ``rows`` zero-state rows at the end (a local copy gained rows)."""
        for name, t in self.state.items():
            self.state[name] = torch.cat([t, t.new_zeros(rows, t.shape[1])])

    def reset(self, rows: torch.Tensor) -> None:
        """Zero the state of ``rows`` (their slots now hold other ids)."""
        for t in self.state.values():
            t[rows] = 0

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        if self.kind == "sgd":
            add_rows(weight, rows, grad, -self.lr)
        elif self.kind == "adagrad":
            total = self.state["sum"]
            add_rows(total, rows, grad * grad)
            std = total.index_select(0, rows).sqrt_().add_(self.options["eps"])
            add_rows(weight, rows, grad / std, -self.lr)
        elif self.kind == "adam":
            self._adam(weight, rows, grad)
        else:
            self._ftrl(weight, rows, grad)

    def _adam(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        # torch.optim.Adam's step on each touched row, with the row's own step count.
        b1, b2, eps = self.options["beta1"], self.options["beta2"], self.options["eps"]
        st = self.state
        step = st["step"][rows] + 1
        st["step"][rows] = step
        m = st["exp_avg"][rows].lerp_(grad, 1 - b1)
        v = st["exp_avg_sq"][rows].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        st["exp_avg"][rows], st["exp_avg_sq"][rows] = m, v
        bias1, bias2 = 1 - b1 ** step, 1 - b2 ** step
        denom = (v.sqrt() / bias2.sqrt()).add_(eps)
        weight[rows] -= self.lr / bias1 * m / denom

    def _ftrl(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        l1, l2, beta = self.options["l1"], self.options["l2"], self.options["beta"]
        alpha = self.lr
        z, n = self.state["z"][rows], self.state["n"][rows]
        n_new = n + grad * grad
        sigma = (n_new.sqrt() - n.sqrt()) / alpha
        z += grad - sigma * weight[rows]
        self.state["z"][rows], self.state["n"][rows] = z, n_new
        value = -(z - z.sign() * l1) / ((beta + n_new.sqrt()) / alpha + l2)
        weight[rows] = torch.where(z.abs() <= l1, torch.zeros_like(value), value)

