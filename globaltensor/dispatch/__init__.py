"""``__torch_dispatch__`` for GlobalTensor: every op on global tensors enters here.

``entry.py`` is the entry (``dispatch``), installed into GlobalTensor when imported
(``import globaltensor`` does), and the run step: boxing the operands, the local op;
``outputs.py`` wraps the outputs and reduces 0-d partial ones; ``copied_views.py``
carries in-place writes through views of boxed copies back to their source. It is the
top of the op path: a call goes to the whole-step planner (``globaltensor/planner/``)
while a step is recorded, replayed or traced, and otherwise to per-op choice (sharding
propagation, ``globaltensor/propagation/``: ``decide``, ``cache``, ``call``, ``plain``),
which both sit below it. Explicit regions and ``check_step``'s fake parts are read here too.

This index re-exports what programs and the rules' authors use from the rooms below
(``Call``, ``LocalCtx``, argument flattening, ``implicit_broadcast``).

>>> from globaltensor.dispatch import implicit_broadcast
"""
from __future__ import annotations

from ..propagation.call import Call, LocalCtx, flatten_args, unflatten_args
from ..propagation.plain import implicit_broadcast

__all__ = ["Call", "LocalCtx", "flatten_args", "implicit_broadcast", "unflatten_args"]
