"""The communication of a simulated world: n ranks as threads of one process.

Collectives run in memory on torch's threaded process group (the one DTensor's tests
run on), extended with sends and receives and with reduce-scatters by every reduction;
the store is an in-memory ``HashStore``.
Ranks take turns (``Turns``): one runs at a time, and a rank hands the turn on only
where it waits for the others (inside a collective, a receive, a store wait, a
group's creation), so everything else a rank runs is free of races and repeatable, and
the caller swaps each rank's state in and out at every turn (``globaltensor/
simulated.py``). A rank that waits longer than the world's timeout for a turn or a
peer ends the world (``Turns.stop``) with every rank's work named.

>>> turns = Turns(2, swap_in, swap_out, timeout=60)      # doctest: +SKIP
>>> init_rank(rank, 2, store, turns)                      # in each rank's thread
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as threaded

from . import groups
from .guard import DivergenceError

BACKEND = "gtsim"


class WorldStopped(RuntimeError):
    """The simulated world ended (a rank failed, or waited past the timeout)."""


class Turns:
    """Which rank runs now. ``take(rank)`` waits for the turn and puts the rank's state
    in place; ``give(rank)`` hands the turn on. A rank's state goes out
    (``swap_out(rank)``) only when another rank's comes in (``swap_in(rank)``): a rank
    that takes the turn back with nobody in between finds its own still in place."""

    def __init__(self, n: int, swap_in: Callable[[int], None], swap_out: Callable[[int], None],
                 timeout: float):
        self.n, self.swap_in, self.swap_out, self.timeout = n, swap_in, swap_out, timeout
        self.cond = threading.Condition()
        self.holder: int | None = None
        self.handed = 0                    # turns handed on so far (``changed_since``)
        self.in_place: int | None = None   # the rank whose state is in place now
        self.stopped: BaseException | None = None
        self.local = threading.local()     # .rank of the thread

    def take(self, rank: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.holder is None or self.stopped,
                                      self.timeout):
                self.stop(WorldStopped(f"rank {rank} waited {self.timeout:g} s for its turn"))
            if self.stopped is not None:
                raise WorldStopped(f"rank {rank}: the world stopped ({self.stopped})")
            self.holder = rank
        self.local.rank = rank
        if self.in_place != rank:
            self.put_away()
            self.swap_in(rank)
            self.in_place = rank

    def give(self, rank: int) -> None:
        with self.cond:
            self.holder = None
            self.handed += 1
            self.cond.notify_all()

    def changed_since(self, handed: int, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until a turn was handed on after ``handed``
        (``self.handed`` read earlier): only a rank holding the turn changes shared
        state, and it hands the turn on when it waits, so what a waiting rank waits for
        can only have come by then."""
        with self.cond:
            self.cond.wait_for(lambda: self.handed != handed or self.stopped, timeout)

    def put_away(self) -> None:
        """Save the state in place as its rank's (by the rank taking the turn, or by
        the caller of a world that ran past its timeout, to name what each rank did)."""
        if self.in_place is not None:
            self.swap_out(self.in_place)
            self.in_place = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Hand the turn on while this rank waits for others (no-op outside a rank)."""
        rank = getattr(self.local, "rank", None)
        if rank is None or self.holder != rank:
            yield
            return
        self.give(rank)
        try:
            yield
        finally:
            self.take(rank)

    def stop(self, error: BaseException) -> None:
        """End the world: every waiting rank wakes and raises ``WorldStopped``."""
        with self.cond:
            if self.stopped is None:
                self.stopped = error
            self.cond.notify_all()
        threaded.ProcessLocalGroup.exception_handle(error)
        with _mail_cond:
            _mail_cond.notify_all()


_turns: Turns | None = None   # the simulated world running now (one at a time)
_mail: dict = collections.defaultdict(collections.deque)  # (group, src, dst, tag) -> sent
_posted: dict = collections.defaultdict(collections.deque)  # ... -> receives waiting for one
_mail_cond = threading.Condition()


def _waiting():
    return _turns.waiting() if _turns is not None else contextlib.nullcontext()


class SimulatedGroup(threaded.ProcessLocalGroup):
    """torch's threaded process group, handing the turn on while a collective waits,
    with sends and receives (in order per sender, receiver and tag)."""

    @property
    def _device_types(self) -> list:
        # (torch's group reports none: it is a group of its own, not a group holding a
        # backend per device; torch's tools that pick a device by it, set_state_dict's
        # broadcast_from_rank0, need the one gloo's reports)
        return [torch.device("cpu")]

    def send(self, tensors: list, dst: int, tag: int = 0):
        key = self.pg_name, self._rank, dst, tag
        with _mail_cond:
            if _posted[key]:    # into the first receive posted for it, as gloo's would
                _posted[key].popleft().fill(tensors[0])
            else:
                _mail[key].append(tensors[0].detach().clone())
            _mail_cond.notify_all()
        return threaded.ret_work(tensors)

    def recv(self, tensors: list, src: int, tag: int = 0):
        """Posted, as gloo's: the receives of one sender and tag take its messages in
        the order they were posted, waited for or not."""
        key = self.pg_name, src, self._rank, tag
        received = _Received(tensors[0])
        with _mail_cond:
            if _mail[key]:
                received.fill(_mail[key].popleft())
            else:
                _posted[key].append(received)
        return received

    def getBackendName(self) -> str:
        return BACKEND


_COLLECTIVES = frozenset({
    "allreduce", "allreduce_coalesced", "barrier", "allgather", "all_gather_single",
    "broadcast", "scatter", "gather", "reduce_scatter", "reduce_scatter_single",
    "all_to_all_single", "alltoall", "reduce_scatter_single_coalesced",
    "all_gather_single_coalesced", "_allgather_base", "_reduce_scatter_base"})


# the kind of collective torch's threaded group makes for each method
_KINDS = {"allreduce": "AllReduce", "allreduce_coalesced": "AllReduce", "barrier": "AllReduce",
          "allgather": "AllGather", "all_gather_single": "AllGather", "broadcast": "Broadcast",
          "scatter": "Scatter", "gather": "Gather", "reduce_scatter": "ReduceScatter",
          "reduce_scatter_single": "ReduceScatter", "all_to_all_single": "AllToAllBase",
          "alltoall": "AllToAll"}


class ReduceScatter(threaded.ReduceScatter):
    """torch's threaded reduce-scatter with every reduction of the other collectives
    (torch's sums and averages only; a partial_max -> split boxing needs max). Named as
    torch's: the divergence check below compares collectives by their class name."""

    def __init__(self, op):
        self.op = op   # (torch's own refuses every reduction but sum and average)

    @torch.no_grad()
    def work(self, data):
        if self.op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return super().work(data)
        reduce = threaded._reduce_ops[self.op.op]
        for rank, (outputs, _) in enumerate(data):
            parts = [scatter[0][rank].to(outputs[0].device) for _, scatter in data]
            outputs[0].detach().copy_(reduce(parts))
        return None


def _reduce_scatter(self, output_tensor, scatter_list, opts=dist.ReduceScatterOptions()):
    coll = threaded.ProcessLocalGroup._start_coll(ReduceScatter(opts.reduceOp), self)
    res = coll.join(self._rank, (output_tensor, scatter_list))
    threaded.ProcessLocalGroup._end_coll(coll, self)
    return res


def _waited(name: str):
    base = _reduce_scatter if name == "reduce_scatter" else \
        getattr(threaded.ProcessLocalGroup, name)
    kind = _KINDS.get(name)

    def method(self, *args, **kwargs):
        # torch's threaded group would pair two different collectives of one group
        # silently (a rank that skipped one): refuse, as gloo's size checks would
        started = threaded.ProcessLocalGroup._cur_coll_on_pgs.get(self.pg_name)
        if kind is not None and started is not None \
                and type(started._collective).__name__ != kind:
            raise DivergenceError(
                f"globaltensor: in a simulated world, rank {dist.get_rank()} reached collective "
                f"{kind} where other ranks of its group are in "
                f"{type(started._collective).__name__} (every rank of a group must run the "
                f"same collectives in the same order)")
        with _waiting():
            return base(self, *args, **kwargs)
    method.__name__ = name
    return method


for _name in _COLLECTIVES:   # each collective waits for the others: the turn goes on
    if hasattr(threaded.ProcessLocalGroup, _name):
        setattr(SimulatedGroup, _name, _waited(_name))


class _Received(dist.Work):
    """A posted receive: ``wait`` hands the turn on until its message is there."""

    def __init__(self, into: torch.Tensor):
        super().__init__()
        self.into, self.done = into, False

    def fill(self, message: torch.Tensor) -> None:
        self.into.copy_(message)
        self.done = True

    def wait(self, timeout=None) -> bool:
        if not self.done:
            with _waiting(), _mail_cond:
                _mail_cond.wait_for(lambda: self.done or (_turns is not None and _turns.stopped))
                if not self.done:
                    raise WorldStopped("the world stopped while a rank received")
        return True

    def is_completed(self) -> bool:
        return self.done


def _create_group(prefix_store, rank: int, world_size: int, timeout):
    group = SimulatedGroup(rank, world_size)
    with _waiting():   # the members meet in the store before the group is used
        threaded._store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return group


class WaitingStore:
    """A view of a store whose blocking calls hand the turn on while they wait, and
    end when the world stops (``groups.default_store``: meetings outside collectives)."""

    def __init__(self, store):
        self.store = store

    def get(self, key):
        if not self.store.check([key]):
            self.wait([key])
        return self.store.get(key)

    def wait(self, keys, timeout: datetime.timedelta | None = None):
        limit = timeout.total_seconds() if timeout is not None else self.store.timeout.total_seconds()
        deadline = time.monotonic() + limit
        # a rank holding the turn hands it on here and is woken by the next hand-over
        turns = _turns
        rank = getattr(turns.local, "rank", None) if turns is not None else None
        in_rank = rank is not None and turns.holder == rank
        with _waiting():
            while True:
                handed = turns.handed if in_rank else 0   # (read before the check)
                if self.store.check(list(keys)):
                    return
                if turns is not None and turns.stopped is not None:
                    raise WorldStopped(f"the world stopped ({turns.stopped})")
                left = deadline - time.monotonic()
                if left < 0:   # as the store's own wait says it
                    raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
                if in_rank:    # the keys come from a rank that holds the turn: wait for it
                    turns.changed_since(handed, left)   # to hand it on, not a polling nap
                else:
                    time.sleep(0.002)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@contextlib.contextmanager
def world(turns: Turns) -> Iterator[None]:
    """The process's torch.distributed as a simulated world for the duration: each
    thread has its own default group (torch's thread-local world); the process's own
    groups, if any, are put aside and come back after."""
    global _turns
    if _turns is not None:
        raise RuntimeError("one simulated world runs at a time")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])
    threaded.ProcessLocalGroup.reset()
    threaded._install_threaded_pg()
    groups.store_view = WaitingStore
    torch._C._distributed_c10d._set_thread_isolation_mode(True)   # group names per thread
    _turns = turns
    _mail.clear()
    _posted.clear()
    try:
        yield
    finally:
        _turns = None
        groups.store_view = None
        _mail.clear()
        _posted.clear()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
        threaded.ProcessLocalGroup.reset()


