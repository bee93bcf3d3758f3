"""Whole values of a global module for tools that read plain tensors (``torch.save``,
safetensors, ``save_pretrained``), and the error such tools get from a GlobalTensor.

A GlobalTensor has no storage of its own (its values are parts on several ranks), so a
tool that reads raw memory through ``untyped_storage()`` / ``data_ptr()`` would read an
invalid one; it gets the error of ``raw_memory`` instead, which points to
``full_state_dict``.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, Sequence, Union

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from .. import comm
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import GlobalTensor, from_full, install_methods

__all__ = ["full_state_dict", "gathering_global_tensors", "placing_global_tensors", "raw_memory",
           "whole_values"]


def full_state_dict(module: torch.nn.Module,
                    ranks: Union[int, Iterable[int]] = (0,)) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as plain tensors holding the whole values, on ``ranks``
    only (every other rank gets ``{}``). Every rank calls it. Each global tensor is
    gathered once, to those ranks only (not to the whole world); tied tensors are one
    tensor under each name, as in ``state_dict``; dtypes are kept; buffers are included
    and non-persistent ones left out, as ``state_dict`` does. For ``torch.save``,
    safetensors and ``save_pretrained`` (which cannot read GlobalTensors); DCP
    (``torch.distributed.checkpoint``) saves the parts themselves, without gathering.

    >>> state = gt.nn.full_state_dict(model)                       # doctest: +SKIP
    >>> if gt.get_rank() == 0:                                     # doctest: +SKIP
    ...     safetensors.torch.save_file(state, "model.safetensors")
    ...     hf_model.save_pretrained("out", state_dict=state)
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"full_state_dict needs a torch.nn.Module, got {type(module).__name__}")
    ranks = [ranks] if isinstance(ranks, int) else list(ranks)
    state = whole_values(module.state_dict(keep_vars=True), ranks)
    return state if comm.get_rank() in ranks else {}


def whole_values(state: Any, ranks: Sequence[int] = ()) -> Any:
    """``state`` (nested dicts, lists and tuples) with every GlobalTensor replaced by a
    plain tensor of its whole value on ``ranks`` (all ranks when empty) and an empty
    tensor on the others; each GlobalTensor gathered once (tied ones stay one tensor),
    in the state's order, so every rank calls it with the same state."""
    comm.init()
    ranks = list(ranks) or list(range(comm.get_world_size()))
    kinds = {t.placement.type for t in tree_leaves(state) if isinstance(t, GlobalTensor)}
    # bad ranks raise here, on every rank, before any communication
    targets = {kind: Placement(kind, ranks) for kind in kinds or {"cpu"}}
    whole: dict = {}            # id(tensor) -> its whole value here

    def one(t: GlobalTensor) -> torch.Tensor:
        if id(t) not in whole:
            gathered = t.detach().to_global(targets[t.placement.type], (broadcast,))
            whole[id(t)] = gathered.local_part.contiguous()
        return whole[id(t)]
    return tree_map_only(GlobalTensor, one, state)


def gathering_global_tensors(gather_state_dict: Callable) -> Callable:
    """torch's ``_gather_state_dict`` (what ``get_model_state_dict``,
    ``get_optimizer_state_dict`` and ``get_state_dict`` call with
    ``StateDictOptions(full_state_dict=True)``), made to give GlobalTensors' whole values
    as plain tensors, as it does DTensors' (only on rank 0 with ``cpu_offload=True``);
    a state without GlobalTensors goes to torch's own unchanged."""
    @functools.wraps(gather_state_dict)
    def gather(state_dict, *args, ranks_only=(), **kwargs):
        if any(isinstance(t, GlobalTensor) for t in tree_leaves(state_dict)):
            state_dict = whole_values(state_dict, ranks_only)
        return gather_state_dict(state_dict, *args, ranks_only=ranks_only, **kwargs)
    gather.__wrapped_by_globaltensor__ = gather_state_dict
    return gather


