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

Devices. The default group serves both device types: gloo carries cpu tensors, and cuda
tensors go through NCCL only when every rank with a GPU has one of its own (NCCL refuses
two ranks on one device); otherwise through gloo, staging what gloo lacks on CUDA
through host memory (``stage_through_host``), with one warning saying why. The ranks
agree on the choice through the rendezvous store before the group exists. Nothing binds
the group to a device, so NCCL starts on the first collective of a cuda placement: a
program on cpu placements runs on a machine with any number of GPUs.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import warnings

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


# What gloo runs on CUDA tensors itself (torch's table of backends: broadcast and
# all_reduce; its all_reduce on the device, with GPUDirect, sums only). The rest, sends
# and receives among them, it lacks on CUDA: they are staged through host memory.
GLOO_ON_CUDA = frozenset({"broadcast", "all_reduce"})

_cuda_via_gloo_why = ""    # why this rank's cuda collectives go through gloo (we chose it)
_warned_gloo = False       # that warning is given once per process
_device_backends: dict[str, str] = {}  # device type -> backend of the default group
_priced_as: dict[str, str] = {}  # device type -> backend priced with (a simulated rank's)


def gpu_of(local_rank: int, device_count: int, visible: str | None) -> str:
    """The GPU a local rank uses (``local_device("cuda")``: index ``local_rank %
    device_count``), named as CUDA_VISIBLE_DEVICES names it (``visible``), else by index,
    so that two ranks of one machine name one GPU alike even when a launcher gave each
    rank its own CUDA_VISIBLE_DEVICES.

    >>> gpu_of(3, 2, None), gpu_of(0, 1, "5"), gpu_of(1, 2, "GPU-a,GPU-b")
    ('1', '5', 'GPU-b')
    """
    index = local_rank % device_count
    names = [name.strip() for name in visible.split(",")] if visible else []
    return names[index] if index < len(names) else str(index)


def cuda_vote(ranks_on_gpu: int, device_count: int, nccl_available: bool) -> str | None:
    """A rank's choice of backend for cuda collectives: None without a GPU (it never
    holds a cuda part, so it does not vote), "nccl" when NCCL is built in and the rank's
    GPU serves ``ranks_on_gpu`` = 1 rank, else "gloo" (NCCL refuses two ranks on one
    GPU: "Duplicate GPU detected"). With every local rank seeing the same GPUs,
    ``ranks_on_gpu`` exceeds 1 somewhere exactly when LOCAL_WORLD_SIZE > device_count.

    >>> cuda_vote(1, 8, True), cuda_vote(2, 1, True), cuda_vote(1, 1, False), cuda_vote(1, 0, True)
    ('nccl', 'gloo', 'gloo', None)
    """
    if device_count <= 0:
        return None
    return "nccl" if nccl_available and ranks_on_gpu <= 1 else "gloo"


def backend_string(cuda: str) -> str:
    """The default group's backend: gloo for cpu tensors, ``cuda`` for cuda tensors.

    >>> backend_string("nccl")
    'cpu:gloo,cuda:nccl'
    """
    return f"cpu:gloo,cuda:{cuda}"


def stage_through_host(kind: str, device_type: str, backend: str) -> bool:
    """Whether collective ``kind`` ("all_gather", "all_reduce", "all_reduce:max",
    "all_to_all", "broadcast", "send", "recv") on a tensor of ``device_type`` runs on host
    copies: where ``backend`` (the group's backend for that device) is gloo and gloo
    lacks it on that device (gloo runs all of them on cpu tensors).

    >>> [stage_through_host(kind, "cuda", "gloo") for kind in ("all_gather", "all_reduce")]
    [True, False]
    >>> stage_through_host("all_gather", "cuda", "nccl"), stage_through_host("send", "cpu", "gloo")
    (False, False)
    """
    return device_type != "cpu" and backend == "gloo" and kind not in GLOO_ON_CUDA


