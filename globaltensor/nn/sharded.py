"""``fully_shard``: ZeRO-3 / FSDP expressed in sbp.

Every parameter is stored split(0) on the placement's data axis (other axes keep their
sbp: tensor parallelism composes). Each module owning parameters is a unit (with
``unit="call"``, FSDP2's: all a call shards, the call's module's forward its own):
before its forward, its parameters are gathered (S -> B on the data axis) and put in
place of the shards; after its forward the shards are put back and the gathered copies
are dropped. Autograd does not keep them either: a saved-tensor hook packs any view of a
gathered copy as (unit's regather, view geometry) and the unit gathers again, once,
when backward first unpacks one (``reshard_after_forward=False``: autograd keeps the
gathered copies instead; an int ``g``: each rank keeps 1/g of them and backward gathers
within groups of g ranks). Under saved-tensor hooks already active (activation
checkpointing) those decide: a checkpointed forward keeps nothing, and its recompute
in backward gathers once and keeps the copies for the backward that follows, except
a Linear's weight, which its backward gathers again (``refetch_in_backward``): the
recompute would otherwise hold every weight of the block until backward reaches it.
The next unit's gather starts before this unit computes (prefetch of one unit, in the
order of the previous forward, across the calls made on a model's parts before the
call on the model); in backward each regather starts the one before it in forward
order (``shard_backward.py``), and a unit of a call is gathered whole as its backward
begins (FSDP2's pre-backward gather: a checkpoint inside it recomputes on the copies).
The gradient of a gathered parameter is partial on the
data axis (split batch); a unit's gradients go to their shards' layout together as soon
as they are computed (``shard_comm.reduce_to_parts``: the full-size partials are freed
then), so each rank's ``.grad`` and optimizer state are its part. An
``nn.Linear`` unit whose weight is gathered again computes its backward weight last
(``_LinearWeightLast``): the input's gradient, then the weight let go, then the weight's
full-size gradient, so the two full-size tensors are never alive together.

Mixed precision (FSDP2's ``MixedPrecisionPolicy``): parameters are stored and optimised
in their own dtype; with ``param_dtype`` the parts are cast before they travel and the
gathered copies compute in it (floating inputs of every unit are cast to it too);
gradients are reduced in ``reduce_dtype`` (default: the dtype they come in) and land
in ``.grad`` in the parameter's dtype.

On a "cpu" placement every host block of 128 KiB or more is mapped on its own from the
first ``fully_shard`` on, and the packing buffers MKL keeps after a large product are
freed where each unit starts (``heap.py``), so resident memory follows what is live,
at the cost of pages faulting in at each allocation.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Union

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import heap
from ..layout import Layout
from ..placement import Placement, check_placement
from ..sbp import Split, broadcast
from ..tensor import GlobalTensor
from .module import tensor_slots, to_global, untraced
from .shard_backward import _Gathered, _gathered, _linear_forward, _pack, _Regather, _unpack
from .shard_comm import Fetch

__all__ = ["fully_shard"]


@dataclass(frozen=True)
class _Policy:
    """How one ``fully_shard`` call gathers, reshards and reduces."""
    param_dtype: Union[torch.dtype, None]
    reduce_dtype: Union[torch.dtype, None]
    reshard: Union[bool, int]
    data_axis: int
    alone: bool = False   # a data axis of one rank: a part is whole, no copy comes and goes


def fully_shard(module: torch.nn.Module, placement: Placement,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                reshard_after_forward: bool | int = True, *,
                data_axis: int = 0, unit: str = "module") -> torch.nn.Module:
    """Shard every parameter of ``module`` split(0) on ``placement``'s ``data_axis``;
    gather on use, free after forward, gather again in backward, reduce the gradient to
    the parts. Parameters already global on ``placement`` keep their other axes' sbp
    (tensor parallelism on a 2-D placement); plain and meta modules are converted as
    by ``gt.nn.to_global`` (buffers broadcast). As FSDP2: ``param_dtype`` is the dtype
    gathered parameters compute in, ``reduce_dtype`` the one gradients are reduced in
    (parameters, ``.grad`` and optimizer state keep the parameters' own dtype);
    ``reshard_after_forward`` False keeps gathered parameters from forward to backward
    (one gather fewer per unit, more memory), an int ``g`` (dividing the data axis'
    size, 1 < g < size) keeps 1/g of them per rank and gathers within g ranks.
    ``unit``: "module" gathers each module's own parameters for its forward (the
    least memory: one module's gathered at a time, and the next one's); "call"
    gathers all this call shards together, as FSDP2 does (one collective per call and
    direction: faster where each collective's latency counts, a whole block's
    parameters gathered at once). Returns ``module``.

    >>> model = gt.nn.fully_shard(model, gt.placement.all("cpu"),      # doctest: +SKIP
    ...                           param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> opt = torch.optim.AdamW(model.parameters())   # steps on the fp32 parts  # doctest: +SKIP
    """
    check_placement(placement)
    if unit not in ("module", "call"):
        raise ValueError(f"fully_shard: unit must be 'module' or 'call', got {unit!r}")
    policy = _check_policy(placement, param_dtype, reduce_dtype, reshard_after_forward,
                           data_axis)
    params = {id(t) for _, _, kind, _, t in tensor_slots(module) if kind == "_parameters"}

    def storage_sbp(name, t):
        if isinstance(t, GlobalTensor) and t.placement == placement:
            sbp = list(t.sbp)
        else:
            sbp = [broadcast] * placement.ndim
        if id(t) in params and t.dim() > 0:
            sbp[data_axis] = Split(0)
        return tuple(sbp)

    host = not policy.alone and heap.maps_large_blocks(placement.type)
    if host:
        heap.map_large_blocks()
    to_global(module, placement, storage_sbp)
    if host:     # the full-size tensors the parts replaced
        heap.release_free_heap()
    root = _Root(policy)
    # Compiled, the hooks run eagerly (as FSDP2's): traced, each unit's gather recompiled
    # for its parameters (12 units hit dynamo's recompile limit, 3x the compile time);
    # skipped, the graph breaks at each hook and a unit's forward compiles once for all.
    module.register_forward_pre_hook(untraced(root.before_forward), with_kwargs=True)
    module.register_forward_hook(untraced(root.after_forward), always_call=True)
    _make_units(module, root, unit)
    return module


def _make_units(module: torch.nn.Module, root: "_Root", unit: str) -> None:
    """The units of one call (``fully_shard``'s ``unit``), their hooks, and the roots
    of the calls made on parts of ``module`` before, put under ``root``."""
    for sub in _unique_modules(module):
        inner = getattr(sub, "_gt_shard_unit", None)
        if inner is not None and inner.root is not root and inner.root.parent is None:
            inner.root.parent = root
    owners = {}   # module -> (its path in ``module``, its parameters this call shards)
    for prefix, sub in module.named_modules():
        names = [n for n, p in sub._parameters.items() if p is not None]
        if names and not hasattr(sub, "_gt_shard_unit"):
            owners[sub] = (prefix, names)
    if unit == "call":   # one unit, its keys the parameters' paths
        groups = [(module, {f"{prefix}.{n}" if prefix else n: (sub, n)
                            for sub, (prefix, names) in owners.items() for n in names})]
    else:
        groups = [(sub, {n: (sub, n) for n in names}) for sub, (_, names) in owners.items()]
    for head, slots in groups:
        if not slots:
            continue
        made = head._gt_shard_head = _Unit(head, slots, root, unit == "call")
        head.register_forward_pre_hook(untraced(_before_forward), with_kwargs=True)
        head.register_forward_hook(untraced(_after_forward), always_call=True)   # early-stopped recompute
        for key, (owner, name) in slots.items():
            owner._gt_shard_unit = made
            owner.__dict__.setdefault("_gt_shard_keys", {})[name] = key
            if type(owner) is torch.nn.Linear:
                owner.forward = types.MethodType(_linear_forward, owner)


def _check_policy(placement, param_dtype, reduce_dtype, reshard, data_axis) -> _Policy:
    """The policy, or a ValueError/TypeError naming the bad argument (before any
    communication)."""
    if not 0 <= data_axis < placement.ndim:
        raise ValueError(f"data_axis {data_axis} is not an axis of {placement} "
                         f"({placement.ndim}-D)")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"fully_shard: {name} must be None or a floating-point "
                            f"torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    size = placement.shape[data_axis]
    if not isinstance(reshard, bool):
        if not isinstance(reshard, int):
            raise TypeError(f"fully_shard: reshard_after_forward must be True, False or an "
                            f"int, got {reshard!r}")
        if not 1 < reshard < size or size % reshard:
            raise ValueError(f"fully_shard: reshard_after_forward={reshard} must divide the "
                             f"data axis' {size} ranks and lie strictly between 1 and {size} "
                             f"(use True to reshard to all {size}, False to keep the "
                             f"gathered parameters)")
    return _Policy(param_dtype, reduce_dtype, reshard, data_axis, size == 1)


def _unique_modules(module):
    seen = set()
    for sub in module.modules():
        if id(sub) not in seen:
            seen.add(id(sub))
            yield sub


def _cast_inputs(policy: _Policy, args, kwargs):
    """Floating tensors among ``args``/``kwargs`` in ``param_dtype`` (as FSDP2's
    ``cast_forward_inputs``); unchanged without one."""
    dtype = policy.param_dtype
    if dtype is None:
        return args, kwargs

    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return tree_map_only(torch.Tensor, cast, (args, kwargs))


class _Root:
    """One ``fully_shard`` call: the order its units ran in the last forward, so each
    unit starts the next one's gather (prefetch) before it computes, as FSDP2 does.
    Inside the forward of a module sharded by a later call around it (``parent``: a
    model's root around its blocks), the outermost such call's order is used: the
    next block's first unit is prefetched as well."""

    def __init__(self, policy: _Policy):
        self.policy = policy
        self.order: list = []       # units of the last forward, in order
        self.running: list = []     # units of this forward so far
        self.pending: dict = {}     # unit -> its started Fetch
        self.parent: "_Root | None" = None
        self.forwards = 0           # forwards of the module running now
        self.last_regather = None   # this forward's latest (backward prefetches in reverse)
        self.prefetched: list = []  # regathers started ahead, maybe never unpacked

    def top(self) -> "_Root":
        """The outermost root whose module's forward is running around this one's."""
        root = self
        while root.parent is not None and root.parent.forwards:
            root = root.parent
        return root

    def before_forward(self, module, args, kwargs):
        for regather in self.prefetched:   # a backward that did not reach them: done
            if regather.pending is not None:
                regather.pending.wait()
        self.prefetched.clear()
        self.forwards += 1
        self.running, self.last_regather = [], None
        return _cast_inputs(self.policy, args, kwargs)

    def after_forward(self, module, args, output):
        self.forwards = max(0, self.forwards - 1)
        for fetch in self.pending.values():   # a prefetch no unit used: finish it
            fetch.wait()
        self.pending.clear()
        self.order, self.running = self.running, []

    def next_after(self, unit):
        order = self.order
        for i, u in enumerate(order[:-1]):
            if u is unit:
                return order[i + 1]
        return None


class _Unit:
    """Parameters gathered together for ``module``'s forward: ``slots`` key -> (the
    module that owns it, its name there); the key is the name for a unit of one module,
    the dotted path from ``module`` for a unit of a call."""

    def __init__(self, module: torch.nn.Module, slots: dict, root: _Root, call: bool = False):
        self.module, self.slots, self.root, self.policy = module, slots, root, root.policy
        self.call = call         # a unit of a call (``fully_shard``'s unit="call")
        self.installed = None    # the regather whose copies are in the modules now
        self.shards: dict = {}
        self.saved: list = []    # per running forward: (saved-tensor hooks or None, regather)
        self.refetcher = None    # this forward's, under activation checkpointing's hooks

    def gathered_layout(self, shard: GlobalTensor) -> Layout:
        sbp = list(shard.sbp)
        sbp[self.policy.data_axis] = broadcast
        return shard.global_layout.with_sbp(tuple(sbp))

    def fetch(self, stored: dict) -> Fetch:
        """Start gathering the stored parameters ``stored`` (name -> parameter) that are
        global and not 0-d."""
        shards = {n: p for n, p in stored.items() if isinstance(p, GlobalTensor) and p.dim() > 0}
        return Fetch(shards, {n: self.gathered_layout(s) for n, s in shards.items()},
                     self.policy.data_axis, self.policy.param_dtype)

    def start(self) -> Fetch:
        if self.installed is not None:   # a backward that gave it no gradient: shards back
            self.installed.uninstall()
        return self.fetch({n: owner._parameters[k] for n, (owner, k) in self.slots.items()})

    def gather(self) -> None:
        root = self.root.top()
        root.running.append(self)
        fetch = root.pending.pop(self, None)
        if fetch is None or fetch.stale():
            if fetch is not None:
                fetch.wait()
            fetch = self.start()
        # prefetch in forward order, not in a forward recomputed inside backward (there
        # the next unit in forward order is not the next one needed)
        in_backward = torch._C._current_graph_task_id() != -1
        following = None if in_backward else root.next_after(self)
        if following is not None and following not in root.pending:
            root.pending[following] = following.start()   # overlaps this unit's compute
        self.shards = dict(fetch.shards)
        regather = _Regather(self, self.shards) if self._reshards() else None
        if regather is not None:   # backward unpacks them in reverse: each starts the next
            regather.before, root.last_regather = root.last_regather, regather
        # under someone else's hooks (activation checkpointing) what the unit's Linears
        # gather again in backward is gathered once for them all (refetch_in_backward)
        self.refetcher = _Regather(self, self.shards) if (
            regather is None and self.policy.reshard is True and not self.policy.alone
            and _foreign_hooks()) else None
        locals_ = fetch.finish()
        names = list(locals_)
        fulls = _Gathered.apply(self.policy, tuple(self.gathered_layout(self.shards[n])
                                                   for n in names), regather if self.call else None,
                                *(self.shards[n] for n in names),
                                *(locals_[n] for n in names)) if names else ()
        for name, full in zip(names, fulls):
            local = locals_[name]
            if regather is not None and local.numel():
                _gathered[local.untyped_storage()._cdata] = (regather, name)
            owner, key = self.slots[name]
            owner._parameters[key] = full
        hooks = None
        if regather is not None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
        self.saved.append((hooks, regather))

    def _reshards(self) -> bool:
        """Whether this forward's saved gathered copies are dropped and gathered again.
        Not with ``reshard_after_forward=False``; not under saved-tensor hooks of
        someone else's (activation checkpointing's, in forward and in its recompute: they decide
        what is kept, and both passes must save alike); not in a forward that runs inside
        backward (a reentrant checkpoint's recompute), as the backward that uses the
        copies follows at once."""
        return (self.policy.reshard is not False and not self.policy.alone
                and not _foreign_hooks() and torch._C._current_graph_task_id() == -1)

    def refetch_in_backward(self, name: str):
        """Under saved-tensor hooks of someone else's (activation checkpointing, whose
        recompute would otherwise hold every gathered weight of the recomputed block
        until its backward reaches each): a function that gathers parameter ``name``
        again, for a node that then saves no copy (the unit's nodes share one gather in
        backward, the first one's: a unit of a call gathers its Linears' weights once,
        each dropped after its last use); None where the copy is kept instead
        (``reshard_after_forward`` False or an int, or ``name`` not gathered). Also where
        the unit is not gathered now: a checkpoint inside a unit of a call (a block's
        part) recomputes in backward, after the unit put its shards back."""
        shard = self.shards.get(name)
        if not self.shards:
            stored = self.slots[name][0]._parameters[self.slots[name][1]]
            shard = stored if isinstance(stored, GlobalTensor) and stored.dim() else None
        if (self.policy.reshard is not True or self.policy.alone or shard is None
                or not _foreign_hooks()):
            return None
        layout = self.gathered_layout(shard)
        refetcher = self.refetcher
        if refetcher is not None and refetcher.shards.get(name) is shard:
            refetcher.saved[name] = refetcher.saved.get(name, 0) + 1
            return lambda: GlobalTensor(refetcher.local(name), layout)

        regather = self.saved[-1][1] if self.saved else None

        def refetch() -> GlobalTensor:
            if regather is not None and regather.installed is not None:   # (a unit of a call)
                return GlobalTensor(regather.installed[name], layout)
            return GlobalTensor(self.fetch({name: shard}).finish()[name], layout)
        return refetch

    def put_back(self, tensors: dict) -> None:
        """``tensors`` (key -> tensor) in place of the unit's parameters."""
        for key, t in tensors.items():
            owner, name = self.slots[key]
            owner._parameters[name] = t

    def release(self) -> None:
        hooks, regather = self.saved.pop() if self.saved else (None, None)
        self.refetcher = None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for name, shard in self.shards.items():
            owner, key = self.slots[name]
            full = owner._parameters[key]
            if full is not shard and isinstance(full, GlobalTensor) and full.local_part.numel():
                _gathered.pop(full.local_part.untyped_storage()._cdata, None)
                if regather is not None and isinstance(self.policy.reshard, int) \
                        and not isinstance(self.policy.reshard, bool):
                    regather.keep_piece(name, full.local_part)
            owner._parameters[key] = shard
        self.shards = {}


def _foreign_hooks() -> bool:
    """Whether saved-tensor hooks other than fully_shard's own are active (activation
    checkpointing's; a unit of a call around this one pushed ours)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top[0] is not _pack


def _before_forward(module, args, kwargs):
    unit = module._gt_shard_head
    if not unit.policy.alone:   # what the last unit's products left (host only)
        heap.release_blas_buffers()
    unit.gather()
    return _cast_inputs(unit.policy, args, kwargs)


def _after_forward(module, args, output):
    unit = module._gt_shard_head
    regather = unit.saved[-1][1] if unit.call and unit.saved else None
    outputs = [t for t in tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if regather is not None and outputs:   # FSDP2's pre-backward gather (Regather.install)
        torch.autograd.graph.register_multi_grad_hook(
            outputs, lambda grads: regather.install(), mode="any")
    unit.release()
