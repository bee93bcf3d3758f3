"""Views that are copies on each rank, and in-place writes through them.

A view op whose input had to be boxed first returns a view of the boxed copy, not of
the input's part: ``w[3]`` or ``logits[:, pad]`` of a tensor split on that dim gathers
the dim, then selects. torch's view would share ``w``'s memory, so a write through it
(``w[3] = 0``, ``logits[:, pad] = -inf``, ``nn.init.dirac_``, an embedding's
``padding_idx`` row zeroed by ``reset_parameters``) changes ``w``; on the copy alone it
would be lost. So such a view is remembered with its source while it lives, and after
an in-place op on it (or on a view of it) the elements it covers are written back into
the source's part: the copy and a mask of those elements boxed back to the source's
layout, then merged. A source changed since the view was taken raises instead: the copy
is stale, where torch's view would have seen the change. (Changes are seen by autograd's
version counter, which a view shares with its base: the parts' own counters do not move
below ``__torch_dispatch__``.)

While no such view lives, dispatch pays one truth test (``records``) per view or
in-place op.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .. import comm
from ..boxing.run import box
from ..layout import Layout
from ..tensor import GlobalTensor


@dataclass(eq=False)
class _Copy:
    source: weakref.ref    # the GlobalTensor the view was taken of
    copy: torch.Tensor     # its part boxed to ``copy_layout``, which the view aliases
    copy_layout: Layout
    version: int | None    # the source's ``_version`` when taken or last written back
    bumped: bool = False   # a write through a view of the copy has yet to move it by one


# id(view) -> the copy it aliases, while the view lives (several views may share one)
records: dict[int, _Copy] = {}


def remember(outputs, source: GlobalTensor, copy: torch.Tensor, copy_layout: Layout) -> None:
    """After a view op that boxed its input ``source`` to ``copy`` (this rank's part of
    ``copy_layout``): its outputs alias the copy. (Remembered on every rank alike, also
    where the boxing only sliced the source's own memory or left an empty part: the
    write-back is collective.)"""
    record = _Copy(weakref.ref(source), copy, copy_layout, _version(source))
    for view in _global_outputs(outputs):
        _keep(view, record)


def propagate(outputs, source: GlobalTensor) -> None:
    """After a view op that ran on ``source``'s part itself: a view of a remembered view
    aliases the same copy."""
    record = records.get(id(source))
    if record is not None:
        for view in _global_outputs(outputs):
            _keep(view, record)


def write_back(target: GlobalTensor) -> None:
    """After an in-place op on ``target``: where it is a view of a copy, the elements it
    covers go into the copy's source (and on, where the source is such a view itself)."""
    record = records.get(id(target))
    source = None if record is None else record.source()
    if source is None or comm.get_rank() not in source._layout.placement:
        return
    version = _version(source)
    if version is not None and record.version is not None and not (
            version == record.version or (record.bumped and version == record.version + 1)):
        raise RuntimeError(
            f"an in-place write through a view of a GlobalTensor (shape {tuple(source.shape)}, "
            f"sbp {source._layout.sbp}) taken before the tensor itself changed: that view "
            f"needed its dims gathered, so it is a copy on each rank, and the copy is out of "
            f"date. Take the view again after changing the tensor (w[i] = v, or "
            f"w[i].fill_(v), in one statement)")
    # The target's elements, located in the copy by their offsets in its storage
    copy, mine = record.copy, target._local
    flags = torch.zeros(copy.untyped_storage().nbytes() // copy.element_size(),
                        dtype=torch.bool, device=copy.device)
    flags.as_strided(mine.size(), mine.stride(), mine.storage_offset()).fill_(True)
    written = flags.as_strided(copy.size(), copy.stride(), copy.storage_offset())
    layout, part = source._layout, source._local
    why = "a write through a view of a split dim"
    values = box(copy, record.copy_layout, layout, why=why)
    written = box(written, record.copy_layout, layout.without_partials(), why=why)
    part.copy_(torch.where(written, values, part))
    # autograd moves the counter it shares with the source once the op returns
    record.version = version
    base = target._base
    record.bumped = base is not None and (base is source or base is source._base)
    write_back(source)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _keep(view, record: _Copy) -> None:
    key = id(view)
    records[key] = record
    weakref.finalize(view, _forget, key, record)


def _forget(key: int, record: _Copy) -> None:
    if records.get(key) is record:
        del records[key]


def _global_outputs(outputs):
    if isinstance(outputs, GlobalTensor):
        return (outputs,)
    return [o for o in outputs if isinstance(o, GlobalTensor)] \
        if isinstance(outputs, (list, tuple)) else ()
