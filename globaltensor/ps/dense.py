"""The worker side of dense parameters: ``DenseOptimizer``.

``DenseOptimizer(dense_params)`` steps the ordinary (dense) parameters: sync mode
all-reduces their gradients among the workers (data parallelism over a group of the
workers only) and steps them locally; async keeps them on the servers as a flat table
(pushed and pulled every step, nobody waits for a slow worker); geo trains them
locally and averages them through the servers every ``k_steps`` steps. Its ``step()``
also marks the end of a training step for geo mode (the tables' exchange), so call it
once per step.

Example (in a worker, after ``gt.ps.init``)::

    opt = gt.ps.DenseOptimizer(mlp.parameters(), optimizer="sgd", lr=0.1)
    opt.zero_grad(); loss.backward(); opt.step()

It is a ``torch.optim.Optimizer``: its ``param_groups``, ``state``, ``state_dict`` and
``load_state_dict`` are those of the torch optimizer the worker steps its parameters
with (``opt.local``), so torch's ``get_state_dict(model, opt)`` / ``set_state_dict``,
LR schedulers and ``gt.checkpoint.Autosave`` take it as they take that optimizer. The
state torch's ``get_state_dict`` creates before the first step (a step with zero
gradients and learning rate 0) is made on the local optimizer only: no communication,
not counted as a training step. In async mode the servers' copy of the dense
parameters and its optimizer state are not part of that state dict.

``gt.ps.Optimizer`` is its former name, kept for one release (a DeprecationWarning).
"""
from __future__ import annotations

import collections
import sys
from typing import Any, Iterable, Optional

import torch

from .. import comm
from .runtime import state, wait_pending
from .table import Rows, need_worker

__all__ = ["DenseOptimizer"]

# async / geo: values per row of the servers' table of a worker's dense parameters
DENSE_ROW = 256
# torch's optimizers the workers step dense parameters with (the servers' flat table
# uses the row optimizer of the same name: on whole rows it is the same formula)
_LOCAL = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


