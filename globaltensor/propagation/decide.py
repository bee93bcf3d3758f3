"""Sharding propagation: how one call runs, as a ``Decision`` (cached by ``cache.py``).

The op runs once on meta tensors for its output metadata; its rule's per-axis
signatures are combined over the placement's axes and each combination is priced (the
boxing of its inputs, parameters weighing more, and what the choice leaves for later
calls: ``later.py``); the cheapest wins. Without a valid signature every input is gathered
to broadcast (warned once per op). The decision also records the shortcuts the run
step may take: a direct local op, the identity output of a rank holding an empty part,
0-d partial outputs to reduce at once.

>>> decide(aten.mm.default, [x, w], (2, ()))   # doctest: +SKIP
Decision(targets=(...), out_layouts=(...), ...)
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from .. import comm
from ..advice import dtensor_operand_error, is_dtensor
from ..boxing.plan import pair_cost
from ..cost import PARAMETER_WEIGHT, returns_view, ring_seconds, writes_nothing
from ..layout import Layout
from ..placement import Placement
from ..rules.registry import FallbackWarning, lookup, lookup_check, lookup_meta
from ..sbp import Split, StridedSplit, broadcast
from ..tensor import GlobalTensor
from .call import Call, LocalCtx, unflatten_args
from .direct import flat_outputs, runner, wraps_of
from .later import padded_partial_cost, return_cost, stream_layouts


@dataclass(frozen=True, kw_only=True)
class Decision:
    """How a call runs on this rank: what its inputs are boxed to, what it outputs."""
    targets: tuple            # per global input: the Layout it is boxed to
    out_layouts: tuple        # per output leaf: Layout (None: not a tensor)
    out_dtypes: tuple         # per output leaf: dtype (for ranks that do not compute)
    out_spec: object          # pytree spec of the output (from the meta run)
    inplace: bool             # the op writes its first argument
    fallback: bool            # no signature fits: inputs gathered to broadcast
    local: object = None      # replaces the op on local tensors, with a LocalCtx
    ctx: object = None        # the LocalCtx handed to ``local`` (fixed per decision)
    empty_shortcut: bool = False  # outputs are identities here (``_empty_shortcut``)
    gidx: tuple = ()          # positions of the GlobalTensor arguments among the leaves
    single: bool = False      # the output is one tensor
    out_strides: tuple = ()   # per output leaf: global strides (None: contiguous)
    direct: object = None     # the op's C++ callable (or its local implementation with
                              # ``ctx``) when it runs on the local parts as they are and
                              # returns one tensor, or writes its target in place (most
                              # repeated calls)
    out_consts: tuple = ()    # per output leaf: its value from the meta run when it is not
                              # a tensor (None gradients, sizes): what ranks outside give
    by_value: bool = False    # depends on the values of float arguments, not only types
    reduced: tuple = ()       # per output leaf: the partial layout a 0-d output is computed
                              # in before it is reduced to broadcast (None: it is not)
    wraps: tuple = ()         # a direct decision's outputs: ``tensor.wrapping`` of each
    multi: object = None      # tuple or list: a direct decision's outputs are several
    view: bool = False        # the op returns views of an input (``dispatch``: under
                              # inference_mode their wrappers are made outside it)
    choice: tuple = dataclasses.field(  # what every rank decides alike (``_choose``):
        default=None, compare=False, repr=False)   # a simulated world's others take it


@dataclass(frozen=True)
class _MetaRun:
    """The op's outputs on meta tensors: what every rank knows of them."""
    leaves: list              # the call's leaves, tensors as meta tensors
    out: object               # the meta output
    out_leaves: list
    out_spec: object
    out_tensors: list         # positions of the tensors among ``out_leaves``


_warned: set = set()  # ops warned of as falling back


class NoMetaKernel(Exception):
    """The op cannot run on meta tensors (torch has no Meta kernel for it:
    ``multi_margin_loss_backward``, ``_ctc_loss``), so its outputs' shapes are known
    only from a real run; raised before any communication."""


def decide(func, leaves: list, spec, choice: "tuple | None" = None) -> Decision:
    """How to run ``func`` on these operands' layouts; ``choice``: the ``Decision.choice``
    of this call decided on another rank of this process (a simulated world). Its meta
    run stays on real meta tensors while torch.compile traces (the decision depends on
    metadata only, and is cached for eager calls too)."""
    if not comm.tracing():
        return _decide(func, leaves, spec, choice)
    with _disable_current_modes():
        return _decide(func, leaves, spec, choice)


