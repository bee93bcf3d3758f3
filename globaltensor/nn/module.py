"""``to_global`` for modules: every parameter and buffer becomes a GlobalTensor.

A plain module's values come from the placement's first rank, which sends every rank
only its part (boxing from a one-rank placement to the target layout: point-to-point
pieces, a scatter, not a broadcast of the whole). A module on the meta device has no
values: each rank allocates only its part, and ``reset_parameters()`` or
``torch.nn.init.*_`` then fill it (random values are generated locally). A tensor held
by several modules (tied weights) becomes one GlobalTensor held by all of them.
Every converted module runs its forward inside ``gt.implicit_broadcast()``, so the plain
tensors a forward builds (position ids, masks) count as broadcast; so does a model's own
``generate`` (Hugging Face's), which appends plain tokens to the global ones. torch's
recurrent layers and cells run on each rank's samples where the batch is split
(``recurrent.py``); ``nn.TransformerEncoder``'s inference fast path keeps to dense
tensors (its nested ones cannot hold GlobalTensors).
"""
from __future__ import annotations

import types
from typing import Callable, Iterator, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import comm
from ..dispatch import implicit_broadcast
from ..factory import made
from ..layout import Layout
from ..local_parts import device_of, empty_local
from ..placement import Placement, check_placement
from ..planner.record import step_boundary
from ..sbp import broadcast
from ..tensor import GlobalTensor, to_layout
from .meta import check_meta_buffers, drop_initialised_marks
from .recurrent import forward_on_parts, runs_on_parts

SbpChoice = Union[object, Callable[[str, torch.Tensor], object]]


def tensor_slots(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, str,
                                                           torch.Tensor]]:
    """(qualified name, owning module, "_parameters"/"_buffers", name, tensor) of every
    parameter and buffer, shared modules and tied tensors included every time."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(sub, kind).items():
                if t is not None:
                    yield (f"{prefix}.{name}" if prefix else name), sub, kind, name, t


def to_global(module: torch.nn.Module, placement: Placement, sbp: SbpChoice) -> torch.nn.Module:
    """Make every parameter and buffer of ``module`` (in place) a GlobalTensor of the
    same global shape on ``placement``. Its value is the one on the placement's first
    rank (each rank receives only its part), or, for a module on the meta device,
    uninitialised (each rank allocates only its part; call ``reset_parameters()`` or
    ``torch.nn.init`` next); a meta buffer that no ``reset_parameters()`` fills again
    (a causal mask: anything but batch-norm statistics) raises ValueError naming it:
    build such modules under ``gt.nn.meta_init()``. A lazy module that has not run yet
    (its parameters have no shape) raises ValueError too. ``sbp`` is one sbp (or tuple) for
    all, or a callable ``(qualified name, tensor) -> sbp``. Tied tensors stay one
    tensor. Its forward (and
    that of every submodule) then takes the plain tensors it builds, e.g.
    ``torch.arange`` position ids or masks, as broadcast (``gt.implicit_broadcast()``),
    and so does its ``generate`` where it has one (a Hugging Face model's: the tokens
    and flags it builds). Returns ``module``.

    >>> gt.nn.to_global(model, p, lambda name, t: gt.sbp.split(0) if name == "0.weight"
    ...                 else gt.sbp.broadcast)                          # doctest: +SKIP
    >>> with torch.device("meta"):                                      # doctest: +SKIP
    ...     big = torch.nn.Linear(8192, 8192)
    >>> gt.nn.to_global(big, p, gt.sbp.split(0)).reset_parameters()    # doctest: +SKIP
    """
    check_placement(placement)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"to_global needs a torch.nn.Module, got {type(module).__name__}")
    choose = sbp if callable(sbp) and not isinstance(sbp, (tuple, list)) else (lambda n, t: sbp)
    comm.init()
    # Check every layout first: bad input raises on every rank before any communication.
    converted: dict = {}   # id(old tensor) -> (old tensor, layout)
    slots = list(tensor_slots(module))
    _check_initialised(slots)
    check_meta_buffers(module, slots)
    for qualified, _, kind, _, t in slots:
        if id(t) not in converted:
            try:
                converted[id(t)] = (t, Layout.make(t.shape, placement, choose(qualified, t)))
            except ValueError as e:   # say which tensor: one sbp for all rarely fits a 0-d buffer
                what = "parameter" if kind == "_parameters" else "buffer"
                raise ValueError(f"to_global: {what} {qualified!r} of shape {tuple(t.shape)}: {e} "
                                 f"(give a callable (name, tensor) -> sbp to lay tensors out one by "
                                 f"one)") from None
    for key, (t, layout) in converted.items():
        value = globalize(t.detach(), layout)
        if isinstance(t, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=t.requires_grad)
        converted[key] = (t, value)
    for _, sub, kind, name, t in slots:
        getattr(sub, kind)[name] = converted[id(t)][1]
    drop_initialised_marks(slots)
    for sub in module.modules():
        _run_globally(sub)
    return module


def _run_globally(sub: torch.nn.Module) -> None:
    """Make a converted module's own code run on GlobalTensors (module docstring)."""
    forward_in_implicit_broadcast(sub)
    if callable(getattr(type(sub), "generate", None)) and "generate" not in vars(sub):
        # (bound to the instance: a deep copy binds it to the copy)
        sub.generate = types.MethodType(_generate_in_implicit_broadcast, sub)
    if runs_on_parts(sub) and "forward" not in vars(sub):
        sub.forward = types.MethodType(forward_on_parts, sub)
    if isinstance(sub, torch.nn.TransformerEncoder):
        # its inference fast path packs a padded batch into a nested tensor, which
        # cannot hold GlobalTensors; its layers' fused attention runs on the parts
        sub.use_nested_tensor = False


