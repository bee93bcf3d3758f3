"""The collectives with their tags (fingerprint.py): each takes what torch.distributed's
takes plus the ordered member ranks of its group, sends the tag with the payload (or in
one small all-gather before it), compares the words that arrive and raises
``DivergenceError`` on a mismatch, before anything reaches the caller's output.
``async_op=True`` returns a handle whose ``wait()`` compares and copies out.
"""
from __future__ import annotations

import array

import torch
import torch.distributed as dist

from . import fingerprint as fp
from . import guard
from .groups import get_group
from .guard import all_gather_single as _all_gather_single
from .guard import guarded
from .guard import reduce_scatter_single as _reduce_scatter_single


def _slots(ranks: tuple, word: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The slots of this rank: one group of chunks per member, zero but this rank's,
    which holds ``word`` in chunks (``fp._chunks``)."""
    k = 64 // bits
    me = ranks.index(fp.rank())
    values = [0] * (len(ranks) * k)
    values[me * k:(me + 1) * k] = fp._chunks(word, bits)
    code = _TYPECODES.get(dtype)   # (a typed array converts in a third of the time)
    if code is None:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


_TYPECODES = {torch.float32: "f", torch.float64: "d", torch.int64: "q", torch.int32: "i",
              torch.int16: "h", torch.int8: "b", torch.uint8: "B"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as flat bytes (a dim of size 1 may have any stride, which a
    view as another dtype refuses)."""
    if t.dim() != 1 or t.stride(0) != 1:
        if not t.is_contiguous():   # (torch.distributed refuses those too)
            raise ValueError("globaltensor: a collective's tensors must be contiguous")
        t = t.as_strided((t.numel(),), (1,))
    return t.view(torch.uint8)


_PAD = torch.zeros(8, dtype=torch.uint8)


def all_gather(dst: torch.Tensor, src: torch.Tensor, ranks: tuple, async_op: bool = False):
    """``all_gather_single(dst, src)`` (flat, contiguous) with tags: an 8-byte header
    before each member's bytes."""
    tag = fp.tag("all_gather", ranks, src.numel(), src.dtype)
    group = get_group(ranks)
    nbytes = src.numel() * src.element_size()
    if not fp.packs(src, nbytes):
        fp.exchange(tag)
        return guarded("all_gather", ranks, lambda: _all_gather_single(
            dst, src, group=group, async_op=async_op))
    n, row = len(ranks), 8 + fp._pad8(nbytes)
    # [word | the bytes | up to 7 bytes of padding]: each row's word lands 8-aligned
    word = tag.word.to_bytes(8, "little")
    send = torch.cat([torch.frombuffer(bytearray(word), dtype=torch.uint8), _bytes(src),
                      _PAD[:row - 8 - nbytes]])
    recv = torch.empty(n * row, dtype=torch.uint8)
    work = guarded("all_gather", ranks, lambda: _all_gather_single(
        recv, send, group=group, async_op=async_op))

    def finish(keep=send) -> None:  # (``keep``: the input lives until the gather is done)
        if recv.as_strided((n, 8), (row, 1)).tolist() != [list(word)] * n:
            fp.check(tag, recv.view(torch.int64)[::row // 8].tolist())
        _bytes(dst).view(n, nbytes).copy_(recv.as_strided((n, nbytes), (row, 1), 8))
    return fp._done(work, finish, async_op)


def all_reduce(t: torch.Tensor, reduce: str, ranks: tuple, async_op: bool = False):
    """In-place ``all_reduce`` of contiguous ``t`` ("sum" or "max") with tags in slots."""
    tag = fp.tag("all_reduce " + reduce, ranks, t.numel(), t.dtype)
    group, op = get_group(ranks), fp._OPS[reduce]
    bits = fp._SLOT_BITS.get(t.dtype)
    if bits is None or not fp.packs(t, t.numel() * t.element_size()):
        fp.exchange(tag)
        return guarded("all_reduce", ranks, lambda: dist.all_reduce(
            t, op=op, group=group, async_op=async_op))
    n, numel = len(ranks), t.numel()
    buf = torch.cat([t.view(-1), _slots(ranks, tag.word, bits, t.dtype)])
    work = guarded("all_reduce", ranks, lambda: dist.all_reduce(
        buf, op=op, group=group, async_op=async_op))

    def finish() -> None:
        fp.check_slots(tag, buf[numel:].tolist(), n, bits)
        t.view(-1).copy_(buf[:numel])
    return fp._done(work, finish, async_op)


def reduce_scatter(dst: torch.Tensor, src: torch.Tensor, reduce: str, ranks: tuple) -> None:
    """``reduce_scatter_tensor(dst, src)`` (``src`` contiguous) with tags in slots after
    each member's chunk."""
    tag = fp.tag("reduce_scatter " + reduce, ranks, src.numel(), src.dtype)
    group, op = get_group(ranks), fp._OPS[reduce]
    bits = fp._SLOT_BITS.get(src.dtype)
    if bits is None or not fp.packs(src, src.numel() * src.element_size()):
        fp.exchange(tag)
        guarded("reduce_scatter", ranks, lambda: _reduce_scatter_single(
            dst, src, op=op, group=group))
        return
    n, m = len(ranks), dst.numel()
    slots = _slots(ranks, tag.word, bits, src.dtype)
    buf = torch.cat([src.view(n, m), slots.expand(n, len(slots))], dim=1)
    recv = torch.empty(buf.shape[1], dtype=src.dtype)
    guarded("reduce_scatter", ranks, lambda: _reduce_scatter_single(
        recv, buf.view(-1), op=op, group=group))
    fp.check_slots(tag, recv[m:].tolist(), n, bits)
    dst.copy_(recv[:m].view(dst.shape))


def _heads(rows: list) -> list:
    """The int64 index of each row's header in rows of ``rows`` bytes laid end to end."""
    heads, at = [], 0
    for row in rows:
        heads.append(at // 8)
        at += row
    return heads


def all_to_all(dst: torch.Tensor, src: torch.Tensor, out_splits, in_splits,
               ranks: tuple) -> None:
    """``all_to_all_single`` of flat tensors (``*_splits`` in elements) with tags: an
    8-byte header before each chunk."""
    tag = fp.tag("all_to_all", ranks, 0, src.dtype)   # (chunk sizes differ per rank)
    group, size = get_group(ranks), src.element_size()
    if not fp.packs(src, max(src.numel(), dst.numel()) * size):
        fp.exchange(tag)
        guarded("all_to_all", ranks, lambda: dist.all_to_all_single(
            dst, src, list(out_splits), list(in_splits), group=group))
        return
    sent = [8 + fp._pad8(c * size) for c in in_splits]
    got = [8 + fp._pad8(c * size) for c in out_splits]
    send = torch.empty(sum(sent), dtype=torch.uint8)
    heads = _heads(sent)
    send.view(torch.int64)[heads] = tag.word
    data, at = _bytes(src.contiguous()), 0
    for head, c in zip(heads, in_splits):
        send[8 * head + 8:8 * head + 8 + c * size] = data[at:at + c * size]
        at += c * size
    recv = torch.empty(sum(got), dtype=torch.uint8)
    guarded("all_to_all", ranks, lambda: dist.all_to_all_single(
        recv, send, got, sent, group=group))
    heads = _heads(got)
    fp.check(tag, recv.view(torch.int64)[heads].tolist())
    out, at = _bytes(dst), 0
    for head, c in zip(heads, out_splits):
        out[at:at + c * size] = recv[8 * head + 8:8 * head + 8 + c * size]
        at += c * size


def broadcast(t: torch.Tensor, src: int, ranks: tuple) -> None:
    """In-place ``broadcast`` of contiguous ``t`` from global rank ``src`` with tags. A
    broadcast brings the source's word alone (the source would never learn of a
    mismatch): small, it runs as a sum of bytes, the source's and zeros, with slots
    (every byte exact); large, after the members compared tags (``exchange``)."""
    tag = fp.tag(f"broadcast from rank {src}", ranks, t.numel(), t.dtype)
    group, nbytes = get_group(ranks), t.numel() * t.element_size()
    if not fp.packs(t, nbytes):
        fp.exchange(tag)
        guarded("broadcast", ranks, lambda: dist.broadcast(t, src=src, group=group))
        return
    mine = _bytes(t) if fp.rank() == src else torch.zeros(nbytes, dtype=torch.uint8)
    buf = torch.cat([mine, _slots(ranks, tag.word, 8, torch.uint8)])
    guarded("broadcast", ranks, lambda: dist.all_reduce(buf, group=group))
    fp.check_slots(tag, buf[nbytes:].tolist(), len(ranks), 8)
    if fp.rank() != src:
        _bytes(t).copy_(buf[:nbytes])


# Point-to-point: per direction of a batch (this rank to a peer, or a peer to this rank),
# the sender's word travels on gloo tag _FORWARD and the receiver's back on _BACK, apart
# from the payloads (tag 0). Each channel pairs a direction's batches in their order, as
# the payloads pair, whatever the order of the two directions on each rank (a pipeline
# posts a stage's sends and receives at different moments on its two sides). A batch
# that goes both ways with a peer (an exchange, a gather by messages: both sides run the
# same step, so the peer's batch goes both ways too) sends both words in one message on
# _BOTH and receives the peer's two: half the messages.
_FORWARD, _BACK, _BOTH = 0x6701, 0x6702, 0x6703


def post_p2p(sends, recvs, rank: int) -> "PairTags":
    """Post the tag messages of a batch of point-to-point ``sends`` and ``recvs``
    ((tensor, peer)); ``wait()`` on the result compares them. The program's call path
    counts only inside a named work (``guard.activity``: a boxing, whose sender and
    receiver run one line of an SPMD program, or a pipeline's step); elsewhere a send
    and its receive are the two sides' own code, from lines of their own."""
    code, path = fp.call_path() if guard._doing else (0, [])
    pending = []
    for peer in sorted({p for _, p in (*sends, *recvs)} - {rank}):
        tags = []   # (tag, index of the peer's word for it) of each direction here
        for direction, messages in (("to", sends), ("from", recvs)):
            sizes = [(t.numel(), t.dtype) for t, p in messages if p == peer]
            if not sizes:
                continue
            op = code
            for numel, dtype in sizes:
                op = fp._mix(fp._mix(op, numel), fp._name(dtype))
            pair = (rank, peer) if direction == "to" else (peer, rank)
            seq = fp._pairs[pair] = fp._pairs.get(pair, 0) + 1
            what = ("point-to-point", peer, sizes if direction == "to" else [],
                    [] if direction == "to" else sizes)
            tags.append((fp.Tag(what, pair, seq, op, path), direction))
        if len(tags) == 2:    # both ways: [to, from] here is [from, to] there
            out = back = _BOTH
            words = [tag.word for tag, _ in tags]
            tags = [(tags[0][0], 1), (tags[1][0], 0)]
        else:
            (tag, direction), = tags
            out, back = (_FORWARD, _BACK) if direction == "to" else (_BACK, _FORWARD)
            words, tags = [tag.word], [(tag, 0)]
        mine, theirs = torch.tensor(words), torch.empty(len(words), dtype=torch.int64)
        works = guarded("point-to-point transfer", tags[0][0].members, lambda: [
            dist.isend(mine, peer, tag=out), dist.irecv(theirs, peer, tag=back)])
        pending.append((tags, peer, theirs, works, mine))
    return PairTags(pending, rank)


class PairTags:
    """The posted tag messages of a point-to-point batch."""

    def __init__(self, pending: list, rank: int):
        self._pending, self._rank = pending, rank

    def wait(self) -> None:
        """Wait for the words and raise ``DivergenceError`` where a peer's differs."""
        found = []
        for tags, peer, theirs, works, _ in self._pending:
            for work in works:
                guarded("point-to-point transfer", tags[0][0].members, work.wait)
            words = theirs.tolist()
            for tag, i in tags:
                if words[i] != tag.word:
                    found.append((tag, {self._rank: tag.word, peer: words[i]}))
        self._pending = []
        if found:
            fp.diverged(found)

    def is_completed(self) -> bool:
        return all(w.is_completed() for p in self._pending for w in p[3])
