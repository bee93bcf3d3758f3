"""Run many checks in one spawned world of processes (spawning costs seconds).

``World(n, module, names)`` starts ``n`` processes with the launcher's variables on a
free port; each runs the named functions of ``module`` in order and reports per check.
The first error on any rank ends the world at once (the others are killed, not left
waiting in a collective); a world that outlives its deadline is killed too. Tests then
ask ``world.check(name)``. A name ``"other_module:function"`` runs a function of another
module. ``World(..., lazy=True)`` returns at once and each ``check`` waits only for its
own reports (a test's duration is its check's, and the deadline is per check).
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
                if ":" in name:
                    other, function = name.split(":")
                    getattr(importlib.import_module(other), function)()
                else:
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
                 env: dict | None = None, lazy: bool = False):
        self.nprocs, self.names, self.timeout, self.lazy = nprocs, list(names), timeout, lazy
        self.errors: dict = {}
        self.done: dict = {name: 0 for name in names}
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_child, args=(r, nprocs, port, module, self.names,
                                                          self._results, env or {}), daemon=True)
                       for r in range(nprocs)]
        self._received, self._closed = 0, False
        for p in self._procs:
            p.start()
        self._deadline = time.monotonic() + timeout
        if not lazy:
            self._collect()

    def _collect(self, until: str | None = None) -> None:
        """Take reports until every check (or ``until``) is done on every rank, an error
        or the deadline; then, unless waiting for ``until`` only, end the processes."""
        expected = self.nprocs * len(self.names)
        try:
            while (self._received < expected and not self.errors
                   and (until is None or self.done[until] < self.nprocs)):
                try:
                    rank, name, err = self._results.get(
                        timeout=max(0.1, self._deadline - time.monotonic()))
                except queue.Empty:
                    self.errors["<timeout>"] = (f"world of {self.nprocs} did not finish within "
                                                f"{self.timeout} s; checks done: {self.done}")
                    break
                self._received += 1
                if err is None:
                    self.done[name] += 1
                    if self.lazy and self.done[name] == self.nprocs:
                        self._deadline = time.monotonic() + self.timeout
                else:
                    self.errors[name] = f"rank {rank}:\n{err}"
        except BaseException:       # e.g. the test's own timeout: the world is over
            self.errors.setdefault("<interrupted>", "the test process stopped waiting")
            self.close()
            raise
        if self._received == expected or self.errors:
            self.close()

    def wait(self) -> None:
        """Take the reports of every remaining check (a lazy world), then end."""
        if not self._closed:
            self._collect()

    def close(self) -> None:
        """End the processes (those still running are killed)."""
        if self._closed:
            return
        self._closed = True
        if not self.errors and self._received == self.nprocs * len(self.names):
            for p in self._procs:
                p.join(max(0.1, self._deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._results.close()

    def check(self, name: str) -> None:
        """Raise AssertionError unless ``name`` passed on every rank."""
        if self.lazy and name in self.done and not self._closed:
            self._collect(until=name)
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
