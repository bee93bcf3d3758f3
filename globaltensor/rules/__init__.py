"""sbp signature rules, one file per op family.

A rule takes a ``Call`` and a placement axis and returns the 1-D signatures valid on
that axis:
a list of ``(input sbps, output sbps)``, one sbp per GlobalTensor input and one per
tensor output. The dispatcher combines them across axes and picks the cheapest. A rule
itself does not communicate; local implementations and decompositions may (the index
range checks reduce a flag, decompositions box through ``to_global``). Rules register
in ``registry.py``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .registry import lookup, lookup_decomposition, register  # noqa: F401 (re-exported)


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


from . import (along_dim, attention, complex, conv, data_dependent,  # noqa: E402,F401
               embedding, functional, like, losses, matmul, norm, optim, pointwise, random,
               reduction, resample, softmax, view)  # (registration)
