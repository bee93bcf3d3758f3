"""Run many checks in one spawned world of processes (spawning costs seconds).

``World(n, module, names)`` starts ``n`` processes with the launcher's variables on a
free port; each runs the named functions of ``module`` in order and reports per check.
The first error on any rank ends the world at once (the others are killed, not left
waiting in a collective); a world that outlives its deadline is killed too. Tests then
ask ``world.check(name)``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, module: str, names: list, results, env: dict):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "GLOBALTENSOR_TIMEOUT": "60", **env})
    try:
        import importlib
        import torch
        torch.set_num_threads(1)
        mod = importlib.import_module(module)
        for name in names:
            try:
                getattr(mod, name)()
            except BaseException:
                results.put((rank, name, traceback.format_exc()))
                return
            results.put((rank, name, None))
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "<setup>", traceback.format_exc()))


class World:
    def __init__(self, nprocs: int, module: str, names: list, timeout: float = 240,
                 env: dict | None = None):
        self.nprocs, self.names = nprocs, list(names)
        self.errors: dict = {}
        self.done: dict = {name: 0 for name in names}
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, nprocs, port, module, self.names,
                                                    results, env or {}), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        expected = nprocs * len(self.names)
        received = 0
        try:
            while received < expected and not self.errors:
                try:
                    rank, name, err = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    self.errors["<timeout>"] = (f"world of {nprocs} did not finish within "
                                                f"{timeout} s; checks done: {self.done}")
                    break
                received += 1
                if err is None:
                    self.done[name] += 1
                else:
                    self.errors[name] = f"rank {rank}:\n{err}"
            if not self.errors:
                for p in procs:
                    p.join(max(0.1, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
            results.close()

    def check(self, name: str) -> None:
        """Raise AssertionError unless ``name`` passed on every rank."""
        if name in self.errors:
            raise AssertionError(self.errors[name])
        if self.done.get(name) != self.nprocs:
            reason = "; ".join(f"{k}: {v.splitlines()[0] if v else ''}"
                               for k, v in self.errors.items())
            raise AssertionError(f"{name} did not run on every rank (an earlier check "
                                 f"failed: {reason})")


def checks_in_worlds(module: str, checks, only_in_4=(), make_world=None):
    """Fixtures and tests running ``checks`` (names of functions in ``module``) in one
    world of 2 and one of 4 processes; ``only_in_4`` need 4 ranks. Use as
    ``world2, world4, test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)``.
    ``make_world(nprocs, names)`` replaces ``World`` (e.g. by one that restarts worlds)."""
    import pytest

    checks, in_4 = list(checks), list(checks) + list(only_in_4)
    make_world = make_world or (lambda n, names: World(n, module, names))

    @pytest.fixture(scope="module")
    def world2():
        return make_world(2, checks)

    @pytest.fixture(scope="module")
    def world4():
        return make_world(4, in_4)

    @pytest.mark.parametrize("name", checks)
    def test_world2(world2, name):
        world2.check(name)

    @pytest.mark.parametrize("name", in_4)
    def test_world4(world4, name):
        world4.check(name)

    return world2, world4, test_world2, test_world4


def launch_example(script: str, nproc: int, tmp_path, *args, timeout: float = 150):
    """Run ``examples/<script>`` as the README does, through the launcher on a free port
    with its logs in ``tmp_path``; returns the CompletedProcess. One OpenMP thread per
    process, also for a 1-rank run, so runs do not oversubscribe the cores."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "--log_dir", str(tmp_path / f"log{nproc}"),
           str(root / "examples" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root,
                          env=env)


def run_example(script: str, nproc: int, tmp_path, *args, timeout: float = 150) -> str:
    """``launch_example`` that must succeed; returns its standard output."""
    out = launch_example(script, nproc, tmp_path, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