def placing_global_tensors(distribute: Callable) -> Callable:
    """torch's ``_distribute_state_dict`` / ``_broadcast_state_dict`` (what
    ``set_state_dict`` and its kin call with ``full_state_dict=True``: they put the whole
    values, given on every rank or on rank 0, in place of the state the model and
    optimizer hold), made to keep a GlobalTensor's layout as they keep a DTensor's: its
    whole value becomes a GlobalTensor of that layout, each rank keeping its part. Without
    it an optimizer took plain whole tensors for its moments."""
    @functools.wraps(distribute)
    def place(full_state_dict, local_state_dict, *args, **kwargs):
        held = {k: v for k, v in local_state_dict.items() if isinstance(v, GlobalTensor)}
        distribute(full_state_dict, local_state_dict, *args, **kwargs)
        for key, before in held.items():
            value = local_state_dict.get(key)
            if (torch.is_tensor(value) and not isinstance(value, GlobalTensor)
                    and value.shape == before.shape):
                local_state_dict[key] = from_full(value, before.global_layout)
    place.__wrapped_by_globaltensor__ = distribute
    return place


def raw_memory(method: str, torch_method):
    """What ``GlobalTensor.<method>()`` (``untyped_storage``, ``storage``, ``data_ptr``)
    returns to its caller: torch's own answer (an invalid storage, a null pointer) when
    torch calls it (deepcopy and torch.compile handle wrapper subclasses by it), else a
    TypeError naming the calling function and pointing to ``full_state_dict``."""
    caller = sys._getframe(2)
    module = caller.f_globals.get("__name__", "?")
    if module == "torch" or module.startswith("torch."):
        return torch_method()
    raise TypeError(
        f"{module}.{caller.f_code.co_qualname}() called GlobalTensor.{method}(): a "
        f"GlobalTensor has no storage of its own (its values are parts held by several "
        f"ranks), so code that reads raw tensor memory (safetensors' save_file, "
        f"save_pretrained, ...) cannot take it. Give it plain tensors with the whole "
        f"values: state = gt.nn.full_state_dict(model) on every rank (whole values on "
        f"rank 0, {{}} elsewhere), then save `state` on rank 0 (e.g. "
        f"save_pretrained(..., state_dict=state)); or save the parts with "
        f"torch.distributed.checkpoint")


# No storage of its own: code outside torch reading raw memory (safetensors,
# save_pretrained) gets an error pointing to gt.nn.full_state_dict instead of an invalid
# storage; torch itself (deepcopy, torch.compile) handles wrapper subclasses by them.
def _untyped_storage(self):
    return raw_memory("untyped_storage", lambda: torch.Tensor.untyped_storage(self))


def _storage(self):
    return raw_memory("storage", lambda: torch.Tensor.storage(self))


def _data_ptr(self):
    return raw_memory("data_ptr", lambda: torch.Tensor.data_ptr(self))


_torch_data = torch._C.TensorBase.data   # torch's descriptor of ``x.data``


def _set_data(self, value) -> None:
    """``x.data = value`` (``vector_to_parameters``, ``p.data = p.data * 2`` in older
    code): torch's setter alone changes only the wrapper's shape and dtype, so the value
    was silently ignored. A value of ``x``'s shape takes ``x``'s layout (a parameter
    keeps its sbp; a plain value is the whole value, each rank keeps its part, as in
    ``copy_``); another shape keeps its own, partial sums reduced."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"x.data = value: the value must be a tensor, not {type(value).__name__}")
    value = value.detach()
    if value.shape == self.shape:
        value = value.to_global(self.placement, self.sbp) if isinstance(value, GlobalTensor) \
            else from_full(value, self._layout)
    elif not isinstance(value, GlobalTensor):
        raise TypeError(f"x.data = value: a plain value of shape {tuple(value.shape)} for a "
                        f"GlobalTensor of shape {tuple(self.shape)}: give a GlobalTensor "
                        f"(a plain value of another shape has no layout)")
    elif value._layout.partial_axes:
        value = value.to_global(sbp=value._layout.without_partials().sbp)
    _torch_data.__set__(self, value)
    for name in GlobalTensor.__slots__:
        if hasattr(value, name):
            setattr(self, name, getattr(value, name))
        elif hasattr(self, name):
            delattr(self, name)


install_methods(untyped_storage=_untyped_storage, storage=_storage, data_ptr=_data_ptr,
                data=property(lambda self: _torch_data.__get__(self, type(self)), _set_data))
