"""Process-group bootstrap and the cache of sub-groups, keyed by the ordered rank tuple.

torch needs every rank of the world to take part in creating a group (its names count
the groups each process made, so members-only creation desynchronises as soon as
ranks use different placements). So the groups of a placement are all made the first
time a collective runs on it (a boxing plan with collectives, a gradient bucket): in
SPMD code every rank reaches that call, including ranks outside the placement, which
take part once and never wait on the group again. Point-to-point transfers need none.
Member order is kept (``sort_ranks=False``) so group rank ``i`` is ``members[i]``:
the order in which a split hands out parts.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os

import torch
import torch.distributed as dist

from .. import env
from ..placement import Placement

_groups: dict[tuple[int, ...], object] = {}


def _backend() -> str:
    # One default group serving both devices: gloo for cpu placements, nccl for cuda.
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init() -> None:
    """Initialise torch.distributed from the launcher's variables (idempotent).

    Without RANK/WORLD_SIZE this is a world of one process, with no error.

    >>> import globaltensor as gt
    >>> gt.init(); gt.get_world_size()
    1
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=env.timeout_seconds())
    world = env.get_world_size()
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A world of one needs no rendezvous: an in-memory store does.
        dist.init_process_group(_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(_backend(), init_method="env://", rank=env.get_rank(),
                                world_size=world, timeout=timeout)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.get_local_rank() % torch.cuda.device_count())
    # A gloo group still alive when the interpreter finalises can abort the process
    # (its worker threads release tensors after Python is gone). Destroy the groups,
    # and drop our own references to them, while Python still runs; it is local.
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _groups.clear()  # the last references to sub-groups, also after a user's own destroy
    _registered.clear()
    gc.collect()


_registered: set = set()


def register_placement(placement: Placement) -> None:
    """Create every sub-group of ``placement`` (along each axis); call on every rank."""
    if placement in _registered:
        return
    init()
    world = tuple(range(dist.get_world_size()))
    for axis in range(placement.ndim):
        for ranks in placement.groups(axis):
            if ranks in _groups or len(ranks) == 1:
                continue
            if ranks == world:
                _groups[ranks] = dist.group.WORLD
            else:
                _groups[ranks] = dist.new_group(
                    list(ranks), sort_ranks=False,
                    timeout=datetime.timedelta(seconds=env.timeout_seconds()))
    _registered.add(placement)


def get_group(ranks: tuple[int, ...]):
    """The process group whose group rank ``i`` is ``ranks[i]`` (the caller is a member)."""
    group = _groups.get(ranks)
    if group is None and ranks == tuple(range(dist.get_world_size())):
        group = _groups[ranks] = dist.group.WORLD
    if group is None:
        raise RuntimeError(f"no process group for ranks {ranks}: register_placement() was "
                           f"not called on the placement that uses it")
    return group
