"""``auto_parallel(..., simulate=placement)``: the candidates compared on a placement
this process does not run (a cluster of 8 to 1024 ranks), each step simulated by
``gt.debug.simulate_step`` on a device profile instead of timed: the predicted step
time and peak memory per rank of each, the fastest that fits the memory budget
proposed. Nothing is applied (the placement is not this world's).
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable, Sequence

import torch

from ..factory import tensor
from ..placement import Placement
from ..step_simulation import simulate_step
from ..tensor import GlobalTensor


def propose(plain: torch.nn.Module, candidates: dict, inputs: Sequence,
            memory_budget: "int | None", loss_fn: "Callable | None", device) -> tuple:
    """(the name of the fastest predicted candidate that fits, {name: report}) over
    ``candidates`` ({name: AutoPlan} on the simulated placement). A candidate whose
    simulated step raises is skipped with a warning naming it.

    >>> best, reports = propose(model, candidates, (ids,), None, None, "h100")  # doctest: +SKIP
    """
    # whole values of this world's example inputs, read before the fake tensors
    inputs = [x.full() if isinstance(x, GlobalTensor) else x for x in inputs]
    reports, failed = {}, {}
    for name, plan in candidates.items():
        try:
            reports[name] = simulate_step(_maker(plain, plan, inputs, loss_fn),
                                          placement=plan.placement, device=device,
                                          planned=True)
        except Exception as e:  # noqa: BLE001 - named in the warning, the others go on
            failed[name] = e
            warnings.warn(f"globaltensor.nn.auto_parallel: skipping candidate {name!r} "
                          f"(simulated): {type(e).__name__}: {e}", stacklevel=3)
    if not reports:
        raise RuntimeError("auto_parallel: every simulated candidate failed: " + "; ".join(
            f"{name}: {type(e).__name__}: {e}" for name, e in failed.items()))
    fits = [n for n, r in reports.items() if memory_budget is None
            or r.peak_memory <= memory_budget]
    if not fits:
        smallest = min(reports, key=lambda n: reports[n].peak_memory)
        raise ValueError(f"memory_budget {memory_budget} bytes per rank cannot be met on "
                         f"{candidates[smallest].placement}: the smallest simulated peak is "
                         f"{reports[smallest].peak_memory} bytes ({smallest})")
    return min(fits, key=lambda n: reports[n].seconds), reports


def _maker(plain: torch.nn.Module, plan, inputs: Sequence, loss_fn) -> Callable:
    """What ``simulate_step`` runs under fake tensors: the model copied and laid out by
    ``plan``, the inputs whole on its placement in the plan's input layouts, and one
    step (forward, backward, AdamW)."""
    def make():
        placement: Placement = plan.placement
        model = plan.apply(copy.deepcopy(plain))
        xs = [_whole(x, placement, sbp) for x, sbp in zip(inputs, plan.inputs)]
        opt = torch.optim.AdamW(model.parameters())

        def step():
            out = model(*xs)
            loss = loss_fn(out) if loss_fn is not None else \
                (out if out.dim() == 0 else out.float().square().mean())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step, model, opt
    return make


def _whole(x, placement: Placement, sbp: tuple):
    """An example input (a whole value) laid out on the simulated placement."""
    return tensor(x, placement=placement, sbp=sbp) if isinstance(x, torch.Tensor) else x
