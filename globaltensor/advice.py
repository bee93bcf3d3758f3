"""Advice where torch's own distributed tools meet GlobalTensors.

torch's tools take a GlobalTensor for a plain tensor and answer with advice that does
not apply (DTensor: "convert all torch.Tensor to DTensor"; FSDP2 and tensor
parallelism try to shard it as a plain tensor, and fail later or deeper). Each case
here raises first, saying what to use instead:

* an op mixing a GlobalTensor and a DTensor (either one's dispatcher): convert one of
  them (``gt.from_dtensor(d)`` / ``x.to_dtensor()``);
* ``torch.distributed.fsdp.fully_shard`` on a module with GlobalTensor parameters:
  ``gt.nn.fully_shard`` (ZeRO-3 as an sbp);
* ``torch.distributed.tensor.parallel.parallelize_module`` on one: annotate the
  parameters with ``gt.nn.to_global(module, placement, sbp_fn)``.

The wrappers are made here; ``interop/torch_patches.py`` installs them in place of
torch's functions, on every module that exposes them, when the program imports those
modules.
"""
from __future__ import annotations

import functools
import sys

import torch

from .tensor import GlobalTensor

_DTENSOR_ADVICE = ("GlobalTensors and DTensors do not mix in one op: convert the DTensor "
                   "with gt.from_dtensor(d), or the GlobalTensor with x.to_dtensor()")


def is_dtensor(x) -> bool:
    """True for a DTensor (without importing DTensor: none exists until it is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def dtensor_operand_error(func) -> ValueError:
    """The error for ``func`` given both a GlobalTensor and a DTensor."""
    return ValueError(f"{func}: mixes a GlobalTensor with a DTensor. {_DTENSOR_ADVICE}")


def _first_global_parameter(module) -> tuple[str, GlobalTensor] | None:
    modules = module if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        if isinstance(m, torch.nn.Module):
            for name, p in m.named_parameters():
                if isinstance(p, GlobalTensor):
                    return name, p
    return None


def refusing_global_modules(original, label: str, advice: str):
    """``original(module, ...)``, raising TypeError with ``advice`` first when ``module``
    has GlobalTensor parameters (``label``: the function's public name)."""
    @functools.wraps(original)
    def wrapper(module, *args, **kwargs):
        found = _first_global_parameter(module)
        if found is not None:
            name, p = found
            raise TypeError(f"{label}: parameter {name!r} is a GlobalTensor (placement "
                            f"{p.placement}, sbp {p.sbp}), and {label.rsplit('.', 1)[1]} "
                            f"lays out plain tensors as DTensors. {advice}")
        return original(module, *args, **kwargs)
    wrapper.__wrapped_by_globaltensor__ = original
    return wrapper


_FULLY_SHARD_ADVICE = (
    "Use gt.nn.fully_shard(module, placement) instead: ZeRO-3 / FSDP as an sbp (every "
    "parameter stored split(0) on the placement, gathered for use, its gradient "
    "reduce-scattered back), with param_dtype=, reduce_dtype= and reshard_after_forward= "
    "as FSDP2's.")
_PARALLELIZE_ADVICE = (
    "Annotate the parameters instead, with gt.nn.to_global(module, placement, sbp_fn): "
    "ColwiseParallel is split(0) of a Linear's weight (and bias), RowwiseParallel split(1) "
    "of its weight (bias broadcast), e.g. sbp_fn = lambda name, t: {\"fc1.weight\": "
    "gt.sbp.split(0), \"fc1.bias\": gt.sbp.split(0), \"fc2.weight\": gt.sbp.split(1)}"
    ".get(name, gt.sbp.broadcast); the ops then box activations as needed.")

# Where torch's tools get ``refusing_global_modules``: the module the program imports ->
# [(module holding the name, name, advice)]. Not the defining modules: FSDP2's own code
# calls fully_shard.state() through its global.
REFUSING_GLOBAL_MODULES = {
    "torch.distributed.fsdp": [
        ("torch.distributed.fsdp", "fully_shard", _FULLY_SHARD_ADVICE),
        ("torch.distributed.fsdp._fully_shard", "fully_shard", _FULLY_SHARD_ADVICE)],
    "torch.distributed._composable.fsdp": [
        ("torch.distributed._composable.fsdp", "fully_shard", _FULLY_SHARD_ADVICE),
        ("torch.distributed._composable.fsdp.fully_shard", "fully_shard", _FULLY_SHARD_ADVICE)],
    "torch.distributed.tensor.parallel": [
        ("torch.distributed.tensor.parallel", "parallelize_module", _PARALLELIZE_ADVICE),
        ("torch.distributed.tensor.parallel.api", "parallelize_module", _PARALLELIZE_ADVICE)],
}


def refusing_global_operands(replicate_spec):
    """DTensor's ``OpDispatcher._try_replicate_spec_for_scalar_tensor`` (which takes a
    GlobalTensor operand for a plain tensor, replicating it when it has one element),
    raising the conversion advice instead."""
    @functools.wraps(replicate_spec)
    def wrapper(self, op_call, tensor_arg, *args, **kwargs):
        if isinstance(tensor_arg, GlobalTensor):
            raise dtensor_operand_error(op_call)
        return replicate_spec(self, op_call, tensor_arg, *args, **kwargs)
    wrapper.__wrapped_by_globaltensor__ = replicate_spec
    return wrapper
