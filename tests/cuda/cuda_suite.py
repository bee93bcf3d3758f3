"""What the GPU suite (tests/cuda/) shares: the device type its placements use, and
its own worlds of processes.

``DEVICE`` is "cuda", or what ``GT_CUDA_TESTS_DEVICE`` says: ``GT_CUDA_TESTS_DEVICE=cpu``
runs the same checks on cpu placements (a dry run on a machine without a GPU; the
``cuda`` marker then does not skip tests/cuda, see tests/conftest.py). In a dry run
the cpu <-> cuda moves are skipped (``cuda_only``), and the CUDA-graph check runs
``mode="reduce-overhead"`` on cpu placements, checking values only.

Worlds. The suite does not run in the session's shared worlds (tests/mp.py): those
start with every selected check, also on a machine where the cuda tests are skipped,
and mix cpu checks into the processes. Each test module here gets worlds of its own
(one per world size), running only the checks the session selected, and ended at the
end of the session (``cuda_worlds`` in conftest.py). Their processes come
from ``globaltensor.testing.World``'s fork server, which imports torch but never
touches CUDA, so every rank initialises CUDA itself (nothing is inherited from the
pytest process, which may have). Rank r takes GPU ``LOCAL_RANK % device_count`` (the
library's ``comm.local_device``): on one GPU the ranks share it and their cuda
collectives go through gloo, on as many GPUs as ranks through NCCL; the checks assume
neither.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import warnings

import pytest

from globaltensor.testing import World

DEVICE = os.environ.get("GT_CUDA_TESTS_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
CHECK_TIMEOUT = 120          # seconds per check (collectives time out sooner: 60 s)

only_on_cuda = pytest.mark.skipif(not ON_CUDA, reason=f"needs cuda placements "
                                  f"(GT_CUDA_TESTS_DEVICE={DEVICE}: a dry run)")


def quiet() -> None:
    """No warning that the ranks' cuda collectives go through gloo (they share a GPU),
    expected on a one-GPU machine. Each rank imports this module first."""
    warnings.filterwarnings("ignore", message="globaltensor: cuda collectives go through gloo")


quiet()
if multiprocessing.parent_process() is not None:    # a rank of a world
    faulthandler.enable()   # one that crashes (a segfault in a backend) says where


def place(ranks, device: str | None = None):
    """``gt.placement(DEVICE, ranks)``."""
    import globaltensor as gt
    return gt.placement(device or DEVICE, ranks)


def local_device(device: str | None = None):
    """This rank's device for ``device`` (default DEVICE) placements."""
    from globaltensor import comm
    return comm.local_device(device or DEVICE)


def seeded(seed: int = 0):
    """A cpu generator: values made on the host, then moved, are the same on every
    device."""
    import torch
    return torch.Generator().manual_seed(seed)


class SuiteWorld:
    """A lazy ``World`` of ``n`` processes running ``names`` ("module:check") in order,
    started by ``start()`` or by its first ``check``. A world ends at its first failing
    check; a later check then runs in a new world together with the checks after it
    (one failure does not fail the rest)."""

    def __init__(self, n: int, names: list):
        self.n, self.names, self.world = n, names, None

    def start(self, first: str | None = None) -> None:
        if self.world is not None:
            self.world.close()
        names = self.names[self.names.index(first):] if first else self.names
        self.world = World(self.n, "cuda_suite", names, timeout=CHECK_TIMEOUT, lazy=True)

    def check(self, name: str) -> None:
        w = self.world
        if w is None or name not in w.done or (w.errors and name not in w.errors
                                               and w.done[name] != self.n):
            self.start(name)
        try:
            self.world.check(name)
        except AssertionError as e:
            crash = self.world.errors.get("<exited>")
            if crash and name not in self.world.errors:
                # ranks died while running it (the checks before it passed): a crash
                # in native code, whose stack faulthandler printed on the ranks' stderr
                raise AssertionError(f"{name}: a rank crashed running it: {crash}") from e
            raise

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


def _skipped(item) -> bool:
    return bool(item.get_closest_marker("skip")) or any(
        m.args and m.args[0] for m in item.iter_markers("skipif"))


def plan_worlds(items) -> dict:
    """A ``SuiteWorld`` per (module, world size) of the selected ``items``' world tests
    (those that run: not skipped), with their checks in order; none started."""
    worlds: dict = {}
    for item in items:
        key = getattr(getattr(item, "function", None), "cuda_world", None)
        if key is None or _skipped(item):
            continue
        module, n = key
        world = worlds.setdefault(key, SuiteWorld(n, []))
        name = f"{module}:{item.callspec.params['name']}"
        if name not in world.names:
            world.names.append(name)
    return worlds


def world_checks(module: str, n: int, names: list, cuda_only=(), timeout: int = 300):
    """A test parametrized over ``names`` (functions of ``module``), each run on every
    rank of this module's world of ``n`` processes; ``cuda_only`` are skipped in a dry
    run. Marked ``cuda`` and ``multiprocess``, with a timeout; the world ends at the
    end of the session, or when its last check is done."""
    params = [pytest.param(name, marks=only_on_cuda) if name in cuda_only else name
              for name in list(names) + [c for c in cuda_only if c not in names]]

    @pytest.mark.cuda
    @pytest.mark.multiprocess
    @pytest.mark.timeout(timeout)
    @pytest.mark.parametrize("name", params)
    def test(name, cuda_worlds):
        cuda_worlds[(module, n)].check(f"{module}:{name}")

    test.cuda_world = (module, n)
    return test
