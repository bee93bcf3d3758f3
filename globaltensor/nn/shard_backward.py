"""fully_shard's autograd side (``sharded.py`` makes the units): the gathered
parameters' node, whose backward reduces a unit's gradients to their parts together; a
Linear's backward that lets its gathered weight go before computing the weight's
gradient; and the regather, which gathers a unit's parameters again in backward for
what autograd saved of them (a saved-tensor hook keeps the view's geometry, not the
copy). A regather starts the one before it in forward order as it starts its own, so
the next unit's gather in backward travels while this one computes (FSDP2's backward
prefetch of one). A unit of a call is gathered whole as its backward begins (FSDP2's
pre-backward gather: a hook on its forward's outputs) and its copies stand in its
modules until its gradients are in, so that a checkpoint inside it recomputes on them.

>>> fulls = _Gathered.apply(policy, layouts, *shards, *locals_)   # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .. import comm
from ..layout import balanced_split
from ..tensor import GlobalTensor
from .shard_comm import concatenates, gather_rows, reduce_to_parts


class _Gathered(torch.autograd.Function):
    """A unit's gathered parameters (``shards`` then their gathered ``locals``), whose
    gradients go back to their shards' layouts together (``reduce_to_parts``: one
    exchange, or one reduce_scatter for the small ones, per unit instead of one per
    parameter), reduced in the policy's reduce dtype and stored in each shard's dtype.
    A unit's gradients usually come from one backward node (a Linear's, a norm's), so
    waiting for all of them holds nothing longer; a module that uses its parameters far
    apart in its forward holds the first gradient until the last one comes."""

    @staticmethod
    def forward(ctx, policy, layouts: tuple, regather, *shards_and_locals):   # (sharded._Policy)
        shards, locals_ = shards_and_locals[:len(layouts)], shards_and_locals[len(layouts):]
        ctx.policy, ctx.regather = policy, regather
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
        if ctx.regather is not None:   # the unit's backward is over: its shards go back
            ctx.regather.uninstall()
        return (None, None, None, *reduce_to_parts(grads, ctx.srcs, policy.data_axis,
                                                   policy.reduce_dtype, ctx.dtypes),
                *(None for _ in grads))


def _linear_forward(module: torch.nn.Linear, x):
    """``nn.Linear.forward`` of a unit: while its weight is gathered again in backward,
    through ``_LinearWeightLast``; under activation checkpointing too, which then keeps
    only the input and gathers the weight again in this node's backward. (Checkpointing
    first: its forward and its recompute must save alike, and a recompute inside a unit
    of a call runs after the unit's regather is gone.)"""
    unit = module._gt_shard_unit
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, module.weight, module.bias)
    refetch = unit.refetch_in_backward(module._gt_shard_keys["weight"])
    if refetch is not None:
        return _LinearWeightLast.apply(x, module.weight, module.bias, refetch)
    if unit.saved and unit.saved[-1][1] is not None:    # the unit's regather keeps it
        return _LinearWeightLast.apply(x, module.weight, module.bias, None)
    return torch.nn.functional.linear(x, module.weight, module.bias)


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
    def backward(ctx, grad):
        _no_second_order()
        x, weight = ctx.saved_tensors
        if ctx.refetch is not None:
            weight = ctx.refetch()
        # Under autocast the forward ran in the output's dtype (bf16, say) on casts of
        # an fp32 input and weight: so does its backward (autograd casts each gradient
        # back to its input's dtype)
        if weight is not None and weight.dtype != grad.dtype:
            weight = weight.to(grad.dtype)
        if x is not None and x.dtype != grad.dtype:
            x = x.to(grad.dtype)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        del weight      # the regather drops its copy at its last unpack (_Regather.local)
        grad = grad.reshape(-1, grad.shape[-1])
        # contiguous (autograd's addmm gives the transpose of x^T grad, whose rows the
        # reduction would copy before sending)
        grad_w = grad.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


# The storage (its StorageImpl, ``_cdata``: fake ones have no data pointer) of each
# gathered copy alive in some forward -> (its unit's regather, parameter name).
_gathered: dict = {}


