"""``gt.nn.auto_parallel``: parameter layouts chosen for the model by measuring it.

Candidates are whole-model layouts, each a plan {parameter name: sbp} plus the sbp of
the batch inputs: data parallel (parameters broadcast, inputs split on the batch),
Megatron tensor parallel (consecutive Linear layers of a module split column then row, a
fused query-key-value projection in 3 blocks, the rest broadcast, inputs broadcast), and
fully sharded (parameters split(0), gathered where used, so ZeRO-3; inputs split on the
batch); on a 2-D placement data parallel and fully sharded span both axes, and two
hybrids take the outer axis for the batch (data x tensor parallel) or for ZeRO-3 (fully
sharded x tensor parallel) and the inner axis for Megatron's layout. A sequence model
(an attention module, or token ids for inputs) also gets the sequence split on the
(inner) axis, parameters broadcast: context parallel (data x context on 2-D; attention
then runs as ring attention); a model with ``gt.nn.MoE`` layers gets expert parallel
(data parallel with the experts split; data x expert on 2-D). Each candidate that fits
the memory budget (parameters, gradients and two optimizer moments per rank) runs a few
training steps on the example inputs, whose activation layouts the whole-step planner
chooses (planner/record.py); the timed ones in turns with the others and with the ranks
meeting before each step; candidates within 10 % of the fastest take more turns. The
fastest (the slowest rank's median step) wins, and every rank agrees on it. A candidate
whose warm-up steps raise on every rank is skipped with a warning naming it and the
error. The plan is returned editable, and can be saved and loaded.

>>> plan = gt.nn.auto_parallel(model, P, (ids, targets))      # doctest: +SKIP
>>> print(plan); plan.save("plan.json")
>>> plan = gt.nn.load_plan("plan.json"); plan.apply(other_model)
"""
from __future__ import annotations

import copy
import json
import statistics
import time
import warnings
from typing import Callable, Sequence

import torch

from .. import comm
from ..cost import max_local_bytes
from ..factory import from_local
from ..layout import Layout
from ..layout_spec import sbp_from_text, sbp_text
from ..placement import Placement, check_placement
from ..planner.record import RECORD_AT
from ..sbp import broadcast, partial_max, partial_sum
from ..tensor import GlobalTensor
from .auto_candidates import candidate_layouts, named_tensors
from .auto_simulated import propose
from .module import to_global

__all__ = ["AutoPlan", "auto_parallel", "load_plan"]

STATE_COPIES = 4   # parameter, gradient, two optimizer moments (Adam)
WARM_STEPS = RECORD_AT + 1   # enough for a step to be recorded and planned
TIMED_STEPS = 7        # per turn of timing; candidates within CLOSE of the fastest take
MAX_TIMED_STEPS = 35   # more turns, up to this many timed steps each
CLOSE = 1.10


