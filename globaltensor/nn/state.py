"""Whole values of a global module for tools that read plain tensors (``torch.save``,
safetensors, ``save_pretrained``), and the error such tools get from a GlobalTensor.

A GlobalTensor has no storage of its own (its values are parts on several ranks), so a
tool that reads raw memory through ``untyped_storage()`` / ``data_ptr()`` would read an
invalid one; it gets the error of ``raw_memory`` instead, which points to
``full_state_dict``.
"""
from __future__ import annotations

import sys
from typing import Iterable, Union

import torch

from .. import comm
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import GlobalTensor, install_methods

__all__ = ["full_state_dict", "raw_memory"]


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
    comm.init()
    ranks = [ranks] if isinstance(ranks, int) else list(ranks)
    state = module.state_dict(keep_vars=True)
    types = {t.placement.type for t in state.values() if isinstance(t, GlobalTensor)}
    # bad ranks raise here, on every rank, before any communication
    targets = {kind: Placement(kind, ranks) for kind in types or {"cpu"}}
    mine = comm.get_rank() in ranks
    whole: dict = {}            # id(tensor) -> its whole value here (tied tensors once)
    out = {}
    for name, t in state.items():
        if id(t) not in whole:
            whole[id(t)] = _whole(t.detach(), targets)
        if mine:
            out[name] = whole[id(t)]
    return out


def _whole(t: torch.Tensor, targets: dict) -> torch.Tensor:
    """``t``'s whole value as a plain tensor on the target ranks (empty elsewhere)."""
    if not isinstance(t, GlobalTensor):
        return t
    gathered = t.to_global(targets[t.placement.type], (broadcast,))
    return gathered.local_part.contiguous()


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


install_methods(untyped_storage=_untyped_storage, storage=_storage, data_ptr=_data_ptr)
