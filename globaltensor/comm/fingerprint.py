"""Every collective carries what it is, so ranks at different collectives raise instead
of mixing their values (on by default; ``GLOBALTENSOR_FINGERPRINTS=0`` turns it off).

gloo and NCCL pair a group's collectives by their order alone. A rank that issues one
more (``if step == 0 or rank == 0: log(x.sum().item())``: a call path met before, see
meet.py, is not met again) pairs its extra all-reduce with the others' next collective
of that group; when the sizes agree, every rank returns a mix of two values, silently.

A collective's **tag** is one 64-bit word: the upper half a fingerprint of the op (its
kind and reduction, dtype and element count, and the program's call path: its
innermost ``PATH_FRAMES`` frames outside globaltensor, torch and the standard library,
by file basename and line, so hosts with other checkouts agree), the lower half the
collective's number in its group (``_seq``; per direction between two ranks for
point-to-point). Every rank compares the words that arrive with its own; on a mismatch
each writes a description of its collective (kind, size, number, the work that
``guard.activity`` names, the call path) to the store, reads the others', and raises
``DivergenceError`` naming every rank's. How the word travels (``tagged.py``), without
changing a value:

- all_gather, all_to_all: as an 8-byte header of each rank's (each chunk's) bytes,
  gathered with them (the payload copied into a byte buffer and out of it);
- all_reduce, reduce_scatter (sum and max): in slots appended to the payload, one per
  rank, zero but in the rank's own slot, where it writes its word cut into chunks that
  the dtype holds exactly (8 bits for bf16/fp16, 16 for fp32, 32 for fp64): a sum or a
  max of one chunk and zeros is that chunk, so every rank reads every rank's word;
- broadcast: as a sum of bytes (the source's, zeros elsewhere) with slots, so that the
  source, too, reads every word;
- payloads over ``PACK_LIMIT`` bytes (whose copy would cost more than a collective),
  payloads on a device (the check would synchronise with it) and dtypes without exact
  chunks (bool, fp8): the word goes first, in one small int64 all-gather of the group
  on the host, or by recursive doubling in a larger group (``exchange``); on a
  mismatch no rank starts the payload's collective;
- point-to-point: per direction of a batch, the sender's word to the receiver and the
  receiver's back: in a 16-byte header of the first small host tensor each way, where
  each way has one (a one-way transfer still sends the receiver's word back as a
  message), else as one-word messages posted with the payload and compared in
  ``wait()``.

The words arrive at every rank, so every rank of a mismatched collective raises (for
point-to-point, both ranks of each mismatched direction). Traced collectives
(torch.compile) carry none: see docs/debugging.md.
"""
from __future__ import annotations

import datetime
import os
import sys
import sysconfig
import zlib
from typing import NoReturn

import torch
import torch.distributed as dist

from .. import env
from . import groups, guard
from .groups import get_group
from .guard import DivergenceError, guarded
from .guard import all_gather_single as _all_gather_single

ON = True                # GLOBALTENSOR_FINGERPRINTS, read at import
# Bytes: larger payloads send their tag in a separate all-gather. A tag all-gather costs a
# small collective's latency (0.3-0.5 ms between two gloo processes on two busy cores,
# tens of us on idle ones), a packed payload two memory copies (about 0.1 ms per MiB):
# on 2 cores packing measured faster up to 1-4 MiB (256 KiB all_reduce 0.70 against
# 1.23 ms), so 256 KiB stays on the cheaper side where the latency is low as well.
PACK_LIMIT = 256 * 1024
PATH_FRAMES = 6          # program frames in a tag: a helper's callers up to this depth
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# Bits of the word per slot element: integers up to 2**bits are exact in the dtype.
_SLOT_BITS = {torch.float64: 32, torch.float32: 16, torch.float16: 8, torch.bfloat16: 8,
              torch.int64: 32, torch.int32: 16, torch.int16: 8, torch.int8: 4,
              torch.uint8: 8, torch.complex128: 32, torch.complex64: 16}


@env.read_at_import
def _read_variable() -> None:
    global ON
    ON = env.fingerprints_enabled()


def set_enabled(on: bool) -> bool:
    """Turn fingerprints on or off in this process (on every rank alike: the benchmark
    of their cost does); returns the previous setting."""
    global ON
    before, ON = ON, bool(on)
    return before


# --- the tag -------------------------------------------------------------------------

_seq: dict = {}     # ranks (as ordered for the group) -> collectives issued in it
_pairs: dict = {}   # (sender, receiver) -> point-to-point batches between them that way
_files: dict = {}   # co_filename -> crc32 of its basename | 1, or 0 for internal code
_names: dict = {}   # str or dtype -> crc32 of its name
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_paths = sysconfig.get_paths()
_STDLIB = tuple({_paths["stdlib"], _paths["platstdlib"]})
_INSTALLED = tuple({_paths["purelib"], _paths["platlib"]})