def _decide(func, leaves: list, spec, choice: "tuple | None") -> Decision:
    gidx = tuple(i for i, x in enumerate(leaves) if isinstance(x, GlobalTensor))
    if choice is None:
        choice = _choose(func, leaves, spec, gidx)
    meta, targets, out_layouts, fallback, read_floats = choice
    inplace = _writes_first_arg(func)
    if targets is None:   # in place, without a signature
        return Decision(targets=(), out_layouts=(), out_dtypes=(), out_spec=meta.out_spec,
                        inplace=True, fallback=True, gidx=gidx, choice=choice)
    call = _call_of(func, leaves, spec, gidx, meta)
    return _finish(call, meta, lookup(func)[1], gidx, targets, list(out_layouts), inplace,
                   fallback, choice=choice, read_floats=read_floats)


def _choose(func, leaves: list, spec, gidx: tuple) -> tuple:
    """(meta run, input targets, output layouts, fallback, whether the rule read a float
    argument): the part of a decision that does not depend on the rank (every rank of an
    SPMD program chooses alike); targets None for an in-place op without a signature."""
    placement = _check_inputs(func, leaves, gidx)
    meta = _meta_run(func, leaves, spec)
    inplace = _writes_first_arg(func)
    rule, local = lookup(func)
    call = _call_of(func, leaves, spec, gidx, meta)
    best = None if rule is None else _cheapest(call, rule, meta, gidx, inplace,
                                               strided_ok=local is None)
    read_floats = any(v.__class__ is float for v in call._named.values())
    fallback = best is None
    if fallback:
        if inplace:
            return meta, None, None, True, read_floats
        best = _fallback(func, leaves, gidx, placement, len(meta.out_tensors))
    targets, outs = best
    out_layouts = [None] * len(meta.out_leaves)
    for i, s in zip(meta.out_tensors, outs):
        out_layouts[i] = Layout.make(meta.out_leaves[i].shape, placement, s)
    return meta, targets, tuple(out_layouts), fallback, read_floats


def _call_of(func, leaves: list, spec, gidx: tuple, meta: "_MetaRun",
             strided_blocks: tuple = ()) -> Call:
    return Call(func, [leaves[i] for i in gidx], [tuple(leaves[i].shape) for i in gidx],
                [tuple(meta.out_leaves[i].shape) for i in meta.out_tensors], leaves, spec,
                leaves[gidx[0]].placement.shape, strided_blocks)


def _check_inputs(func, leaves: list, gidx: tuple) -> Placement:
    """The placement of the call: one for all GlobalTensor inputs, and plain tensor
    operands of one element only (a DTensor not at all)."""
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
                f"operands as broadcast (also where torch builds the plain tensor itself, "
                f"as torch.combinations and torch.unravel_index do)")
    return placement


def _meta(x):
    if isinstance(x, torch.Tensor):  # not .to("meta"): a fake tensor would stay fake
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _meta_run(func, leaves: list, spec) -> _MetaRun:
    """The op run on meta tensors of the operands' global shapes, dtypes and strides."""
    meta_leaves = [_meta(x) for x in leaves]
    args, kwargs = unflatten_args(meta_leaves, spec)
    if kwargs.get("device") is not None:
        kwargs = dict(kwargs, device="meta")  # shape inference stays on meta
    meta = lookup_meta(func)
    try:
        if meta is None:
            out = func(*args, **kwargs)
        else:
            placement = next(x for x in leaves if isinstance(x, GlobalTensor)).placement
            out = meta(func, placement, *args, **kwargs)
    except NotImplementedError as e:
        raise NoMetaKernel(func) from e
    out_leaves, out_spec = tree_flatten(out)
    return _MetaRun(meta_leaves, out, out_leaves, out_spec,
                    [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)])


