"""Run a boxing plan on this rank's local tensor: a loop over the plan's steps, with the
dtype and memory policy that every step shares."""
from __future__ import annotations

import torch

from .. import comm
from .steps import Handle, Step


def start(plan, local: torch.Tensor, rank: int | None = None,
          donate: bool = False) -> Handle:
    """Run every step of ``plan`` but the last, start the last, and return its handle;
    ``wait()`` gives this rank's local tensor in ``plan.dst``. The last step's messages
    are in flight meanwhile (a pipeline hand-off's transfer overlaps compute).

    The result never aliases ``local`` when it holds different data, so the source
    tensor stays valid, unless ``donate`` says that no one else holds ``local`` (a
    temporary): then a reduction may run in place in it. The dtype never changes;
    dtypes that a backend cannot reduce or gather (int16) travel widened. Only the
    ranks a step involves take part in it (process groups are made by their members),
    so ranks outside both placements may skip the call.

    >>> handle = start(plan_route(src, dst, 4), x_local)    # doctest: +SKIP
    >>> out = handle.wait()
    """
    if rank is None:
        rank = comm.get_rank()
    if not plan.steps:
        return Handle.ready(local)
    x = local
    *first, last = plan.steps
    for step in first:
        x = _start(step, x, rank, local, donate).wait()
    handle = _start(last, x, rank, local, donate)
    if donate:
        return handle
    return handle.then(lambda out: out.clone() if out.numel() and _shares_storage(out, local)
                       else out)


def execute(plan, local: torch.Tensor, rank: int | None = None,
            donate: bool = False) -> torch.Tensor:
    """This rank's local tensor in ``plan.dst``, from its local tensor in ``plan.src``
    (``start`` and wait).

    >>> out = execute(plan_route(src, dst, 4), x_local)     # doctest: +SKIP
    """
    return start(plan, local, rank, donate).wait()


# Collectives of gloo and NCCL lack these dtypes (point-to-point carries any): they
# travel as the next wider integer type, which holds every value and sums alike.
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _start(step: Step, x: torch.Tensor, rank: int, caller: torch.Tensor,
           donate: bool) -> Handle:
    if not step.runs_on(rank):
        return Handle.ready(x)
    wide = _WIDER.get(x.dtype) if step.widens else None
    if wide is None:
        # A step may reuse its input's memory when that is not the caller's.
        return step.start(x, rank, donate or not _shares_storage(x, caller))
    dtype = x.dtype
    return step.start(x.to(wide), rank, True).then(lambda out: out.to(dtype))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if comm.tracing():  # fake tensors have no storage to compare: assume shared
        return True
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata   # (fake ones too)
