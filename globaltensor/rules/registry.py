"""Which rule, local implementation and decomposition an op has (a leaf module: the
family files register into it, dispatch looks up in it).

One form registers all three:

>>> @register(aten.mm, aten.bmm)                        # doctest: +SKIP
... def product_rule(call): ...
>>> @register(aten.cumsum, local=_cumsum_local)         # doctest: +SKIP
... def along_dim_rule(call): ...
>>> @register(aten.linalg_vector_norm, decompose=True)  # doctest: +SKIP
... def vector_norm_decomposition(x, ord=2, ...): ...

A rule gives the 1-D signatures of one placement axis, the same on every axis for
almost every op: ``rule(call)``, asked once per axis. A rule whose signatures differ by
axis (a reshape, whose parts depend on that axis's rank count) asks for it with
``per_axis=True`` and is called ``rule(call, axis)``:

>>> @register(aten.view, per_axis=True)                 # doctest: +SKIP
... def view_rule(call, axis): ...

A key may be an op, an ``OpOverloadPacket`` (every overload) or a ``torch.Tag``: the
rule registered for ``torch.Tag.pointwise`` serves every pointwise op without its own.

A family of ops shares one decomposition, made per op by a factory, for the ops a
predicate accepts (every op with out= arguments, every ``_foreach_*`` op):

>>> @register_family(lambda func: func._schema.name.startswith("aten::_foreach_"))  # doctest: +SKIP
... def foreach(func): return lambda *args, **kwargs: ...

An op's decomposition is looked up in this order: its overload's; its packet's, for
an overload without out= arguments (an out= overload computes its functional overload,
whose decomposition then applies); the first family whose predicate accepts it; last,
for an op without a rule that torch defines by other ops (CompositeImplicitAutograd),
those ops.
"""
from __future__ import annotations

from typing import Callable

import torch


class FallbackWarning(UserWarning):
    """An op with no sbp rule ran on broadcast copies: its inputs were gathered whole on
    every rank (correct, but slow). Warned once per op; ``gt.debug.FallbackWarning``.

    >>> warnings.simplefilter("error", gt.debug.FallbackWarning)   # doctest: +SKIP
    """


_RULES: dict = {}
_LOCAL: dict = {}
_CHECKS: dict = {}
_DECOMPOSITIONS: dict = {}
_FAMILIES: list = []  # (predicate, factory) in registration order
_META: dict = {}


def register(*funcs, local=None, check=None, decompose: bool = False, per_axis: bool = False):
    """Decorator. By default the function becomes the sbp rule of ``funcs``, called
    ``rule(call)``, or ``rule(call, axis)`` with ``per_axis=True`` (the rule's
    ``per_axis`` attribute says which to the dispatcher);
    ``local(ctx, *args, **kwargs)``, when given, replaces the op on local tensors (for
    ops that need global offsets or counts); ``check(call, in_layouts, out_layouts)``,
    when given, vets each combination of the rule's per-axis signatures as a whole (a
    reshape of a dim that two placement axes split: each axis alone cannot tell
    whether the parts line up). With ``decompose=True`` the function
    instead computes the op from other ops on GlobalTensors (which dispatch on their
    own), or returns NotImplemented to use the op's rule: for ops that would otherwise
    need the data of several ranks."""
    if decompose and per_axis:
        raise ValueError("register: per_axis is for rules; a decomposition takes the op's arguments")

    def wrap(fn):
        if not decompose:
            # How a rule is called belongs to the function, not to one op it serves: a
            # rule registered twice (again with a local implementation) must agree.
            if getattr(fn, "per_axis", per_axis) != per_axis:
                raise ValueError(f"register: {getattr(fn, '__name__', fn)} was registered with "
                                 f"per_axis={fn.per_axis}, now with per_axis={per_axis}")
            fn.per_axis = per_axis
        for f in funcs:
            if decompose:
                _DECOMPOSITIONS[f] = fn
                continue
            _RULES[f] = fn
            if local is not None:
                _LOCAL[f] = local
            if check is not None:
                _CHECKS[f] = check
        return fn
    return wrap