def _agree_on_cuda_backend(store, world: int, host: str, gpu: str | None,
                           nccl_available: bool) -> tuple[str, str]:
    """(backend for cuda collectives, why gloo: "" for NCCL), the same on every rank:
    NCCL when every rank with a GPU votes for it (a rank without one abstains: it never
    joins a cuda collective), gloo when any refuses or no rank has a GPU. ``gpu`` is
    this rank's GPU (``gpu_of``), None without one. Each rank counts itself on
    ``host``/``gpu``: of two ranks on one GPU the later one sees 2 and refuses, which is
    enough, since one refusal decides. A handful of store operations per rank; the last
    rank to arrive writes the decision, which the others wait for (the world's first
    meeting, before init_process_group: every rank runs this)."""
    key = "globaltensor/cuda_backend/"
    vote = None
    if gpu is not None:
        sharing = store.add(f"{key}gpu/{host}/{gpu}", 1)
        vote = cuda_vote(sharing, 1, nccl_available)  # 1: this rank has its GPU
        store.add(key + "voters", 1)
    if vote == "gloo":
        if not nccl_available:
            why = (f"NCCL is not available in the torch build of a rank on {host}; for "
                   f"NCCL, install a CUDA build of torch with NCCL")
        else:
            why = (f"local ranks share a GPU (GPU {gpu} of {host} serves more than one "
                   f"rank); for NCCL, run one rank per GPU: --nproc_per_node <= the number "
                   f"of GPUs (torch.cuda.device_count())")
        store.set(key + "why", why)
        store.add(key + "refusals", 1)
    if store.add(key + "arrived", 1) == world:  # every rank voted before it arrived
        refusals, voters = store.add(key + "refusals", 0), store.add(key + "voters", 0)
        store.set(key + "decided", "nccl" if voters and not refusals else
                  "gloo" if voters else "gloo:none")
    store.wait([key + "decided"])
    decided = store.get(key + "decided").decode()
    if decided == "nccl":
        return "nccl", ""
    return "gloo", store.get(key + "why").decode() if decided == "gloo" else ""


def _choose_backend(store, world: int) -> str:
    """This rank's backend string for the default group, agreed through ``store`` (None:
    a world of one, which agrees with itself); records why cuda goes through gloo."""
    global _cuda_via_gloo_why
    count = torch.cuda.device_count()   # NVML or the driver: creates no CUDA context
    gpu = gpu_of(env.get_local_rank(), count, os.environ.get("CUDA_VISIBLE_DEVICES")) \
        if count else None
    if store is None:
        store = dist.HashStore()
    cuda, why = _agree_on_cuda_backend(store, world, socket.gethostname(), gpu,
                                       dist.is_nccl_available())
    # A rank without a GPU uses gloo whatever the others chose: ProcessGroupNCCL refuses
    # to start without one, and the cpu backend (gloo, created first) is the same.
    cuda = cuda if gpu is not None else "gloo"
    _cuda_via_gloo_why = why if gpu is not None else ""
    return backend_string(cuda)


def device_backend(device_type: str) -> str:
    """The backend ("gloo", "nccl", ...) that carries collectives on ``device_type``
    tensors in the default group and its sub-groups (whoever made the group). The first
    time it answers gloo for cuda because the ranks chose so at ``init``, it warns once
    why, and how to get NCCL.

    >>> device_backend("cpu")            # doctest: +SKIP
    'gloo'
    """
    global _warned_gloo
    backend = _device_backends.get(device_type)
    if backend is None:
        init()
        backend = "gloo"
        for item in str(dist.get_backend_config()).split(","):
            device, _, name = item.rpartition(":")
            if device in ("", device_type):  # "gloo" alone serves every device
                backend = name
        _device_backends[device_type] = backend
    if device_type == "cuda" and backend == "gloo" and _cuda_via_gloo_why and not _warned_gloo:
        _warned_gloo = True
        warnings.warn(
            f"globaltensor: cuda collectives go through gloo, not NCCL: "
            f"{_cuda_via_gloo_why}. gloo is slower on GPUs, and what it lacks on CUDA "
            f"(all-gather, all-to-all, point-to-point) is staged through host memory.",
            stacklevel=3)
    return backend


def backend_of(device_type: str) -> str:
    """The backend that carries (or, before ``init``, would carry) ``device_type``'s
    collectives, read without starting the world or warning: what the cost model
    prices with. Before ``init``, cuda is taken as NCCL where torch has it and this
    process sees a GPU.

    >>> backend_of("cpu")
    'gloo'
    """
    priced = _priced_as.get(device_type)
    if priced is not None:
        return priced
    if device_type == "cpu":
        return "gloo"
    known = _device_backends.get(device_type)
    if known is not None:
        return known
    if dist.is_initialized():
        return device_backend(device_type)
    return "nccl" if dist.is_nccl_available() and torch.cuda.device_count() else "gloo"


