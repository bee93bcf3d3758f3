"""The atexit teardown (``groups._destroy``) frees the gloo groups while Python still runs.

A gloo worker thread still alive when the interpreter finalises can abort the process
("terminate called without an active exception", SIGABRT after the program's last
line): it drops a finished work whose tensors' Python objects died first, takes the GIL
to free them, and Python ends the thread inside a noexcept destructor. Freeing a group
joins its worker threads, so none may be left after ``_destroy``, also when torch
modules that bind ``group.WORLD`` as a default argument (torch.distributed.nn.functional,
imported by torch._dynamo) are imported after the group was made.
"""
from __future__ import annotations

import os

import pytest
from mp import World


def _gloo_threads_end_in_destroy():
    import torch

    import globaltensor as gt
    from globaltensor.comm import groups
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(8.0), placement=P, sbp=gt.sbp.split(0))
    assert (x * 2).full().tolist() == [2.0 * i for i in range(8)]
    import torch._dynamo  # noqa: F401  (after init: imports torch.distributed.nn.functional)
    groups._destroy()
    names = [open(f"/proc/self/task/{t}/comm").read().strip()
             for t in os.listdir("/proc/self/task")]
    left = [n for n in names if "gloo" in n]
    assert not left, f"gloo threads still running after _destroy: {left}"


def _global_ops_after_the_program_destroys_the_group():
    # torch.distributed.destroy_process_group() in the program, then global ops again:
    # the world is made again (a new store prefix each time), twice over
    import torch
    import torch.distributed as dist

    import globaltensor as gt
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    for _ in range(2):
        dist.destroy_process_group()
        y = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
        assert y.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert (x * 2).sum().item() == 12.0


def _the_program_makes_the_group_again_itself():
    # the store kept for our own worlds does not stand in the way of a program that
    # destroys the group and makes it again itself (same variables, same port)
    import torch
    import torch.distributed as dist

    import globaltensor as gt
    P = gt.placement.all("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    y = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    assert y.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_destroy_joins_the_gloo_threads_and_the_world_can_be_made_again():
    world = World(2, __name__, ["_global_ops_after_the_program_destroys_the_group",
                                "_the_program_makes_the_group_again_itself",
                                "_gloo_threads_end_in_destroy"])
    world.check("_global_ops_after_the_program_destroys_the_group")
    world.check("_the_program_makes_the_group_again_itself")
    world.check("_gloo_threads_end_in_destroy")


EXIT_SCRIPT = """
import torch.distributed as dist
# a backend registered with torch (importing torch._dynamo registers "fake": slower)
dist.Backend.register_backend("another", lambda *args: None, devices=["cpu"])
import globaltensor as gt
gt.init()
x = gt.randn(4, 4, placement=gt.placement.all("cpu"), sbp=gt.sbp.broadcast)
print(dist.group.WORLD._get_backend_name(), float(x.sum()) == float(x.sum()))
"""


@pytest.mark.timeout(120)
def test_the_default_group_ends_without_a_warning():
    """The default group names gloo its default backend: torch names none for
    "cpu:gloo,cuda:gloo" once any backend is registered with it (torch._dynamo's import
    registers one, which the launcher's workers make early), and destroying the group
    at exit then warned "No backend of type 0 found ... Assuming no hooks are
    registered", on every rank of every program."""
    import subprocess
    import sys
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                         timeout=100, env=environ)
    assert out.returncode == 0, out.stderr
    name, equal = out.stdout.split()   # (nccl where this machine has a GPU)
    assert name in ("gloo", "nccl") and equal == "True", out.stdout
    assert "No backend of type" not in out.stderr, out.stderr
