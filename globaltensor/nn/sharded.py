"""``fully_shard``: ZeRO-3 / FSDP expressed in sbp.

Every parameter is stored split(0) on the placement's data axis (other axes keep their
sbp: tensor parallelism composes). Each module owning parameters is a unit: before
its forward, its parameters are gathered (S -> B on the data axis) and put in place of
the shards; after its forward the shards are put back and the gathered copies are
dropped. Autograd does not keep them either: a saved-tensor hook packs any view of a
gathered copy as (unit's regather, view geometry) and the unit gathers again, once,
when backward first unpacks one (``reshard_after_forward=False``: autograd keeps the
gathered copies instead; an int ``g``: each rank keeps 1/g of them and backward gathers
within groups of g ranks). Under saved-tensor hooks already active (activation
checkpointing) those decide: a checkpointed forward keeps nothing, and its recompute
in backward gathers once and keeps the copies for the backward that follows, except
a Linear's weight, which its backward gathers again (``refetch_in_backward``): the
recompute would otherwise hold every weight of the block until backward reaches it.
The next unit's gather starts before this unit computes (prefetch of one unit, in the
order of the previous forward). The gradient of a gathered parameter is partial on the
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
from torch.utils._pytree import tree_map_only

from .. import comm, heap
from ..layout import Layout, balanced_split
from ..placement import Placement, check_placement
from ..sbp import Split, broadcast
from ..tensor import GlobalTensor
from .module import tensor_slots, to_global, untraced
from .shard_comm import Fetch, concatenates, gather_rows, reduce_to_parts

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
                data_axis: int = 0) -> torch.nn.Module:
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
    Returns ``module``.

    >>> model = gt.nn.fully_shard(model, gt.placement.all("cpu"),      # doctest: +SKIP
    ...                           param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> opt = torch.optim.AdamW(model.parameters())   # steps on the fp32 parts  # doctest: +SKIP
    """
    check_placement(placement)
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

    host = heap.maps_large_blocks(placement.type) and not policy.alone
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
    for sub in _unique_modules(module):
        names = [n for n, p in sub._parameters.items() if p is not None]
        if names and not hasattr(sub, "_gt_shard_unit"):
            sub._gt_shard_unit = _Unit(sub, names, root)
            if type(sub) is torch.nn.Linear:
                sub.forward = types.MethodType(_linear_forward, sub)
            sub.register_forward_pre_hook(untraced(_before_forward), with_kwargs=True)
            sub.register_forward_hook(untraced(_after_forward), always_call=True)   # early-stopped recompute
    return module


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
    unit starts the next one's gather (prefetch) before it computes, as FSDP2 does."""

    def __init__(self, policy: _Policy):
        self.policy = policy
        self.order: list = []       # units of the last forward, in order
        self.running: list = []     # units of this forward so far
        self.pending: dict = {}     # unit -> its started Fetch

    def before_forward(self, module, args, kwargs):
        self.running = []
        return _cast_inputs(self.policy, args, kwargs)

    def after_forward(self, module, args, output):
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
    """The parameters one module owns, gathered together for its forward."""

    def __init__(self, module: torch.nn.Module, names: list, root: _Root):
        self.module, self.names, self.root, self.policy = module, names, root, root.policy
        self.shards: dict = {}
        self.saved: list = []    # per running forward: (saved-tensor hooks or None, regather)

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
        params = self.module._parameters
        return self.fetch({n: params[n] for n in self.names})

    def gather(self) -> None:
        root = self.root
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
        params = self.module._parameters
        self.shards = dict(fetch.shards)
        regather = _Regather(self, self.shards) if self._reshards() else None
        locals_ = fetch.finish()
        names = list(locals_)
        fulls = _Gathered.apply(self.policy, tuple(self.gathered_layout(self.shards[n])
                                                   for n in names),
                                *(self.shards[n] for n in names),
                                *(locals_[n] for n in names)) if names else ()
        for name, full in zip(names, fulls):
            local = locals_[name]
            if regather is not None and local.numel():
                _gathered[local.untyped_storage()._cdata] = (regather, name)
            params[name] = full
        hooks = None
        if regather is not None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
        self.saved.append((hooks, regather))

    def _reshards(self) -> bool:
        """Whether this forward's saved gathered copies are dropped and gathered again.
        Not with ``reshard_after_forward=False``; not under saved-tensor hooks already
        active (activation checkpointing's, in forward and in its recompute: they decide
        what is kept, and both passes must save alike); not in a forward that runs inside
        backward (a reentrant checkpoint's recompute), as the backward that uses the
        copies follows at once."""
        return (self.policy.reshard is not False and not self.policy.alone
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
                and torch._C._current_graph_task_id() == -1)

    def refetch_in_backward(self, name: str):
        """Under saved-tensor hooks of someone else's (activation checkpointing, whose
        recompute would otherwise hold every gathered weight of the recomputed block
        until its backward reaches each): a function that gathers parameter ``name``
        again, for a node that then saves no copy; None where the copy is kept instead
        (``reshard_after_forward`` False or an int, or ``name`` not gathered)."""
        shard = self.shards.get(name)
        if (self.policy.reshard is not True or self.policy.alone or shard is None
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            return None
        layout = self.gathered_layout(shard)

        def refetch() -> GlobalTensor:
            return GlobalTensor(self.fetch({name: shard}).finish()[name], layout)
        return refetch

    def release(self) -> None:
        hooks, regather = self.saved.pop() if self.saved else (None, None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        params = self.module._parameters
        for name, shard in self.shards.items():
            full = params[name]
            if full is not shard and isinstance(full, GlobalTensor) and full.local_part.numel():
                _gathered.pop(full.local_part.untyped_storage()._cdata, None)
                if regather is not None and isinstance(self.policy.reshard, int) \
                        and not isinstance(self.policy.reshard, bool):
                    regather.keep_piece(name, full.local_part)
            params[name] = shard
        self.shards = {}


class _Gathered(torch.autograd.Function):
    """A unit's gathered parameters (``shards`` then their gathered ``locals``), whose
    gradients go back to their shards' layouts together (``reduce_to_parts``: one
    exchange, or one reduce_scatter for the small ones, per unit instead of one per
    parameter), reduced in the policy's reduce dtype and stored in each shard's dtype.
    A unit's gradients usually come from one backward node (a Linear's, a norm's), so
    waiting for all of them holds nothing longer; a module that uses its parameters far
    apart in its forward holds the first gradient until the last one comes."""

    @staticmethod
    def forward(ctx, policy: _Policy, layouts: tuple, *shards_and_locals):
        shards, locals_ = shards_and_locals[:len(layouts)], shards_and_locals[len(layouts):]
        ctx.policy = policy
        ctx.srcs = tuple(s.global_layout for s in shards)
        ctx.dtypes = tuple(s.dtype for s in shards)
        ctx.set_materialize_grads(False)    # an unused parameter's gradient stays None
        outs = tuple(GlobalTensor(local, layout) for local, layout in zip(locals_, layouts))
        frozen = [o for o, s in zip(outs, shards) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        policy = ctx.policy
        return (None, None, *reduce_to_parts(grads, ctx.srcs, policy.data_axis,
                                             policy.reduce_dtype, ctx.dtypes),
                *(None for _ in grads))


def _linear_forward(module: torch.nn.Linear, x):
    """``nn.Linear.forward`` of a unit: while its weight is gathered again in backward,
    through ``_LinearWeightLast``; under activation checkpointing too, which then keeps
    only the input and gathers the weight again in this node's backward."""
    unit = module._gt_shard_unit
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, module.weight, module.bias)
    if unit.saved and unit.saved[-1][1] is not None:    # the unit's regather keeps it
        return _LinearWeightLast.apply(x, module.weight, module.bias, None)
    refetch = unit.refetch_in_backward("weight")
    if refetch is None:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return _LinearWeightLast.apply(x, module.weight, module.bias, refetch)


class _LinearWeightLast(torch.autograd.Function):
    """``F.linear`` whose backward computes the input's gradient first, lets the
    gathered weight go, and only then computes the weight's full-size gradient: the two
    are never alive together (autograd's own linear holds the weight until its node
    ends), which lowers the backward peak by one weight per unit. With ``refetch`` the
    weight is not saved at all: backward calls it for a fresh gathered copy."""

    @staticmethod
    def forward(ctx, x, weight, bias, refetch):
        # each only where the other's gradient needs it (a first layer's input needs
        # none: its weight is not kept, nor gathered again)
        ctx.refetch = refetch if x.requires_grad else None
        ctx.save_for_backward(x if weight.requires_grad else None,
                              weight if x.requires_grad and refetch is None else None)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.refetch is not None:
            weight = ctx.refetch()
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        del weight      # the regather drops its copy at its last unpack (_Regather.local)
        grad = grad.reshape(-1, grad.shape[-1])
        # contiguous (autograd's addmm gives the transpose of x^T grad, whose rows the
        # reduction would copy before sending)
        grad_w = grad.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _before_forward(module, args, kwargs):
    unit = module._gt_shard_unit
    if not unit.policy.alone:   # what the last unit's products left (host only)
        heap.release_blas_buffers()
    unit.gather()
    return _cast_inputs(unit.policy, args, kwargs)


def _after_forward(module, args, output):
    module._gt_shard_unit.release()


# The storage (its StorageImpl, ``_cdata``: fake ones have no data pointer) of each
# gathered copy alive in some forward -> (its unit's regather, parameter name).
_gathered: dict = {}


class _Regather:
    """The gathered parameters of one forward of a unit, gathered again in backward: all
    that autograd saved, in one ``Fetch``, at the first unpack (shared by every saved
    view, freed with the last). With ``reshard_after_forward=g`` each parameter is
    gathered from the 1/g piece kept after forward, within this rank's g ranks."""

    def __init__(self, unit: _Unit, shards: dict):
        self.unit, self.shards = unit, shards
        self.saved: dict = {}             # name -> how many views of it autograd saved
        self.pieces: dict = {}            # name -> (piece, group, shape) with an int g
        self.fulls: dict | None = None

    def keep_piece(self, name: str, full: torch.Tensor) -> None:
        if name not in self.saved or not concatenates(self.shards[name].global_layout,
                                                      self.unit.policy.data_axis):
            return
        g, rank = self.unit.policy.reshard, comm.get_rank()
        members = self.shards[name].placement.group(rank, self.unit.policy.data_axis)
        first = members.index(rank) // g * g
        group = members[first:first + g]
        offset, size = balanced_split(full.shape[0], g)[group.index(rank)]
        self.pieces[name] = (full.narrow(0, offset, size).clone(), group, tuple(full.shape))

    def local(self, name: str) -> torch.Tensor:
        """The gathered copy of ``name`` for one unpack; the last unpack of its views
        drops it here (a node that lets it go early frees it: ``_LinearWeightLast``)."""
        if self.fulls is not None and name not in self.fulls:   # unpacked once more
            self.fulls[name] = self.unit.fetch({name: self.shards[name]}).finish()[name]
        if self.fulls is None:
            rest = sorted(set(self.saved) - set(self.pieces))
            # the regather's own shards: a recompute (activation checkpointing) may have
            # put gathered copies in the module meanwhile
            self.fulls = self.unit.fetch({n: self.shards[n] for n in rest}).finish() \
                if rest else {}
            started = {n: gather_rows(piece, group, shape, piece.dtype)
                       for n, (piece, group, shape) in self.pieces.items()}
            self.fulls.update({n: finish() for n, finish in started.items()})
            self.pieces = {}
        self.saved[name] -= 1
        return self.fulls[name] if self.saved[name] > 0 else self.fulls.pop(name)


def _pack(t):
    if type(t) is GlobalTensor and t.local_part.numel():
        found = _gathered.get(t.local_part.untyped_storage()._cdata)
        if found is not None:
            regather, name = found
            regather.saved[name] = regather.saved.get(name, 0) + 1
            local = t.local_part
            return (regather, name, t.global_layout, tuple(t.stride()), tuple(local.size()),
                    tuple(local.stride()), local.storage_offset())
    return t


def _unpack(packed):
    if type(packed) is not tuple:
        return packed
    regather, name, layout, strides, size, stride, offset = packed
    local = regather.local(name).as_strided(size, stride, offset)
    return GlobalTensor(local, layout, strides=None if strides == layout.strides else strides)