def bind_gloo_to_address(addr: str | None) -> None:
    """Make every gloo group this process creates from now on send and receive on
    ``addr`` (an address of this machine), not on the address its hostname resolves to;
    ``None`` puts torch's own class back (a worker forked from a process that had bound
    an address, in a job without one).

    torch offers GLOO_SOCKET_IFNAME, an interface, which cannot tell two addresses of one
    interface apart (two nodes on 127.0.0.2 and 127.0.0.3 of ``lo``), and no address
    option in ``init_process_group``; so the name torch constructs gloo groups by
    (``torch.distributed.ProcessGroupGloo``, also RPC's) is given a stand-in that makes
    them with a device on ``addr`` (the launcher's ``--local_addr``, applied at import
    by interop/torch_patches.py).

    >>> bind_gloo_to_address("127.0.0.3")  # doctest: +SKIP
    """
    if addr is None:
        if isinstance(c10d.ProcessGroupGloo, _GlooOnAddress):
            c10d.ProcessGroupGloo = dist.ProcessGroupGloo = _TORCH_GLOO  # type: ignore[misc]
        return
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
    """The device this process uses for ``device_type``: "cpu", or for "cuda" GPU
    ``LOCAL_RANK % device_count`` (local ranks share GPUs when there are fewer GPUs than
    local ranks; their cuda collectives then go through gloo, see ``device_backend``).

    >>> local_device("cpu")
    device(type='cpu')
    """
    device = _local_devices.get(device_type)
    if device is None:   # asked for every op's output: made once (init forgets it)
        if device_type == "cuda":
            index = env.get_local_rank() % max(torch.cuda.device_count(), 1)
            device = torch.device("cuda", index)
        else:
            device = torch.device(device_type)
        _local_devices[device_type] = device
    return device


_local_devices: dict = {}


def _init_default_group() -> None:
    """The default group from the launcher's variables (a world of one in memory)."""
    global _store
    timeout = datetime.timedelta(seconds=env.timeout_seconds())
    world = env.get_world_size()
    # No device_id: binding the group to a GPU starts NCCL at once (on every rank,
    # also for a program on cpu placements), and makes sub-groups split from its
    # communicator, a collective of all ranks, which members-only groups cannot
    # run. NCCL starts on a group's first cuda collective, on the current device.
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A world of one needs no rendezvous: an in-memory store does.
        dist.init_process_group(_choose_backend(None, 1), store=dist.HashStore(),
                                rank=0, world_size=1, timeout=timeout)
        _name_default_backend(dist.group.WORLD)
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
        dist.init_process_group(_choose_backend(store, world), store=store,
                                rank=env.get_rank(), world_size=world, timeout=timeout)
        _name_default_backend(dist.group.WORLD)


def _name_default_backend(group) -> None:
    """torch names a group's default backend (the one its destroy asks for hooks) from
    its backend string, but names none for several backends without NCCL
    ("cpu:gloo,cuda:gloo") once any backend is registered with it (importing torch._dynamo
    registers "fake"): destroying the group then warns on every rank "No backend of type
    0 found ... Assuming no hooks are registered". Gloo is named there, as torch names it
    when no backend is registered."""
    if getattr(group, "_get_backend_name", lambda: "")() == "undefined":
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)


def init() -> None:
    """Initialise torch.distributed from the launcher's variables (idempotent).

    Without RANK/WORLD_SIZE this is a world of one process, with no error. When the
    program made the default group itself, it is used as it is.

    >>> import globaltensor as gt
    >>> gt.init(); gt.get_world_size()
    1
    """
    global _ready, _generation, _cuda_via_gloo_why
    if _ready:
        if dist.is_initialized():
            return
        # The program destroyed the default group (torch.distributed.destroy_process_group):
        # our sub-groups died with it; the next global op makes the world again.
        _groups.clear()
        _ready = False
        _generation += 1
    _device_backends.clear()
    _local_devices.clear()
    _cuda_via_gloo_why = ""  # the program's own group: its backend is its choice, not ours
    if not dist.is_initialized():
        _init_default_group()
    if torch.cuda.is_available():
        # Also when the program made the group: outputs of transfers land on the
        # current device, which must be this rank's (shared when local ranks outnumber
        # the GPUs: LOCAL_RANK % device_count); NCCL starts its communicators there.
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
    _device_backends.clear()
    _ready = False
    if store_view is None:   # gloo's groups, freed while Python runs (a simulated world's
        gc.collect()         # hold no threads, and a collection per rank costs ~80 ms)


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


store_view = None   # the simulated world's wrapper of the store (comm/simulated.py)


def default_store():
    """The default group's store, for meetings outside collectives (``meet.py``)."""
    store = c10d._get_default_store()
    return store if store_view is None else store_view(store)


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