class AutoPlan(dict):
    """{parameter name: sbp tuple}, with ``inputs`` (the sbp each batch input gets),
    ``strategy`` and the measured ``seconds`` and ``bytes_per_rank`` of every candidate.
    A dict: edit it, then ``apply``.

    >>> plan["h.0.mlp.fc1.weight"] = (gt.sbp.split(0),)          # doctest: +SKIP
    >>> plan.apply(model)
    """

    def __init__(self, layouts: dict, placement: Placement, inputs: tuple,
                 strategy: str = "custom", measured: dict | None = None):
        super().__init__(layouts)
        self.placement, self.inputs, self.strategy = placement, tuple(inputs), strategy
        self.measured = dict(measured or {})

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Lay ``model``'s parameters and buffers out as planned (``to_global``) and
        box its batch inputs to ``inputs`` as its forward begins. Returns ``model``."""
        missing = [n for n, _ in named_tensors(model) if n not in self]
        if missing:
            raise ValueError(f"the plan has no sbp for {missing[:5]}: add them "
                             f"(plan[name] = (gt.sbp.broadcast,)) before apply")
        to_global(model, self.placement, lambda name, t: self[name])
        handle = getattr(model, "_gt_input_hook", None)
        if handle is not None:
            handle.remove()
        inputs, placement = self.inputs, self.placement
        model._gt_input_hook = model.register_forward_pre_hook(
            lambda m, args: tuple(_relaid(a, s, placement) for a, s in zip(args, inputs))
            + tuple(args[len(inputs):]), prepend=True)
        return model

    def save(self, path: str) -> None:
        """Write the plan as JSON (``gt.nn.load_plan`` reads it)."""
        with open(path, "w") as f:
            json.dump({"placement": {"type": self.placement.type,
                                     "ranks": self.placement.ranks},
                       "strategy": self.strategy, "inputs": [_encode(s) for s in self.inputs],
                       "layouts": {k: _encode(v) for k, v in self.items()}}, f, indent=1)

    def __repr__(self) -> str:
        lines = [f"AutoPlan({self.strategy} on {self.placement}; inputs "
                 f"{', '.join(map(_show, self.inputs))})"]
        for name, seconds in self.measured.items():
            lines.append(f"  measured {name}: {seconds}")
        lines += [f"  {name}: {_show(s)}" for name, s in self.items()]
        return "\n".join(lines)


def load_plan(path: str) -> AutoPlan:
    """The plan ``plan.save(path)`` wrote."""
    with open(path) as f:
        data = json.load(f)
    placement = Placement(data["placement"]["type"], data["placement"]["ranks"])
    return AutoPlan({k: _decode(v) for k, v in data["layouts"].items()}, placement,
                    [_decode(s) for s in data["inputs"]], data["strategy"])


def auto_parallel(model: torch.nn.Module, placement: Placement, example_inputs: Sequence,
                  memory_budget: int | None = None, loss_fn: Callable | None = None,
                  simulate: Placement | None = None, device="cpu") -> AutoPlan:
    """Choose ``model``'s parameter layouts on ``placement`` (data parallel, Megatron
    tensor parallel, fully sharded, and on 2-D placements their hybrids; see the
    module docstring) by timing a few
    training steps of each on ``example_inputs`` (GlobalTensors or plain tensors, the
    batch first), among those whose parameters, gradients and two optimizer moments
    fit ``memory_budget`` bytes per rank; apply the fastest to ``model`` and return its
    plan. ``loss_fn(output)`` makes the scalar to backpropagate (default: the output if
    it is a scalar, else the mean of its squares). A budget no candidate meets raises
    ValueError with the smallest footprint, before any step runs. Call on every rank.

    ``simulate``: a placement of a world this process does not run (a cluster of 8 to
    1024 ranks): the candidates are made on it and each training step (forward,
    backward, AdamW; planned as whole-step planning replays it) is simulated by
    ``gt.debug.simulate_step`` on ``device`` ("cpu", "h100", "h200" or a profile)
    instead of timed; the fastest predicted among those whose simulated peak memory
    fits ``memory_budget`` is returned, not applied (``placement`` is then unused;
    ``plan.measured`` gives every candidate's predicted step and peak).

    >>> plan = gt.nn.auto_parallel(gpt, P, (ids, targets), memory_budget=2**30)  # doctest: +SKIP
    >>> plan = gt.nn.auto_parallel(gpt, P, (ids, targets),                       # doctest: +SKIP
    ...                            simulate=gt.placement("cuda", ranks=range(256)), device="h100")
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"auto_parallel needs a torch.nn.Module, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    if simulate is not None:
        return _simulated(model, simulate, example_inputs, memory_budget, loss_fn, device)
    check_placement(placement)
    plain = copy.deepcopy(model)
    candidates = _candidates(plain, placement, example_inputs)
    footprint = {name: _bytes_per_rank(plain, plan) for name, plan in candidates.items()}
    fits = [name for name in candidates if memory_budget is None
            or footprint[name] <= memory_budget]
    if not fits:
        smallest = min(footprint, key=footprint.get)
        raise ValueError(f"memory_budget {memory_budget} bytes per rank cannot be met: the "
                         f"smallest footprint is {footprint[smallest]} bytes ({smallest}: "
                         f"parameters, gradients and two optimizer moments per rank)")
    seconds = _timed_all({name: copy.deepcopy(plain) for name in fits},
                         candidates, example_inputs, loss_fn)
    fits = [name for name in fits if name in seconds]
    best = min(fits, key=seconds.get)
    plan = candidates[best]
    plan.measured = {name: f"{seconds[name] * 1e3:.2f} ms per step, {footprint[name]} "
                     f"bytes per rank" for name in fits}
    plan.apply(model)
    return plan


def _simulated(model, target: Placement, inputs: tuple, memory_budget, loss_fn,
               device) -> AutoPlan:
    """``auto_parallel(..., simulate=target)``: the fastest predicted candidate's plan."""
    if not isinstance(target, Placement):
        raise TypeError(f"auto_parallel: simulate must be a gt.placement, got "
                        f"{type(target).__name__}")
    plain = copy.deepcopy(model)
    candidates = _candidates(plain, target, inputs)
    best, reports = propose(plain, candidates, inputs, memory_budget, loss_fn, device)
    plan = candidates[best]
    plan.measured = {name: f"predicted {r.seconds * 1e3:.2f} ms per step, peak "
                     f"{r.peak_memory} bytes per rank on {r.device.name}"
                     for name, r in reports.items()}
    return plan


# --- candidates (auto_candidates.py) -------------------------------------------------------

def _candidates(model, placement: Placement, inputs: tuple) -> dict:
    """{strategy: AutoPlan} of ``candidate_layouts``."""
    return {name: AutoPlan(layouts, placement, batch, name) for name, (layouts, batch)
            in candidate_layouts(model, placement, inputs).items()}


def _bytes_per_rank(model, plan: AutoPlan) -> int:
    """Parameter, gradient and optimizer bytes on the rank holding the most."""
    total = 0
    for name, t in named_tensors(model):
        layout = Layout.make(t.shape, plan.placement, plan[name])
        copies = STATE_COPIES if isinstance(t, torch.nn.Parameter) else 1
        total += max_local_bytes(layout, t.element_size()) * copies
    return total


# --- measuring ----------------------------------------------------------------------------

def _relaid(x, sbp, placement: Placement):
    """A batch input in the planned layout (a plain tensor: the same on every rank)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, GlobalTensor):
        x = from_local(x, placement, (broadcast,) * placement.ndim, shape=tuple(x.shape))
    if isinstance(x, GlobalTensor) and x.sbp != tuple(sbp):
        return x.to_global(sbp=sbp)
    return x


def _timed_all(models: dict, plans: dict, inputs: tuple, loss_fn) -> dict:
    """Per candidate, the slowest rank's median step time. Candidates take turns step
    by step, so that a load on the machine falls on all of them alike, in reversed
    order every other round; the ranks meet before each step, so that no step is
    charged with a peer still finishing the candidate before it (a fixed order
    charged the one after the slowest: data parallel after fully sharded). Candidates
    within ``CLOSE`` of the fastest take more turns (up to ``MAX_TIMED_STEPS``): steps of
    a few ms vary by 2x on a busy machine, and 7 of them could not tell 20 % apart."""
    for name, model in models.items():
        plans[name].apply(model)
    placement = plans[next(iter(models))].placement
    names = _warmed(models, inputs, loss_fn, placement)
    times: dict = {name: [] for name in names}
    _take_turns(models, names, TIMED_STEPS, times, inputs, loss_fn, placement)
    agreed = _slowest_medians(times, placement)
    while True:
        best = min(agreed.values())
        close = [n for n in names if agreed[n] <= CLOSE * best]
        if len(close) < 2 or len(times[close[0]]) >= MAX_TIMED_STEPS:
            return agreed     # every rank decides alike: ``agreed`` is the same on all
        _take_turns(models, close, TIMED_STEPS, times, inputs, loss_fn, placement)
        agreed = _slowest_medians(times, placement)


def _warmed(models: dict, inputs, loss_fn, placement: Placement) -> list:
    """The candidates whose warm-up steps (recorded and planned) ran on every rank; a
    candidate that raised on every rank (a layout some op of the model cannot take) is
    skipped with a warning naming it and the error. Errors of sbp rules come before
    any communication and alike on every rank, which then agree in one all-reduce per
    candidate; a candidate that failed on some ranks only raises on every rank."""
    names, failed = [], {}
    for name in models:
        error = None
        try:
            _take_turns(models, [name], WARM_STEPS, None, inputs, loss_fn, placement)
        except Exception as e:  # noqa: BLE001 - reported below, on every rank alike
            error = e
        ranks_failed = _count_on_placement(error is not None, placement)
        if ranks_failed == 0:
            names.append(name)
        elif ranks_failed == placement.size:
            failed[name] = error
            warnings.warn(f"globaltensor.nn.auto_parallel: skipping candidate {name!r}: "
                          f"{type(error).__name__}: {error}", stacklevel=3)
        else:
            raise RuntimeError(
                f"auto_parallel: candidate {name!r} failed on {ranks_failed} of "
                f"{placement.size} ranks"
                + (f" (here: {type(error).__name__}: {error})" if error else "")) from error
    if not names:
        raise RuntimeError("auto_parallel: every candidate failed: " + "; ".join(
            f"{name}: {type(e).__name__}: {e}" for name, e in failed.items()))
    return names


def _count_on_placement(flag: bool, placement: Placement) -> int:
    """How many ranks of ``placement`` passed ``flag`` True (the same on every rank)."""
    mine = torch.tensor([float(flag)], dtype=torch.float64)
    total = from_local(mine, placement, (partial_sum,) * placement.ndim, shape=(1,))
    return int(total.to_global(sbp=(broadcast,) * placement.ndim).to_local()[0])


def _take_turns(models: dict, names: list, rounds: int, times, inputs, loss_fn,
                placement: Placement) -> None:
    """``rounds`` training steps of each of ``names``, in turns; with ``times``, each
    step's seconds appended to its candidate's list."""
    for k in range(rounds):
        for name in (names if k % 2 == 0 else names[::-1]):
            model = models[name]
            comm.barrier(placement.flat_ranks)
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            out = model(*inputs)
            loss = loss_fn(out) if loss_fn is not None else \
                (out if out.dim() == 0 else out.float().square().mean())
            loss.backward()
            if times is not None:
                times[name].append(time.perf_counter() - started)


def _slowest_medians(times: dict, placement: Placement) -> dict:
    """{candidate: the largest over the ranks of its median step}, the same on every rank."""
    names = list(times)
    mine = torch.tensor([statistics.median(times[n]) for n in names], dtype=torch.float64)
    slowest = from_local(mine, placement, (partial_max,) * placement.ndim,
                         shape=(len(names),))
    agreed = slowest.to_global(sbp=(broadcast,) * placement.ndim).to_local()
    return {n: float(t) for n, t in zip(names, agreed)}


def _encode(sbp) -> list:
    return [sbp_text(s) for s in sbp]


def _decode(items: list) -> tuple:
    try:   # (plans saved before wrote split(0,2), partial_sum: read as well)
        return tuple(sbp_from_text(item) for item in items)
    except ValueError as e:
        raise ValueError(f"not an sbp in a saved plan: {items!r} ({e})") from None


def _show(sbp) -> str:
    return ", ".join(map(repr, sbp))
