"""Thin wrappers over torch.distributed collectives and batched point-to-point.

Each takes the member ranks of the group (ordered) and records what it moves in
``stats`` so ``debug.comm_stats()`` can count it. A group of one does the local
equivalent without calling torch.distributed. While torch.compile traces, the
collectives take their functional form (``_functional_collectives``), which a graph
can hold, and write it into the caller's buffer (functionalization turns the copy back
into a plain use); point-to-point transfers have no such form and refuse to trace.
Where the group's backend lacks a collective on the tensors' device (gloo, which serves
cuda when local ranks share a GPU, lacks all but broadcast and all_reduce there), it runs
on host copies (``HostCopies``), the same code whatever the device.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import fingerprint, float_keys, groups, stats, tagged
from .groups import get_group, init
from .guard import DivergenceError, Waiting, guarded
from .guard import all_gather_single as _all_gather_single
from .guard import reduce_scatter_single as _reduce_scatter_single
from .host_copies import CopiedBack, HostCopies

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed reduce_scatter_tensor (deprecated there), with the same signature
_FUNCTIONAL_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or \
    funcol.reduce_scatter_tensor


def tracing() -> bool:
    """True while torch.compile traces (dynamo, AOTAutograd, make_fx over fake tensors)."""
    return funcol._are_we_tracing()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _staged(kind: str, device: torch.device) -> bool:
    """Whether collective ``kind`` on ``device`` tensors runs on host copies
    (``groups.stage_through_host`` for the default group's backend of that device)."""
    if device.type == "cpu":
        return False
    return groups.stage_through_host(kind, device.type, groups.device_backend(device.type))


def _traced_on_host(kind: str, t: torch.Tensor):
    """While tracing: ``t`` as the traced collective ``kind`` must take it (a host copy
    where the group's backend lacks it on ``t``'s device: gloo on cuda), and how to
    bring its result back to ``t``'s device."""
    if not _staged(kind, t.device):
        return t, (lambda r: r)
    device = t.device
    return t.cpu(), (lambda r: r.to(device))


def _gather(dst: torch.Tensor, src: torch.Tensor, ranks: tuple[int, ...], async_op=False):
    """``all_gather_single`` among ``ranks``, with its tag unless fingerprints are off."""
    if fingerprint.ON:
        return tagged.all_gather(dst, src, ranks, async_op)
    return guarded("all_gather", ranks, lambda: _all_gather_single(
        dst, src, group=get_group(ranks), async_op=async_op))


def _reduce(buf: torch.Tensor, reduce: str, ranks: tuple[int, ...], async_op=False):
    """In-place ``all_reduce`` among ``ranks``, with its tag unless fingerprints are off."""
    if fingerprint.ON:
        return tagged.all_reduce(buf, reduce, ranks, async_op)
    return guarded("all_reduce", ranks, lambda: dist.all_reduce(
        buf, op=_REDUCE_OPS[reduce], group=get_group(ranks), async_op=async_op))


# gloo's all_gather stages the whole output in a buffer of its own and passes the parts
# around a ring; point-to-point messages straight into the output's parts took 0.65-0.92x
# its time for parts of 1-4 MiB, 0.81-0.94x at 512 KiB, between 2 and 4 cpu ranks. Smaller
# parts stay with the one collective, which carries their tags in its payload (a part
# over fingerprint.PACK_LIMIT is compared first either way).
GATHER_BY_MESSAGES_BYTES = 512 << 10


def _gathers_by_messages(part: torch.Tensor) -> bool:
    """Whether an all-gather of ``part`` (a cpu tensor, each member's) goes by
    point-to-point messages (``GATHER_BY_MESSAGES_BYTES``): the members agree, deciding
    by its size."""
    return part.device.type == "cpu" and _nbytes(part) >= GATHER_BY_MESSAGES_BYTES \
        and groups.backend_of("cpu") != "nccl"   # (a simulated rank priced as NCCL)


def _gather_by_messages(dst: torch.Tensor, src: torch.Tensor, ranks: tuple[int, ...]) -> None:
    """Every member's ``src`` into its chunk of flat ``dst`` (ours copied) by one batch
    of point-to-point messages, posted once the tags agree (compared as before gloo's
    all_gather of this size: the messages carry none of their own)."""
    n = len(ranks)
    if stats.dry():   # counted as all_gather_p2p counts it, before n views are made
        stats.record("all_gather", _nbytes(src) * (n - 1), ranks, 2 * (n - 1))
        return
    if fingerprint.ON:
        fingerprint.exchange(fingerprint.tag("all_gather", ranks, src.numel(), src.dtype))
    all_gather_p2p(list(dst.chunk(n)), src, ranks, tag=False).wait()


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...]) -> None:
    """``out`` (contiguous, len(ranks) * inp.numel()) receives every member's ``inp``
    (on gloo, for parts of ``GATHER_BY_MESSAGES_BYTES`` or more, by point-to-point
    messages into its parts, counted as one all_gather)."""
    if len(ranks) == 1:
        out.view(-1).copy_(inp.reshape(-1))
        return
    if tracing():
        src, back = _traced_on_host("all_gather", inp.contiguous().view(-1))
        out.view(-1).copy_(back(funcol.all_gather_tensor(src, 0, get_group(ranks))))
        return
    # Flat views: backends check the output as len(ranks) chunks of the input's shape.
    dst, src = out.view(-1), inp.contiguous().view(-1)
    if _gathers_by_messages(src):
        _gather_by_messages(dst, src, ranks)
        return
    if stats.record("all_gather", _nbytes(inp) * (len(ranks) - 1), ranks):
        return
    host = HostCopies() if _staged("all_gather", out.device) else None
    if host is not None:
        dst, src = host.receive(dst), host.send(src)
    _gather(dst, src, ranks)
    if host is not None:
        host.finish()