def _check_initialised(slots: list) -> None:
    """Raise ValueError naming a tensor of a lazy module that has not run yet."""
    for qualified, sub, kind, _, t in slots:
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            what = "parameter" if kind == "_parameters" else "buffer"
            raise ValueError(f"to_global: {what} {qualified!r} of {type(sub).__name__} has no shape "
                             f"yet (a lazy module takes its sizes from its first input): run the "
                             f"model once on a plain input first, or build it with the sizes")


def _generate_in_implicit_broadcast(self, *args, **kwargs):
    """The model's class's ``generate`` inside ``gt.implicit_broadcast()``: the loop around
    the forwards mixes the plain tensors it builds (appended tokens, stopping flags,
    cache positions) with the global logits, the same on every rank."""
    with implicit_broadcast():
        return type(self).generate(self, *args, **kwargs)


def forward_in_implicit_broadcast(module: torch.nn.Module) -> None:
    """Run ``module``'s forward inside ``gt.implicit_broadcast()`` (hooks registered once;
    the scope closes when forward returns or raises). SPMD code builds the same plain
    tensors on every rank; ``gt.debug.check_consistency()`` verifies that it does."""
    if _open_scope not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_open_scope, prepend=True)
        module.register_forward_hook(_close_scope, always_call=True)


def untraced(hook: Callable) -> Callable:
    """``hook``, which torch.compile calls without tracing it: a graph break around an
    eager call, as FSDP2's hooks (a wrapper that chose at each call would itself be
    traced, and its rest compiled again for every hook it wraps).

    >>> module.register_forward_pre_hook(untraced(gather))   # doctest: +SKIP
    """
    return torch.compiler.disable(hook)


# (module, the implicit_broadcast context it entered or None) of every converted forward
# running now, innermost last. Only the outermost enters one: the forwards it calls run
# inside it, and skip the context's cost (a few microseconds per module call).
_scopes: list = []


def _open_scope(module, args):
    # Compiled code skips the scope: dynamo would defer the counter change past the
    # trace that reads it (wrap the compiled call in gt.implicit_broadcast() instead).
    if not torch.compiler.is_compiling():
        scope = None if _scopes else implicit_broadcast()
        if scope is not None:
            step_boundary(module)   # the outermost forward starts a training step
            scope.__enter__()
        _scopes.append((module, scope))


def _close_scope(module, args, output):
    # Runs also when forward raised, or when a pre-hook ran before ours raised: then
    # the innermost entry is not this module's and stays for its own module. Compiled
    # code opened none, and does not read the list: dynamo, meeting there the wrapper
    # of a module compiled before to_global (torch.compile(block) inside the model),
    # failed tracking that module twice.
    if not torch.compiler.is_compiling() and _scopes and _scopes[-1][0] is module:
        scope = _scopes.pop()[1]
        if scope is not None:
            scope.__exit__(None, None, None)


def globalize(t: torch.Tensor, layout: Layout) -> GlobalTensor:
    """``t`` as a GlobalTensor of ``layout``: a GlobalTensor is boxed; a meta tensor gets
    an uninitialised local part (zeros: a partial layout stays well defined), a fake one
    (``FakeTensorMode``: ``gt.debug.simulate_step``) a fake part of its own; a plain
    tensor is taken from the placement's first rank, which sends each rank its part."""
    if isinstance(t, GlobalTensor):
        return to_layout(t, layout)
    rank = comm.get_rank()
    made(layout, t.dtype)  # this rank's module: its members compare shapes before sending any
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        # no values to send: sending a fake tensor's parts would only cost the time of
        # a scatter to every rank (a 1024-rank simulation spent a fifth of its time so)
        if rank not in layout.placement:
            return GlobalTensor(empty_local(layout, t.dtype), layout)
        if isinstance(t, FakeTensor):
            return GlobalTensor(t.new_zeros(layout.local_shape(rank),
                                            device=device_of(layout.placement)), layout)
        return GlobalTensor(torch.zeros(layout.local_shape(rank), dtype=t.dtype,
                                        device=device_of(layout.placement)), layout)
    root = layout.placement.flat_ranks[0]
    source = Layout.make(t.shape, Placement(layout.placement.type, [root]), broadcast)
    local = t.to(device_of(layout.placement)).contiguous() if rank == root \
        else empty_local(source, t.dtype)
    out = to_layout(GlobalTensor(local, source), layout)
    # (the storages compared, not their data pointers: fake tensors have none)
    if rank == root and out.local_part.untyped_storage()._cdata == \
            local.untyped_storage()._cdata:
        # the root's part is a slice of the module's tensor: keep it, not the whole
        out = GlobalTensor(out.local_part.clone(), layout)
    return out