def _file_code(name: str) -> int:
    if name.startswith((_PACKAGE, _TORCH, "<frozen ")) or (
            name.startswith(_STDLIB) and not name.startswith(_INSTALLED)):
        return 0
    return zlib.crc32(os.path.basename(name).encode()) | 1


def call_path() -> tuple[int, list]:
    """(fingerprint, [(file, line), ...]) of the program's call path to here: its
    innermost ``PATH_FRAMES`` frames outside globaltensor, torch and the standard library
    (a logging helper's line alone is the same for every tensor logged; its caller's is
    not). ([] where there are none: a backward thread.)"""
    frame, code, path = sys._getframe(1), 0, []
    while frame is not None:
        name = frame.f_code.co_filename
        file = _files.get(name)
        if file is None:
            file = _files[name] = _file_code(name)
        if file:
            line = frame.f_lineno
            code = ((code ^ file ^ (line << 32)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF  # FNV
            path.append((name, line))
            if len(path) == PATH_FRAMES:
                break
        frame = frame.f_back
    return code, path


def _name(x) -> int:
    code = _names.get(x)
    if code is None:
        code = _names[x] = zlib.crc32(str(x).encode())
    return code


def _mix(h: int, v: int) -> int:
    """FNV-style mixing of the integer ``v`` into the 64-bit ``h``; the upper half of
    the result is the better mixed. The same in every process (no Python ``hash`` of a
    string, which is salted per process)."""
    return ((h ^ v) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF


class Tag:
    """One collective as this rank issued it: ``word`` travels with it; the rest
    describes it after a mismatch (formatted only then)."""

    __slots__ = ("word", "what", "members", "seq", "path", "doing")

    def __init__(self, what: tuple, members: tuple, seq: int, op: int, path: list):
        self.word = ((op >> 33) << 32) | (seq & 0xFFFFFFFF)   # 31 bits of op: >= 0
        self.what, self.members, self.seq, self.path = what, members, seq, path
        self.doing = tuple(guard._doing)

    def describe(self) -> str:
        doing = " <- ".join(str(w) for w in reversed(self.doing)) or "a direct collective call"
        kind, *rest = self.what
        if kind == "point-to-point":
            peer, to, got = rest
            what = (f"point-to-point with rank {peer} (sends {_sizes(to)}, receives "
                    f"{_sizes(got)}), exchange #{self.seq} of ranks {list(self.members)}")
        else:
            count, dtype = rest
            what = (f"{kind} of {count} {dtype} element(s), collective #{self.seq} of "
                    f"ranks {list(self.members)}")
        where = " <- ".join(f"{name}:{line}" for name, line in self.path) or "?"
        return f"{what} for {doing}, called from {where}"


def _sizes(messages) -> str:
    return "[" + ", ".join(f"{n} {dtype}" for n, dtype in messages) + "]"


def tag(kind: str, ranks: tuple, count: int, dtype) -> Tag:
    """The tag of the next collective ``kind`` ("all_reduce sum", ...) of ``count``
    elements of ``dtype`` (the same on every member) in the group of ``ranks``."""
    seq = _seq[ranks] = _seq.get(ranks, 0) + 1
    code, path = call_path()
    op = _mix(code ^ _name(kind) ^ (_name(dtype) << 32), count)
    return Tag((kind, count, dtype), ranks, seq, op, path)


# --- comparing ------------------------------------------------------------------------

def check(tag: Tag, words: list) -> None:
    """Raise ``DivergenceError`` unless every member's word (member order) is ``tag``'s."""
    if words.count(tag.word) != len(words):
        diverged([(tag, dict(zip(tag.members, words)))])


def _key(members, rank: int, word: int) -> str:
    return f"globaltensor/fingerprint/{','.join(map(str, members))}/{rank}/{word}"


def diverged(found: list) -> NoReturn:
    """Raise ``DivergenceError`` for mismatched collectives ``found``: (this rank's tag,
    {member: its word}). Each rank of a mismatch got the others' words, so each comes
    here: it writes its description to the store first, then reads the others'."""
    store = groups.default_store()
    rank = dist.get_rank()   # (cached in ``rank()``; this runs once, before raising)
    for tag, words in found:
        store.set(_key(sorted(words), rank, tag.word), tag.describe())
    parts = []
    for tag, words in found:
        by_word: dict = {}
        for r, w in sorted(words.items()):
            by_word.setdefault(w, []).append(r)
        for w, ranks in by_word.items():
            text = tag.describe() if w == tag.word else _description(store, sorted(words),
                                                                      ranks[0], w)
            parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} "
                         f"{', '.join(map(str, ranks))}: {text}")
    others = sorted({r for _, words in found for r in words} - {rank})
    raise DivergenceError(
        f"globaltensor: rank {rank} and {'rank' if len(others) == 1 else 'ranks'} "
        f"{', '.join(map(str, others))} reached different collectives, whose values would "
        f"have mixed ({'; '.join(parts)}). Every rank of a group "
        f"must issue the same collectives in the same order, each from the same program "
        f"line (SPMD): a branch on the rank that communicates on some ranks only (if rank "
        f"== 0: log(x.sum().item())), or a loop that runs once more on one rank, does not. "
        f"Compute such a value on every rank and read it on one. (Every collective carries "
        f"a fingerprint of its op, size, program line and number in its group, compared on "
        f"arrival; no value of this one was returned. GLOBALTENSOR_FINGERPRINTS=0 turns "
        f"the comparison off.)")


def _description(store, members, rank: int, word: int) -> str:
    """What ``rank`` wrote about its collective of tag ``word`` (it writes as soon as
    it sees the mismatch, which it sees when this rank does)."""
    key = _key(members, rank, word)
    try:
        store.wait([key], datetime.timedelta(seconds=env.read_timeout_seconds()))
        return store.get(key).decode(errors="replace")
    except (RuntimeError, dist.DistError):  # a timeout, or the store's host gone
        return (f"a collective whose fingerprint differs ({word >> 32:#010x}, number "
                f"{word & 0xFFFFFFFF}); its description did not come")


# Groups above this many ranks compare tags by recursive doubling (``_agree``): gloo
# all-gathers around a ring, n - 1 messages in a row, which on hundreds of ranks costs
# more than a large collective itself; doubling takes log2 n rounds.
RING_RANKS = 4
_AGREE = 0x6704   # the gloo tag of the doubling's messages


def exchange(tag: Tag) -> None:
    """Compare ``tag`` with the group's on the host before the collective itself (which
    no rank then starts on a mismatch): in one small all-gather of int64 words, or, in
    a group of more than ``RING_RANKS``, the least and the greatest word by recursive
    doubling first (the words are all equal where those are), and the all-gather only
    where they differ, to name every rank's."""
    members = tag.members
    if len(members) > RING_RANKS and _agree(tag):
        return
    mine = torch.tensor([tag.word], dtype=torch.int64)
    everyone = torch.empty(len(members), dtype=torch.int64)
    guarded("fingerprint all_gather", members, lambda: _all_gather_single(
        everyone, mine, group=get_group(members)))
    check(tag, everyone.tolist())


def _agree(tag: Tag) -> bool:
    """Whether every member's word is ``tag.word``: [-word, word] reduced by maximum
    (-least, greatest) in log2 n rounds of one message each way (recursive doubling;
    the members past the largest power of two hand theirs to a partner first and get
    the result back last). Every member gets the same answer."""
    members, me = tag.members, tag.members.index(rank())
    n = len(members)
    p = 1 << (n.bit_length() - 1)
    best = [-tag.word, tag.word]

    def swap(peer: int, send: bool = True, receive: bool = True) -> None:
        out = torch.tensor(best, dtype=torch.int64)
        got = torch.empty(2, dtype=torch.int64)
        works = guarded("fingerprint comparison", members, lambda: (
            [dist.isend(out, members[peer], tag=_AGREE)] if send else []) + (
            [dist.irecv(got, members[peer], tag=_AGREE)] if receive else []))
        for work in works:
            guarded("fingerprint comparison", members, work.wait)
        if receive:
            best[:] = [max(a, b) for a, b in zip(best, got.tolist())]
    if me >= p:
        swap(me - p, receive=False)
        swap(me - p, send=False)
        return best[0] == -best[1]
    if me + p < n:
        swap(me + p, send=False)
    step = 1
    while step < p:
        swap(me ^ step)
        step <<= 1
    if me + p < n:
        swap(me + p, receive=False)
    return best[0] == -best[1]


_rank: int | None = None


def rank() -> int:
    """This process's global rank (cached: asked at every collective)."""
    global _rank
    if _rank is None or not dist.is_initialized():
        _rank = dist.get_rank()
    return _rank


def packs(t: torch.Tensor, nbytes: int) -> bool:
    """Whether a collective on ``t`` carries its tag in its payload (host memory, small)."""
    return t.is_cpu and nbytes <= PACK_LIMIT


class _Finishing:
    """A started packed collective: ``wait()`` waits, then compares the words and
    copies the payload out (once)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> None:
        if self._finish is not None:
            self._work.wait()
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        return self._finish is None or self._work.is_completed()


def _done(work, finish, async_op: bool):
    if not async_op:
        finish()
        return None
    return _Finishing(work, finish)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _chunks(word: int, bits: int) -> list:
    mask = (1 << bits) - 1
    return [(word >> shift) & mask for shift in range(0, 64, bits)]


def check_slots(tag: Tag, values: list, n: int, bits: int) -> None:
    """``check`` for words that came in ``n`` slots (``values``: the reduced slots)."""
    if values != _chunks(tag.word, bits) * n:   # (3.0 == 3: floats compare with ints)
        check(tag, _words(values, n, bits))


def _words(values: list, n: int, bits: int) -> list:
    """The members' words from the values of ``n`` slots of chunks (as ``_chunks``
    cut them; complex values hold them in their real parts)."""
    k = 64 // bits
    if values and isinstance(values[0], complex):
        values = [v.real for v in values]
    return [sum(int(c) << (i * bits) for i, c in enumerate(values[r * k:(r + 1) * k]))
            for r in range(n)]