def all_reduce_(t: torch.Tensor, reduce: str, ranks: tuple[int, ...]) -> None:
    """In-place all-reduce of a contiguous tensor with "sum" or "max" (of floats: NaN
    wins, as in ``torch.amax``; ``float_keys``)."""
    if len(ranks) == 1:
        return
    if reduce == "max" and float_keys.has_keys(t):
        keys = float_keys.to_keys(t)
        all_reduce_(keys, "max", ranks)
        t.copy_(float_keys.from_keys(keys, t.dtype))
        return
    if tracing():
        src, back = _traced_on_host("all_reduce" if reduce == "sum" else "all_reduce:max", t)
        t.copy_(back(funcol.all_reduce(src, reduce, get_group(ranks))))
        return
    if stats.record("all_reduce", 2 * _nbytes(t) * (len(ranks) - 1) // len(ranks), ranks):
        return
    host = HostCopies() if _staged("all_reduce" if reduce == "sum" else "all_reduce:max",
                                    t.device) else None
    buf = t if host is None else host.both(t)
    _reduce(buf, reduce, ranks)
    if host is not None:
        host.finish()


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, reduce: str,
                        ranks: tuple[int, ...]) -> None:
    """``out`` (contiguous, ``inp.numel() / len(ranks)`` elements) receives the
    reduction ("sum" or "max") over the members of chunk ``i`` of ``inp`` along dim 0,
    ``i`` this rank's place in ``ranks``: one native collective (NCCL's kernel)."""
    if len(ranks) == 1:
        out.copy_(inp.view(out.shape))
        return
    if reduce == "max" and float_keys.has_keys(inp):
        keys = float_keys.to_keys(inp)
        reduced = torch.empty(out.shape, dtype=keys.dtype, device=out.device)
        reduce_scatter_into(reduced, keys, "max", ranks)
        out.copy_(float_keys.from_keys(reduced, out.dtype))
        return
    if tracing():
        src, back = _traced_on_host("reduce_scatter", inp.contiguous())
        out.copy_(back(_FUNCTIONAL_REDUCE_SCATTER(src, reduce, 0,
                                                  get_group(ranks))).view(out.shape))
        return
    if stats.record("reduce_scatter", _nbytes(inp) * (len(ranks) - 1) // len(ranks), ranks):
        return
    dst, src = out, inp.contiguous()
    host = HostCopies() if _staged("reduce_scatter", out.device) else None
    if host is not None:
        dst, src = host.receive(out), host.send(src)
    if fingerprint.ON:
        tagged.reduce_scatter(dst, src, reduce, ranks)
    else:
        guarded("reduce_scatter", ranks, lambda: _reduce_scatter_single(
            dst, src, op=_REDUCE_OPS[reduce], group=get_group(ranks)))
    if host is not None:
        host.finish()


class _Done:
    def wait(self) -> None:
        pass


def all_reduce_async(t: torch.Tensor, ranks: tuple[int, ...], what: str = "all_reduce"):
    """Start an in-place sum all-reduce; returns a handle with ``wait()`` (``what`` names
    the work in an error)."""
    if len(ranks) == 1:
        return _Done()
    if tracing():
        all_reduce_(t, "sum", ranks)
        return _Done()
    if stats.record("all_reduce", 2 * _nbytes(t) * (len(ranks) - 1) // len(ranks), ranks):
        return _Done()
    host = HostCopies() if _staged("all_reduce", t.device) else None
    buf = t if host is None else host.both(t)
    work = _reduce(buf, "sum", ranks, async_op=True)
    waiting = Waiting("all_reduce", ranks, work, what)
    return waiting if host is None else CopiedBack(waiting, host)


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...],
                     what: str = "all_gather"):
    """Start ``all_gather_into(out, inp, ranks)``; returns a handle with ``wait()``
    (fully_shard prefetches the next unit's parameters with it)."""
    if len(ranks) == 1:
        out.view(-1).copy_(inp.reshape(-1))
        return _Done()
    if tracing():
        all_gather_into(out, inp, ranks)
        return _Done()
    if stats.record("all_gather", _nbytes(inp) * (len(ranks) - 1), ranks):
        return _Done()
    dst, src = out.view(-1), inp.contiguous().view(-1)
    host = HostCopies() if _staged("all_gather", out.device) else None
    if host is not None:
        dst, src = host.receive(dst), host.send(src)
    work = _gather(dst, src, ranks, async_op=True)
    waiting = Waiting("all_gather", ranks, work, what)
    return waiting if host is None else CopiedBack(waiting, host)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                      in_splits: Sequence[int], ranks: tuple[int, ...]) -> None:
    """1-D all-to-all: chunk ``i`` of ``inp`` (``in_splits[i]`` elements) goes to
    ``ranks[i]``; ``out`` holds what each member sent, in member order."""
    if len(ranks) == 1:
        out.copy_(inp)
        return
    if tracing():
        src, back = _traced_on_host("all_to_all", inp.contiguous())
        out.copy_(back(funcol.all_to_all_single(src, list(out_splits), list(in_splits),
                                                get_group(ranks))))
        return
    me = ranks.index(dist.get_rank())
    if stats.record("all_to_all", (sum(in_splits) - in_splits[me]) * inp.element_size(),
                    ranks):
        return
    dst, src = out, inp
    host = HostCopies() if _staged("all_to_all", out.device) else None
    if host is not None:
        dst, src = host.receive(out), host.send(inp)
    if fingerprint.ON:
        tagged.all_to_all(dst, src, out_splits, in_splits, ranks)
    else:
        guarded("all_to_all", ranks, lambda: dist.all_to_all_single(
            dst, src, list(out_splits), list(in_splits), group=get_group(ranks)))
    if host is not None:
        host.finish()


