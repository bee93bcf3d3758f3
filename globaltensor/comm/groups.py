"""Process-group bootstrap and the cache of sub-groups, keyed by the ordered rank tuple.

A group is made by its members only, the first time one of them communicates in it.
torch's own members-only creation (``new_group(use_local_synchronization=True)``)
names a group by its ranks *and* by how many groups the calling process made before,
so two members that used different placements earlier disagree on the name and wait
forever. We name a group by its ordered ranks alone (one group per rank tuple per
process), so members agree whatever else they did, ranks outside never take part,
and pipeline stages that run different actions never wait on each other here.
Member order is kept so group rank ``i`` is ``members[i]``: the order in which a split
hands out parts.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os

import torch
import torch.distributed as dist
# Imported before any group exists, on purpose: its functions take ``group=group.WORLD``
# as a default argument, evaluated at import. Imported after init (torch._dynamo imports
# it, e.g. on the first GlobalTensor op) they would hold the default group, so _destroy
# could not free it and its gloo threads would outlive Python (see _destroy).
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed import distributed_c10d as c10d

from .. import env

_groups: dict[tuple[int, ...], object] = {}
_TORCH_GLOO = c10d.ProcessGroupGloo  # torch's, whatever bind_gloo_to_address installs
_ready = False
_generation = 0  # default groups made so far, less one (the program may destroy and reuse)
_store = None    # the store of the first world we made: it outlives the group (see init)


def _backend() -> str:
    # One default group serving both devices: gloo for cpu placements, nccl for cuda.
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def bind_gloo_to_address(addr: str) -> None:
    """Make every gloo group this process creates from now on send and receive on
    ``addr`` (an address of this machine), not on the address its hostname resolves to.

    torch offers GLOO_SOCKET_IFNAME, an interface, which cannot tell two addresses of one
    interface apart (two nodes on 127.0.0.2 and 127.0.0.3 of ``lo``), and no address
    option in ``init_process_group``; so the name torch constructs gloo groups by
    (``torch.distributed.ProcessGroupGloo``, also RPC's) is given a stand-in that makes
    them with a device on ``addr`` (the launcher's ``--local_addr``, applied at import
    by interop/torch_patches.py).

    >>> bind_gloo_to_address("127.0.0.3")  # doctest: +SKIP
    """
    stand_in = _GlooOnAddress(addr)
    c10d.ProcessGroupGloo = dist.ProcessGroupGloo = stand_in  # type: ignore[misc, assignment]


class _GlooOnAddress:
    """Builds torch's ProcessGroupGloo with its device on one address. Not a subclass:
    torch checks ``isinstance(group, ProcessGroupGloo)`` for groups made elsewhere too
    (before binding, by RPC), so it answers isinstance for torch's class, and forwards
    the class's other attributes (``_Options``, ``create_device``)."""

    def __init__(self, addr: str):
        self.addr = addr

    def __call__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
        if isinstance(timeout, _TORCH_GLOO._Options):  # the options form: the caller chose devices
            return _TORCH_GLOO(store, rank, size, timeout)
        options = _TORCH_GLOO._Options()
        options._timeout, options._threads = timeout, 2  # torch's own defaults
        options._devices = [_TORCH_GLOO.create_device(hostname=self.addr)]
        return _TORCH_GLOO(store, rank, size, options)

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, _TORCH_GLOO)

    def __repr__(self) -> str:
        return f"<ProcessGroupGloo on {self.addr} (globaltensor --local_addr)>"

    def __getattr__(self, name: str):
        return getattr(_TORCH_GLOO, name)