def new_store(timeout: float):
    """The in-memory store the ranks of a simulated world share."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def init_rank(rank: int, n: int, store: dist.Store, timeout: float) -> None:
    """This thread's default group: rank ``rank`` of ``n`` (call in the rank's thread,
    holding its turn)."""
    torch.autograd.set_multithreading_enabled(False)   # backward runs on this thread
    with _waiting():
        dist.init_process_group(BACKEND, rank=rank, world_size=n, store=store,
                                timeout=datetime.timedelta(seconds=timeout))


def end_rank() -> None:
    """This thread's default group destroyed (each rank in its own thread)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --- one rank of a world that does not exist (``gt.debug.simulate_step``) -------------

@contextlib.contextmanager
def thread_worlds() -> Iterator[None]:
    """Each thread its own default group for the duration (torch's thread-local world),
    so that a thread may be a rank of another world than the process's own."""
    if _turns is not None:
        raise RuntimeError("a step cannot be simulated inside a simulated world")
    threaded._install_threaded_pg()   # (the process's own world is put aside meanwhile)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        yield
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()


def init_fake_rank(rank: int, world: int, backend: str = "gloo") -> None:
    """This thread's default group: rank ``rank`` of a world of ``world`` processes on
    torch's fake backend (every collective returns at once, nothing is sent; group
    creation needs no peer); its cpu collectives priced as ``backend``'s (the cost
    model, and so per-op choice and boxing, as on that backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    groups._priced_as["cpu"] = backend
