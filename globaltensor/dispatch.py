"""__torch_dispatch__ for GlobalTensor: pick an sbp signature, box inputs, run locally.

For one call: the output metadata comes from running the op on meta tensors; the op's
rule (``rules/``) lists 1-D signatures per placement axis; the combination with the
least boxing cost from the inputs' current layouts wins (none needed is best). Inputs
are boxed, the op (or its local implementation) runs on local tensors, outputs are
wrapped. Decisions are cached per (op, input layouts and dtypes, non-tensor
arguments), so a repeated call only flattens, looks up and runs. Ops without a rule
gather their inputs to broadcast (a warning once per op). In-place ops keep their
first argument's layout. ``_foreach_*`` ops run as one call on the local parts when
their per-tensor op is pointwise and the tensors at each index share a layout without
partials (optimizer steps), else element by element (``_foreach_norm`` has its own
decomposition: one collective for all partial norms); some ops decompose into other
global ops when their data spans ranks (softmax over a split dim, ...). A 0-d output
that the chosen signature makes partial (a loss, ``x.sum()`` over split rows) is
reduced to broadcast at once, outside backward, so any one rank can read it.

This module and tensor.py read GlobalTensor's fields (``_local``, ``_layout``) directly:
this is the per-op hot path, where a property call per operand is measurable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import comm, gradsync, reads
from .advice import dtensor_operand_error, is_dtensor
from .boxing import plan_route
from .layout import Layout
from .parts import identity_value
from .placement import Placement
from .rules import Call, LocalCtx, flatten_args, lookup, lookup_decomposition, unflatten_args
from .sbp import Partial, Split, broadcast
from .tensor import (GlobalTensor, box, device_of, empty_local, gradient_layout,
                     install_dispatcher, wrap_part)

aten = torch.ops.aten


@dataclass(frozen=True)
class Decision:
    targets: tuple            # per global input: the Layout it is boxed to
    out_layouts: tuple        # per output leaf: Layout (None: not a tensor)
    out_dtypes: tuple         # per output leaf: dtype (for ranks that do not compute)
    out_spec: object          # pytree spec of the output (from the meta run)
    inplace: bool             # the op writes its first argument
    fallback: bool
    local: object = None      # replaces the op on local tensors, with a LocalCtx
    ctx: object = None        # the LocalCtx handed to ``local`` (fixed per decision)
    empty_shortcut: bool = False  # this rank lacks an input part: outputs are identities
    gidx: tuple = ()          # positions of the GlobalTensor arguments among the leaves
    single: bool = False      # the output is one tensor
    out_strides: tuple = ()   # per output leaf: global strides (None: contiguous)
    direct: object = None     # the op's C++ callable when it runs on the local parts as
                              # they are and returns one tensor (most repeated calls)
    out_consts: tuple = ()    # per output leaf: its value from the meta run when it is not
                              # a tensor (None gradients, sizes): what ranks outside give
    by_value: bool = False    # depends on the values of float arguments, not only types
    reduced: tuple = ()       # per output leaf: the partial layout a 0-d output is computed
                              # in before it is reduced to broadcast (None: it is not)


# Decisions by (op, argument spec, per leaf: a GlobalTensor's layout and dtype, a plain
# tensor's metadata, a constant's value; a float only by its type). Bounded: when full,
# the oldest quarter goes (hits stay a plain dict lookup).
CACHE_SIZE = 4096
_cache: dict = {}
# Decisions that depend on the value of a float argument (a rule looked at it, or a
# local implementation reads it): keyed again with the floats' values.
_BY_VALUE = object()
_by_value: dict = {}
_warned: set = set()


def _key_of(leaf):
    if type(leaf) is GlobalTensor:
        return leaf._key
    if leaf.__class__ is float:
        # Learning rates, bias corrections, scales: new values every step; keying on the
        # value grew the cache by one entry per parameter per step.
        return float
    if isinstance(leaf, torch.Tensor):  # its class: a DTensor is refused, a plain one not
        return "t", leaf.__class__, tuple(leaf.shape), leaf.dtype, leaf.device.type
    if isinstance(leaf, list):
        return tuple(leaf)  # sizes and dims; a list holding anything unhashable raises
    if isinstance(leaf, (dict, set)):
        raise TypeError  # unhashable: no caching
    return leaf


def _remember(cache: dict, key, decision) -> None:
    if len(cache) >= CACHE_SIZE:
        for old in list(itertools.islice(cache, CACHE_SIZE // 4)):
            del cache[old]
    cache[key] = decision


def _lookup(func, leaves, spec):
    """The cached decision for this call, deciding (and caching) it when new."""
    try:
        key = (func, spec, tuple([x._key if x.__class__ is GlobalTensor else _key_of(x)
                                  for x in leaves]))
        decision = _cache.get(key)
    except TypeError:
        return _decide_outside_trace(func, leaves, spec)
    if decision is None:
        decision = _decide_outside_trace(func, leaves, spec)
        if decision.by_value:
            _remember(_cache, key, _BY_VALUE)
            _remember(_by_value, (key, tuple(x for x in leaves if x.__class__ is float)),
                      decision)
        else:
            _remember(_cache, key, decision)
    elif decision is _BY_VALUE:
        by_value = (key, tuple(x for x in leaves if x.__class__ is float))
        decision = _by_value.get(by_value)
        if decision is None:
            decision = _decide_outside_trace(func, leaves, spec)
            _remember(_by_value, by_value, decision)
    return decision


def _decide_outside_trace(func, leaves, spec) -> Decision:
    """``_decide``, whose meta run stays on real meta tensors while torch.compile traces
    (the decision depends on metadata only, and is cached for eager calls too)."""
    if not comm.tracing():
        return _decide(func, leaves, spec)
    with _disable_current_modes():
        return _decide(func, leaves, spec)


def dispatch(func, types, args, kwargs):
    """``__torch_dispatch__`` of GlobalTensor: ``func`` on global operands.

    Special ops go first (out= variants, ``_foreach_*``, value ops, decompositions,
    which may decline). Otherwise: plain tensor operands become broadcast where allowed
    (``implicit_broadcast()``, backward formulas), the decision is looked up or made
    (``_decide``), and a call that needs no boxing runs its local op directly; the rest
    goes through ``_run``. Leaves that require grad are watched for gradient sync.

    >>> (x @ w).relu()      # each op enters here once     # doctest: +SKIP
    """
    special = _special.get(func)
    if special is None:
        special = _special[func] = _special_handler(func)
    if special is not _NORMAL:
        out = special(*args, **kwargs)
        if out is not NotImplemented:
            return out
    leaves, spec = flatten_args(args, kwargs)
    for i, x in enumerate(leaves):
        if type(x) is GlobalTensor:
            if x.requires_grad and x.is_leaf:
                gradsync.watch(x)
        elif isinstance(x, torch.Tensor) and x.numel() > 1 and (_implicit or _in_backward()):
            leaves[i] = _plain_as_broadcast(x, leaves, func)
    decision = _lookup(func, leaves, spec)
    op = decision.direct
    if op is not None:
        local = [x._local if x.__class__ is GlobalTensor else x for x in leaves]
        n, names = spec
        out = op(*local[:n], **dict(zip(names, local[n:]))) if names else op(*local)
        return wrap_part(out, decision.out_layouts[0], decision.out_strides[0])
    return _run(func, decision, leaves, spec)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_implicit = 0  # open implicit_broadcast() contexts


@contextlib.contextmanager
def implicit_broadcast() -> Iterator[None]:
    """Inside, a plain tensor operand of an op on GlobalTensors is taken as broadcast
    on the op's placement (each rank must pass the same value, as DTensor's
    ``implicit_replication``); GLOBALTENSOR_DEBUG=1 or ``gt.debug.check_consistency()``
    verify that it is. Outside, such operands raise ValueError.

    >>> pos = torch.arange(T)                 # doctest: +SKIP
    >>> with gt.implicit_broadcast():         # doctest: +SKIP
    ...     h = emb(pos)                      # emb's weight is a GlobalTensor
    """
    global _implicit
    _implicit += 1
    try:
        yield
    finally:
        _implicit -= 1


def _plain_as_broadcast(t: torch.Tensor, leaves, func) -> GlobalTensor:
    """A plain operand taken as broadcast on the op's placement: inside
    ``implicit_broadcast()``, or a tensor a backward formula built (zeros to scatter
    into, an index), which is the same on every rank."""
    if is_dtensor(t):
        raise dtensor_operand_error(func)
    placement = next(x.placement for x in leaves if type(x) is GlobalTensor)
    layout = Layout.make(t.shape, placement, (broadcast,) * placement.ndim)
    rank = comm.get_rank()
    if rank not in placement:
        return GlobalTensor(empty_local(layout, t.dtype), layout)
    if _implicit and comm.check_mode() and not comm.tracing():
        value = t.detach().cpu().contiguous().reshape(-1)
        comm.agree(zlib.crc32(value.view(torch.uint8).numpy().tobytes()), tuple(placement),
                   f"{func}: a plain operand of shape {tuple(t.shape)} taken as broadcast "
                   f"under gt.implicit_broadcast()",
                   "hold different values: a plain operand must be the same on every rank")
    return GlobalTensor(t.to(device_of(placement)), layout)


_NORMAL = object()
_special: dict = {}


def _special_handler(func):
    """What runs instead of the rule path: a _foreach loop, a value op, or a
    decomposition (which may decline with NotImplemented)."""
    if any(a.is_out for a in func._schema.arguments):
        return _out_variant(func)
    decomposition = lookup_decomposition(func)
    if func.overloadpacket.__name__.startswith("_foreach_") and decomposition is None:
        return lambda *args, **kwargs: _foreach(func, args, kwargs)
    if func in _VALUE_OPS:
        return _VALUE_OPS[func]
    return _NORMAL if decomposition is None else decomposition


def _out_variant(func):
    """``op(..., out=o)``: the functional op computed globally, then copied into ``o``,
    which keeps its layout (the rule path would write a boxed copy of ``o``)."""
    names = [a.name for a in func._schema.arguments if a.is_out]

    def run(*args, **kwargs):
        outs = [kwargs.pop(name) for name in names]
        result = func.overloadpacket(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for o, r in zip(outs, results):
            if tuple(o.shape) != tuple(r.shape):
                raise ValueError(f"{func}: out= has shape {tuple(o.shape)}, the result "
                                 f"{tuple(r.shape)}; a GlobalTensor out= is not resized")
            o.copy_(r)
        return outs[0] if len(outs) == 1 else tuple(outs)
    return run


# _foreach ops pass as a trailing positional argument what the per-tensor op takes as
# a keyword: _foreach_addcmul_(self, t1, t2, value) -> addcmul_(self, t1, t2, value=value).
_FOREACH_KEYWORD = {"addcmul": "value", "addcdiv": "value"}


def _foreach(func, args, kwargs):
    """``_foreach_op(lists, ...)``: the op on each index (lists zip, the rest repeat)."""
    if _foreach_is_local(func, args):
        # One call on the local parts, as plain torch would make (optimizer steps).
        local = [[t._local for t in a] if isinstance(a, (list, tuple)) and a
                 and isinstance(a[0], GlobalTensor) else a for a in args]
        out = func(*local, **kwargs)
        if out is None:
            return None
        return [wrap_part(o, t._layout) for o, t in zip(out, args[0])]
    name = func.overloadpacket.__name__[len("_foreach_"):]
    base = name.rstrip("_")
    op = getattr(aten, "linalg_vector_norm" if base == "norm" else name)
    n = len(args[0])

    def pick(a, i):
        if isinstance(a, (list, tuple)) and len(a) == n:
            return a[i]
        if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() == 1 \
                and a.numel() == n:
            return a[i].item()  # a tensor of per-element scalars
        return a

    outs = []
    for i in range(n):
        each = [pick(a, i) for a in args]
        extra = dict(kwargs)
        if base in _FOREACH_KEYWORD and len(each) > 3:
            extra[_FOREACH_KEYWORD[base]] = each.pop(3)
        outs.append(op(*each, **extra))
    return None if name.endswith("_") else outs


_FOREACH_POINTWISE: dict = {}


def _foreach_is_local(func, args) -> bool:
    """True when a _foreach op may run on the local parts in one call: its per-tensor op
    is pointwise (or copy_/zero_), every tensor is a GlobalTensor in a list, the tensors
    at each index share one layout without partials, this rank holds a part, and no
    gradient is recorded (gradient sync watches leaves op by op)."""
    pointwise = _FOREACH_POINTWISE.get(func)
    if pointwise is None:
        base = func.overloadpacket.__name__[len("_foreach_"):].rstrip("_")
        packet = getattr(aten, base, None)
        pointwise = _FOREACH_POINTWISE[func] = base in ("copy", "zero") or (
            packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags
                                       for o in packet.overloads()))
    if not pointwise:
        return False
    lists = [a for a in args if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], torch.Tensor)]  # not the lists of per-tensor scalars
    if any(isinstance(a, GlobalTensor) for a in args) or not lists:
        return False
    grad = torch.is_grad_enabled()
    rank = comm.get_rank()
    for row in zip(*lists):
        first = row[0]
        if type(first) is not GlobalTensor:
            return False
        layout = first._layout
        if layout.partial_axes or rank not in layout.placement:
            return False
        for t in row:
            if type(t) is not GlobalTensor or t._layout != layout or (grad and t.requires_grad):
                return False
    return True


# Ops that return a Python value (``reads.py``): a broadcast tensor's copy on this rank,
# else gathered by the ranks of its placement.
_VALUE_OPS = {
    aten._local_scalar_dense.default: lambda x: reads.item(x, "float(x) (or int(x))"),
    aten.equal.default: reads.equal,
    aten.is_nonzero.default: lambda x: bool(reads.item(x, "bool(x) (or `if x:`)")),
}


def _global_leaves(leaves):
    return [i for i, x in enumerate(leaves) if isinstance(x, GlobalTensor)]


def _check_inputs(func, leaves, gidx):
    placement = leaves[gidx[0]].placement
    for i in gidx[1:]:
        if leaves[i].placement != placement:
            raise ValueError(
                f"{func}: inputs are on different placements ({placement} and "
                f"{leaves[i].placement}); move them onto one with x.to_global(placement=...)")
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, GlobalTensor) and is_dtensor(x):
            raise dtensor_operand_error(func)
        if isinstance(x, torch.Tensor) and not isinstance(x, GlobalTensor) and x.numel() > 1:
            raise ValueError(
                f"{func}: mixes a GlobalTensor with a plain tensor of shape {tuple(x.shape)}; "
                f"only one-element plain tensors are allowed: make it global (gt.tensor / "
                f"gt.to_global), or run the op inside gt.implicit_broadcast() to take plain "
                f"operands as broadcast")
    return placement


def _meta(x):
    if isinstance(x, GlobalTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):  # not .to("meta"): a fake tensor would stay fake
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _decide(func, leaves, spec) -> Decision:
    """How to run ``func`` on these operands' layouts (cached by the caller).

    The op runs once on meta tensors for its output metadata; the rule's per-axis
    signatures are combined over the placement's axes and the combination whose input
    boxing costs least wins (parameters weigh more, padding an output to partial is
    charged its later reduction). Without a valid signature every input is gathered
    to broadcast (warned once per op). The decision also records the shortcuts
    ``_run`` and ``dispatch`` may take: a direct local op, the identity output of a
    rank holding an empty part."""
    gidx = _global_leaves(leaves)
    placement = _check_inputs(func, leaves, gidx)
    meta_leaves = [_meta(x) for x in leaves]
    meta_args, meta_kwargs = unflatten_args(meta_leaves, spec)
    if meta_kwargs.get("device") is not None:
        meta_kwargs = dict(meta_kwargs, device="meta")  # shape inference stays on meta
    meta_out = func(*meta_args, **meta_kwargs)
    out_leaves, out_spec = tree_flatten(meta_out)
    out_tensors = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
    inplace = _writes_first_arg(func)

    call = Call(func, [leaves[i] for i in gidx], [tuple(leaves[i].shape) for i in gidx],
                [tuple(out_leaves[i].shape) for i in out_tensors], leaves, spec, placement.shape)
    rule, local = lookup(func)
    best = None
    if rule is not None:
        per_axis = [rule(call, axis) for axis in range(placement.ndim)]
        current = [leaves[i]._layout for i in gidx]
        weights = [PARAMETER_WEIGHT if _is_parameter(leaves[i]) else 1.0 for i in gidx]
        for combo in itertools.product(*per_axis):
            ins = [tuple(c[0][k] for c in combo) for k in range(len(gidx))]
            outs = [tuple(c[1][k] for c in combo) for k in range(len(out_tensors))]
            if inplace and outs[0] != current[0].sbp:
                continue
            try:
                targets = [Layout.make(cur.shape, placement, s) for cur, s in zip(current, ins)]
            except ValueError:  # e.g. a split dim that a 0-d operand does not have
                continue
            # Any boxing at all costs a little, so "none needed" wins ties.
            cost = sum((plan_route(cur, tgt, leaves[i].element_size()).cost + 1e-9) * w
                       for cur, tgt, i, w in zip(current, targets, gidx, weights) if cur != tgt)
            for k, o in zip(out_tensors, outs):
                cost += _padded_partial_cost(out_leaves[k], placement, o, current, targets)
            if best is None or cost < best[0]:
                best = (cost, targets, outs)
    fallback = best is None
    if fallback:
        if inplace:
            return Decision((), (), (), out_spec, True, True, gidx=tuple(gidx))
        if func not in _warned:
            _warned.add(func)
            warnings.warn(f"globaltensor: {func} has no sbp rule; its inputs are gathered to "
                          f"broadcast (correct but slow)", stacklevel=4)
        nd_b = (broadcast,) * placement.ndim
        targets = [Layout.make(leaves[i].shape, placement, nd_b) for i in gidx]
        outs = [nd_b] * len(out_tensors)
        best = (0.0, targets, outs)
    _, targets, outs = best
    out_layouts = [None] * len(out_leaves)
    for i, s in zip(out_tensors, outs):
        out_layouts[i] = Layout.make(out_leaves[i].shape, placement, s)
    reduced = _reduced_scalars(func, out_layouts, inplace)
    dtypes = tuple(getattr(o, "dtype", None) for o in out_leaves)
    rank = comm.get_rank()
    shortcut = (not inplace and all(isinstance(o, torch.Tensor) for o in out_leaves)
                and any(0 in t.local_shape(rank) for t in targets)
                and all(l.partial_axes or 0 in l.local_shape(rank) for l in out_layouts))
    single = len(out_leaves) == 1 and isinstance(meta_out, torch.Tensor)
    strides = tuple(None if l is None or o.stride() == l.strides else tuple(o.stride())
                    for o, l in zip(out_leaves, out_layouts))
    # The context is cached with the decision: it holds meta tensors, not this call's.
    ctx = None if local is None else LocalCtx(
        dataclasses.replace(call, inputs=[meta_leaves[i] for i in gidx], leaves=meta_leaves),
        tuple(targets), tuple(l for l in out_layouts if l is not None), rank)
    direct = (single and not inplace and not fallback and local is None and not shortcut
              and not reduced and spec.__class__ is tuple and rank in placement
              and all(leaves[i]._layout == t for i, t in zip(gidx, targets)))
    # A non-tensor output of a meta run depends on metadata only (meta tensors hold no
    # data), so it is every rank's answer, also where the op does not run.
    consts = tuple(None if isinstance(o, torch.Tensor) else o for o in out_leaves)
    by_value = local is not None or any(v.__class__ is float for v in call._named.values())
    if reduced:
        out_layouts = [l if r is None else gradient_layout(l)
                       for l, r in zip(out_layouts, reduced)]
    return Decision(tuple(targets), tuple(out_layouts), dtypes, out_spec, inplace, fallback,
                    local, ctx, shortcut, tuple(gidx), single,
                    strides, func._op if direct else None, consts, by_value, reduced)


def _reduced_scalars(func, out_layouts: list, inplace: bool) -> tuple:
    """Which outputs are 0-d partials (a loss, ``x.sum()`` over split rows), reduced to
    broadcast as soon as the op made them: their layouts, per output leaf (None for the
    others), or () when there are none. A broadcast scalar reads without communication
    on any one rank (``if rank == 0: log(loss.item())``), where a partial one needs every
    rank of the placement; reducing it costs one tiny all-reduce, which its first read
    would have run anyway. Not for views or in-place ops, which must keep their base's
    or target's layout (and memory)."""
    if inplace or not any(l is not None and not l.shape and l.partial_axes for l in out_layouts):
        return ()
    if any(r.alias_info is not None for r in func._schema.returns):
        return ()
    return tuple(l if l is not None and not l.shape and l.partial_axes else None
                 for l in out_layouts)


