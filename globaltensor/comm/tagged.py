"""The collectives with their tags (fingerprint.py): each takes what torch.distributed's
takes plus the ordered member ranks of its group, sends the tag with the payload (or
compares it before, ``fp.exchange``), compares the words that arrive and raises
``DivergenceError`` on a mismatch, before anything reaches the caller's output.
``async_op=True`` returns a handle whose ``wait()`` compares and copies out.
"""
from __future__ import annotations

import ctypes
import struct
import sys

import torch
import torch.distributed as dist

from . import fingerprint as fp
from . import guard
from .groups import get_group
from .guard import all_gather_single as _all_gather_single
from .guard import guarded
from .guard import reduce_scatter_single as _reduce_scatter_single

# A payload of at most PACK_LIMIT bytes goes into a buffer with its tag and back out by
# plain memory copies: torch ops there (cat, slices, copy_, tolist) cost a small
# collective more host time than the rest of its tagging, each several times its warm
# cost after the thread slept in the backend; a memmove costs about a microsecond.
_copy = ctypes.memmove
_read = ctypes.string_at
# struct's code of each slot dtype's values (complex: of its real and imaginary parts)
_FORMATS = {torch.float64: "d", torch.float32: "f", torch.float16: "e", torch.int64: "q",
            torch.int32: "i", torch.int16: "h", torch.int8: "b", torch.uint8: "B",
            torch.complex128: "d", torch.complex64: "f"}


# Free packing buffers by (elements, dtype), reused: a fresh tensor costs a small
# collective as much host time as the rest of its packing. (At most _EACH of a size,
# an exchange takes two, a send's and a receive's, of _SIZES sizes, _KEEP bytes in all.)
_free: dict = {}
_EACH, _SIZES, _KEEP = 2, 256, 8 * 2**20
_kept = 0


