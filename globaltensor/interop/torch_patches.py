"""Every change globaltensor makes to torch, in one place, made once when globaltensor is
imported (``apply``). Each says why; docs/torch_changes.md lists them, and
tests/interop/test_import_changes.py checks that importing globaltensor changes exactly
those. Each installed function does what torch's own does unless a GlobalTensor is
involved. The functions installed live with what they do (``rules/``, ``advice.py``,
``random.py``, ``interop/dcp.py``); this module only puts them in torch's place:

* ``torch.nn.functional``: ``one_hot``, ``embedding_bag``,
  ``scaled_dot_product_attention``, ``dropout`` and ``dropout1d/2d/3d`` on
  GlobalTensors (``override_function``);
* ``torch.einsum`` of GlobalTensors, as one op (``rules/einsum.py``);
* ``torch.nn.utils``: ``clip_grad_norm_``'s total norm and clipping over gradients on
  several placements;
* the ``_foreach_*`` paths of ``torch.optim`` and ``torch.nn.utils`` accept GlobalTensors;
* gloo groups bind to the launcher's ``--local_addr`` under the launcher
  (``GLOBALTENSOR_LOCAL_ADDR`` set; ``torch.distributed.distributed_c10d.ProcessGroupGloo``,
  comm/groups.py); without it, nothing;
* ``torch.save`` refuses a GlobalTensor before it opens its file;
* ``torch.get_rng_state`` / ``set_rng_state`` carry globaltensor's draw number;
* FSDP2's ``fully_shard``, ``parallelize_module`` and DTensor's dispatcher refuse
  GlobalTensors with advice, wrapped when the program imports them (an import hook);
  ``GLOBALTENSOR_TORCH_ADVICE=0`` leaves them, and ``sys.meta_path``, alone.

One change is made later, at the first ``dcp.load`` planning into a GlobalTensor:
``FileSystemReader.read_data`` reads only the overlap for GlobalTensor targets
(``interop/dcp_reads.py``). Not made at all: DCP checksums are DCP storage classes the
program passes itself (``gt.checkpoint.ChecksummedWriter`` / ``VerifyingReader``,
``interop/checksums.py``).

>>> import globaltensor                                  # applies them  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

import torch
import torch.nn.functional as F

from .. import advice, comm, env
from ..nn.state import gathering_global_tensors, placing_global_tensors
from ..random import carrying_draws
from ..rules import einsum as einsum_rules
from ..rules import functional as functional_rules
from ..rules import optim as optim_rules
from ..rules import random as random_rules
from ..tensor import GlobalTensor
from .dcp import refuse_global_tensors

__all__ = ["apply", "override_function"]

_applied = False


def apply() -> None:
    """Make every change to torch (once; later calls do nothing)."""
    global _applied
    if _applied:
        return
    _applied = True
    _override_functionals()
    _override_clip_grad()
    _accept_in_foreach_paths()
    _guard_torch_save()
    _carry_draws_in_rng_state()
    env.read_at_import(_advise_when_torch_tools_are_imported)
    env.read_at_import(_bind_gloo_to_local_addr)


def override_function(namespace, name: str, fn) -> None:
    """Make ``namespace.name`` (e.g. ``torch.nn.functional.one_hot``) run ``fn`` when a
    GlobalTensor is among its arguments or in a list or tuple argument (``fn`` may decline
    with NotImplemented), else the original. Code that took the function before
    globaltensor was imported keeps the original.

    >>> override_function(torch.nn.functional, "one_hot", global_one_hot)  # doctest: +SKIP
    """
    original = getattr(namespace, name)
    original = getattr(original, "__wrapped_by_globaltensor__", original)

    def holds_global(a) -> bool:
        return isinstance(a, GlobalTensor) or (
            isinstance(a, (list, tuple)) and any(isinstance(t, GlobalTensor) for t in a))

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if any(holds_global(a) for a in args) or any(holds_global(a) for a in kwargs.values()):
            out = fn(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return original(*args, **kwargs)
    wrapper.__wrapped_by_globaltensor__ = original
    setattr(namespace, name, wrapper)


def _override_functionals() -> None:
    # These build plain helper tensors (one_hot's arange, embedding_bag's offsets) or draw
    # random numbers inside their kernels (dropout; attention with dropout takes torch's
    # math path): their composites never reach __torch_dispatch__ whole, so they are
    # taken before they decompose (rules/functional.py, rules/random.py).
    override_function(F, "one_hot", functional_rules.one_hot)
    override_function(F, "embedding_bag", functional_rules.embedding_bag)
    override_function(F, "scaled_dot_product_attention",
                      functional_rules.scaled_dot_product_attention)
    override_function(F, "dropout", random_rules.dropout)
    for name in random_rules.FEATURE_DROPOUT_DIMS:
        override_function(F, name, random_rules.feature_dropout(name))
    # torch.einsum decomposes into a dozen views and a bmm per call (forward; more in
    # backward), each dispatched on its own: it runs as one op (rules/einsum.py).
    override_function(torch, "einsum", einsum_rules.einsum)
    # torch.stft frames its signal with as_strided, which only a whole copy allows: a
    # batch of signals is transformed rank by rank (rules/functional.py).
    override_function(torch, "stft", functional_rules.stft)


def _override_clip_grad() -> None:
    # Gradients on several placements (pipeline stages) need one norm over all of them and
    # clipping per placement (rules/optim.py). clip_grad_norm_ calls these two through
    # its module's globals; torch.nn.utils exports them under public names too.
    clip_grad = torch.nn.utils.clip_grad
    override_function(clip_grad, "_get_total_norm", optim_rules.total_norm)
    override_function(clip_grad, "_clip_grads_with_norm_", optim_rules.clip_grads_with_norm)
    torch.nn.utils.get_total_norm = clip_grad._get_total_norm
    torch.nn.utils.clip_grads_with_norm_ = clip_grad._clip_grads_with_norm_


def _accept_in_foreach_paths() -> None:
    # torch.optim and torch.utils take their one-call-per-list (_foreach_*) paths only for
    # the tensor types listed here (by default where kernels exist: CUDA, not CPU);
    # dispatch runs those calls on the local parts at once.
    from torch.optim import optimizer
    from torch.utils import _foreach_utils
    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if GlobalTensor not in types:
            types.append(GlobalTensor)


def _guard_torch_save() -> None:
    # torch.save opens (and truncates) its file before it pickles: a GlobalTensor's
    # pickling error would destroy a good file. It is refused first (interop/dcp.py).
    save = torch.save

    @functools.wraps(save)
    def guarded_save(obj, f, *args, **kwargs):
        refuse_global_tensors(obj)
        return save(obj, f, *args, **kwargs)

    torch.save = guarded_save
    torch.serialization.save = guarded_save


def _carry_draws_in_rng_state() -> None:
    # Activation checkpointing and torch.random.fork_rng save and restore torch's CPU
    # state around a replay: carrying the draw number along makes a recomputed dropout
    # draw the mask it drew in forward (random.py).
    get_state, set_state = carrying_draws(torch.get_rng_state, torch.set_rng_state)
    for module in (torch, torch.random):
        module.get_rng_state, module.set_rng_state = get_state, set_state


def _bind_gloo_to_local_addr() -> None:
    # Under the launcher's --local_addr, gloo groups use that address, not the one the
    # hostname resolves to: two nodes on one machine (127.0.0.2, 127.0.0.3), or a machine
    # whose hostname names the wrong network (comm/groups.py). Without it torch's class
    # stays (or is put back, in a worker forked from a process that had bound one).
    comm.bind_gloo_to_address(env.local_addr())


# --- torch's distributed tools: wrapped when the program imports them ---------------------

def _advise_when_torch_tools_are_imported() -> None:
    # FSDP2's fully_shard, parallelize_module and DTensor's dispatcher take a GlobalTensor
    # for a plain tensor and fail later or deeper (advice.py). Importing their modules
    # costs seconds, so they are not imported here: each is wrapped right after the
    # program imports it (an import hook), or now when it already has. Wrapped in place
    # on every module that exposes them, so that `from torch.distributed.fsdp import
    # fully_shard` returns the wrapper. GLOBALTENSOR_TORCH_ADVICE=0: none of it (and
    # what a forked worker inherited wrapped is put back).
    ours = [f for f in sys.meta_path if isinstance(f, _Finder)]
    if not env.torch_advice_enabled():
        for finder in ours:
            sys.meta_path.remove(finder)
        _unwrap_torch_tools()
        return
    if not ours:
        sys.meta_path.insert(0, _Finder())
    for name, after in _AFTER_IMPORT.items():
        if name in sys.modules:
            after()


def _unwrap_torch_tools() -> None:
    for entries in advice.REFUSING_GLOBAL_MODULES.values():
        for module_name, name, _ in entries:
            module = sys.modules.get(module_name)
            original = getattr(getattr(module, name, None), "__wrapped_by_globaltensor__", None)
            if original is not None:
                setattr(module, name, original)
    state_dict = sys.modules.get(_STATE_DICT)
    for name in _FULL_STATE_DICT_FUNCTIONS:
        original = getattr(getattr(state_dict, name, None), "__wrapped_by_globaltensor__", None)
        if original is not None:
            setattr(state_dict, name, original)
    dispatch = sys.modules.get("torch.distributed.tensor._dispatch")
    if dispatch is not None:
        method = dispatch.OpDispatcher._try_replicate_spec_for_scalar_tensor
        original = getattr(method, "__wrapped_by_globaltensor__", None)
        if original is not None:
            dispatch.OpDispatcher._try_replicate_spec_for_scalar_tensor = original


def _refuse_global_modules(imported: str) -> None:
    for module_name, name, text in advice.REFUSING_GLOBAL_MODULES[imported]:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None)
        if callable(original) and not hasattr(original, "__wrapped_by_globaltensor__"):
            setattr(module, name, advice.refusing_global_modules(
                original, f"{imported}.{name}", text))


def _refuse_global_in_dtensor_ops() -> None:
    from torch.distributed.tensor._dispatch import OpDispatcher
    original = OpDispatcher._try_replicate_spec_for_scalar_tensor
    if not hasattr(original, "__wrapped_by_globaltensor__"):
        OpDispatcher._try_replicate_spec_for_scalar_tensor = \
            advice.refusing_global_operands(original)


def _whole_values_in_full_state_dicts() -> None:
    # get_state_dict(..., options=StateDictOptions(full_state_dict=True)) gathers DTensors
    # to whole plain tensors (_gather_state_dict), and set_state_dict with it puts whole
    # values back into the DTensors' layouts (_distribute_state_dict,
    # _broadcast_state_dict), all three imported by name into this module: GlobalTensors
    # came back as they were (torch.save refused them), and an optimizer loaded plain
    # whole moments for its global parameters.
    module = sys.modules[_STATE_DICT]
    for name, wrap in _FULL_STATE_DICT_FUNCTIONS.items():
        original = getattr(module, name)
        if not hasattr(original, "__wrapped_by_globaltensor__"):
            setattr(module, name, wrap(original))


_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_FULL_STATE_DICT_FUNCTIONS = {"_gather_state_dict": gathering_global_tensors,
                              "_distribute_state_dict": placing_global_tensors,
                              "_broadcast_state_dict": placing_global_tensors}
_AFTER_IMPORT = {name: functools.partial(_refuse_global_modules, name)
                 for name in advice.REFUSING_GLOBAL_MODULES}
_AFTER_IMPORT["torch.distributed.tensor._dispatch"] = _refuse_global_in_dtensor_ops
_AFTER_IMPORT[_STATE_DICT] = _whole_values_in_full_state_dicts


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the wrapping."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._after()

    def __getattr__(self, name):  # is_package, get_code, get_source, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the watched modules' specs to ``_Loader``."""

    def find_spec(self, fullname, path, target=None):
        after = _AFTER_IMPORT.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, after)
                return spec
        return None
