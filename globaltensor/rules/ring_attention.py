"""Attention with the sequence split (context parallel), as ring attention: each rank
keeps its block of queries and passes its block of keys and values around the ranks
that split the sequence, one hop per step, so no rank ever holds the whole sequence.

Forward: a rank attends its queries to each key/value block as it arrives (the fused
kernel on the pair of blocks, with its log-sum-exp) and merges the partial results
by their log-sum-exps (the online softmax). Backward: the same walk with the global
output and log-sum-exp, which make each block's kernel backward exact: the query
gradient adds up where it is, and each block's key/value gradient travels with that
block and arrives home after the last hop. The next block's transfer is posted
before the current block is computed, so the two overlap.

Causal attention skips the blocks wholly after a rank's queries and runs the kernel's
own causal mask on the diagonal block (same offsets); any other partial overlap gets
an explicit mask. An attention mask split on its query rows (a padding mask) is cut
per key block. Uneven splits are fine: every block's size comes from the layout.

These are the local implementations of the flash kernels and their backward, the
CPU one and the CUDA one (``attention.py`` offers the sequence split for them); with
any other signature they run the kernel as it is. On the CUDA kernel each block runs
the kernel itself, as torch's own context parallel does (a block that would need a mask,
which that kernel takes none of, runs as plain ops). ``gt.nn.packed_attention`` walks the
same ring on any device: off the CPU each block runs as plain ops with its log-sum-exp
(``math_forward``, ``math_backward``), a block's scores at a time.
"""
from __future__ import annotations

import functools

import torch

from .. import comm
from ..sbp import Split
from .registry import communicating

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_CUDA_FORWARD = aten._scaled_dot_product_flash_attention.default
_CUDA_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
SEQ = 2   # (batch, heads, sequence, head dim)


@functools.lru_cache(maxsize=1024)   # asked at every call of the kernel
def ring_of(layout, rank: int) -> "tuple[tuple, tuple] | None":
    """(the ranks that hold the other blocks of ``layout``'s sequence dim with the same
    part of every other dim: those that differ from this rank only on the placement
    axes splitting the sequence, in sequence order, this rank among them; each one's
    (start, stop) on the sequence), or None where that dim is not split."""
    axes = [a for a, s in enumerate(layout.sbp) if isinstance(s, Split) and s.dim == SEQ]
    if not axes:
        return None
    placement, mine = layout.placement, layout.placement.coord(rank)
    ring = []
    for r in placement.flat_ranks:
        there = placement.coord(r)
        if all(there[a] == mine[a] for a in range(placement.ndim) if a not in axes):
            region = layout.region(r)
            start = region.offsets[SEQ]
            ring.append((start, tuple(there[a] for a in axes), r, start + region.sizes[SEQ]))
    ring.sort()
    return tuple(r for _, _, r, _ in ring), tuple((start, stop) for start, _, _, stop in ring)


