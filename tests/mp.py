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


# --------------------------------------------------------------------------------------
# session worlds: every test file's checks for a world of n run in one spawned world
# --------------------------------------------------------------------------------------

CHECK_TIMEOUT = 240         # seconds per check (collectives time out sooner: 60 s)


class SharedWorld:
    """Lazy ``World``s of ``n`` processes running ``names`` ("module:check") in order.
    A world ends at its first failing check; a check that did not get to run then runs
    in a new world together with the checks after it (so one failure does not fail the
    rest of the session)."""

    def __init__(self, n: int, names: list):
        self.n, self.names = n, names
        self.world: World | None = None

    def check(self, name: str) -> None:
        w = self.world
        if w is None or name not in w.done or (w.errors and name not in w.errors
                                               and w.done[name] != self.n):
            if w is not None:
                w.close()
            w = self.world = World(self.n, "mp", self.names[self.names.index(name):],
                                   timeout=CHECK_TIMEOUT, lazy=True)
        w.check(name)

    def wait(self) -> None:
        """Let the current world run its remaining checks (until done or an error)."""
        if self.world is not None:
            self.world.wait()

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


_SHARED: dict = {}


def _shared_world(n: int, request) -> SharedWorld:
    """The session's world of ``n``, made at the first request, for every check that the
    session selected in a world of ``n`` (from any test file). One world runs at a time:
    the others first finish what they run (their results wait for their tests)."""
    for m, other in _SHARED.items():
        if m != n:
            other.wait()
    if n not in _SHARED:
        names = []
        for item in request.session.items:
            if getattr(getattr(item, "function", None), "shared_world", None) == n:
                name = f"{item.module.__name__}:{item.callspec.params['name']}"
                if name not in names:
                    names.append(name)
        _SHARED[n] = SharedWorld(n, names)
        request.config.add_cleanup(lambda: _SHARED.pop(n).close())
    return _SHARED[n]


def world_test(module: str, n: int, names: list):
    """A test parametrized over ``names`` (functions of ``module``), each run on every
    rank of the session's world of ``n`` processes. Checks must leave no state behind
    that a later check could see (they share the processes with other files' checks)."""
    import pytest

    # the test that starts a world first waits for the other worlds' remaining checks;
    # hangs are bounded per check (CHECK_TIMEOUT, collectives sooner)
    @pytest.mark.timeout(1800)
    @pytest.mark.parametrize("name", list(names))
    def test(name, request):
        _shared_world(n, request).check(f"{module}:{name}")

    test.shared_world = n
    return test


def checks_in_worlds(module: str, checks, only_in_4=()):
    """Tests running ``checks`` (names of functions in ``module``) in the session's
    world of 2 and world of 4; ``only_in_4`` need 4 ranks. Use as
    ``test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)``."""
    return world_test(module, 2, checks), world_test(module, 4, list(checks) + list(only_in_4))


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
