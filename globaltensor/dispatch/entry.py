"""``__torch_dispatch__`` of GlobalTensor: the entry of every op, and the run step.

A call first asks the registry for a decomposition (its own, or its family's: out=
variants, ``_foreach_*``, value reads), which may decline. Otherwise plain tensor
operands become broadcast where allowed (``plain.py``), the decision is looked up or
made (``cache.py``, ``decide.py``), and a call that needs no boxing runs its local op
directly; the rest goes through ``_run``: inputs are boxed, the op (or its local
implementation) runs on this rank's parts, outputs are wrapped (``outputs.py``). A 0-d
output that the chosen signature makes partial (a loss, ``x.sum()`` over split rows) is
reduced to broadcast at once, outside backward, so any one rank can read it. A view of
a boxed input, and in-place ops through it, go by ``copied_views.py``.

This module reads GlobalTensor's fields (``_local``, ``_layout``) directly: this is the
per-op hot path, where a property call per operand is measurable.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .. import comm, explicit_mode, gradsync, modes, rules  # noqa: F401  (rules: every family registers)
from ..boxing.plan import plan_route
from ..boxing.reuse import box_reusing
from ..boxing.run import box
from ..local_parts import traced_from
from ..planner import pins, record, traced  # noqa: F401  (pins: watches to_global)
from ..propagation import plain
from ..propagation.cache import cached_decision, direct_call
from ..propagation.call import flatten_args, unflatten_args
from ..propagation.decide import Decision, NoMetaKernel
from ..propagation.options import options
from ..rules.attention_scores import AttentionScores
from ..rules.data_dependent import run_on_whole_values
from ..rules.registry import FallbackWarning, lookup_decomposition
from ..sbp import broadcast
from ..tensor import GlobalTensor, install_dispatcher, wrap_as
from . import copied_views
from .copied_views import records as _copied_views
from .outputs import identities, wrap_outputs
from .outputs import in_backward as _in_backward

aten = torch.ops.aten
_PLAIN = torch.Tensor


def dispatch(func, types, args, kwargs):
    """``__torch_dispatch__`` of GlobalTensor: ``func`` on global operands.

    The active mode (``modes.py``), read once, sees the call first: with none on (or
    none that changes this call, ``_passed``), a repeated call takes the warm path.
    Decompositions go first (which may decline).
    Otherwise plain tensor operands become broadcast where allowed
    (``implicit_broadcast()``, backward formulas), leaves that require grad are
    watched for gradient sync, and the call goes down the modes' chain to the plain
    path: its decision looked up or made, and carried out.

    >>> (x @ w).relu()      # each op enters here once     # doctest: +SKIP
    """
    mode = modes.active
    if mode is not None and mode.fakes:    # gt.debug.check_step: ops run on fake parts
        args, kwargs = mode.operands(args, kwargs)
    special = _special.get(func._op)   # (keyed so: an OpOverload's hash is Python's)
    if special is None:
        special = _special[func._op] = _special_handler(func)
    if special is not _NORMAL:
        out = special(*args, **kwargs)
        if out is not NotImplemented:
            return out
    # The warm path, also for a call whose decomposition declined (an index checked)
    found = direct_call(func, args, kwargs, gradsync.watch) if mode is None else \
        _passed(mode, func, args, kwargs)
    if found is not None:
        if found[0].direct is not None:
            return _direct(found[0], found[1], args, kwargs)
        return _carry_out(func, found[0], [*args, *kwargs.values()] if kwargs else list(args),
                          (len(args), tuple(kwargs)))   # (its boxing: no flattening, no modes)
    leaves, spec = flatten_args(args, kwargs)
    fake, viewed = _take_leaves(func, leaves, args)
    if viewed is not None:
        return viewed
    tracing = fake and comm.tracing()   # torch.compile traces with fake or functional parts
    try:
        if mode is not None:
            return mode.call(func, leaves, spec, tracing)
        if tracing:
            return PLAIN_PATH.call(func, leaves, spec, tracing)
        return _carry_out(func, cached_decision(func, leaves, spec), leaves, spec)
    except NoMetaKernel:   # (raised before anything is sent; the op runs so from now on)
        run = _special[func._op] = _on_whole_values(func)
        return run(*args, **kwargs)


def _take_leaves(func, leaves: list, args: tuple) -> tuple:
    """The general path's pass over a call's flattened operands, changing ``leaves`` in
    place: leaves that require grad are watched for gradient sync, plain tensors become
    broadcast where allowed, deferred GlobalTensors are computed. Returns (whether a
    part is fake, as while torch.compile traces; the call's result where a deferred
    operand gives it itself, else None)."""
    fake = False    # a part that is no plain tensor: torch.compile may be tracing
    taken = []      # plain tensors taken as broadcast
    for i, x in enumerate(leaves):
        if type(x) is GlobalTensor:
            if x.requires_grad and x.is_leaf:
                gradsync.watch(x)
            if x._local.__class__ is not _PLAIN:
                fake = True
        elif x.__class__ is AttentionScores:
            # deferred (attention's scores, rules/attention_scores.py), met below
            # autograd: torch.matmul's view back to the batch dims keeps it so; inside
            # another op's kernel it is computed here (autograd holds its history)
            viewed = x.viewed(func, args)
            if viewed is not None:
                return False, viewed
            leaves[i] = x.realized()
        elif isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() \
                and not _in_backward():
            # a plain parameter, or a tensor computed from one (F.linear's weight.t()):
            # its gradient made plain (and it taken as broadcast where allowed, as below)
            plain.watch_gradient(x)
            if x._base is not None:   # (and the parameter: a recompute makes a new view)
                plain.watch_gradient(x._base)
            if x.numel() > 1 and (modes.implicit or comm.tracing()) or _one_element_operand(x, func):
                taken.append(i)
        elif isinstance(x, torch.Tensor) and (x.numel() > 1 and (
                modes.implicit or _in_backward() or comm.tracing()) or _one_element_operand(x, func)):
            # While torch.compile traces, converted modules' scopes are skipped (dynamo
            # would apply the counter's change after the trace that reads it): a plain
            # tensor the traced code built (positions, masks, rotary tables) is taken
            # as broadcast there, as the scope takes it eagerly.
            taken.append(i)
    for i in taken:
        leaves[i] = plain.as_broadcast(leaves[i], leaves, func)
    return fake, None


def _one_element_operand(x: torch.Tensor, func) -> bool:
    """A plain operand of one element in a dim (an index ``(1,)``, ``nn.PReLU``'s weight)
    of an op outside the pointwise family: taken as broadcast, as its value is whole on
    every rank, so that the op's rule sees every tensor operand it was written for (a
    rule that met it plain misread which sbp was whose). A 0-d one stays plain: the
    scalars of pointwise ops and of the optimizers' kernels, which their rules take."""
    return x.numel() == 1 and x.dim() > 0 and torch.Tag.pointwise not in func.tags


