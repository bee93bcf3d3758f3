"""Stages that run on plain tensors: on one rank, or data parallel.

A global tensor on a one-rank placement is its local part, whatever its sbp: every op
computes on the part what it would compute on the whole. Such a stage can therefore
run its module on the local parts of its parameters, buffers and input, without our
per-op dispatch, which costs 10-20 us per op (measured: 15-25 % of a small MLP stage's
forward and backward). Its parameters become plain leaves that share the parameters'
memory, and their ``.grad`` that of the parameters' ``.grad`` (autograd accumulates
into it in place); a gradient the parameter did not have yet is handed over once per
step.

A data-parallel stage (several ranks, every parameter and buffer broadcast) computes
the same way when its module treats rows independently: each rank runs the module on
its rows. Its leaves' gradients are then this rank's contributions: they are handed
to the parameters' ``.grad`` as partial sums over the axes where the input is split
just before the stage's last micro-batch, which runs global, so that gradient sync
reduces everything once, overlapped with that backward, as in the global path.

A stage qualifies only if, on the first micro-batch of every shape, its global run
drew no placement-invariant random values (a plain run would draw torch's instead)
and a plain run computes the same output (so a stage that calls the global API, e.g.
``to_global``, or mixes rows, e.g. batch norm in training, keeps the global path);
every member of a data-parallel stage must find so. The loss after a one-rank last
stage is checked and run the same way. A step in which a parameter has gradient hooks
of its own runs the stage global (the hooks see the parameter's gradient there).

>>> stage = PlainStage(module, placement)            # doctest: +SKIP
>>> stage.agrees(x.local_part, module(x).local_part)   # on the first micro-batch
>>> out = stage(local_input); out.backward(grad)      # plain tensors
>>> stage.flush_grads()                               # one rank: into .grad
>>> stage.hand_over(input_layout)                     # data parallel: as partial sums
"""
from __future__ import annotations

import itertools

import torch
from torch.func import functional_call

from ..gradsync import has_other_hooks, keep_partial
from ..layout import Layout
from ..placement import Placement
from ..sbp import Broadcast, partial_sum
from ..tensor import GlobalTensor, to_layout


def runs_locally(module: torch.nn.Module, placement: Placement, rank: int) -> bool:
    """Whether ``module`` (a stage on ``placement``) may run on plain tensors on
    ``rank``: the module is not compiled (a compiled stage has no per-op dispatch to
    save), and ``rank`` is the placement's only rank, or a member of a data-parallel
    stage (every parameter and buffer broadcast)."""
    if hasattr(module, "_orig_mod") or rank not in placement:
        return False
    return placement.flat_ranks == (rank,) or _replicated(module)


class PlainStage:
    """Runs ``module`` (global on ``placement``) on plain tensors."""

    def __init__(self, module: torch.nn.Module, placement: Placement):
        self.module = module
        self.shared = len(placement.flat_ranks) > 1  # data parallel
        self._leaves: dict = {}   # parameter name -> (parameter, plain leaf)
        self._tensors: dict = {}  # name -> plain tensor, as functional_call takes them

    def refresh(self) -> bool:
        """Make the plain leaves match the parameters (once per step: an optimizer
        updates parameters in place, which the leaves see; new storage or a changed
        requires_grad makes a new leaf), and on one rank their gradients. False if
        this step must run global: a parameter has gradient hooks that a plain leaf
        would not run, or a data-parallel stage is no longer replicated."""
        tensors = {}
        params = list(self.module.named_parameters())
        if any(has_other_hooks(p) for _, p in params) or \
                (self.shared and not _replicated(self.module)):
            return False
        for name, p in params:
            kept = self._leaves.get(name)
            local = p.local_part
            if kept is None or kept[0] is not p or not _same_memory(kept[1], local) \
                    or kept[1].requires_grad != p.requires_grad:
                kept = self._leaves[name] = (p, local.detach().requires_grad_(p.requires_grad))
            leaf, g = kept[1], p.grad
            # contributions of a data-parallel stage are summed over ranks later: they
            # cannot start from the gradient every rank already holds
            seed = g is not None and not self.shared and _same_kind(g.local_part, local)
            leaf.grad = g.local_part if seed else None
            tensors[name] = leaf
        for name, b in self.module.named_buffers():
            tensors[name] = b.local_part if isinstance(b, GlobalTensor) else b
        self._tensors = tensors
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, self._tensors, (x,))

    def agrees(self, x: torch.Tensor, expected: torch.Tensor) -> bool:
        """Whether a plain run on ``x`` gives ``expected``, the global run's local
        output (see ``agrees``)."""
        return self.refresh() and agrees(self, (x,), expected)

    def flush_grads(self) -> None:
        """One rank: hand the leaves' gradients to the parameters' ``.grad`` (a
        GlobalTensor in the parameter's gradient layout) where they are not that
        memory already."""
        for p, leaf in self._leaves.values():
            g, leaf.grad = leaf.grad, None
            if g is None or (p.grad is not None and p.grad.local_part is g):
                continue
            if p.grad is None:
                p.grad = GlobalTensor(g, p.global_layout.without_partials())
            else:  # a .grad in other strides or dtype than the parameter's
                p.grad.local_part.add_(g)

    def hand_over(self, inputs: Layout) -> None:
        """Data parallel: add the leaves' gradients (this rank's contributions) to the
        parameters' ``.grad`` as partial sums over the axes where the stage's input
        layout ``inputs`` is not broadcast; gradient sync reduces them with the next
        (global) backward's."""
        axes = {a for a, s in enumerate(inputs.sbp) if not isinstance(s, Broadcast)}
        for p, leaf in self._leaves.values():
            g, leaf.grad = leaf.grad, None
            if g is None:
                continue
            sbp = tuple(partial_sum if a in axes else s for a, s in enumerate(p.sbp))
            part = GlobalTensor(g, Layout.make(p.shape, p.placement, sbp))
            if p.grad is None:
                p.grad = part
            else:  # a kept .grad stays .grad once reduced, as in torch; made partial
                # first (no communication), so the sum stays partial whatever per-op
                # choice would make of adding a partial to a broadcast tensor
                keep_partial(p, to_layout(p.grad, part._layout) + part)


def agrees(fn, args: tuple, expected: torch.Tensor) -> bool:
    """Whether ``fn(*args)`` on plain tensors, without gradients, gives ``expected``
    (a global run's local result); torch's random state is left as it was.

    >>> agrees(F.mse_loss, (out.local_part, target.local_part), loss.local_part)   # doctest: +SKIP
    """
    device = expected.device  # its generator is put back too (cuda: the rank's device)
    forked = [] if device.type == "cpu" else [device]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=forked, device_type=device.type):
            out = fn(*args)
        torch.testing.assert_close(out, expected, equal_nan=True)
    except Exception:  # noqa: BLE001  any failure means: keep the global path
        return False
    return True


def _replicated(module: torch.nn.Module) -> bool:
    return all(isinstance(t, GlobalTensor) and all(isinstance(s, Broadcast) for s in t.sbp)
               for t in itertools.chain(module.parameters(), module.buffers()))


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and _same_kind(a, b)
