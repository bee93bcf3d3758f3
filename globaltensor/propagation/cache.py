"""The decision cache: a repeated call only flattens, looks up and runs.

Decisions are keyed by (op, argument spec, per leaf: a GlobalTensor's layout and dtype,
a plain tensor's metadata, a constant's value; a float only by its type); the op by its
C++ callable (``func._op``), whose hash is C's (an OpOverload's is a Python method).
Bounded: when full, the oldest quarter goes (hits stay a plain dict lookup). Decisions that depend on
the value of a float argument (a rule looked at it, or a local implementation reads
it) are keyed again with the floats' values, in a second table. ``direct_call`` is the
warm path of a repeated call: its key and local parts made in one pass over the
arguments, without flattening them (``call_key``, with which a replayed step's warm
path keys its calls too).

>>> cached_decision(aten.mm.default, [x, w], (2, ()))   # doctest: +SKIP
Decision(...)
"""
from __future__ import annotations

import itertools

import torch

from ..tensor import GlobalTensor
from .decide import Decision, decide

CACHE_SIZE = 4096
_cache: dict = {}
_BY_VALUE = object()  # in ``_cache``: look in ``_by_value`` with the floats' values
_by_value: dict = {}


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


def key_of_call(func, leaves: list, spec):
    """The cache key of this call, or None when an argument is unhashable."""
    try:
        key = (func._op, spec, tuple([x._key if x.__class__ is GlobalTensor else _key_of(x)
                                      for x in leaves]))
        hash(key)
        return key
    except TypeError:
        return None


_CONSTANTS = (str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def call_key(func, args: tuple, kwargs: dict, watch):
    """(cache key, local parts of the arguments) of a call, made in one pass over the
    arguments as ``key_of_call`` keys the flattened ones; ``watch`` is called with each
    leaf that requires grad. None for anything the warm path leaves to the general one
    (a plain tensor, a list of tensors, a traced part)."""
    key, local = [], []
    for x in (args if not kwargs else (*args, *kwargs.values())):
        c = x.__class__
        if c is GlobalTensor:
            part = x._local
            if part.__class__ is not _PLAIN:
                return None
            if x.requires_grad and x.is_leaf:
                watch(x)
            key.append(x._key)
            local.append(part)
        elif c is int or c is bool or x is None or c in _CONSTANTS:
            key.append(x)
            local.append(x)
        elif c is float:
            key.append(float)
            local.append(x)
        elif c is list and (not x or x[0].__class__ is int or x[0].__class__ is bool):
            key.append(tuple(x))
            local.append(x)
        else:
            return None
    return (func._op, (len(args), tuple(kwargs) if kwargs else ()), tuple(key)), local


def direct_call(func, args: tuple, kwargs: dict, watch):
    """(decision, local parts of the arguments) of a repeated call whose decision is
    cached (``call_key``), which the caller runs directly (``decision.direct``) or
    carries out; None for anything else (a decision not made yet): the general path."""
    found = call_key(func, args, kwargs, watch)
    if found is None:
        return None
    key, local = found
    decision = _cache.get(key)
    if decision is _BY_VALUE:   # (attention reads its dropout probability)
        decision = _by_value.get((key, tuple(x for x in local if x.__class__ is float)))
    return None if decision is None else (decision, local)


_PLAIN = torch.Tensor


# The ranks of a simulated world share this process, and each decides every call of the
# program anew (a decision is the rank's own: its shortcuts, its local context). What
# does not depend on the rank (the meta run and the chosen layouts: ``Decision.choice``)
# is decided by the first rank and taken by the others, keyed by the call and its
# floats' values: a third of such a world's time went to deciding. None elsewhere.
_shared: "dict | None" = None


def share_choices(on: bool) -> None:
    """Let the ranks of this process share their decisions' choices (a simulated world,
    while it runs), or stop."""
    global _shared
    _shared = {} if on else None


def _decided(func, leaves: list, spec, key) -> Decision:
    if _shared is None:
        return decide(func, leaves, spec)
    shared_key = (key, tuple(x for x in leaves if x.__class__ is float))
    choice = _shared.get(shared_key)
    decision = decide(func, leaves, spec, choice)
    if choice is None:
        _remember(_shared, shared_key, decision.choice)
    return decision


def cached_decision(func, leaves: list, spec) -> Decision:
    """The cached decision for this call, deciding (and caching) it when new."""
    try:
        key = (func._op, spec, tuple([x._key if x.__class__ is GlobalTensor else _key_of(x)
                                      for x in leaves]))
        decision = _cache.get(key)
    except TypeError:
        return decide(func, leaves, spec)
    if decision is None:
        decision = _decided(func, leaves, spec, key)
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
            decision = _decided(func, leaves, spec, key)
            _remember(_by_value, by_value, decision)
    return decision