def broadcast_(t: torch.Tensor, src: int, ranks: tuple[int, ...]) -> None:
    """In-place broadcast of ``t`` from global rank ``src`` to the members."""
    if len(ranks) == 1:
        return
    if tracing():
        sent, back = _traced_on_host("broadcast", t)
        t.copy_(back(funcol.broadcast(sent, ranks.index(src), get_group(ranks))))
        return
    if (stats.record("broadcast", _nbytes(t) * (len(ranks) - 1), ranks) if dist.get_rank() == src
            else stats.dry()):
        return
    host = HostCopies() if _staged("broadcast", t.device) else None
    buf = t if host is None else host.both(t)
    if fingerprint.ON:
        tagged.broadcast(buf, src, ranks)
    else:
        guarded("broadcast", ranks, lambda: dist.broadcast(buf, src=src, group=get_group(ranks)))
    if host is not None:
        host.finish()


_abandoned: list = []   # P2PWorks whose tags differed: their payloads are still posted


class P2PWork:
    """Posted sends and receives; ``wait()`` blocks until all are done (and copies
    receives made on host copies back: ``host``), first comparing their tags (``tags``:
    ``tagged.post_p2p``'s, None when fingerprints are off: the word messages before the
    payloads are waited for, the words in payloads after)."""

    def __init__(self, works, peers=(), host: HostCopies | None = None, tags=None):
        self._works, self._peers, self._host, self._tags = works, peers, host, tags

    def wait(self) -> None:
        if self._tags is not None:
            try:
                self._tags.wait()   # a mismatch raises before the payloads are waited for
            except DivergenceError:
                # ... but the posted payloads go on: a posted receive still takes its
                # peer's message (what follows pairs as it did), and gloo must not lose
                # the buffer of a receive still posted (a later message on the pair
                # then never completed). Kept until done.
                _abandoned[:] = [w for w in _abandoned if not w.is_completed()] + [self]
                raise
        for work in self._works:
            guarded("point-to-point transfer", self._peers, work.wait)
        if self._tags is not None:
            self._tags.finish()
        if self._host is not None:
            self._host.finish()

    def is_completed(self) -> bool:
        """True when every message is done (never blocks)."""
        return all(work.is_completed() for work in self._works) and (
            self._tags is None or self._tags.is_completed())


