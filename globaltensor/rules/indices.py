"""Index checks for ops that look up rows or classes (embedding, nll_loss).

Plain torch raises IndexError for an index outside ``[0, size)``. On parts, an index
outside a rank's window looks like "held by another rank", so without a check the op
silently returns zeros. The check runs on each rank's part of the indices and takes
the worst case across ranks with one reduction of one number (none when the indices
are broadcast), so every rank of the placement raises together.
"""
from __future__ import annotations

import torch

from .. import comm
from ..boxing.run import box
from ..layout import Layout
from ..sbp import Partial, Split, broadcast
from ..tensor import GlobalTensor


def _excess(local: torch.Tensor, size: int, ignore_index) -> int:
    """How far the worst index lies outside [0, size) (<= 0: all inside)."""
    if ignore_index is not None:
        local = local[local != ignore_index]
    if not local.numel():
        return -1
    return max(int(local.max()) - (size - 1), -int(local.min()))


def check_index_range(indices, size: int, what: str, ignore_index=None,
                      error: type = IndexError) -> None:
    """Raise ``error`` (IndexError, as torch) on every rank of the placement when an index (other than
    ``ignore_index``) is outside ``[0, size)``.

    >>> check_index_range(gt_indices, 10, "embedding")   # doctest: +SKIP

    Skipped while torch.compile traces: the check reads index values, which a graph
    cannot branch on (compiled torch does not check them either).
    """
    if comm.tracing():
        return
    if not isinstance(indices, GlobalTensor):
        excess = _excess(indices, size, ignore_index)
    else:
        placement = indices.placement
        excess = -1
        # Reduced among the placement's ranks only: a rank outside holds no index and
        # may be busy elsewhere (another pipeline stage); it does not raise. They meet
        # first, as for an op's scalar result (``box(meet=True)``): a rank that skipped
        # a metric another rank computed alone meets it here, at its next step's
        # lookup, and both name it.
        if comm.get_rank() in placement:
            worst = _excess(indices.local_part, size, ignore_index)
            # Parts of a split differ: their worst cases are a partial max; copies agree.
            sbp = tuple(Partial("max") if isinstance(s, Split) else broadcast
                        for s in indices.sbp)
            layout = Layout.make((), placement, sbp)
            local = torch.tensor(worst, dtype=torch.int64, device=indices.local_part.device)
            excess = int(box(local, layout, layout.without_partials(), donate=True,
                             why=f"{what} index check", meet=True))
    if excess > 0:
        raise error(f"{what}: index out of range: valid indices are 0..{size - 1}"
                         + (f" (or {ignore_index}, ignored)" if ignore_index is not None else ""))
