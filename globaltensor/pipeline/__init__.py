"""Pipeline parallelism: stages on placements, micro-batches, schedules as data.

``Pipeline(stages, micro_batches, schedule, loss_fn)`` trains stages that are already
global (each on its own placement, any sbp inside) with GPipe, 1F1B or interleaved
1F1B. Schedules are per-placement action lists built by pure functions
(``schedule.py``); one runtime runs them (``runtime.py``); stage hand-offs are boxing
between placements, posted without blocking (``handoff.py``); a stage that this rank
holds whole runs on plain tensors (``plain_stage.py``).

>>> import globaltensor as gt
>>> pipe = gt.pipeline.Pipeline([s0, s1], micro_batches=4, schedule="1f1b",  # doctest: +SKIP
...                             loss_fn=torch.nn.functional.cross_entropy)
>>> loss = pipe.step(x, target)                                             # doctest: +SKIP
"""
from .runtime import Pipeline
from .schedule import SCHEDULES, Action, build, simulate
from .timeline import Timeline

__all__ = ["Pipeline", "SCHEDULES", "Action", "build", "simulate", "Timeline"]
