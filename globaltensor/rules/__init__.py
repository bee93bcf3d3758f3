"""sbp signature rules, one file per op family.

A rule takes a ``Call`` and a placement axis and returns the 1-D signatures valid on
that axis:
a list of ``(input sbps, output sbps)``, one sbp per GlobalTensor input and one per
tensor output. The dispatcher combines them across axes and picks the cheapest. Rules
never communicate.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_RULES: dict = {}


def flatten_args(args, kwargs):
    """(leaves, spec) of an op's arguments; tensors are always leaves. Without a tensor
    inside a list (the common case) the spec is a plain tuple (argument count, keyword
    names), which skips the cost of torch's pytree."""
    for a in itertools.chain(args, kwargs.values()) if kwargs else args:
        if a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, torch.Tensor):
                    return tree_flatten((args, kwargs))
    if kwargs:
        return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return list(args), (len(args), ())


def unflatten_args(leaves, spec):
    if spec.__class__ is tuple:
        n, keys = spec
        return leaves[:n], (dict(zip(keys, leaves[n:])) if keys else {})
    return tree_unflatten(leaves, spec)


_ABSENT = object()


@dataclass
class Call:
    func: object
    inputs: list          # the GlobalTensor arguments, in flattened order
    in_shapes: list       # their global shapes
    out_shapes: list      # global shapes of the tensor outputs
    leaves: list          # every flattened argument (tensors and constants)
    spec: object          # pytree spec to rebuild (args, kwargs) from leaves
    mesh: tuple           # the placement's hierarchy shape
    # Arguments looked up by name so far. A Call's non-tensor arguments are part of the
    # dispatch cache key, so the local implementations of one cached decision can reuse
    # them; a schema walk per lookup would cost more than the op.
    _named: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def args_kwargs(self):
        return unflatten_args(self.leaves, self.spec)

    def arg(self, name: str, default=None):
        """An argument by its schema name (positional or keyword), else its default."""
        if name not in self._named:
            self._named[name] = self._find_arg(name, _ABSENT)
        found = self._named[name]
        return default if found is _ABSENT else found

    def _find_arg(self, name: str, default):
        args, kwargs = self.args_kwargs
        if name in kwargs:
            return kwargs[name]
        for i, a in enumerate(self.func._schema.arguments):
            if a.name == name:
                if i < len(args):
                    return args[i]
                return a.default_value if a.has_default_value() else default
        return default


@dataclass
class LocalCtx:
    """What a local implementation may know: the call, the layouts its GlobalTensor
    inputs were boxed to and its outputs have, and this rank."""
    call: Call
    in_layouts: tuple
    out_layouts: tuple
    rank: int

    def region(self, i: int):
        """This rank's region of the i-th GlobalTensor input (offsets, sizes)."""
        return self.in_layouts[i].region(self.rank)


_LOCAL: dict = {}
_DECOMPOSITIONS: dict = {}


def register(*funcs, local=None):
    """Decorator: ``@register(aten.mm, ...)`` makes the function the rule of those ops
    (an OpOverloadPacket covers every overload). ``local(ctx, *args, **kwargs)``, when
    given, replaces the op on local tensors (for ops that need global offsets or counts)."""
    def wrap(rule):
        for f in funcs:
            _RULES[f] = rule
            if local is not None:
                _LOCAL[f] = local
        return rule
    return wrap


def register_decomposition(*funcs):
    """Decorator: ``fn(*args, **kwargs)`` computes the op from other ops on
    GlobalTensors (which dispatch on their own), or returns NotImplemented to use the
    op's rule. For ops that would otherwise need the data of several ranks."""
    def wrap(fn):
        for f in funcs:
            _DECOMPOSITIONS[f] = fn
        return fn
    return wrap


def _get(table, func):
    found = table.get(func)
    return found if found is not None else table.get(func.overloadpacket)


def lookup(func):
    """(rule, local implementation or None) of an op; rule None means the fallback."""
    rule = _get(_RULES, func)
    if rule is None and _is_pointwise(func):
        from .pointwise import pointwise_rule
        rule = pointwise_rule
    return rule, _get(_LOCAL, func)


def lookup_decomposition(func):
    """The decomposition of an op, if any. An op without a rule that torch itself
    defines by other ops (CompositeImplicitAutograd: linear, matmul, ... which reach
    dispatch undecomposed under ``torch.inference_mode()``) runs as those ops, so
    their rules apply instead of the broadcast fallback."""
    found = _get(_DECOMPOSITIONS, func)
    if found is None and _get(_RULES, func) is None and not _is_pointwise(func) \
            and not func.overloadpacket.__name__.startswith("_foreach_") \
            and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        return func.decompose
    return found


def _is_pointwise(func) -> bool:
    import torch
    return torch.Tag.pointwise in func.tags


from . import (along_dim, attention, complex, conv, embedding, functional,  # noqa: E402,F401
               like, matmul, norm, optim, pointwise, random, reduction, resample, softmax,
               view)  # (registration)
