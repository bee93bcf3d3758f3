"""Plans remembered by what they depend on: a recorded step is solved once per process.

A step's plan (``problem.plan_step``) is a function of its calls (op, cache key, float
arguments, operand layouts and producers, the signatures its rule allows and the
per-op choice), of its sinks and pins, and of the cost model (each device type's
constants, the boxing step kinds registered). The same step is recorded again where
nothing of that changed: at every save and restore of ``Autosave`` (``record.restart``
plans anew so that a resumed run replays what the uninterrupted one replays), for a
model built again in one process, and by every rank of a simulated world, which share
this process. Each then takes the remembered choice (the same choice, so the same
bits) instead of solving again: a 12-layer GPT on a 2 x 4 placement takes 0.1 s so,
1.3-2.3 s solved, on a 2-core machine (``benchmarks/planning.py``).

>>> key = key_of(record, sinks, pin_grads)        # doctest: +SKIP
>>> recall(key) is None    # the first time: solve, then remember  # doctest: +SKIP
True
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..boxing.steps.registry import ALL_STEPS
from ..cost import costs_for

MAX_REMEMBERED = 8   # steps (each holds its calls' keys and signatures)

# (what identifies a step cheaply) -> (its calls' signatures, which must be equal too;
# the choice per call, the per-op cost, the planned cost)
_remembered: OrderedDict = OrderedDict()
_lock = threading.Lock()   # (threads of one program may plan at once)


def key_of(record: list, sinks, pin_grads) -> tuple:
    """(a hashable key of what the plan of ``record`` depends on, the signatures of its
    calls): the second is compared, not hashed (equal layouts are one object, so the
    comparison is quick where hashing would walk every layout)."""
    calls, signatures, types = [], [], set()
    for node in record:
        greedy = node.greedy
        calls.append((node.func, node.key, node.floats, node.in_backward, greedy.inplace,
                      tuple(node.producers), tuple(node.inputs)))
        signatures.append((node.opts.signatures, node.opts.greedy) if node.opts is not None
                          else (greedy.targets, greedy.out_layouts, greedy.fallback))
        types.update(layout.placement.type for layout, _, _ in node.inputs)
    costs = tuple(costs_for(t) for t in sorted(types))
    return (tuple(calls), tuple(sinks), tuple(pin_grads), costs, len(ALL_STEPS)), signatures


def recall(key: tuple) -> "tuple | None":
    """(choice, per-op cost, planned cost) remembered for ``key`` (``key_of``), or None."""
    with _lock:
        try:
            found = _remembered.get(key[0])
        except TypeError:   # an argument of a call that cannot be hashed: not remembered
            return None
        if found is None or found[0] != key[1]:
            return None
        _remembered.move_to_end(key[0])
        return found[1:]


def remember(key: tuple, choice: list, per_op_cost: float, planned_cost: float) -> None:
    """Keep the plan of ``key``: at most ``MAX_REMEMBERED`` steps, the oldest used
    forgotten first."""
    with _lock:
        try:
            _remembered[key[0]] = (key[1], list(choice), per_op_cost, planned_cost)
        except TypeError:
            return
        _remembered.move_to_end(key[0])
        while len(_remembered) > MAX_REMEMBERED:
            _remembered.popitem(last=False)


def forget() -> None:
    """Forget every remembered plan (they hold layouts: a test counting those still
    held; a cost model changed by hand)."""
    with _lock:
        _remembered.clear()