def start_p2p(sends: Sequence[tuple[torch.Tensor, int]],
              recvs: Sequence[tuple[torch.Tensor, int]], kind: str | None = "send",
              tag: bool = True) -> P2PWork:
    """Post every send and receive (tensor, peer global rank) at once; messages between
    one pair of ranks match in the order posted. Receive tensors must be contiguous.
    Each send is counted as ``kind`` (None: not counted, the caller counts).
    ``tag=False``: the messages carry no tags (the caller compared them before)."""
    if not sends and not recvs:
        return P2PWork([])
    for t, peer in sends if kind is not None else ():
        stats.record(kind, _nbytes(t), (peer,))
    if stats.dry():
        return P2PWork([])
    if tracing():
        raise RuntimeError(
            "globaltensor: a point-to-point transfer cannot be traced by torch.compile "
            "(moving between placements, or the eager exchange of a reduce-scatter or "
            "all-to-all); keep to_global across placements outside the compiled function")
    init()
    host = HostCopies()
    sends = [(host.send(t) if _staged("send", t.device) else t.contiguous(), peer)
             for t, peer in sends]
    recvs = [(host.receive(t) if _staged("recv", t.device) else t, peer) for t, peer in recvs]
    # (tags may put a message into a buffer with its words: in these lists)
    tags = tagged.post_p2p(sends, recvs, dist.get_rank()) if fingerprint.ON and tag else None
    if len(sends) + len(recvs) == 1:
        # One message (a hand-off between single ranks): batch_isend_irecv's coalescing
        # adds nothing to one message but its own cost.
        (t, peer), post = (sends[0], dist.isend) if sends else (recvs[0], dist.irecv)
        peers = sorted({dist.get_rank(), peer})
        return P2PWork([guarded("point-to-point transfer", peers, lambda: post(t, peer))],
                       peers, host, tags)
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    peers = sorted({dist.get_rank()} | {p for _, p in sends} | {p for _, p in recvs})
    return P2PWork(guarded("point-to-point transfer", peers,
                           lambda: dist.batch_isend_irecv(ops)), peers, host, tags)