def _writes_first_arg(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _cheapest(call: Call, rule, meta: _MetaRun, gidx: tuple, inplace: bool,
              strided_ok: bool = False):
    """(input layouts, output sbps) of the cheapest valid combination of the rule's
    per-axis signatures, or None when none is valid. An in-place op must keep its
    target's layout."""
    leaves = call.leaves
    placement = leaves[gidx[0]].placement
    current = [leaves[i]._layout for i in gidx]
    parameters = [_is_parameter(leaves[i]) for i in gidx]
    weights = [PARAMETER_WEIGHT if p else 1.0 for p in parameters]
    sizes = [leaves[i].element_size() for i in gidx]
    out_metas = [meta.out_leaves[k] for k in meta.out_tensors]
    streams = stream_layouts(current, parameters)
    best, best_cost = None, None
    for targets, outs in _signatures(call, rule, meta, gidx, inplace, strided_ok):
        cost = _boxing_cost(current, targets, sizes, weights) + ring_seconds(
            call.func, targets, sizes[0])
        for out, sbp in zip(out_metas, outs):
            cost += padded_partial_cost(out, placement, sbp, current, targets)
            if streams:
                cost += return_cost(out, placement, sbp, streams)
        if best is None or cost < best_cost:
            best, best_cost = (targets, outs), cost
    return best


def _signatures(call: Call, rule, meta: _MetaRun, gidx: tuple, inplace: bool,
                strided_ok: bool):
    """Every valid (input layouts, output nd-sbps) of the call."""
    leaves = call.leaves
    placement = leaves[gidx[0]].placement
    current = [leaves[i]._layout for i in gidx]
    check = lookup_check(call.func)
    # An in-place op keeps its target's layout, and takes the target as it is (boxed,
    # the op would write a copy); a plain (one-element) target holds the whole value on
    # every rank, as broadcast does.
    kept = current[0].sbp if gidx[0] == 0 else (broadcast,) * placement.ndim
    for ins, outs in _combinations(call, rule, len(gidx), len(meta.out_tensors), strided_ok):
        if inplace and (outs[0] != kept or (gidx[0] == 0 and ins[0] != kept)):
            continue
        try:
            targets = tuple(Layout.make(cur.shape, placement, s) for cur, s in zip(current, ins))
            made = [Layout.make(meta.out_leaves[k].shape, placement, sbp)
                    for k, sbp in zip(meta.out_tensors, outs)]
        except ValueError:  # e.g. a split dim that a 0-d operand does not have
            continue
        if check is not None and not check(call, targets, made):
            continue
        yield targets, outs


def _combinations(call: Call, rule, n_in: int, n_out: int, strided_ok: bool = False):
    """Every combination of the rule's 1-D signatures over the placement's axes, as
    (per input: its nd-sbp, per tensor output: its nd-sbp)."""
    per_axis = [rule(call, axis) if rule.per_axis else rule(call) for axis in range(len(call.axis_sizes))]
    if strided_ok:
        per_axis = [_with_strided(call, axis, cands) for axis, cands in enumerate(per_axis)]
    for combo in itertools.product(*per_axis):
        yield ([tuple(c[0][k] for c in combo) for k in range(n_in)],
               [tuple(c[1][k] for c in combo) for k in range(n_out)])


def _with_strided(call: Call, axis: int, cands: list) -> list:
    """``cands`` and, where an input holds a strided split on ``axis``, each signature
    with its splits made strided alike. Sound for ops that run on the parts as they
    are (no local implementation reading offsets): such an op pairs element i of one
    operand's split dim with element i of the others', and a strided split of equal
    lengths puts equal indices on one rank in one order, as a plain split does."""
    blocks = call.strided_counts(axis=axis)
    if not blocks:
        return cands
    shapes = list(call.in_shapes) + list(call.out_shapes)
    out = list(cands)
    for k in blocks:
        for ins, outs in cands:
            sbps = list(ins) + list(outs)
            if any(isinstance(s, StridedSplit) for s in sbps):
                continue   # the rule's own blocks (cat's): other counts would not hold
            lengths = {shapes[i][s.dim] for i, s in enumerate(sbps) if isinstance(s, Split)}
            if len(lengths) == 1 and lengths.pop() % k == 0:
                made = [StridedSplit(s.dim, k) if isinstance(s, Split) else s for s in sbps]
                out.append((tuple(made[:len(ins)]), tuple(made[len(ins):])))
    return out


def _boxing_cost(current: list, targets: tuple, sizes: list, weights: list) -> float:
    # Any boxing at all costs a little, so "none needed" wins ties.
    return sum((pair_cost(cur, tgt, size) + 1e-9) * w
               for cur, tgt, size, w in zip(current, targets, sizes, weights) if cur != tgt)


def _is_parameter(x: GlobalTensor) -> bool:
    """A leaf that requires grad, or a view of one (``w.t()`` inside F.linear)."""
    base = x._base if x._base is not None else x
    return base.requires_grad and base.is_leaf


def _fallback(func, leaves: list, gidx: tuple, placement: Placement, n_out: int) -> tuple:
    """Every input gathered to broadcast, every output broadcast (warned once per op)."""
    if func not in _warned:
        _warned.add(func)
        warnings.warn(f"globaltensor: {func} has no sbp rule; its inputs are gathered to "
                      f"broadcast (correct but slow)", FallbackWarning, stacklevel=5)
    nd_b = (broadcast,) * placement.ndim
    return tuple(Layout.make(leaves[i].shape, placement, nd_b) for i in gidx), [nd_b] * n_out


def _finish(call: Call, meta: _MetaRun, local, gidx: tuple, targets: tuple,
            out_layouts: list, inplace: bool, fallback: bool,
            in_layouts: "tuple | None" = None, choice: "tuple | None" = None,
            read_floats: "bool | None" = None) -> Decision:
    """The decision for the chosen layouts, with the shortcuts of its run step.
    ``in_layouts``: the inputs' layouts when they are not the call's (a planned step);
    ``read_floats``: whether the rule read a float argument (None: ``call`` says)."""
    if read_floats is None:
        read_floats = any(v.__class__ is float for v in call._named.values())
    func, leaves = call.func, call.leaves
    if in_layouts is None:
        in_layouts = tuple(leaves[i]._layout for i in gidx)
    rank = comm.get_rank()
    reduced = _reduced_scalars(func, out_layouts, inplace)
    if reduced and all(r is None or r.same_parts(r.without_partials()) for r in reduced):
        # partial only on axes of one rank (a world of one): the addend is the sum
        out_layouts = [l if r is None else r.without_partials()
                       for l, r in zip(out_layouts, reduced)]
        reduced = ()
    shortcut = not inplace and not getattr(local, "communicates", False) and \
        _empty_shortcut(meta.out_leaves, targets, out_layouts, rank)
    single = len(meta.out_leaves) == 1 and isinstance(meta.out, torch.Tensor)
    multi = None if single or inplace else flat_outputs(meta.out)
    # Direct: no boxing (inputs hold their targets' parts), nothing to reduce, one output
    # or a flat tuple (list) of tensors.
    direct = ((single or multi is not None) and not fallback and not shortcut and not reduced
              and call.spec.__class__ is tuple and rank in targets[0].placement
              and all(cur == t or cur.same_parts(t) for cur, t in zip(in_layouts, targets)))
    # The context is cached with the decision: it holds meta tensors, not this call's.
    ctx = None if local is None else LocalCtx(
        dataclasses.replace(call, inputs=[meta.leaves[i] for i in gidx], leaves=meta.leaves),
        targets, tuple(l for l in out_layouts if l is not None), rank)
    strides = _out_strides(meta.out_leaves, out_layouts)
    if reduced:
        out_layouts = [l if r is None else l.without_partials()
                       for l, r in zip(out_layouts, reduced)]
    return Decision(
        targets=targets, out_layouts=tuple(out_layouts),
        out_dtypes=tuple(getattr(o, "dtype", None) for o in meta.out_leaves),
        out_spec=meta.out_spec, inplace=inplace, fallback=fallback, local=local, ctx=ctx,
        empty_shortcut=shortcut, gidx=gidx, single=single, out_strides=strides,
        direct=runner(func, local, ctx) if direct else None,
        wraps=wraps_of(meta.out_leaves, out_layouts, strides) if direct else (),
        multi=multi if direct else None,
        # (``_unsafe_view`` too: composite out= ops write through it, as kron's does)
        view=not inplace and writes_nothing(func),
        out_consts=_out_consts(meta.out_leaves),
        by_value=any(v.__class__ is float for v in leaves) and (  # floats to key by
            local is not None or read_floats),
        reduced=reduced, choice=choice)


def _empty_shortcut(out_leaves: list, targets: tuple, out_layouts: list, rank: int) -> bool:
    """Whether this rank's outputs are the identities of their layouts (zeros, or the
    lowest value of a partial max) without running the op, which some kernels refuse on
    empty parts (a max over nothing): when the rank holds an empty part of some input
    and every output is empty here or partial, and no input it holds a part of is
    partial. A partial input's addend is part of the result (``addmm``'s bias under a
    partial product): where one is held, the op runs. Outputs a mask left out (None,
    batch norm's backward) stay None; kernels may crash on empty parts (batch norm's
    backward divides by their size)."""
    if not all(isinstance(o, torch.Tensor) or o is None for o in out_leaves):
        return False
    if not any(0 in t.local_shape(rank) for t in targets):
        return False
    made = [l for l in out_layouts if l is not None]
    if all(0 in l.local_shape(rank) for l in made):
        return True
    return (all(l.partial_axes for l in made if 0 not in l.local_shape(rank))
            and not any(t.partial_axes and 0 not in t.local_shape(rank) for t in targets))


def _out_strides(out_leaves: list, out_layouts: list) -> tuple:
    """Per output leaf: the meta run's global strides where they are not contiguous."""
    return tuple(None if l is None or o.stride() == l.strides else tuple(o.stride())
                 for o, l in zip(out_leaves, out_layouts))


def _out_consts(out_leaves: list) -> tuple:
    # A non-tensor output of a meta run depends on metadata only (meta tensors hold no
    # data), so it is every rank's answer, also where the op does not run.
    return tuple(None if isinstance(o, torch.Tensor) else o for o in out_leaves)


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
    if returns_view(func):
        return ()
    return tuple(l if l is not None and not l.shape and l.partial_axes else None
                 for l in out_layouts)