class DenseOptimizer(torch.optim.Optimizer):
    """Steps the dense parameters of a worker's model, per the strategy's mode.

    ``optimizer`` ("sgd", "adagrad" or "adam") and ``lr`` as torch's ``SGD`` / ``Adagrad`` /
    ``Adam`` (adam's flat table in async / geo mode has lazy Adam's per-row steps). All
    workers must create it with the same parameter values (seed the model alike).

    A ``torch.optim.Optimizer`` whose ``param_groups``, ``state``, ``defaults``,
    ``state_dict()`` and ``load_state_dict()`` are the local torch optimizer's
    (``self.local``): ``get_state_dict(model, opt)`` / ``set_state_dict`` work on it.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: str = "sgd", lr: float = 0.01):
        need_worker("gt.ps.DenseOptimizer")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("gt.ps.DenseOptimizer got no parameters that require grad")
        if optimizer not in _LOCAL:
            raise ValueError(f"DenseOptimizer's optimizer must be one of {tuple(_LOCAL)}, got {optimizer!r}")
        self.mode = state.strategy.mode
        self.k_steps = state.strategy.k_steps
        self.workers = tuple(range(state.workers))  # global ranks of the workers
        self.local = _LOCAL[optimizer](self.params, lr=lr)  # sync and geo step locally
        # torch.optim.Optimizer's hook registries (its __init__ is not run: the groups
        # and state are the local optimizer's, below)
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                      "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                      "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, collections.OrderedDict())
        self.numel = sum(p.numel() for p in self.params)
        self.steps = 0
        self.flat: Optional[Rows] = None
        if self.mode != "sync":
            # async / geo: the parameters, flattened and cut into rows of DENSE_ROW
            # values (zero-padded), as a table on the servers starting from these values.
            # Whole rows of a few hundred values keep the servers' index ops few.
            rows = -(-self.numel // DENSE_ROW)
            initial = self._as_rows(self._flat_values())
            self.flat = Rows(rows, DENSE_ROW, optimizer, lr, 0.0, 0, f"dense{len(state.optimizers)}",
                             initial=initial)
            self.all_ids = torch.arange(rows)
            self.base = initial.clone()
        state.optimizers.append(self)

    def _flat_values(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in self.params])

    def _as_rows(self, flat: torch.Tensor) -> torch.Tensor:
        rows = -(-self.numel // DENSE_ROW)
        return torch.nn.functional.pad(flat, (0, rows * DENSE_ROW - self.numel)).view(rows, DENSE_ROW)

    # --- torch.optim.Optimizer's interface: the local optimizer's -----------------------

    @property
    def param_groups(self) -> list:  # type: ignore[override]
        return self.local.param_groups

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        self.local.param_groups = groups

    @property
    def state(self):  # type: ignore[override]
        return self.local.state

    @state.setter
    def state(self, state) -> None:
        self.local.state = state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.local.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.local.defaults = defaults

    def state_dict(self) -> dict:  # type: ignore[override]
        """The local optimizer's ``state_dict()`` (torch's format: state by parameter
        index, param_groups)."""
        return self.local.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """The local optimizer's ``load_state_dict`` (what ``state_dict`` returned)."""
        self.local.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("gt.ps.DenseOptimizer steps the parameters it was created "
                                  "with; create another one for more")

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"gt.ps.DenseOptimizer({self.mode}, {self.local!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in self.params])

    def _assign(self, flat: torch.Tensor) -> None:
        flat = flat.reshape(-1)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One training step's update (call once per step, after ``backward``)."""
        if closure is not None:
            raise ValueError("gt.ps.DenseOptimizer.step takes no closure (one step is one "
                             "exchange with the other workers or the servers)")
        if _initialising_state():
            # torch's get_state_dict / set_state_dict creating the state to fill in (zero
            # gradients, learning rate 0): the local optimizer's alone, as for a plain one
            self.local.step()
            return
        need_worker("gt.ps.DenseOptimizer.step")
        self.steps += 1
        if self.mode == "sync":
            # The tables' pushes of this step first: a worker that finished early fails
            # them at once (the all-reduce would wait for it until the timeout).
            wait_pending()
            # Data parallelism among the workers: the mean gradient, then a local step.
            grad = self._flat_grad()
            if len(self.workers) > 1:
                comm.all_reduce_(grad, "sum", self.workers)
                grad /= len(self.workers)
            offset = 0
            for p in self.params:
                p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            self.local.step()
        elif self.mode == "async":
            assert self.flat is not None
            self.flat.push(self.all_ids, self._as_rows(self._flat_grad()), "grad")
            self._assign(self.flat.pull(self.all_ids))
        else:
            self.local.step()
            if self.steps % self.k_steps == 0:
                if state.optimizers[0] is self:  # the tables' exchange, once per step
                    for table in state.tables:
                        table.flush()
                self.flush()

    def flush(self) -> None:
        """geo: push the dense parameters' change since the last pull, pull fresh ones."""
        if self.mode != "geo":
            return
        assert self.flat is not None
        current = self._as_rows(self._flat_values())
        self.flat.push(self.all_ids, (current - self.base) / state.workers, "delta")
        wait_pending()
        self.base = self.flat.pull(self.all_ids)
        self._assign(self.base)


def _initialising_state() -> bool:
    """Whether ``DenseOptimizer.step`` runs inside torch's ``_init_optim_state``
    (torch.distributed.checkpoint.state_dict: it steps an optimizer without state once,
    with zero gradients and learning rate 0, so that its state dict has tensors to load
    into; an LR scheduler's wrapper of ``step`` may stand between). That function calls
    no training code, so any other step is a training step."""
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    code = getattr(getattr(module, "_init_optim_state", None), "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(2)  # step's caller
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
