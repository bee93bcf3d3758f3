"""The values behind a partial layout: a reduction's identity and the reduction of
equal-shape addends, in one place for the boxing steps, the simulator, random init,
checkpoints and the rules.
"""
from __future__ import annotations

import torch

from .layout import Layout
from .sbp import StridedSplit


def identity_value(reduce: str, dtype: torch.dtype):
    """The element that leaves a partial reduction unchanged (0 for sum, lowest for max).

    >>> identity_value("max", torch.int8)
    -128
    """
    if reduce == "sum":
        return 0
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return float("-inf")
    return torch.iinfo(dtype).min


def reduce_values(xs: list, reduce: str) -> torch.Tensor:
    """The sum or max of equal-shape tensors, in their dtype (a sum of bools is their
    "or", as torch adds bools; torch's own sum would widen integers to int64).

    >>> reduce_values([torch.tensor([1, 5]), torch.tensor([4, 2])], "max")
    tensor([4, 5])
    """
    stacked = torch.stack(xs)
    return (stacked.sum(0) if reduce == "sum" else stacked.amax(0)).to(xs[0].dtype)


def identity_fill(layout: Layout, rank: int) -> str | None:
    """None when ``rank`` holds the value on ``layout``'s partial axes (it is the first
    member along each), else the reduce whose identity its local tensor holds: that of
    the outermost partial axis it is not first on.

    >>> identity_fill(Layout.make((4,), p, partial_sum), 1)   # doctest: +SKIP
    'sum'
    """
    coord = layout.placement.coord(rank)
    for axis in layout.partial_axes:
        if coord[axis] != 0:
            return layout.sbp[axis].reduce
    return None


def local_part(value: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s local tensor of the whole ``value``: its region, and on partial axes
    the value on the first member and the reduction's identity on the others.

    >>> local_part(torch.arange(4), Layout.make((4,), p, split(0)), 1)   # doctest: +SKIP
    tensor([2, 3])
    """
    if layout.strided:   # the refined view's part, seen back on the layout's shape
        fine = layout.refined({s.dim: s.blocks for s in layout.sbp
                               if isinstance(s, StridedSplit)})
        return local_part(value.reshape(fine.shape), fine, rank).reshape(
            layout.local_shape(rank))
    return keep_on_first(value[layout.region(rank).slices()].clone(), layout, rank)


def keep_on_first(local: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``local``, a part of a whole value, as ``rank``'s local tensor of ``layout``: kept
    on the first member of every partial axis, filled in place with the reduction's
    identity elsewhere (so the members' reduction is the value once).

    >>> keep_on_first(torch.ones(2), Layout.make((2,), p, partial_max), 1)  # doctest: +SKIP
    tensor([-inf, -inf])
    """
    fill = identity_fill(layout, rank)
    return local if fill is None else local.fill_(identity_value(fill, local.dtype))