class PlainPath(modes.Mode):
    """The bottom of the modes' chain: the op's decision looked up or made per op (or,
    while torch.compile traces, the plan a traced graph follows), and carried out."""

    def operands(self, args: tuple, kwargs: dict) -> tuple:
        return args, kwargs

    def call(self, func, leaves: list, spec, tracing: bool):
        if tracing and (record.ENABLED or record.state.plans):
            return record.STEP.call(func, leaves, spec, True)   # may replay a plan, or be recorded
        return modes.top().run(func, cached_decision(func, leaves, spec), leaves, spec, None)

    def run(self, func, decision: Decision, leaves: list, spec, why):
        return _carry_out(func, decision, leaves, spec, why)


PLAIN_PATH = PlainPath()
modes.install_plain_path(PLAIN_PATH)


class FakeParts(modes.Mode):
    """Every op inside runs on fake local parts made by ``mode`` (a ``FakeTensorMode``
    that allows real inputs): no values, no compute (``gt.debug.check_step``). Each
    GlobalTensor operand gets a twin of the same layout; the program's tensors keep
    their real parts."""

    def __init__(self, mode):
        self.mode = mode

    def operands(self, args: tuple, kwargs: dict) -> tuple:
        args, kwargs = self.below.operands(args, kwargs)

        def fake(x):
            if type(x) is not GlobalTensor or x._local.__class__ is not _PLAIN:
                return x
            if x.requires_grad and x.is_leaf:
                gradsync.watch(x)   # as a real step would (the twin is no leaf)
            return GlobalTensor(self.mode.from_tensor(x._local), x._layout)
        leaves, spec = tree_flatten((args, kwargs))
        return tree_unflatten([fake(x) for x in leaves], spec)


def fake_parts(mode) -> FakeParts:
    """Run every op inside on fake local parts made by ``mode`` (``FakeParts``)."""
    return FakeParts(mode)


def _passed(mode, func, args: tuple, kwargs: dict):
    """The warm path's (decision, local parts) of a call that the modes on leave as it
    is: the functional steps' watch where no step begins here, and the replay of a step
    where this is the call planned next (by index: ``record.replay_by_index``); else
    None (the modes' chain takes it)."""
    if mode is record.WATCH:
        if not mode.passes():
            return None
        mode = mode.below
        if mode is PLAIN_PATH:
            return direct_call(func, args, kwargs, gradsync.watch)
    if mode is record.STEP and mode.below is PLAIN_PATH:
        return record.replay_by_index(func, args, kwargs)
    return None