# Moving a parameter costs more than its bytes once: its gradient comes back the same
# way in backward, and the parameter is moved again every step, while moving the
# activation instead keeps the layer as annotated (a Megatron column-split weight stays
# split; the activation is gathered).
PARAMETER_WEIGHT = 3.0


def _padded_partial_cost(out, placement: Placement, sbp: tuple, current: list,
                         targets: list) -> float:
    """What a partial output costs later when the signature makes an input partial
    (a split or broadcast input boxed to a partial addend, for free): the cheapest
    reduction out of it. Without it, greedy choice per op pads a batch-split activation
    into a full-size partial (no communication now, duplicated work) and gathers the
    weight instead of the activation, leaving a large reduction behind. Partials an op
    makes itself (a sum over a split dim) or passes on are not charged."""
    axes = [a for a, s in enumerate(sbp) if isinstance(s, Partial)
            and any(isinstance(t.sbp[a], Partial) and not isinstance(c.sbp[a], Partial)
                    for c, t in zip(current, targets))]
    if not axes:
        return 0.0
    src = Layout.make(out.shape, placement, sbp)
    size = out.element_size()
    cost = 0.0
    for a in axes:
        ends = [broadcast] + [Split(d) for d in range(out.dim())
                              if out.shape[d] >= placement.shape[a]]
        cost += min(plan_route(src, Layout.make(out.shape, placement,
                                                sbp[:a] + (e,) + sbp[a + 1:]), size).cost
                    for e in ends)
    return cost