def all_gather_p2p(pieces: Sequence[torch.Tensor], mine: torch.Tensor,
                   ranks: tuple[int, ...], tag: bool = True) -> P2PWork:
    """Start an all-gather by point-to-point messages: ``pieces[i]`` (contiguous, any
    sizes) receives member ``i``'s ``mine`` (ours is copied here). Unlike gloo's
    all_gather, which stages the whole output in a buffer of its own, the parts land in
    place. Counted as one all_gather. ``tag=False``: the messages carry no tags (the
    caller compared them before)."""
    return all_gather_p2p_batch([(pieces, mine)], ranks, tag)


def all_gather_p2p_batch(gathers: Sequence[tuple], ranks: tuple[int, ...],
                         tag: bool = True) -> P2PWork:
    """``all_gather_p2p`` of several tensors over one group, ``gathers`` (pieces, mine)
    each, posted as one batch of messages (one round per peer), counted as one
    all_gather."""
    me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
    for pieces, mine in gathers:
        pieces[me].copy_(mine.view(pieces[me].shape))
    if len(ranks) == 1:
        return P2PWork([])
    # (counted without the lists: a simulated rank of 1024 gathers hundreds of tensors)
    messages = sum((len(ranks) - 1) * bool(mine.numel())
                   + sum(bool(p.numel()) for j, p in enumerate(pieces) if j != me)
                   for pieces, mine in gathers)
    if stats.record("all_gather", sum(_nbytes(m) for _, m in gathers) * (len(ranks) - 1),
                    ranks, messages):
        return P2PWork([])
    sends = [(mine, m) for pieces, mine in gathers
             for j, m in enumerate(ranks) if j != me and mine.numel()]
    recvs = [(p, m) for pieces, _ in gathers
             for j, (p, m) in enumerate(zip(pieces, ranks)) if j != me and p.numel()]
    return start_p2p(sends, recvs, kind=None, tag=tag)


def batched_p2p(sends: Sequence[tuple[torch.Tensor, int]],
                recvs: Sequence[tuple[torch.Tensor, int]], kind: str = "send") -> None:
    """``start_p2p`` and wait."""
    start_p2p(sends, recvs, kind).wait()


def all_gather_ints(values: Sequence[int], ranks: tuple[int, ...] | None = None,
                    same_length: bool = False) -> list:
    """Every member's list of integers (lengths may differ, unless ``same_length``
    promises they do not: one collective instead of two), in member order (the whole
    world by default). Integers only: nothing from a peer is unpickled."""
    init()
    if ranks is None:
        ranks = tuple(range(dist.get_world_size()))
    if len(ranks) == 1:
        return [list(values)]
    if stats.record("all_gather", 8 * (len(values) + (not same_length)) * (len(ranks) - 1),
                    ranks):
        return [list(values)] * len(ranks)   # a dry run: as if every member agreed
    n = len(ranks)
    if same_length:
        lengths = torch.full((n,), len(values), dtype=torch.int64)
    else:
        lengths = torch.empty(n, dtype=torch.int64)
        _gather(lengths, torch.tensor([len(values)], dtype=torch.int64), ranks)
    width = max(int(lengths.max()), 1)
    mine = torch.zeros(width, dtype=torch.int64)
    mine[:len(values)] = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(n * width, dtype=torch.int64)
    _gather(out, mine, ranks)
    rows = out.view(n, width).tolist()
    return [row[:k] for row, k in zip(rows, lengths.tolist())]


def barrier(ranks: tuple[int, ...] | None = None) -> None:
    """Return once every member (the whole world by default) has called it: one
    all-gather of one integer."""
    all_gather_ints((0,), ranks, same_length=True)


_rank: int | None = None


def get_rank() -> int:
    """This process's global rank (cached: it is asked on every op)."""
    global _rank
    if _rank is None or not dist.is_initialized():
        init()
        _rank = dist.get_rank()
    return _rank


def get_world_size() -> int:
    init()
    return dist.get_world_size()