def _take(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer of ``numel`` elements, free for this collective (``_give`` it
    back once the collective is done with it)."""
    global _kept
    free = _free.get((numel, dtype))
    if free:
        buf = free.pop()
        if not free:   # (sizes come and go: keep none that holds nothing)
            _free.pop((numel, dtype), None)
        _kept -= numel * buf.element_size()
        return buf
    # a normal tensor even in inference mode, which a later collective outside it can
    # write (the backend's in-place ops refuse an inference tensor there)
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype, device="cpu")


def _give(*bufs: torch.Tensor) -> None:
    global _kept
    for buf in bufs:
        size = buf.numel() * buf.element_size()
        free = _free.get((buf.numel(), buf.dtype))
        if (len(free) < _EACH if free is not None else len(_free) < _SIZES) \
                and _kept + size <= _KEEP:
            _free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            _kept += size


# bf16's bits of the integers 0-255 (float32's upper half: exact for them)
_BF16 = [struct.unpack("=I", struct.pack("=f", v))[0] >> 16 for v in range(256)]


def _encoder(dtype: torch.dtype):
    """``word -> bytes``: one member's slot of ``dtype``, the word cut into chunks as
    ``fp._chunks`` cuts it (complex: in real parts, imaginary zero)."""
    bits = fp._SLOT_BITS[dtype]
    shifts, mask = range(0, 64, bits), (1 << bits) - 1
    if dtype is torch.bfloat16:
        pack = struct.Struct("=8H").pack
        return lambda word: pack(*[_BF16[(word >> s) & mask] for s in shifts])
    if dtype.is_complex:
        pack = struct.Struct(f"={128 // bits}{_FORMATS[dtype]}").pack
        return lambda word: pack(*[v for s in shifts for v in ((word >> s) & mask, 0)])
    pack = struct.Struct(f"={64 // bits}{_FORMATS[dtype]}").pack
    return lambda word: pack(*[(word >> s) & mask for s in shifts])


_ENCODE = {dtype: _encoder(dtype) for dtype in fp._SLOT_BITS}


def _own_slots(chunk: bytes, me: int, n: int) -> bytes:
    """This rank's slots: one per member, zero but this rank's, which holds ``chunk``
    (zero is all zero bytes in every dtype)."""
    return bytes(me * len(chunk)) + chunk + bytes((n - me - 1) * len(chunk))


def _check_slots(tag: fp.Tag, at: int, chunk: bytes, n: int, bits: int, dtype) -> None:
    """Compare the reduced slots at address ``at`` with ``n`` copies of this rank's
    ``chunk`` (a sum or max of one chunk and zeros is that chunk, byte for byte); on a
    difference, read the members' words from them."""
    got = _read(at, n * len(chunk))
    if got != chunk * n:
        fp.check_slots(tag, torch.frombuffer(bytearray(got), dtype=dtype).tolist(), n, bits)


def _check_heads(tag: fp.Tag, at: int, rows: list, word: bytes) -> None:
    """Compare the 8-byte headers of ``rows`` (bytes each) laid end to end from address
    ``at`` with this rank's ``word``."""
    heads = []
    for row in rows:
        heads.append(_read(at, 8))
        at += row
    if heads.count(word) != len(heads):
        fp.check(tag, [int.from_bytes(h, sys.byteorder) for h in heads])


def _flat(t: torch.Tensor) -> int:
    """The address of contiguous ``t``'s first element (torch.distributed refuses other
    tensors too)."""
    if not t.is_contiguous():
        raise ValueError("globaltensor: a collective's tensors must be contiguous")
    return t.data_ptr()


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
    word = tag.word.to_bytes(8, sys.byteorder)
    send, recv = _take(row, torch.uint8), _take(n * row, torch.uint8)
    _copy(send.data_ptr(), word, 8)
    _copy(send.data_ptr() + 8, _flat(src), nbytes)
    work = guarded("all_gather", ranks, lambda: _all_gather_single(
        recv, send, group=group, async_op=async_op))

    def finish() -> None:
        at, out = recv.data_ptr(), _flat(dst)
        _check_heads(tag, at, [row] * n, word)
        for i in range(n):
            _copy(out + i * nbytes, at + i * row + 8, nbytes)
        _give(send, recv)
    return fp._done(work, finish, async_op)


def all_reduce(t: torch.Tensor, reduce: str, ranks: tuple, async_op: bool = False):
    """In-place ``all_reduce`` of contiguous ``t`` ("sum" or "max") with tags in slots."""
    tag = fp.tag("all_reduce " + reduce, ranks, t.numel(), t.dtype)
    group, op = get_group(ranks), fp._OPS[reduce]
    bits = fp._SLOT_BITS.get(t.dtype)
    nbytes = t.numel() * t.element_size()
    if bits is None or not fp.packs(t, nbytes):
        fp.exchange(tag)
        return guarded("all_reduce", ranks, lambda: dist.all_reduce(
            t, op=op, group=group, async_op=async_op))
    n, chunk = len(ranks), _ENCODE[t.dtype](tag.word)
    buf = _take(t.numel() + n * (64 // bits), t.dtype)   # [payload | slots]
    at = buf.data_ptr()
    _copy(at, _flat(t), nbytes)
    _copy(at + nbytes, _own_slots(chunk, ranks.index(fp.rank()), n), n * len(chunk))
    work = guarded("all_reduce", ranks, lambda: dist.all_reduce(
        buf, op=op, group=group, async_op=async_op))

    def finish() -> None:
        _check_slots(tag, at + nbytes, chunk, n, bits, t.dtype)
        _copy(t.data_ptr(), at, nbytes)
        _give(buf)
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
    n, m, size = len(ranks), dst.numel(), src.element_size()
    chunk, part = _ENCODE[src.dtype](tag.word), m * size
    slots = _own_slots(chunk, ranks.index(fp.rank()), n)
    width = m + n * (64 // bits)    # elements of a member's row: [its chunk | slots]
    buf, recv = _take(n * width, src.dtype), _take(width, src.dtype)
    at, row, frm = buf.data_ptr(), width * size, _flat(src)
    for i in range(n):
        _copy(at + i * row, frm + i * part, part)
        _copy(at + i * row + part, slots, len(slots))
    guarded("reduce_scatter", ranks, lambda: _reduce_scatter_single(
        recv, buf, op=op, group=group))
    _check_slots(tag, recv.data_ptr() + part, chunk, n, bits, src.dtype)
    if dst.is_contiguous():
        _copy(dst.data_ptr(), recv.data_ptr(), part)
    else:
        dst.copy_(recv[:m].view(dst.shape))
    _give(buf, recv)


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
    word = tag.word.to_bytes(8, sys.byteorder)
    sent = [8 + fp._pad8(c * size) for c in in_splits]
    got = [8 + fp._pad8(c * size) for c in out_splits]
    send, recv = _take(sum(sent), torch.uint8), _take(sum(got), torch.uint8)
    at, frm = send.data_ptr(), _flat(src.contiguous())
    for row, c in zip(sent, in_splits):
        _copy(at, word, 8)
        _copy(at + 8, frm, c * size)
        at, frm = at + row, frm + c * size
    guarded("all_to_all", ranks, lambda: dist.all_to_all_single(
        recv, send, got, sent, group=group))
    at, out = recv.data_ptr(), _flat(dst)
    _check_heads(tag, at, got, word)
    for row, c in zip(got, out_splits):
        _copy(out, at + 8, c * size)
        at, out = at + row, out + c * size
    _give(send, recv)


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
    n, chunk = len(ranks), _ENCODE[torch.uint8](tag.word)
    buf = _take(nbytes + n * 8, torch.uint8)   # [bytes | slots]
    at, source = buf.data_ptr(), fp.rank() == src
    if source:
        _copy(at, _flat(t), nbytes)
    else:
        ctypes.memset(at, 0, nbytes)
    _copy(at + nbytes, _own_slots(chunk, ranks.index(fp.rank()), n), n * 8)
    guarded("broadcast", ranks, lambda: dist.all_reduce(buf, group=group))
    _check_slots(tag, at + nbytes, chunk, n, 8, torch.uint8)
    if not source:
        _copy(_flat(t), at, nbytes)
    _give(buf)


# Point-to-point: per direction of a batch (this rank to a peer, or a peer to this rank),
# a word, the sender's and the receiver's. Where the messages each way with a peer
# include a small host tensor, the sender's words travel in a header of the first such
# (_HEAD bytes: its word to the peer, its word from it or 0), copied with the payload:
# an exchange then sends no message more, and a one-way transfer one, the receiver's
# word back to the sender on gloo tag _BACK (a message costs a small transfer about as
# much host time as its payload). Otherwise the words go as messages of their own:
# the sender's on _FORWARD and the receiver's back on _BACK, or, for a batch that goes
# both ways with the peer (an exchange, a gather by messages: both sides run the same
# step, so the peer's batch goes both ways too), both words in one message each way on
# _BOTH. Each channel pairs a direction's batches in their order, as the payloads pair,
# whatever the order of the two directions on each rank (a pipeline posts a stage's
# sends and receives at different moments on its two sides).
_FORWARD, _BACK, _BOTH = 0x6701, 0x6702, 0x6703
_HEAD = 16


def post_p2p(sends: list, recvs: list, rank: int) -> "PairTags":
    """Tag a batch of point-to-point ``sends`` and ``recvs`` ((tensor, peer)): put the
    first small message to and from each peer into a buffer with a header
    (in place, in the lists) and post the word messages; ``wait()`` on the result
    compares the words that came in messages, ``finish()`` (once the payloads are
    done) those in headers, and copies the received payloads out. The program's call
    path counts only inside a named work (``guard.activity``: a boxing, whose sender
    and receiver run one line of an SPMD program, or a pipeline's step); elsewhere a
    send and its receive are the two sides' own code, from lines of their own."""
    code, path = fp.call_path() if guard._doing else (0, [])
    tags = PairTags(rank)
    for peer in sorted({p for _, p in (*sends, *recvs)} - {rank}):
        ways = {}   # "to" / "from" -> the tag of that direction with the peer
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
            ways[direction] = fp.Tag(what, pair, seq, op, path)
        if not tags.pack(sends, recvs, peer, ways.get("to"), ways.get("from")):
            tags.post(peer, ways.get("to"), ways.get("from"))
    return tags


def _first_small(messages: list, peer: int):
    """The index of the first of ``messages`` with ``peer`` that can carry a header (a
    small host tensor; the peer's list of that direction has it at the same place), or
    None."""
    return next((i for i, (t, p) in enumerate(messages)
                 if p == peer and fp.packs(t, t.numel() * t.element_size())), None)


class PairTags:
    """The tags of a point-to-point batch: word messages posted, headers to read."""

    def __init__(self, rank: int):
        self._rank = rank
        self._pending = []   # ([(tag, index of the peer's word for it)], peer, theirs, works, mine)
        self._packed = []    # (buffer, the receive tensor, peer, tag to, tag from)
        self._sent = []      # the headed send buffers

    def pack(self, sends: list, recvs: list, peer: int, to, frm) -> bool:
        """Put the words to ``peer`` into a header of the first small message each way
        (a fully_shard unit's gather: its bias after its weight), if each way has one;
        post the one-way word back. False where not."""
        i, j = _first_small(sends, peer), _first_small(recvs, peer)
        if (to is not None and i is None) or (frm is not None and j is None):
            return False
        if i is not None:
            t = sends[i][0]
            nbytes = t.numel() * t.element_size()
            buf = _take(_HEAD + nbytes, torch.uint8)
            _copy(buf.data_ptr(), struct.pack("=2Q", to.word, frm.word if frm else 0), _HEAD)
            _copy(buf.data_ptr() + _HEAD, _flat(t), nbytes)
            sends[i] = (buf, peer)
            self._sent.append(buf)
        if j is not None:
            t = recvs[j][0]
            _flat(t)   # (refused now, before anything is sent, as the backend would)
            buf = _take(_HEAD + t.numel() * t.element_size(), torch.uint8)
            recvs[j] = (buf, peer)
            self._packed.append((buf, t, peer, to, frm))
        if to is None or frm is None:   # one way: the receiver's word goes back
            if frm is None:
                self._post(peer, [], [(to, 0)], None, _BACK, to.members)
            else:
                self._post(peer, [frm.word], [], _BACK, None, frm.members)
        return True

    def post(self, peer: int, to, frm) -> None:
        """Post the word messages of the directions ``to`` and ``frm`` with ``peer``."""
        if to is not None and frm is not None:   # [to, from] here is [from, to] there
            self._post(peer, [to.word, frm.word], [(to, 1), (frm, 0)], _BOTH, _BOTH,
                       to.members)
        elif to is not None:
            self._post(peer, [to.word], [(to, 0)], _FORWARD, _BACK, to.members)
        else:
            self._post(peer, [frm.word], [(frm, 0)], _BACK, _FORWARD, frm.members)

    def _post(self, peer: int, words: list, compare: list, out, back, members) -> None:
        mine = torch.tensor(words, dtype=torch.int64) if out is not None else None
        theirs = torch.empty(len(compare), dtype=torch.int64) if back is not None else None
        works = guarded("point-to-point transfer", members, lambda: (
            [dist.isend(mine, peer, tag=out)] if out is not None else []) + (
            [dist.irecv(theirs, peer, tag=back)] if back is not None else []))
        self._pending.append((compare, peer, theirs, works, mine))

    def wait(self) -> None:
        """Wait for the word messages and raise ``DivergenceError`` where a peer's
        differs (before the payloads are waited for)."""
        found = []
        for compare, peer, theirs, works, _ in self._pending:
            for work in works:
                guarded("point-to-point transfer", [self._rank, peer], work.wait)
            words = theirs.tolist() if compare else []
            for tag, i in compare:
                if words[i] != tag.word:
                    found.append((tag, {self._rank: tag.word, peer: words[i]}))
        self._pending = []
        if found:
            fp.diverged(found)

    def finish(self) -> None:
        """Once the payloads are done: compare the headers' words and copy the received
        payloads out (none where a word differs)."""
        found = []
        for buf, _, peer, to, frm in self._packed:
            theirs_to, theirs_from = struct.unpack("=2Q", _read(buf.data_ptr(), _HEAD))
            for tag, word in ((frm, theirs_to), (to, theirs_from)):
                if tag is not None and word != tag.word:
                    found.append((tag, {self._rank: tag.word, peer: word}))
        if found:
            fp.diverged(found)
        for buf, t, _, _, _ in self._packed:
            _copy(_flat(t), buf.data_ptr() + _HEAD, t.numel() * t.element_size())
            _give(buf)
        _give(*self._sent)
        self._packed = self._sent = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for p in self._pending for w in p[3])