def _direct(decision: Decision, local: list, args, names):
    """The warm path of a repeated (or replayed) call: its decision runs directly
    (``propagation/direct.py``) on the arguments' local parts (``cache.call_key``: the
    positional ones, then those named ``names``), and its outputs are wrapped as the
    decision precomputed; the general path gives the same result."""
    if names:
        n = len(args)
        out = decision.direct(*local[:n], **dict(zip(names, local[n:])))
    else:
        out = decision.direct(*local)
    if decision.inplace:
        if _copied_views:
            copied_views.write_back(args[0])
        return args[0]
    if decision.view and torch.is_inference_mode_enabled():
        with torch.inference_mode(False):   # (see ``_carry_out``)
            result = _wrapped(decision, out)
    else:
        result = _wrapped(decision, out)
    if decision.view and _copied_views:
        copied_views.propagate(result, args[0])
    return result


def _wrapped(decision: Decision, out):
    if decision.multi is None:
        return wrap_as(out, decision.wraps[0])
    # (an undefined tensor out is None, where its meta kernel gave one)
    return decision.multi([None if o is None else wrap_as(o, how) for o, how in zip(out, decision.wraps)])


def _carry_out(func, decision: Decision, leaves, spec, why=None):
    """Run ``decision``: a call that needs no boxing runs its local op directly, the
    rest goes through ``_run`` (``why`` names its boxing: by default ``func``)."""
    if decision.direct is not None:
        local = [x._local if x.__class__ is GlobalTensor else x for x in leaves]
        n, names = spec
        return _direct(decision, local, leaves[:n] if names else leaves, names)
    if decision.view and torch.is_inference_mode_enabled():
        # Under inference_mode torch makes a view of a tensor made outside it share that
        # tensor's version counter, which a wrapper made inside (an inference tensor)
        # cannot take: "Cannot set version_counter for inference tensor". Made outside,
        # it is a normal tensor, as torch's own view of a normal tensor is.
        with torch.inference_mode(False):
            return _run(func, decision, leaves, spec, why)
    return _run(func, decision, leaves, spec, why)


def _explicit_check(region, func, decision: Decision, leaves, spec) -> Decision:
    """In an explicit region (``gt.explicit()``): ``decision``, or where it would send
    data to box an operand, the first signature the op's rule allows that sends none (a
    broadcast operand made a partial addend locally, say); else ``LayoutError`` before
    anything is sent. Also raised where an op makes a partial result and partials are
    not allowed (``explicit_mode.py``)."""
    if func is aten._is_any_true.default:   # anomaly detection's check of a gradient
        return decision
    moves = _sending_moves(decision.gidx, decision.targets, leaves)
    if moves:
        opts = options(func, leaves, spec, decision)
        quiet = [k for k, (targets, _) in enumerate(opts.signatures if opts else ())
                 if not _sending_moves(decision.gidx, targets, leaves)]
        if not quiet:
            raise explicit_mode.op_boxing_error(func, moves)
        decision = opts.decision(quiet[0], tuple(leaves[i]._layout for i in decision.gidx))
    if not region.allow_partial:
        outs = [o if r is None else r for o, r in
                zip(decision.out_layouts, decision.reduced or (None,) * len(decision.out_layouts))]
        made = explicit_mode.makes_partial(list(decision.targets), outs)
        if made:
            raise explicit_mode.partial_error(func, made)
    return decision


def _sending_moves(gidx: tuple, targets: tuple, leaves) -> list:
    """(position, layout, target, plan) of each operand whose boxing to ``targets``
    sends data (a local slice or view does not)."""
    moves = []
    for i, target in zip(gidx, targets):
        layout = leaves[i]._layout
        if layout is not target and layout != target:
            plan = plan_route(layout, target, leaves[i].element_size())
            if plan.sends:
                moves.append((i, layout, target, plan))
    return moves


_NORMAL = object()  # in ``_special``: the op takes the rule path
_special: dict = {}  # per op (its C++ callable): its decomposition, or _NORMAL


def _on_whole_values(func):
    """How an op without a Meta kernel runs from now on: on its operands' whole values,
    gathered to broadcast, as an op whose output shape depends on the values (warned
    once: correct but slow)."""
    warnings.warn(f"globaltensor: {func} cannot run on meta tensors (torch has no Meta "
                  f"kernel for it), so its output shapes are known only by running it: "
                  f"its inputs are gathered to broadcast and it runs on the whole values "
                  f"(correct but slow)", FallbackWarning, stacklevel=4)

    def run(*args, **kwargs):
        return run_on_whole_values(func, args, kwargs)
    return run


