"""An op's input boxing, reused by the next ops that read the same tensor the same way.

One activation is often read by several ops in turn, each needing it in the same other
layout: the query, key and value projections of one hidden state, a SwiGLU's gate and
up projections, a recurrent cell's weight at every time step. Decided op by op (the
first steps of training, before whole-step planning; inference and ``generate()``,
whose growing key-value cache is never planned), each op boxed it again: a 2-layer
Llama made Megatron-style gathered each decoded token's hidden state five times per
layer instead of twice. Here the last few boxings that communicated are kept, and an op
whose input reads the same values (the same GlobalTensor, or a view alike of all of the
same one), unchanged since (version counters), boxed between the same layouts, takes
the kept result instead of communicating. Every rank decides alike (from what all see
alike), so no rank skips a collective that another runs.

Only ops that neither write nor view their inputs take part (``dispatch/entry.py``),
and a kept result that something wrote since is not reused: no two values share
memory that torch would not have shared. ``KEPT`` results at most stay alive past their
op: memory of that many boxed parts, for the span of a few ops (their inputs are not
kept alive). Not while tracing for
``torch.compile`` (the graph is deduplicated by the compiler, and tracing tensors have no
versions to compare), nor for tensors made under ``torch.inference_mode()`` (no version
counters either).

>>> local = box_reusing(x, x._local, x._layout, target, why=func)   # doctest: +SKIP
"""
from __future__ import annotations

import logging
import weakref

import torch

from .. import modes
from ..layout import Layout
from .plan import plan_route
from .run import box

KEPT = 2   # boxings kept: consecutive readers (q, k, v; gate, up) sit within two

_log = logging.getLogger("globaltensor")
_kept: list = []   # newest first: (input, its root (weak), what it reads, versions, src, dst, result, its version)


def box_reusing(x: torch.Tensor, local: torch.Tensor, src: Layout, dst: Layout,
                why: object) -> torch.Tensor:
    """``box(local, src, dst, why=why)`` of the GlobalTensor ``x`` (``local`` its part
    here), or the result of the same boxing a recent op made of the same, unchanged,
    values."""
    if local.is_inference() or not plan_route(src, dst, local.element_size()).sends:
        return box(local, src, dst, why=why)   # (no version counters; nothing to save)
    base = x._base
    root = x if base is None else base
    # A write to ``x`` is counted on ``x`` and its views (its part is written below
    # autograd, where torch counts nothing), one to the part itself (``to_local()``) on
    # the part.
    versions = x._version, local._version
    reads = None
    for source, source_root, source_reads, seen_versions, seen_src, seen_dst, result, \
            result_version in _kept:
        if seen_versions != versions or source_root() is not root or seen_src != src \
                or seen_dst != dst or result._version != result_version:
            continue
        kept = source()
        if kept is not x:   # a view of the root reading what the kept one read
            if base is None:
                continue
            reads = reads or _reads(x, root)
            if reads is None or reads != _read_alike(kept, source_reads, root):
                continue
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s reuses the boxing of its input from sbp %s to %s that an op "
                       "before it made", why, src.sbp, dst.sbp)
        return result
    out = box(local, src, dst, why=why)
    # (the inputs by weak reference: a kept GlobalTensor would keep its autograd graph,
    # a forward's saved activations, alive past the step; a root is told by its
    # identity, a view by what it reads, as each reader makes its own)
    _kept.insert(0, (weakref.ref(x), weakref.ref(root),
                     None if base is None else reads or _reads(x, root), versions, src, dst,
                     out, out._version))
    del _kept[KEPT:]
    return out


def _read_alike(kept: torch.Tensor | None, kept_reads: tuple | None, root: torch.Tensor):
    """What a kept input reads of ``root``: kept with it for a view, told anew for the
    root itself (a root is kept by identity: most readers pass it as it is)."""
    return _reads(root, root) if kept is root else kept_reads


def _reads(x: torch.Tensor, root: torch.Tensor) -> tuple | None:
    """What ``x`` reads of ``root``, told by what every rank sees alike (a part's own
    memory is no guide: a rank holding none of a view has an empty or a new part, where
    another's is a view of its root's part, and the ranks must decide alike whether to
    communicate): a view of all of ``root`` (an op's ``x.view(...)`` of one activation,
    made anew for each reader), by its shape and strides. None for a view of less (a
    slice: its offset is not among the global metadata) or of overlapping elements.
    While ``root`` lives (its views hold it), no other tensor is given its identity."""
    stride = x.stride()
    if x.numel() != root.numel() or 0 in stride:
        return None
    return x.shape, stride, x.dtype, x.is_conj(), x.is_neg()


def forget() -> None:
    """Let go of every kept boxing (``gt.testing.reset()``)."""
    _kept.clear()


modes.on_reset(forget)
