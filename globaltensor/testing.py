"""Helpers for tests and benchmarks of programs on global tensors (public).

- ``World(n, module, names)``: spawn a world of ``n`` processes (the launcher's
  variables, a free port, one OpenMP thread each) that run the named check functions
  in order and report per check; the first error on any rank ends the world at once
  (no rank is left waiting in a collective), and a world that outlives its deadline
  is killed. ``simulated=True``: one process runs each check as ``n`` simulated ranks.
- ``simulated_world(n)(fn, *args)``: ``fn`` run as ``n`` ranks in this process.
- ``spawn(main, n, argv)``: run ``main(argv)`` on ``n`` spawned processes (or in this
  process when a launcher started it), for benchmarks.
- ``free_port()``, ``peak_rise()`` (measured peak resident memory of a block),
  ``no_fallback(fn)`` (fails if an op ran without an sbp rule) and ``boxing_log()``.

``GLOBALTENSOR_CHECK_TIMES=<file>`` makes rank 0 of every world append
"<seconds> <world size> <check>" per check to that file (where a suite's time goes).

>>> w = World(2, "my_checks", ["check_add", "check_matmul"])   # doctest: +SKIP
>>> w.check("check_add")                                        # raises with the traceback
>>> with peak_rise() as peak:                                   # doctest: +SKIP
...     model = build()
>>> peak.mib
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import time
import traceback
import warnings
from typing import Callable

__all__ = ["World", "free_port", "spawn", "peak_rise", "Peak", "no_fallback", "boxing_log",
           "reset", "simulated_world"]


def simulated_world(n: int, timeout: float | None = None) -> Callable:
    """``simulated_world(n)(fn, *args)``: ``fn`` run as ``n`` ranks in this one process
    (threads taking turns, collectives in memory), through the same dispatch, boxing,
    autograd and gradient sync as a world of processes; returns the ranks' results as a
    list. A debugger steps through any rank. Limits: ``globaltensor/simulated.py``.

    >>> gt.testing.simulated_world(2)(lambda: gt.get_rank())   # doctest: +SKIP
    [0, 1]
    """
    from .simulated import simulated_world as world
    return world(n, timeout)


def reset() -> None:
    """End every mode of the per-op path and forget what each kept (``modes.py``):
    whole-step plans and recordings, check mode, explicit regions and implicit
    broadcast left open, fake parts; the modes a program starts with (check mode under
    GLOBALTENSOR_DEBUG=1, the watch for functional steps) are on again. Test worlds run
    it after every check, so no check's plans or modes reach the next.

    >>> import globaltensor as gt
    >>> gt.testing.reset()
    """
    from . import modes
    modes.reset()


_PORTS_GIVEN: set = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a job's store, not given before by this process.
    Taken below the range the kernel gives outgoing connections (32768-60999 on Linux)
    and below the launchers' default 29500: a port from that range, free when asked, was
    at times given to another job's gloo connection before its own job bound it
    ("--master_port ... is already in use")."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 29000)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:   # (all taken: any free one)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_context():
    """The multiprocessing context of test worlds: a fork server that imported torch,
    globaltensor (whose settings each process reads again from its own environment,
    ``_child``) and what a first op imports (``FIRST_OP_IMPORTS``) once starts a world's
    processes in ~30 ms instead of ~4 s of interpreter start and imports each."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from .launch.forkserver import FIRST_OP_IMPORTS
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *FIRST_OP_IMPORTS, "globaltensor"])
    return ctx


def _child(rank: int, world: int, port: int, module: str, names: list, results,
           parent_env: dict, env: dict, simulated: bool = False):
    # A forked child has the fork server's environment: take the test process's instead.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "GLOBALTENSOR_TIMEOUT": "60", **env})
    try:
        import importlib

        import torch

        from . import env as settings
        settings.reread()   # (imported by the fork server, with its environment)
        torch.set_num_threads(1)
        mod = importlib.import_module(module)
        from .env import check_times_file
        times = check_times_file()  # a file: "<seconds> <world size> <check>" lines
        if simulated:
            from .simulated import failing_rank, simulated_world
            run_as_world = simulated_world(world)
        for name in names:
            start = time.perf_counter()
            try:
                if ":" in name:
                    other, function = name.split(":")
                    check = getattr(importlib.import_module(other), function)
                else:
                    check = getattr(mod, name)
                run_as_world(check) if simulated else check()
            except BaseException as e:
                failed = (failing_rank(e) or 0) if simulated else rank
                results.put((failed, name, traceback.format_exc()))
                return
            if "globaltensor.modes" in sys.modules:   # nothing a check left on reaches the next
                reset()
            if times and rank == 0:
                with open(times, "a") as f:
                    f.write(f"{time.perf_counter() - start:.2f} {world} {name}\n")
            for done in range(world) if simulated else (rank,):
                results.put((done, name, None))
        if "globaltensor.comm" in sys.modules and not simulated:  # leave the world together
            sys.modules["globaltensor.comm"].finish()
    except BaseException:
        results.put((rank, "<setup>", traceback.format_exc()))


