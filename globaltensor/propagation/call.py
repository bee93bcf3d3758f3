"""What a rule and a local implementation see of one call: ``Call`` (the op, its
GlobalTensor inputs and their shapes, its output shapes, every argument), ``LocalCtx``
(the layouts chosen), and the flattening of an op's arguments into leaves.

A leaf of the dispatcher: the rules import it, so it imports nothing of globaltensor.

>>> leaves, spec = flatten_args((x, 2), {"alpha": 0.5})   # doctest: +SKIP
>>> unflatten_args(leaves, spec)                          # doctest: +SKIP
([x, 2], {'alpha': 0.5})
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, object]:
    """(leaves, spec) of an op's arguments; tensors are always leaves. Without a tensor
    inside a list (the common case) the spec is a plain tuple (argument count, keyword
    names), which skips the cost of torch's pytree.

    >>> flatten_args((1, 2), {"dim": 0})
    ([1, 2, 0], (2, ('dim',)))
    """
    for a in itertools.chain(args, kwargs.values()) if kwargs else args:
        if a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, torch.Tensor):
                    return tree_flatten((args, kwargs))
    if kwargs:
        return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return list(args), (len(args), ())


def unflatten_args(leaves: list, spec) -> tuple:
    """(args, kwargs) back from ``flatten_args``'s leaves and spec.

    >>> unflatten_args([1, 2, 0], (2, ("dim",)))
    ([1, 2], {'dim': 0})
    """
    if spec.__class__ is tuple:
        n, keys = spec
        return leaves[:n], (dict(zip(keys, leaves[n:])) if keys else {})
    return tree_unflatten(leaves, spec)


_ABSENT = object()


@dataclass
class Call:
    """One call of an op as its rule sees it (``call.arg("dim")`` reads an argument)."""
    func: object
    inputs: list          # the GlobalTensor arguments, in flattened order
    in_shapes: list       # their global shapes
    out_shapes: list      # global shapes of the tensor outputs
    leaves: list          # every flattened argument (tensors and constants)
    spec: object          # pytree spec to rebuild (args, kwargs) from leaves
    axis_sizes: tuple     # ranks per placement axis (``Placement.shape``): (2, 4) on a 2x4 mesh
    # Block counts of strided splits that the step planner has seen in this step: its
    # options also offer operands strided so, where the operands do not hold it now.
    strided_blocks: tuple = ()
    # Arguments looked up by name so far. A Call's non-tensor arguments are part of the
    # dispatch cache key, so the local implementations of one cached decision can reuse
    # them; a schema walk per lookup would cost more than the op.
    _named: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def strided_counts(self, axis: "int | None" = None, dim: "int | None" = None) -> set:
        """The block counts of the strided splits the inputs hold (on placement axis
        ``axis``, of tensor dim ``dim``; None: any) and of those a plan offers
        (``strided_blocks``): what a rule or ``decide`` tries strided signatures with."""
        held = {s.blocks for x in self.inputs for a, s in enumerate(x._layout.sbp)
                if getattr(s, "blocks", None) and axis in (None, a)   # (StridedSplit's)
                and dim in (None, s.dim)}
        return held | set(self.strided_blocks)

    @property
    def mesh(self) -> tuple:
        """Deprecated name of ``axis_sizes`` (it held no mesh, only its shape); kept for
        one release because ``Call`` is exported from ``globaltensor.dispatch``."""
        warnings.warn("Call.mesh is deprecated: use Call.axis_sizes (ranks per placement axis)",
                      DeprecationWarning, stacklevel=2)
        return self.axis_sizes

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