class _Regather:
    """The gathered parameters of one forward of a unit, gathered again in backward: all
    that autograd saved, in one ``Fetch``, at the first unpack (shared by every saved
    view, freed with the last). With ``reshard_after_forward=g`` each parameter is
    gathered from the 1/g piece kept after forward, within this rank's g ranks."""

    def __init__(self, unit, shards: dict):   # (sharded._Unit)
        self.unit, self.shards = unit, shards
        self.saved: dict = {}             # name -> how many views of it autograd saved
        self.pieces: dict = {}            # name -> (piece, group, shape) with an int g
        self.fulls: dict | None = None
        self.before: "_Regather | None" = None   # the unit gathered before, this forward
        self.pending = None                       # its Fetch, started ahead (prefetch)
        self.installed: dict | None = None        # name -> gathered, through the backward

    def install(self) -> None:
        """As the unit's backward begins (a unit of a call, from a hook on its forward's
        outputs; FSDP2's pre-backward gather): all its parameters gathered at once and
        put in its modules, so that a recompute inside it (a checkpoint in its forward)
        computes on them and what autograd saved reads them; ``uninstall`` once its
        gradients are in."""
        if self.installed is not None or self.pieces:
            return
        fetch, self.pending = self.pending, None
        if fetch is not None and fetch.stale():   # the shards changed since it started
            fetch.wait()
            fetch = None
        rest = {n: s for n, s in self.shards.items() if fetch is None or n not in fetch.shards}
        more = self.unit.fetch(rest) if rest else None
        self._ahead()
        got = fetch.finish() if fetch is not None else {}
        got.update(more.finish() if more is not None else {})
        self.installed, self.unit.installed = got, self
        # out at the end of this backward at the latest: a unit whose parameters get no
        # gradient (all frozen) never runs ``_Gathered.backward``
        torch.autograd.Variable._execution_engine.queue_callback(self.uninstall)
        self.unit.put_back({n: GlobalTensor(t, self.unit.gathered_layout(self.shards[n]))
                            .requires_grad_(self.shards[n].requires_grad)
                            for n, t in got.items()})

    def uninstall(self) -> None:
        if self.installed is not None:
            self.unit.put_back(self.shards)
            self.installed = self.unit.installed = None

    def start(self) -> bool:
        """Start gathering what autograd saved (a unit of a call: all it holds, for
        ``install``), ahead of the first unpack (the regather after it in forward order
        calls this: its backward comes first). True if it started; not with pieces kept
        (an int ``reshard_after_forward``)."""
        if (self.fulls is not None or self.installed is not None or self.pending is not None
                or self.pieces):
            return False
        names = sorted(self.shards if self.unit.call else self.saved)   # (install: all)
        if not names:
            return False
        self.pending = self.unit.fetch({n: self.shards[n] for n in names})
        return True

    def _ahead(self) -> None:
        """Start the regather before this one in forward order: its backward is next."""
        before, self.before = self.before, None
        if before is not None and before.start():
            self.unit.root.prefetched.append(before)

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
        drops it here (a node that lets it go early frees it: ``_LinearWeightLast``),
        unless the unit's copies are installed for its backward (``install``)."""
        if self.installed is not None and name in self.installed:
            self.saved[name] -= 1
            return self.installed[name]
        if self.fulls is not None and name not in self.fulls:   # unpacked once more
            self.fulls[name] = self.unit.fetch({name: self.shards[name]}).finish()[name]
        if self.fulls is None:
            fetch, self.pending = self.pending, None
            if fetch is not None and fetch.stale():   # the shards changed since it started
                fetch.wait()
                fetch = None
            rest = sorted(set(self.saved) - set(self.pieces))
            # the regather's own shards: a recompute (activation checkpointing) may have
            # put gathered copies in the module meanwhile
            if fetch is None and rest:
                fetch = self.unit.fetch({n: self.shards[n] for n in rest})
            self._ahead()
            self.fulls = fetch.finish() if fetch is not None else {}
            started = {n: gather_rows(piece, group, shape, piece.dtype)
                       for n, (piece, group, shape) in self.pieces.items()}
            self.fulls.update({n: finish() for n, finish in started.items()})
            self.pieces = {}
        self.saved[name] -= 1
        return self.fulls[name] if self.saved[name] > 0 else self.fulls.pop(name)


def _no_second_order() -> None:
    """A backward that builds a graph (``create_graph=True``: a gradient penalty, a
    Hessian-vector product) would differentiate the gathered copies that backward
    makes afresh, which have no history to the shards: their terms would be missing
    from the second-order gradient. Refused before anything is computed or sent."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fully_shard: a backward with create_graph=True (torch.autograd.grad(..., "
            "create_graph=True): a gradient penalty, a Hessian-vector product) through a "
            "fully sharded unit is not supported: the parameters backward gathers again "
            "have no history to their shards. Lay such parameters out with "
            "gt.nn.to_global (broadcast or tensor-parallel sbps), whose double backward "
            "works")


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
    _no_second_order()
    regather, name, layout, strides, size, stride, offset = packed
    local = regather.local(name).as_strided(size, stride, offset)
    return GlobalTensor(local, layout, strides=None if strides == layout.strides else strides)
