"""``__torch_dispatch__`` for GlobalTensor: pick an sbp signature, box inputs, run locally.

For one call: the output metadata comes from running the op on meta tensors; the op's
rule (``rules/``) lists 1-D signatures per placement axis; the combination with the
least boxing cost from the inputs' current layouts wins (none needed is best). Inputs
are boxed, the op (or its local implementation) runs on local tensors, outputs are
wrapped. Decisions are cached, so a repeated call only flattens, looks up and runs.
Ops without a rule gather their inputs to broadcast (a warning once per op). In-place
ops keep their first argument's layout. Ops whose data spans ranks, and whole families
(``_foreach_*``, out= variants, value reads), run as the registry's decompositions.

The rooms:

- ``entry.py``: the entry (``dispatch``), installed into GlobalTensor when imported
  (``import globaltensor`` does); the run step (boxing, the local op, wrapping
  outputs, reducing 0-d partial outputs).
- ``decide.py``: sharding propagation, one call's ``Decision``.
- ``cache.py``: decisions cached per (op, input layouts and dtypes, constants).
- ``call.py``: what rules see (``Call``, ``LocalCtx``) and argument flattening.
- ``plain.py``: plain tensor operands, ``implicit_broadcast``.
Whole-step layouts (record a step, plan it, replay; traced graphs too) are
``globaltensor/planner/``'s: it uses ``decide`` and ``cache``, and ``entry`` hands it
the calls of a step it records or replays.

This index re-exports the names of ``call`` and ``plain`` only: the rules import
``call`` (through this index), and ``entry`` and ``decide`` import the rules, so
importing those here would close a circle. ``dispatch`` and ``Decision`` are imported
from their modules.

>>> from globaltensor.dispatch import implicit_broadcast
"""
from __future__ import annotations

from .call import Call, LocalCtx, flatten_args, unflatten_args
from .plain import implicit_broadcast

__all__ = ["Call", "LocalCtx", "flatten_args", "implicit_broadcast", "unflatten_args"]
