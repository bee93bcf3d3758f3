"""Modules built without memory: ``meta_init()`` (parameters on the meta device, buffers
real) and the check that converting a meta module leaves no buffer silently at zero.

A buffer is usually computed in ``__init__`` (a causal mask, rotary frequencies) and no
``reset_parameters()`` recomputes it, so a module built under ``torch.device("meta")``
would get zeros for it. Under ``meta_init()`` buffers keep their values and only
parameters go to the meta device (as accelerate's ``init_empty_weights(include_buffers=
False)``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["meta_init", "check_meta_buffers", "drop_initialised_marks"]


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules with every parameter on the meta device (no memory) and every buffer
    real, computed by the module's own ``__init__``. Convert with ``gt.nn.to_global`` /
    ``gt.nn.fully_shard`` (each rank allocates its parts; buffers come from the first
    rank), then fill the parameters with ``reset_parameters()`` or ``torch.nn.init``.
    A parameter is first made as the module makes it and then moved to meta: the memory
    of ``torch.empty`` is never touched (an initialiser that runs in ``__init__`` after
    registering works on meta).

    >>> with gt.nn.meta_init():                            # doctest: +SKIP
    ...     model = GPT(config)                            # causal-mask buffer real
    >>> gt.nn.fully_shard(model, gt.placement.all("cpu"))  # doctest: +SKIP
    >>> gt.manual_seed(0)                                  # doctest: +SKIP
    >>> for m in model.modules():                          # doctest: +SKIP
    ...     if hasattr(m, "reset_parameters"):
    ...         m.reset_parameters()
    """
    original = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta" \
                and not isinstance(param, torch.nn.parameter.UninitializedParameter):
            param = _on_meta(param)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _on_meta(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """``param`` on the meta device, with its class and its attributes."""
    data = param.detach().to("meta")
    if type(param) is torch.nn.Parameter:
        meta = torch.nn.Parameter(data, param.requires_grad)
        meta.__dict__.update(vars(param))
        return meta
    # subclasses (quantised weights, ...) take their attributes as keyword arguments
    return type(param)(data, **{**vars(param), "requires_grad": param.requires_grad})


def _refilled_buffers(module: torch.nn.Module) -> set:
    """ids of the buffers that the module's own reset methods fill again: the running
    statistics of torch's norm layers (``reset_running_stats``, which their
    ``reset_parameters`` calls)."""
    refilled = set()
    for sub in module.modules():
        if callable(getattr(sub, "reset_running_stats", None)):
            refilled.update(id(b) for b in sub._buffers.values() if b is not None)
    return refilled


def check_meta_buffers(module: torch.nn.Module, slots: list) -> None:
    """Raise ValueError naming every meta-device buffer of ``module`` that nothing will
    fill after conversion (it would stay zero). ``slots`` are ``tensor_slots(module)``.
    No communication: every rank raises alike."""
    refilled = _refilled_buffers(module)
    empty = [qualified for qualified, _, kind, _, t in slots
             if kind == "_buffers" and t.device.type == "meta" and id(t) not in refilled]
    if empty:
        raise ValueError(
            f"buffers built on the meta device have no values, and no reset_parameters() "
            f"computes them again: {', '.join(empty)} (they would stay zero). Build the "
            f"module under gt.nn.meta_init() instead of torch.device('meta'): parameters "
            f"go to meta, buffers keep the values __init__ computes")


def drop_initialised_marks(slots: list) -> None:
    """A module whose parameters were on the meta device holds no values yet, whatever it
    says. transformers marks a module initialised (``_is_hf_initialized``) once its
    ``post_init()`` ran the initialisers, also on meta parameters under ``meta_init()``
    (its own check for meta looks at torch's default device, which ``meta_init`` leaves
    alone), and its ``init_weights()`` then skipped the module: the allocated parts kept
    zeros. The marks are dropped so that ``init_weights()`` fills them. ``slots`` are
    ``tensor_slots(module)``, taken before the conversion."""
    for _, sub, kind, _, t in slots:
        if kind == "_parameters" and t.device.type == "meta" \
                and getattr(sub, "_is_hf_initialized", False):
            sub._is_hf_initialized = False
