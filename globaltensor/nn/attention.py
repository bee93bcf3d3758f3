"""Attention over packed sequences: several documents laid end to end in one sequence,
given by their offsets (``cu_seqlens``), where no token attends across a document
boundary, without a (sequence x sequence) mask. With the sequence split it runs as ring
attention (``rules/ring_attention.py``), each block's mask made from the documents'
numbers when the block arrives: a rank holds (sequence / n)^2 of mask at a time, and
skips the blocks that share no document with its queries.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..rules.ring_attention import _Ring, ring_backward, ring_forward
from ..sbp import Partial
from ..tensor import GlobalTensor, from_local_part


def packed_attention(query, key, value, offsets: "Sequence[int] | torch.Tensor",
                     is_causal: bool = True, scale: "float | None" = None,
                     positions: "torch.Tensor | None" = None):
    """``F.scaled_dot_product_attention(query, key, value, is_causal=is_causal)`` where
    position i sees position j only in the same document: ``offsets`` are the
    documents' starts and the sequence's end (``[0, 100, 356, 512]``: three documents,
    as flash-attention's ``cu_seqlens``), the same for every batch row. q, k, v are
    (batch, heads, sequence, head dim), plain tensors or GlobalTensors of one layout;
    a sequence split runs as ring attention. ``positions``: where each slot of the
    sequence is in the original order (a permutation; ``zigzag_order``'s balances a
    causal ring), which the causal mask and the documents follow.

    >>> out = gt.nn.packed_attention(q, k, v, offsets=[0, 100, 356, 512])  # doctest: +SKIP
    """
    length = query.shape[2]
    documents = _documents(offsets, length)
    positions = _positions(positions, length)
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 4 or x.shape[:3] != query.shape[:3] or query.dim() != 4:
            raise ValueError(f"packed_attention: query {tuple(query.shape)} and {name} "
                             f"{tuple(x.shape)} must be (batch, heads, sequence, head dim) "
                             "alike")
    if not isinstance(query, GlobalTensor):
        ring = _Ring(_whole(query), _whole(key), 0, positions)
        return _Packed.apply(query, key, value, documents, ring, is_causal, scale)
    if any(isinstance(s, Partial) for x in (query, key, value) for s in x.sbp):
        raise ValueError("packed_attention: partial query, key or value: reduce them first "
                         "(to_global with a split or broadcast sbp)")
    placement, sbp = query.placement, query.sbp
    key, value = (x.to_global(placement=placement, sbp=sbp) for x in (key, value))
    layout = Layout.make(tuple(query.shape[:3]) + (value.shape[3],), placement, sbp)
    rank = comm.get_rank()
    if rank not in placement:   # holds no part: nothing to compute, nothing to pass on
        return from_local_part(torch.empty(0, dtype=query.dtype), layout)
    ring = _Ring(query._layout, key._layout, rank, positions)
    local = _Packed.apply(query.to_local(), key.to_local(), value.to_local(),
                          documents, ring, is_causal, scale)
    return from_local_part(local, layout)


def _documents(offsets, length: int) -> "torch.Tensor | None":
    """Each position's document number (None for one document), after checking
    ``offsets``."""
    starts = torch.as_tensor(offsets, dtype=torch.int64).flatten()
    if (len(starts) < 2 or int(starts[0]) != 0 or int(starts[-1]) != length
            or bool((starts[1:] <= starts[:-1]).any())):
        raise ValueError(f"packed_attention: offsets must rise from 0 to the sequence length "
                         f"{length} (each document's start, then the end), got "
                         f"{starts.tolist()}")
    if len(starts) == 2:   # one document: no mask of documents
        return None
    return torch.searchsorted(starts, torch.arange(length), right=True) - 1


def zigzag_order(length: int, ranks: int) -> torch.Tensor:
    """The order of a sequence's positions that balances causal ring attention: the
    sequence cut in ``2 * ranks`` equal chunks, rank r's part of a split of the
    reordered sequence holding chunks r and 2 ranks - 1 - r (a causal query chunk near
    the start sees few keys, one near the end many; each rank gets one of each).
    Reorder the batch with it (``ids[:, order]``, and the targets), give it as the
    positions (position embeddings, ``packed_attention(..., positions=order)``).

    >>> gt.nn.zigzag_order(8, 2)
    tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if length % (2 * ranks):
        raise ValueError(f"zigzag_order: a sequence of {length} does not cut into "
                         f"2 x {ranks} equal chunks; pad it to a multiple of {2 * ranks}")
    chunks = torch.arange(length).view(2 * ranks, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * ranks - 1 - r]])
                      for r in range(ranks)])


def _positions(positions, length: int) -> "torch.Tensor | None":
    """``positions`` checked: a permutation of the sequence's slots (None: in order)."""
    if positions is None:
        return None
    order = torch.as_tensor(positions, dtype=torch.int64).flatten().cpu()
    if len(order) != length or not torch.equal(order.sort().values, torch.arange(length)):
        raise ValueError(f"packed_attention: positions must be an order of the sequence's "
                         f"{length} positions (a permutation of 0..{length - 1})")
    return order


def _whole(x: torch.Tensor) -> Layout:
    """The layout of a plain tensor: whole on a ring of one."""
    from ..placement import Placement
    from ..sbp import broadcast
    return Layout.make(tuple(x.shape), Placement("cpu", [0]), (broadcast,))


class _Packed(torch.autograd.Function):
    """Packed attention on this rank's parts: forward and backward walk the ring."""

    @staticmethod
    def forward(ctx, query, key, value, documents, ring, causal, scale):
        # (as they come: the CPU kernel takes F.scaled_dot_product_attention's
        # transposed (batch, sequence, heads, dim) memory fastest, not a contiguous copy)
        out, lse = ring_forward(ring, query, key, value, causal, None, scale, documents)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.documents, ctx.ring, ctx.causal, ctx.scale = documents, ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        grads = ring_backward(ctx.ring, grad_out, query, key, value, out, lse,
                              ctx.causal, None, ctx.scale, ctx.documents)
        return (*grads, None, None, None, None)