def _special_handler(func):
    """What runs instead of the rule path: the op's decomposition, or its family's (out=
    variants, ``_foreach_*``, value reads), from the registry."""
    decomposition = lookup_decomposition(func)
    return _NORMAL if decomposition is None else decomposition


def _run(func, decision: Decision, leaves, spec, why=None):
    """Carry out ``decision``: box each global input to its target layout, run the op
    (or the rule's local implementation) on this rank's parts, and wrap the outputs with
    their layouts. A rank outside the placement computes nothing and returns empty
    parts with the right metadata; an in-place op returns its target."""
    if decision.inplace and decision.fallback:
        return _inplace_via_functional(func, leaves, spec)
    rank = comm.get_rank()
    gidx = decision.gidx
    inside = rank in leaves[gidx[0]]._layout.placement
    local_leaves = list(leaves)
    reusing = None
    for i, target in zip(gidx, decision.targets):
        x = leaves[i]
        layout = x._layout
        if layout is target or layout == target:
            local_leaves[i] = x._local
            continue
        if reusing is None:
            # an op of torch's own that neither writes nor views its inputs (its outputs
            # share no memory with them) may take a boxing a recent op made (boxing/reuse.py)
            reusing = not (decision.inplace or decision.view or decision.local is not None
                           or comm.tracing() or func._schema.is_mutable)
        local_leaves[i] = box_reusing(x, x._local, layout, target, why or func) if reusing \
            else box(x._local, layout, target, why=why or func)
    if not inside:
        out = None
    elif decision.empty_shortcut:
        out = identities(decision, rank)
        if comm.tracing():  # (the same data edges on every rank: ``traced_from``)
            sources = [t for t in local_leaves if isinstance(t, torch.Tensor)]
            out = tree_map_only(torch.Tensor, lambda o: traced_from(o, sources), out)
    else:
        args, kwargs = unflatten_args(local_leaves, spec)
        if decision.local is not None:
            out = decision.local(decision.ctx, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
    if decision.inplace:
        if _copied_views:
            copied_views.write_back(leaves[0])
        return leaves[0]
    result = wrap_outputs(func, decision, out, inside, leaves[gidx[0]]._local, why)
    if decision.view and inside:
        # a view of a boxed copy: an in-place write through it goes back to the source
        source, target = leaves[gidx[0]], decision.targets[0]
        if source._layout is not target and source._layout != target:
            copied_views.remember(result, source, local_leaves[gidx[0]], target)
        elif _copied_views:
            copied_views.propagate(result, source)
    return result


def _inplace_via_functional(func, leaves, spec):
    """An in-place op whose rules cannot keep the target's layout: compute the
    functional op globally, then box the result into the target's layout."""
    functional, names = _functional_of(func)
    args, kwargs = unflatten_args(leaves, spec)
    target = args[0]
    result = functional(**dict(zip(names, args)), **kwargs)   # (by name: the order may differ)
    if not isinstance(result, GlobalTensor):
        raise RuntimeError(f"{func}: unexpected functional result {type(result).__name__}")
    if not isinstance(target, GlobalTensor):   # a plain one-element target: the whole value
        whole = result._layout.with_sbp((broadcast,) * result._layout.placement.ndim)
        local = box(result._local, result._layout, whole, why=func)
        if comm.get_rank() in whole.placement:
            target.copy_(local)
        return target
    local = box(result._local, result._layout, target._layout, why=func)
    if comm.get_rank() in target.placement:
        target._local.copy_(local)
    if _copied_views:
        copied_views.write_back(target)
    return target


@functools.lru_cache(maxsize=None)
def _functional_of(func):
    """The functional overload of in-place ``func``, and the names of ``func``'s
    positional arguments: found by the arguments' names and types, as overload names
    differ (``pow_.Scalar`` is ``pow.Tensor_Scalar``) and so may the order
    (``polygamma_(self, n)``, ``polygamma(n, self)``)."""
    def arguments(op):
        return [(a.name, str(a.type)) for a in op._schema.arguments if not a.kwarg_only]
    packet = getattr(aten, func.overloadpacket.__name__.rstrip("_"))
    want = arguments(func)
    for name in [func._overloadname] + sorted(packet.overloads()):
        op = getattr(packet, name, None)
        if op is not None and sorted(arguments(op)) == sorted(want) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
            return op, tuple(name for name, _ in want)
    raise NotImplementedError(f"{func}: no functional overload of {packet} takes its arguments")


explicit_mode.Region.check = _explicit_check
install_dispatcher(dispatch)