class World:
    """``nprocs`` spawned processes running the functions ``names`` of ``module`` in
    order (a name ``"other_module:function"`` runs a function of another module),
    reporting per check; ``check(name)`` raises AssertionError with the failing rank's
    traceback. ``lazy=True`` returns at once and each ``check`` waits only for its own
    reports (the deadline is then per check). ``env`` adds environment variables.
    ``simulated=True`` runs the checks as ``nprocs`` ranks of a simulated world
    (``simulated_world``) in one spawned process: the same dispatch, boxing and
    autograd on one core, without the processes' start and sockets, for checks that
    need no real process (its limits: ``globaltensor.simulated``).

    >>> World(2, "my_checks", ["check_add"]).check("check_add")    # doctest: +SKIP
    >>> World(4, "my_checks", ["check_add"], simulated=True)       # doctest: +SKIP
    """

    def __init__(self, nprocs: int, module: str, names: list, timeout: float = 240,
                 env: dict | None = None, lazy: bool = False, simulated: bool = False):
        self.nprocs, self.names, self.timeout, self.lazy = nprocs, list(names), timeout, lazy
        self.errors: dict = {}
        self.done: dict = {name: 0 for name in names}
        ctx = _start_context()
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_child, args=(r, nprocs, port, module, self.names,
                                                          self._results, dict(os.environ),
                                                          env or {}, simulated), daemon=True)
                       for r in range(1 if simulated else nprocs)]
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
                left = self._deadline - time.monotonic()
                try:
                    rank, name, err = self._results.get(timeout=min(1.0, max(0.1, left)))
                except queue.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                            if p.exitcode not in (None, 0)]
                    if dead:   # a process that died without reporting (a crash, a kill)
                        self.errors["<exited>"] = "; ".join(
                            f"rank {r} exited with code {code} before reporting"
                            for r, code in dead) + f"; checks done: {self.done}"
                        break
                    if left > 1.0:
                        continue
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

    def kill(self) -> None:
        """Kill the processes now (safe while another thread waits for their reports:
        it then sees them exit)."""
        for p in self._procs:
            p.kill()

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


def _spawned(rank: int, world: int, port: int, main, argv) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    main(argv)


def spawn(main: Callable, nproc: int, argv: list | None = None) -> None:
    """Run ``main(argv)`` in this process when a launcher started it (RANK is set),
    else on ``nproc`` spawned processes on a free local port (``argv`` defaults to
    this process's arguments).

    >>> spawn(main, 2)            # doctest: +SKIP
    """
    if "RANK" in os.environ:
        main(None)
        return
    import torch.multiprocessing as tmp
    argv = sys.argv[1:] if argv is None else argv
    tmp.start_processes(_spawned, args=(nproc, free_port(), main, argv), nprocs=nproc,
                        start_method="spawn")


# --- memory ---------------------------------------------------------------------------
# The kernel's high-water mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs,
# so a rise is measured, not inferred from sizes (Linux). Free heap memory goes back
# to the OS before each block.

def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Peak:
    mib: float = 0.0


@contextlib.contextmanager
def peak_rise():
    """``with peak_rise() as p: ...`` then ``p.mib``: peak resident memory of this
    process during the block minus its resident memory at the start, in MiB (Linux).

    >>> with peak_rise() as p:    # doctest: +SKIP
    ...     x = torch.ones(2 ** 20)
    >>> p.mib                     # about 4
    """
    import gc

    from .heap import release_free_heap
    gc.collect()
    # free heap pages go back to the OS first: in a process that ran other checks, a
    # block could otherwise reuse resident pages and show a rise smaller than it is
    release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    peak = Peak()
    start = _status_mib("VmRSS")
    yield peak
    peak.mib = _status_mib("VmHWM") - start


# --- rules ----------------------------------------------------------------------------

def no_fallback(fn: Callable, what: str = ""):
    """``fn()``, failing with AssertionError if any op inside ran without an sbp rule
    (gathered to broadcast: a ``FallbackWarning``); returns ``fn``'s result.

    >>> y = no_fallback(lambda: x @ w, "matmul")     # doctest: +SKIP
    """
    from .rules.registry import FallbackWarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert not fallbacks, f"{what}: {fallbacks}"
    return out


@contextlib.contextmanager
def boxing_log():
    """The messages the "globaltensor" logger writes at DEBUG level inside the block
    (every boxing: what moved and why), collected into the list it yields; the
    logger's level and handlers are restored after.

    >>> with boxing_log() as messages:              # doctest: +SKIP
    ...     y = x.to_global(sbp=gt.sbp.broadcast)
    >>> any("boxes for to_global" in m for m in messages)
    True
    """
    import logging
    messages: list = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("globaltensor")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)