def local_device(device_type: str) -> torch.device:
    """The device this process uses for ``device_type`` ("cpu", or its LOCAL_RANK's GPU)."""
    if device_type == "cuda":
        return torch.device("cuda", env.get_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device(device_type)


def init() -> None:
    """Initialise torch.distributed from the launcher's variables (idempotent).

    Without RANK/WORLD_SIZE this is a world of one process, with no error. When the
    program made the default group itself, it is used as it is.

    >>> import globaltensor as gt
    >>> gt.init(); gt.get_world_size()
    1
    """
    global _ready, _generation, _store
    if _ready:
        if dist.is_initialized():
            return
        # The program destroyed the default group (torch.distributed.destroy_process_group):
        # our sub-groups died with it; the next global op makes the world again.
        _groups.clear()
        _ready = False
        _generation += 1
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=env.timeout_seconds())
        world = env.get_world_size()
        # On GPUs, binding the default group to this rank's device lets NCCL start
        # eagerly on the right GPU (and sub-groups split from it).
        device_id = local_device("cuda") if torch.cuda.is_available() else None
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # A world of one needs no rendezvous: an in-memory store does.
            dist.init_process_group(_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout, device_id=device_id)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            # The store of the first world is kept for the worlds made again after the
            # program destroyed the group, under a new prefix each (gloo would read the
            # dead group's addresses otherwise). A new store would race: rank 0 hosts it
            # on the same port, and a rank that gets there first can connect to the old
            # one, which closes as rank 0 destroys its group.
            if _store is None:
                _store = next(dist.rendezvous("env://", env.get_rank(), world,
                                              timeout=timeout))[0]
            store = _store if _generation == 0 else \
                dist.PrefixStore(f"globaltensor/generation{_generation}", _store)
            dist.init_process_group(_backend(), store=store, rank=env.get_rank(),
                                    world_size=world, timeout=timeout, device_id=device_id)
    if torch.cuda.is_available():
        # Also when the program made the group: outputs of transfers land on the
        # current device, which must be this rank's.
        torch.cuda.set_device(local_device("cuda"))
    # A gloo group still alive when the interpreter finalises can abort the process:
    # a worker thread drops a finished work, whose tensors' Python objects died first,
    # so it takes the GIL to free them; during finalisation Python ends such a thread
    # (pthread_exit) inside a noexcept destructor: "terminate called without an active
    # exception". Freeing the groups joins these threads; do it, and drop our own
    # references to them, while Python still runs. It is local. (Once: the world may be
    # made again after the program destroyed it.)
    atexit.unregister(_destroy)
    atexit.register(_destroy)
    _ready = True


def finish() -> None:
    """This process's end of the world: wait until every rank gets here, then free every
    group (a spawned test world's children end this way, with no rank left waiting).

    >>> comm.finish()        # doctest: +SKIP
    """
    if dist.is_initialized():
        dist.barrier()
    _destroy()


def _destroy() -> None:
    global _ready, _generation
    if dist.is_initialized():
        dist.destroy_process_group()
        _generation += 1
    _groups.clear()  # the last references to sub-groups, also after a user's own destroy
    _ready = False
    gc.collect()


def _member_group(ranks: tuple[int, ...]):
    """A new group of ``ranks`` (in that order), made by its members only."""
    backend = dist.get_backend()
    name = "globaltensor:" + ",".join(map(str, ranks))
    # torch's helper rendezvouses the members under a store prefix taken from the name;
    # ``new_group`` cannot be given a name, hence the helper.
    group, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(dist.get_rank()), list(ranks), backend,
        c10d._get_default_store(), group_name=name,
        timeout=datetime.timedelta(seconds=env.timeout_seconds()))
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    return group


def get_group(ranks: tuple[int, ...]):
    """The process group whose group rank ``i`` is ``ranks[i]``; made on first use by
    its members (the caller must be one)."""
    group = _groups.get(ranks)
    if group is None or not dist.is_initialized():
        init()
        group = None
        if ranks == tuple(range(dist.get_world_size())):
            group = dist.group.WORLD
        elif dist.get_rank() not in ranks:
            raise RuntimeError(f"rank {dist.get_rank()} asked for the group of ranks "
                               f"{list(ranks)}, which it is not a member of")
        else:
            group = _member_group(ranks)
        _groups[ranks] = group
    return group
