"""Before gradients are first all-reduced from a call path, the ranks of their
placement meet through the store (``comm/meet.py``): a rank that skipped ``backward()``
makes the others fail within GLOBALTENSOR_READ_TIMEOUT, naming it, instead of waiting
GLOBALTENSOR_TIMEOUT in the all-reduce. Called by gradient sync (``gradsync.py``)."""
from __future__ import annotations

import torch

from .boxing.run import call_path, where
from .comm.meet import meet_once, met_before

GRADIENT_ADVICE = (
    "backward() reduces the gradients of parameters used on split data (data parallel) "
    "among the ranks of their placement: a collective, which every one of them must run, "
    "on the same loss. A rank that skips backward() (if its loss is not finite, or once "
    "it has no batches left) leaves the others waiting there. Decide on every rank alike, "
    "from a value every rank has: the loss itself is broadcast, so if not "
    "torch.isfinite(loss): continue skips the step on every rank; and give every rank the "
    "same number of batches.")


def gradients_meet(placement, dtype: torch.dtype, items: list, serials: tuple,
                    how: str = "") -> None:
    """Before the gradients ``items`` ((leaf, gradient) pairs, ``serials`` their leaves'
    serial numbers) are first all-reduced from a call path (the program's line that
    called ``backward()``, and the lines that called it), the ranks of their placement
    meet through the store, as a read's do: a rank that skipped ``backward()`` makes the
    others raise ``CollectiveError`` within GLOBALTENSOR_READ_TIMEOUT, naming it, and
    ranks whose buckets differ (other parameters got gradients) raise
    ``DivergenceError`` naming both, where their all-reduces would wait or pair up.

    Told apart by placement, dtype, ``how`` and the serials (the same on every rank): a
    training loop meets in its first steps (the second one's buckets follow the first
    one's gradient order; the first backward into kept gradients meets once more), and
    then pays the call path and a set look-up per bucket, no communication. A rank that
    skips a later backward is not caught so, as a reduction's path run on every rank
    first and later on some only is not (``boxing.run.reduction_meets``; check mode
    meets every time): the others' all-reduce meets that rank's next collective, or
    fails after GLOBALTENSOR_TIMEOUT, or at once when that rank's process ends."""
    ranks = tuple(sorted(placement.flat_ranks))
    if len(ranks) == 1:
        return
    path = call_path()
    key = ("gradients", how, placement, dtype, serials, path)
    if met_before(ranks, key):
        return
    elements = sum(leaf.numel() for leaf, _ in items)
    same = (f"all-reduce the {dtype} gradients of {len(items)} parameter(s) ({elements} "
            f"elements) on {placement}{how}, in backward() called from {where(path)}")
    meet_once(ranks, key, "backward()", same, GRADIENT_ADVICE, same)