def _is_parameter(x: GlobalTensor) -> bool:
    """A leaf that requires grad, or a view of one (``w.t()`` inside F.linear)."""
    base = x._base if x._base is not None else x
    return base.requires_grad and base.is_leaf


def _identity(layout: Layout, dtype, rank: int) -> torch.Tensor:
    shape = layout.local_shape(rank)
    fill = 0
    for axis in layout.partial_axes:
        fill = identity_value(layout.sbp[axis].reduce, dtype)
        break
    return torch.full(shape, fill, dtype=dtype, device=device_of(layout.placement))


def _writes_first_arg(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _run(func, decision: Decision, leaves, spec):
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
    for i, target in zip(gidx, decision.targets):
        x = leaves[i]
        layout = x._layout
        local_leaves[i] = x._local if layout is target or layout == target else \
            box(x._local, layout, target, why=func)
    if inside and decision.empty_shortcut:
        # This rank holds no part of some input: it contributes the identity of each
        # (partial or empty) output, which some kernels refuse to compute from nothing.
        computed = decision.reduced or decision.out_layouts
        out = tree_unflatten([_identity(r or layout, dtype, rank) for layout, r, dtype
                              in zip(decision.out_layouts, computed, decision.out_dtypes)],
                             decision.out_spec)
    elif inside:
        args, kwargs = unflatten_args(local_leaves, spec)
        if decision.local is not None:
            out = decision.local(decision.ctx, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
    else:
        out = None
    if decision.inplace:
        return leaves[0]
    like = None if inside else leaves[gidx[0]]._local  # empty parts are made from it
    if decision.reduced:
        return _wrap_reduced(func, decision, out, inside, like)
    if decision.single:  # one tensor out: skip the pytree round trip
        layout = decision.out_layouts[0]
        return wrap_part(out if inside else empty_local(layout, decision.out_dtypes[0], like),
                         layout, decision.out_strides[0])
    if inside:
        out_leaves, out_spec = tree_flatten(out)
    else:
        out_leaves, out_spec = [None] * len(decision.out_layouts), decision.out_spec
    wrapped = []
    for o, layout, dtype, strides, const in zip(out_leaves, decision.out_layouts,
                                                decision.out_dtypes, decision.out_strides,
                                                decision.out_consts):
        if layout is not None:
            wrapped.append(wrap_part(o if inside else empty_local(layout, dtype, like), layout,
                                     strides))
        else:
            wrapped.append(o if inside else const)
    return tree_unflatten(wrapped, out_spec)


def _wrap_reduced(func, decision: Decision, out, inside: bool, like):
    """The outputs of a decision with 0-d partial outputs, those reduced to broadcast:
    one all-reduce per (layout, dtype) among them. In backward they stay partial: there
    a scalar's partial gradient (of a 0-d parameter) joins the bucketed gradient sync,
    or stays local under ``no_sync()``, as any other."""
    if inside:
        out_leaves = [out] if decision.single else tree_flatten(out)[0]
    else:
        out_leaves = [None] * len(decision.out_layouts)
    layouts = list(decision.out_layouts)
    if _in_backward():
        layouts = [layout if r is None else r for layout, r in zip(layouts, decision.reduced)]
    elif inside:
        together: dict = {}
        for k, r in enumerate(decision.reduced):
            if r is not None:
                together.setdefault((r, decision.out_dtypes[k]), []).append(k)
        for (src, _), ks in together.items():
            for k, local in zip(ks, _reduce_together([out_leaves[k] for k in ks], src, func)):
                out_leaves[k] = local
    wrapped = []
    for o, layout, dtype, strides, const in zip(out_leaves, layouts, decision.out_dtypes,
                                                decision.out_strides, decision.out_consts):
        if layout is None:
            wrapped.append(o if inside else const)
        else:
            wrapped.append(wrap_part(o if inside else empty_local(layout, dtype, like), layout,
                                     strides))
    return wrapped[0] if decision.single else tree_unflatten(wrapped, decision.out_spec)


def _reduce_together(scalars: list, src: Layout, why) -> list:
    """0-d partial parts of one layout and dtype, reduced to broadcast in one collective."""
    dst = gradient_layout(src)
    if len(scalars) == 1:
        return [box(scalars[0], src, dst, donate=True, why=why)]
    n = len(scalars)
    stacked = box(torch.stack(scalars), Layout.make((n,), src.placement, src.sbp),
                  Layout.make((n,), dst.placement, dst.sbp), donate=True, why=why)
    return [stacked[k] for k in range(n)]  # selects: unbind would trace as getitem calls


def _inplace_via_functional(func, leaves, spec):
    """An in-place op whose rules cannot keep the target's layout: compute the
    functional op globally, then box the result into the target's layout."""
    name = func.overloadpacket.__name__.rstrip("_")
    functional = getattr(getattr(aten, name), func._overloadname)
    args, kwargs = unflatten_args(leaves, spec)
    target = args[0]
    result = functional(*args, **kwargs)
    if not isinstance(result, GlobalTensor):
        raise RuntimeError(f"{func}: unexpected functional result {type(result).__name__}")
    local = box(result._local, result._layout, target._layout, why=func)
    if comm.get_rank() in target.placement:
        target._local.copy_(local)
    return target


install_dispatcher(dispatch)
