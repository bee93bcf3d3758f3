"""Per-op choice (sharding propagation): one call's signature from its operands' layouts.

For one call: the output metadata comes from running the op on meta tensors; the op's
rule (``rules/``) lists 1-D signatures (per placement axis where the rule asks); the
combination with the least cost from the inputs' current layouts wins (none needed is
best), priced by the one cost model (``globaltensor/cost.py``). Decisions are cached,
so a repeated call only flattens, looks up and runs. Ops without a rule gather their
inputs to broadcast (a warning once per op). In-place ops keep their first argument's
layout. Ops whose data spans ranks, and whole families (``_foreach_*``, out= variants,
value reads), run as the registry's decompositions.

- ``decide.py``: one call's ``Decision``, and every signature it allows (``options``,
  what the whole-step planner chooses among).
- ``cache.py``: decisions cached per (op, input layouts and dtypes, constants).
- ``call.py``: what rules see (``Call``, ``LocalCtx``) and argument flattening.
- ``plain.py``: plain tensor operands, ``implicit_broadcast``.

Below the whole-step planner (``globaltensor/planner/``), which uses ``decide`` and
``cache``, and below ``dispatch/entry.py``, which runs the decisions; above the rules.

>>> from globaltensor.propagation.call import flatten_args
>>> flatten_args((1, 2), {"dim": 0})
([1, 2, 0], (2, ('dim',)))
"""
