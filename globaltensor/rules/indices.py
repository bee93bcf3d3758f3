"""Index checks for ops that look up rows or classes (embedding, nll_loss, one_hot) and
for lookups with split indices (``x[i]``, ``index_put``, ``index_select``, ``index_add``).

Plain torch raises IndexError for an index outside ``[0, size)``. On parts, an index
outside a rank's window looks like "held by another rank", so without a check the op
silently returns zeros. The check runs on each rank's part of the indices and takes
the worst case across ranks with one reduction of one number (none when the indices
are broadcast), so every rank of the placement raises together. Where the op itself
checks (indexing with split indices, each rank its own part), a rank whose part holds
a bad index would raise alone while the others went on to wait for it.
"""
from __future__ import annotations

import torch

from .. import comm
from ..boxing.run import box
from ..layout import Layout
from ..sbp import Partial, Split, broadcast
from ..tensor import GlobalTensor


def _excess(local: torch.Tensor, size: int, ignore_index, lowest: int) -> torch.Tensor:
    """How far the worst index lies outside [lowest, size) (<= 0: all inside), as a 0-d
    int64 tensor on ``local``'s device: computed without reading a value (on a GPU a
    read waits for every kernel queued before it)."""
    if not local.numel():
        return torch.full((), -1, dtype=torch.int64, device=local.device)
    local = local.to(torch.int64)
    if ignore_index is not None:   # an ignored index counts as index 0 (inside)
        local = torch.where(local == ignore_index, torch.zeros_like(local), local)
    return torch.maximum(local.max() - (size - 1), lowest - local.min())


def _message(what: str, size: int, ignore_index, lowest: int) -> str:
    return (f"{what}: index out of range: valid indices are {lowest}..{size - 1}"
            + (f" (or {ignore_index}, ignored)" if ignore_index is not None else ""))


def check_index_range(indices, size: int, what: str, ignore_index=None,
                      error: type = IndexError, negative: bool = False) -> None:
    """Raise ``error`` (IndexError, as torch) on every rank of the placement when an
    index (other than ``ignore_index``) is outside ``[0, size)`` (``[-size, size)`` with
    ``negative``, as Python's indexing); on a GPU, assert on the
    device on every rank instead (as torch's kernels do there), so that the host does
    not wait for the device at every lookup.

    >>> check_index_range(gt_indices, 10, "embedding")   # doctest: +SKIP

    Skipped while torch.compile traces: the check reads index values, which a graph
    cannot branch on (compiled torch does not check them either).
    """
    if comm.tracing():
        return
    lowest = -size if negative else 0
    if not isinstance(indices, GlobalTensor):
        excess = _excess(indices, size, ignore_index, lowest)
    else:
        placement = indices.placement
        excess = -1
        # Reduced among the placement's ranks only: a rank outside holds no index and
        # may be busy elsewhere (another pipeline stage); it does not raise. They meet
        # first, as for an op's scalar result (``box(meet=True)``): a rank that skipped
        # a metric another rank computed alone meets it here, at its next step's
        # lookup, and both name it.
        if comm.get_rank() in placement:
            worst = _excess(indices.local_part, size, ignore_index, lowest)
            # Parts of a split differ: their worst cases are a partial max; copies agree.
            sbp = tuple(Partial("max") if isinstance(s, Split) else broadcast
                        for s in indices.sbp)
            layout = Layout.make((), placement, sbp)
            excess = box(worst, layout, layout.without_partials(), donate=True,
                         why=f"{what} index check", meet=True)
    if isinstance(excess, int) or comm.stats.dry():   # a dry run (check_step) has no values
        return
    if excess.device.type != "cpu":
        # On a GPU, as torch's own kernels: a device-side assert, on every rank holding
        # the reduced value, with no wait for the device here.
        torch._assert_async(excess <= 0, _message(what, size, ignore_index, lowest))
    elif int(excess) > 0:
        raise error(_message(what, size, ignore_index, lowest))


def check_split_indices(indices, sizes, what: str, negative: bool) -> None:
    """``check_index_range`` for each GlobalTensor of ``indices`` that is split now
    (``sizes``: the size each one indexes); broadcast ones are checked by the op on
    every rank alike, and a partial one is summed before it is used."""
    for t, size in zip(indices, sizes):
        if isinstance(t, GlobalTensor) and any(isinstance(s, Split) for s in t.sbp) \
                and not t.dtype.is_floating_point and t.dtype != torch.bool:
            check_index_range(t, size, what, negative=negative)
