"""Cutting a batch into micro-batches on a stage's placement (``Pipeline.step``)."""
from __future__ import annotations

import zlib

import torch

from .. import comm
from ..layout import Layout
from ..local_parts import device_of
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import GlobalTensor, from_full


def batch_rows(t) -> int:
    """The batch size (dim 0) of a stage input or target."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise ValueError(f"expected a tensor with a batch dim, got {describe(t)}")
    return t.shape[0]


def describe(t) -> str:
    """What ``t`` is, for error messages."""
    if isinstance(t, GlobalTensor):
        return f"GlobalTensor(shape={tuple(t.shape)}, placement={t.placement}, sbp={t.sbp})"
    if isinstance(t, torch.Tensor):
        return f"a plain tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def batch_signature(t, values: bool) -> list[int]:
    """Integers that differ when two ranks pass different batches (or targets): rank
    count of dims, the shape, a digest of the dtype and, for a GlobalTensor, of its
    placement and sbp; with ``values`` (check mode), of a plain tensor's values too.
    ``describe_signature`` reads the shape back."""
    kind = str(t.dtype) + (f"|{t.placement}|{t.sbp}" if isinstance(t, GlobalTensor) else "")
    out = [t.dim(), *t.shape, zlib.crc32(kind.encode())]
    if values and not isinstance(t, GlobalTensor):
        out.append(zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    return out


def describe_signature(sig: list[int]) -> str:
    return str(tuple(sig[1:1 + sig[0]]))


def agree_on_batches(ranks: tuple[int, ...], batches: tuple, schedule: tuple = ()) -> None:
    """Raise ``DivergenceError`` on every rank of ``ranks`` unless all pass batches (and
    targets) of one shape, dtype and layout, and run one schedule (``schedule``: its
    shape as integers: micro-batches, stages, kind): the micro-batches' hand-offs would
    otherwise pair messages of different sizes (gloo aborts the process) or mix values.
    One small all-gather of integers; in check mode plain batches' values are compared too."""
    sigs = [batch_signature(t, comm.check_mode()) for t in batches if t is not None]
    flat = [len(schedule), *schedule, len(sigs)] + [v for sig in sigs for v in [len(sig), *sig]]
    everyone = comm.all_gather_ints(flat, ranks)
    if all(other == flat for other in everyone):
        return
    schedules = {tuple(other[1:1 + other[0]]) for other in everyone}
    if len(schedules) > 1:
        what = "; ".join(f"rank {r} {other[1]} micro-batches of {other[2]} stages"
                         for r, other in zip(ranks, everyone) if len(other) > 2)
        raise comm.DivergenceError(
            f"globaltensor: the ranks of a Pipeline run different schedules ({what}; or "
            f"another schedule kind). Every rank of the pipeline makes the Pipeline with the "
            f"same stages, micro_batches and schedule")
    everyone = [other[1 + other[0]:] for other in everyone]
    by_batch: dict = {}
    for rank, other in zip(ranks, everyone):
        shapes, i = [], 1
        for _ in range(other[0]):
            shapes.append(describe_signature(other[i + 1:i + 1 + other[i]]))
            i += 1 + other[i]
        by_batch.setdefault((" and target ".join(shapes), tuple(other)), []).append(rank)
    what = "; ".join(f"ranks {rs} a batch {shapes}" for (shapes, _), rs in by_batch.items())
    same_shapes = len({shapes for shapes, _ in by_batch}) == 1
    raise comm.DivergenceError(
        f"globaltensor: the ranks of a Pipeline.step passed different batches ({what}"
        f"{': same shapes, different dtype, layout or values' if same_shapes else ''}). Every "
        f"rank of the pipeline passes the same batch and target (a plain tensor: the whole "
        f"batch, equal on every rank; or one GlobalTensor)")


def cut_micro_batches(x, sizes, placement: Placement, sbp) -> list:
    """Micro-batches of ``x`` (rows in order, ``sizes`` each) on ``placement``: a
    GlobalTensor is gathered there once and sliced locally; a plain tensor (the whole
    value, the same on every rank) is sliced and each rank keeps its part."""
    if isinstance(x, GlobalTensor):
        if sbp is None:
            sbp = x.sbp if x.placement.ndim == placement.ndim else None
        whole = x.to_global(placement, (broadcast,) * placement.ndim)
    else:
        whole = x
    sbp = sbp if sbp is not None else (broadcast,) * placement.ndim
    parts, offset = [], 0
    for size in sizes:
        part = whole[offset:offset + size]
        offset += size
        if isinstance(part, GlobalTensor):
            parts.append(part.to_global(placement, sbp))
            continue
        layout = Layout.make(part.shape, placement, sbp)
        if layout.partial_axes or comm.get_rank() not in placement:
            parts.append(from_full(part, layout))
        else:  # a view of the caller's batch, as plain torch would use it: no copy
            local = part[layout.region(comm.get_rank()).slices()]
            parts.append(GlobalTensor(local.to(device_of(placement)), layout))
    return parts
