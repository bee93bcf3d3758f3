"""The whole-step planner: a step's calls recorded, planned together, replayed.

Per-op choice (``propagation/decide.py``) picks each call's signature from its operands'
layouts alone; the planner sees a whole training step and picks every call's signature
at once, so that a layout costly for one call but cheap for the calls after it can win
(a residual stream kept batch-split, a Megatron block's activation gathered once).

- ``record.py``: eager steps: when a step begins, recording the fifth, planning it,
  replaying the plan in later steps; its boundaries (``step_boundary``, ``paused``).
- ``traced.py``: the same for graphs torch.compile traces.
- ``pins.py``: what ``to_global`` pins (its target layout, its gradient's).
- ``problem.py``: a record as a min-sum problem (per call an option per signature,
  per producer/consumer pair a matrix of boxing costs, compute per option), priced
  with the one cost model (``globaltensor/cost.py``), and the plan its solution gives.
- ``solve.py``, ``walks.py``: the solver (pure: lists of floats in, a choice out).
- ``explain.py``: ``gt.debug.explain_step``.

It sits between per-op choice (which it imports: ``propagation/decide.py``,
``propagation/options.py``, ``propagation/cache.py``) and ``__torch_dispatch__``
(``dispatch/entry.py``, which hands a call to ``record`` or ``traced`` while a step is
recorded, replayed or traced).

>>> import globaltensor as gt
>>> from globaltensor.planner import record
>>> record.RECORD_AT
5
"""
