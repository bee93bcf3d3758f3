"""Reading a GlobalTensor's value into Python: ``x.item()``, ``float(x)``, ``int(x)``,
``bool(x)``, ``x.tolist()``, ``x.numpy()``, ``torch.equal``, ``f"{x:.4f}"``.

A rank that holds the whole value (a broadcast tensor, on a rank of its placement)
reads its own copy: no communication, so ``if rank == 0: log(loss.item())`` works
(dispatch makes the scalar result of a reduction broadcast). A split or partial
tensor is gathered among the ranks whose parts make up this rank's value; they first
meet briefly (``comm.meet``), so a read called on some of them only fails within
GLOBALTENSOR_READ_TIMEOUT seconds, naming the call, instead of hanging in its
collective. A rank outside the placement holds nothing to read and raises at once.

>>> loss = F.cross_entropy(logits, target)   # logits, target split(0)  # doctest: +SKIP
>>> if gt.get_rank() == 0:                                               # doctest: +SKIP
...     print(loss.item())                   # broadcast: this rank's copy
"""
from __future__ import annotations

import itertools

import torch

from . import comm
from .layout import Layout
from .sbp import Broadcast, broadcast
from .tensor import GlobalTensor, _call_site, relayout


def whole_value(x: GlobalTensor, call: str) -> torch.Tensor:
    """``x``'s whole value on this rank as a plain tensor, for the read ``call`` (e.g.
    "x.item()"): the local copy when ``x`` is broadcast here, else gathered from the
    ranks holding its parts (who must all read it too).

    >>> whole_value(loss, "x.item()").item()      # doctest: +SKIP
    """
    layout = x._layout
    placement = layout.placement
    rank = comm.get_rank()
    if rank not in placement:
        raise RuntimeError(
            f"{call} on rank {rank}, which holds no part of x (its placement is "
            f"{placement}, sbp {layout.sbp}): read it on a rank of its placement, or bring "
            f"it here first, on every rank: x.to_global(placement=gt.placement.all("
            f"\"{placement.type}\"), sbp=gt.sbp.broadcast), or x.full()")
    if all(s.__class__ is Broadcast for s in layout.sbp):
        return x._local
    if not comm.tracing():  # a traced read runs on every rank by construction
        readers = _readers(layout, rank)
        read = (f"{call} of a {x.dtype} {tuple(x.shape)} tensor with sbp {layout.sbp} on "
                f"{placement}, called from {_call_site()}")
        comm.meet(readers, call, read, _advice(call, readers))
    return relayout(x, (broadcast,) * placement.ndim)._local


def _readers(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks whose parts make up ``rank``'s whole value: those that differ from it
    only along the axes that are not broadcast (they gather along those axes)."""
    placement = layout.placement
    coord = placement.coord(rank)
    axes = [a for a, s in enumerate(layout.sbp) if s.__class__ is not Broadcast]
    ranks = []
    for values in itertools.product(*(range(placement.shape[a]) for a in axes)):
        here = list(coord)
        for a, v in zip(axes, values):
            here[a] = v
        ranks.append(placement.rank_at(here))
    return tuple(ranks)


def _advice(call: str, readers: tuple[int, ...]) -> str:
    return (f"A read of a split or partial tensor gathers it: call {call} on every one of "
            f"ranks {list(readers)}, or make the tensor broadcast first, on every one of "
            f"them (y = x.to_global(sbp=gt.sbp.broadcast)); then reading y needs no "
            f"communication, on any rank of its placement.")


def item(x: GlobalTensor, call: str = "x.item()"):
    """``x.item()``: a Python number."""
    return whole_value(x, call).item()


def tolist(x: GlobalTensor):
    """``x.tolist()``: nested lists of the whole value."""
    return whole_value(x, "x.tolist()").tolist()


def numpy(x: GlobalTensor, force: bool = False):
    """``x.numpy()``: a numpy array of the whole value (a copy when it was gathered)."""
    return whole_value(x, "x.numpy()").detach().cpu().numpy(force=force)


def equal(a: GlobalTensor, b: GlobalTensor) -> bool:
    """``torch.equal(a, b)``: same shape and elements."""
    if a.shape != b.shape:
        return False
    call = "torch.equal(a, b)"
    values = [whole_value(t, call) if isinstance(t, GlobalTensor) else t for t in (a, b)]
    return bool(values[0].equal(values[1].to(values[0].device)))