def _block_forward(query, key, value, causal: bool, mask, scale):
    """(output, log-sum-exp) of one block: the CPU flash kernel, or plain ops."""
    if query.device.type == "cpu":
        return _FORWARD(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
    return math_forward(query, key, value, causal, mask, scale)


def _block_backward(grad_out, query, key, value, out, lse, causal: bool, mask, scale):
    """(query, key, value gradients) of one block, given the whole row's output and
    log-sum-exp: the CPU flash kernel's backward, or plain ops."""
    if query.device.type == "cpu":
        return _BACKWARD(grad_out, query, key, value, out, lse, 0.0, causal,
                         attn_mask=mask, scale=scale)
    return math_backward(grad_out, query, key, value, out, lse, causal, mask, scale)


def _scores(query, key, causal: bool, mask, scale):
    """A block's scaled scores in fp32, masked (causal: top-left aligned, as torch)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query.float() @ key.float().transpose(-2, -1)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask.float()
    return scores, scale


def math_forward(query, key, value, causal: bool, mask=None, scale=None) -> tuple:
    """(output, log-sum-exp) of attention on one block, as plain ops (a row that sees no
    key: output 0, log-sum-exp -inf).

    >>> out, lse = math_forward(q, k, v, causal=True)   # doctest: +SKIP
    """
    scores, _ = _scores(query, key, causal, mask, scale)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ value.float()).to(query.dtype), lse


def math_backward(grad_out, query, key, value, out, lse, causal: bool, mask=None,
                  scale=None) -> tuple:
    """(query, key, value gradients) of one block given the whole row's output and
    log-sum-exp (exact per block: the softmax's normaliser is the row's).

    >>> dq, dk, dv = math_backward(g, q, k, v, out, lse, causal=True)   # doctest: +SKIP
    """
    scores, scale = _scores(query, key, causal, mask, scale)
    probs = torch.exp(scores - lse.float().unsqueeze(-1)).nan_to_num(0.0)
    grad = grad_out.float()
    grad_v = probs.transpose(-2, -1) @ grad
    rows = (grad * out.float()).sum(-1, keepdim=True)
    grad_s = probs * (grad @ value.float().transpose(-2, -1) - rows)
    grad_q = (grad_s @ key.float()) * scale
    grad_k = (grad_s.transpose(-2, -1) @ query.float()) * scale
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


def _block_mask(rows: tuple, cols: tuple, causal: bool, explicit, dtype, documents=None,
                device=None):
    """(the kernel's is_causal, its attn_mask) for queries at positions ``rows`` against
    keys at ``cols`` ((start, stop) each), or None where no key is visible.
    ``explicit``: the caller's mask on those rows and columns; ``documents``: each
    position's document number (packed sequences: no query sees another document)."""
    if causal and cols[0] > rows[1] - 1:
        return None   # every key after every query
    if documents is not None and (documents[cols[1] - 1] < documents[rows[0]] or
                                  documents[cols[0]] > documents[rows[1] - 1]):
        return None   # (numbers rise along the sequence) no document in common
    i = torch.arange(rows[0], rows[1]).unsqueeze(1)
    j = torch.arange(cols[0], cols[1]).unsqueeze(0)
    hidden = None
    if documents is not None and not (documents[rows[0]] == documents[rows[1] - 1]
                                      == documents[cols[0]] == documents[cols[1] - 1]):
        hidden = documents[i] != documents[j]   # (else one document: nothing hidden)
    if causal and cols[1] - 1 > rows[0]:   # some key after some query
        if rows[0] == cols[0] and explicit is None and hidden is None:
            return True, None   # the diagonal block: the kernel's mask, top-left aligned
        hidden = (j > i) if hidden is None else hidden | (j > i)
    if hidden is None:
        return False, explicit
    visible = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(
        hidden.to(device), float("-inf"))
    return False, visible if explicit is None else explicit + visible


class _Ring:
    """One rank's walk around its ring: which block it holds at each step, and the
    transfers that move blocks (and what travels with them) one hop on. Not split
    (or on one rank): a ring of one, whose one step is the whole attention."""

    def __init__(self, query_layout, key_layout, rank: int, positions=None):
        found = ring_of(key_layout, rank)
        if found is None:
            found = (rank,), ((0, key_layout.shape[SEQ]),)
        ranks, self.spans = found
        self.n, self.me = len(ranks), ranks.index(rank)
        self.next, self.prev = ranks[(self.me + 1) % self.n], ranks[(self.me - 1) % self.n]
        query = query_layout.region(rank)
        # runs of consecutive positions: (first, last + 1 local index, first position)
        self.rows = _runs((query.offsets[SEQ], query.offsets[SEQ] + query.sizes[SEQ]),
                          positions)
        self.cols = [_runs(span, positions) for span in self.spans]

    def pairs(self, block: int, causal: bool, mask, query, documents):
        """(query rows, key rows, the kernel's is_causal and attn_mask) of each pair of
        runs of this rank's queries and ``block``'s keys that sees some key."""
        start = self.spans[block][0]
        for r0, r1, at in self.rows:
            for c0, c1, bt in self.cols[block]:
                explicit = None if mask is None else mask[..., r0:r1, start + c0:start + c1]
                how = _block_mask((at, at + r1 - r0), (bt, bt + c1 - c0), causal, explicit,
                                  query.dtype, documents, query.device)
                if how is not None:
                    yield slice(r0, r1), slice(c0, c1), how[0], how[1]

    def held(self, step: int) -> int:
        """The block this rank holds at ``step`` (its own at 0)."""
        return (self.me - step) % self.n

    def pass_on(self, tensors: list, block: int):
        """Post sending ``tensors`` (of ``block``) on and receiving the previous rank's,
        of the block before; returns (the receive buffers, the transfer)."""
        size = self.spans[(block - 1) % self.n]
        size = size[1] - size[0]
        recvs = [t.new_empty(t.shape[:SEQ] + (size,) + t.shape[SEQ + 1:]) for t in tensors]
        work = comm.start_p2p([(t.contiguous(), self.next) for t in tensors],
                              [(t, self.prev) for t in recvs])
        return recvs, work


def _is_ring(ctx, index: int) -> bool:
    ring = ring_of(ctx.in_layouts[index], ctx.rank)
    return ring is not None and len(ring[0]) > 1


@communicating
def flash_forward_local(ctx, query, key, value, dropout_p=0.0, is_causal=False, *,
                        attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu`` on this rank's parts: the kernel
    itself, or ring attention where the sequence is split."""
    if not _is_ring(ctx, 1):
        if not query.numel() or not key.numel():   # an empty part (the kernel would trap)
            return _empty_forward(query, value)
        return _FORWARD(query, key, value, dropout_p, is_causal, attn_mask=attn_mask,
                        scale=scale)
    ring = _Ring(ctx.in_layouts[0], ctx.in_layouts[1], ctx.rank)
    return ring_forward(ring, query, key, value, is_causal, attn_mask, scale)


def _empty_forward(query, value) -> tuple:
    """The kernel's (output, log-sum-exp) for no queries or no keys: the CPU kernel
    traps (SIGFPE) on a part with no heads, which an uneven head split gives a rank."""
    return (torch.zeros(query.shape[:-1] + value.shape[-1:], dtype=query.dtype,
                        device=query.device),
            torch.full(query.shape[:-1], float("-inf"), device=query.device))


def ring_forward(ring: _Ring, query, key, value, causal: bool, mask, scale, documents=None,
                 block_forward=None):
    """(output, log-sum-exp) of this rank's queries against every key block
    (``block_forward``: one block's, ``_block_forward``'s arguments and result; by
    default ``_block_forward`` itself)."""
    block_forward = block_forward or _block_forward
    out, lse = _empty_forward(query, value)
    out = out.float()
    held = [key, value]
    for step in range(ring.n):
        block = ring.held(step)
        moving = ring.pass_on(held, block) if step < ring.n - 1 else None
        if query.numel() and held[0].numel():
            for rows, cols, is_causal, explicit in ring.pairs(block, causal, mask, query,
                                                              documents):
                o, l = block_forward(*_parts(query, held[0], held[1], rows=rows, cols=cols),
                                     is_causal, explicit, scale)
                if explicit is not None:   # the kernel gives a row that sees no key lse 0
                    l = l.masked_fill(~(explicit > float("-inf")).any(-1), float("-inf"))
                _merge(out, lse, rows, o, l)
        if moving is not None:
            held, work = moving
            work.wait()
    return out.to(query.dtype), lse


def _parts(*tensors, rows: slice, cols: slice) -> list:
    """The query-side tensors' ``rows`` and the key-side ones' ``cols`` of the sequence
    (the first one query-side, the rest key-side), views: the kernel takes strided
    memory (F.scaled_dot_product_attention's transposed layout runs fastest)."""
    return [t[..., rows if k == 0 else cols, :] for k, t in enumerate(tensors)]


def _merge(out, lse, rows: slice, o, l) -> None:
    """The online softmax, in place: the partial attention (o, l) of ``rows`` merged
    into ``out`` and ``lse`` by their log-sum-exps (a row that saw no key has -inf and
    weighs nothing)."""
    o = o.float().nan_to_num(0.0)
    before = lse[..., rows]
    total = torch.logaddexp(before, l)
    ahead = torch.exp(before - total).nan_to_num(0.0).unsqueeze(-1)
    here = torch.exp(l - total).nan_to_num(0.0).unsqueeze(-1)
    out[..., rows, :] = out[..., rows, :] * ahead + o * here
    lse[..., rows] = total


@communicating
def flash_backward_local(ctx, grad_out, query, key, value, out, logsumexp, dropout_p,
                         is_causal, *, attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` on this rank's parts:
    the kernel itself, or ring attention's backward where the sequence is split."""
    if not _is_ring(ctx, 2):
        if not query.numel() or not key.numel():   # an empty part (the kernel would trap)
            return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        return _BACKWARD(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                         attn_mask=attn_mask, scale=scale)
    ring = _Ring(ctx.in_layouts[1], ctx.in_layouts[2], ctx.rank)
    return ring_backward(ring, grad_out, query, key, value, out, logsumexp, is_causal,
                         attn_mask, scale)


def ring_backward(ring: _Ring, grad_out, query, key, value, out, logsumexp, causal: bool,
                  mask, scale, documents=None, block_backward=None):
    """(query, key, value gradients) of this rank's parts: the ring walked again
    (``block_backward``: one block's, ``_block_backward``'s arguments and result; by
    default ``_block_backward`` itself)."""
    block_backward = block_backward or _block_backward
    grad_q = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    held = [key, value, torch.zeros(key.shape, dtype=torch.float32, device=key.device),
            torch.zeros(value.shape, dtype=torch.float32, device=value.device)]
    for step in range(ring.n):
        block = ring.held(step)
        if query.numel() and held[0].numel():
            for rows, cols, is_causal, explicit in ring.pairs(block, causal, mask, query,
                                                              documents):
                g, q, o = (_parts(t, rows=rows, cols=cols)[0] for t in (grad_out, query, out))
                lse = logsumexp[..., rows]
                k, v = _parts(query, held[0], held[1], rows=rows, cols=cols)[1:]
                dq, dk, dv = block_backward(g, q, k, v, o, lse, is_causal, explicit, scale)
                grad_q[..., rows, :] += dq
                held[2][..., cols, :] += dk
                held[3][..., cols, :] += dv
        if ring.n == 1:
            break
        # the keys and values go on while another rank still needs them; their
        # gradients go on every time: after the last step, one hop takes them home
        if step < ring.n - 1:
            held, work = ring.pass_on(held, block)
        else:
            held[2:], work = ring.pass_on(held[2:], block)
        work.wait()
    return grad_q.to(query.dtype), held[2].to(key.dtype), held[3].to(value.dtype)


@communicating
def cuda_flash_forward_local(ctx, query, key, value, dropout_p=0.0, is_causal=False,
                             return_debug_mask=False, *, scale=None):
    """``_scaled_dot_product_flash_attention`` (the CUDA flash kernel) on this rank's
    parts: the kernel itself, or ring attention where the sequence is split, each block
    on the kernel. The ring's other outputs are the kernel's kinds (empty random state:
    no dropout here) with the whole call's sequence lengths."""
    if not _is_ring(ctx, 1):
        return _CUDA_FORWARD(query, key, value, dropout_p, is_causal, return_debug_mask,
                             scale=scale)
    ring = _Ring(ctx.in_layouts[0], ctx.in_layouts[1], ctx.rank)
    out, lse = ring_forward(ring, query, key, value, is_causal, None, scale,
                            block_forward=_cuda_block_forward)
    # what the kernel's outputs after these are (their kinds change between torch
    # versions), from its meta implementation on parts of these shapes
    kinds = aten._scaled_dot_product_flash_attention.default(
        *(torch.empty_like(t, device="meta") for t in (query, key, value)), 0.0, is_causal,
        False, scale=scale)[2:]
    rest = [torch.empty(o.shape, dtype=o.dtype, device=query.device)
            if isinstance(o, torch.Tensor) else o for o in kinds]
    rest[2], rest[3] = ctx.in_layouts[0].shape[SEQ], ctx.in_layouts[1].shape[SEQ]
    return (out, lse, *rest)


@communicating
def cuda_flash_backward_local(ctx, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                              cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                              philox_offset, *, scale=None):
    """``_scaled_dot_product_flash_attention_backward`` on this rank's parts: the kernel
    itself, or ring attention's backward where the sequence is split (each block's
    backward on the kernel, with the whole rows' output and log-sum-exp)."""
    if not _is_ring(ctx, 2):
        return _CUDA_BACKWARD(grad_out, query, key, value, out, logsumexp, cum_seq_q,
                              cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                              philox_offset, scale=scale)
    ring = _Ring(ctx.in_layouts[1], ctx.in_layouts[2], ctx.rank)
    return ring_backward(ring, grad_out, query, key, value, out, logsumexp, is_causal, None,
                         scale, block_backward=functools.partial(
                             _cuda_block_backward, philox_seed, philox_offset))


def _cuda_block_forward(query, key, value, causal: bool, mask, scale):
    """``_block_forward`` on the CUDA flash kernel (which takes no mask: a block that
    needs one runs as plain ops)."""
    if mask is not None:
        return math_forward(query, key, value, causal, mask, scale)
    found = _CUDA_FORWARD(query, key, value, 0.0, causal, False, scale=scale)
    return found[0], found[1]


def _cuda_block_backward(seed, offset, grad_out, query, key, value, out, lse, causal: bool,
                         mask, scale):
    """``_block_backward`` on the CUDA flash kernel. The rows' log-sum-exp is cut from
    the whole part's: made contiguous, as the kernel reads it."""
    if mask is not None:
        return math_backward(grad_out, query, key, value, out, lse, causal, mask, scale)
    return _CUDA_BACKWARD(grad_out, query, key, value, out, lse.contiguous(), None, None,
                          query.shape[SEQ], key.shape[SEQ], 0.0, causal, seed, offset,
                          scale=scale)


def _runs(span: tuple, positions) -> list:
    """[(first, last + 1, first position)] of the runs of consecutive positions of the
    sequence slots ``span`` ((start, stop)) in their order (one run without
    ``positions``; none for an empty span)."""
    start, stop = span
    if stop <= start:
        return []
    if positions is None:
        return [(0, stop - start, start)]
    at = positions[start:stop].tolist()
    runs, first = [], 0
    for k in range(1, len(at) + 1):
        if k == len(at) or at[k] != at[k - 1] + 1:
            runs.append((first, k, at[first]))
            first = k
    return runs