def register_family(predicate: Callable[[object], bool]):
    """Decorator: ``factory(func)`` makes the decomposition of each op that
    ``predicate(func)`` accepts and that has none of its own (dispatch asks once per op
    and keeps the answer). The decomposition may return NotImplemented, as any.

    >>> @register_family(has_out_arguments)   # doctest: +SKIP
    ... def out_variant(func): return lambda *args, **kwargs: ...
    """
    def wrap(factory):
        _FAMILIES.append((predicate, factory))
        return factory
    return wrap


def register_meta(*funcs):
    """Decorator: ``meta(func, placement, *args, **kwargs)`` gives the outputs of
    ``funcs`` on meta tensors in place of torch's meta kernel, where that kernel (written
    to CUDA's conventions) refuses what the placement's device kernel takes, or gives
    other dtypes. The dispatcher reads output shapes and dtypes from it.

    >>> @register_meta(aten._grouped_mm)               # doctest: +SKIP
    ... def grouped_mm_meta(func, placement, mat_a, mat_b, offs=None, ...): ...
    """
    def wrap(fn):
        for f in funcs:
            _META[f] = fn
        return fn
    return wrap


def with_direct(make: Callable):
    """Decorator of a local implementation ``local(ctx, *args, **kwargs)``:
    ``make(ctx)`` gives what a decision that runs directly calls instead,
    ``fn(*args, **kwargs)``, with what depends on the decision alone (a view's local
    size) computed once (``propagation/direct.py``).

    >>> @with_direct(lambda ctx: functools.partial(_to_local_size, ctx))  # doctest: +SKIP
    ... def _to_local_size(ctx, x, size): ...
    """
    def wrap(local):
        local.direct = make
        return local
    return wrap


def communicating(local: Callable) -> Callable:
    """Decorator of a local implementation that communicates (ring attention passes
    key and value blocks around): every rank of the placement must run it, also one
    whose part is empty, which otherwise returns empty outputs without running the op.

    >>> @communicating                                  # doctest: +SKIP
    ... def flash_forward_local(ctx, query, key, value): ...
    """
    local.communicates = True
    return local


def has_out_arguments(func) -> bool:
    """True for an op with out= arguments (``torch.add(a, b, out=c)``'s overload)."""
    return any(a.is_out for a in func._schema.arguments)


def _get(table, func):
    found = table.get(func)
    return found if found is not None else table.get(func.overloadpacket)


def lookup(func):
    """(rule, local implementation or None) of an op; rule None means the fallback."""
    rule = _get(_RULES, func)
    if rule is None and torch.Tag.pointwise in func.tags:
        rule = _RULES.get(torch.Tag.pointwise)
    return rule, _get(_LOCAL, func)


def lookup_meta(func):
    """The meta implementation ``register_meta`` gave an op, or None (torch's)."""
    return _get(_META, func)


def lookup_check(func):
    """The whole-signature check of an op's rule, or None (every combination is valid)."""
    return _get(_CHECKS, func)


def lookup_decomposition(func):
    """The decomposition of an op, if any (the order is in this module's docstring). An
    op without a rule that torch itself defines by other ops (CompositeImplicitAutograd:
    linear, matmul, ... which reach dispatch undecomposed under
    ``torch.inference_mode()``) runs as those ops, so their rules apply instead of the
    broadcast fallback."""
    found = _DECOMPOSITIONS.get(func)
    if found is None and not has_out_arguments(func):
        found = _DECOMPOSITIONS.get(func.overloadpacket)
    if found is not None:
        return found
    for predicate, factory in _FAMILIES:
        if predicate(func):
            return factory(func)
    if _get(_RULES, func) is None and torch.Tag.pointwise not in func.tags \
            and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        return func.decompose
    return None
