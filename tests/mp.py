"""Run many checks in one spawned world of processes (spawning costs seconds).

The world itself is ``globaltensor.testing.World``; this module adds what is
particular to this suite: the session's shared worlds (every test file's checks for a
world of n run in one spawned world) and running the examples through the launcher.
"""
from __future__ import annotations

import os

from globaltensor.testing import World, free_port  # noqa: F401  (tests import them here)

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
_STARTER: list = []         # the thread starting the session's worlds, while it runs


def _world_names(items, n: int) -> list:
    """The checks ("module:check") that the selected ``items`` run in a world of ``n``."""
    names = []
    for item in items:
        if getattr(getattr(item, "function", None), "shared_world", None) == n:
            name = f"{item.module.__name__}:{item.callspec.params['name']}"
            if name not in names:
                names.append(name)
    return names


def order_world_tests_last(items: list) -> None:
    """Put the shared worlds' tests after every other test (world 2's, then world 4's),
    in their order otherwise: the worlds then run behind the other tests, which leave
    cores idle while they wait for launched jobs, and their tests find them done. The
    examples' runs (several processes each, busy the whole time) go just before them:
    they then fill both cores once the worlds are done, where a test that waits or runs
    in one process would leave one idle."""
    def key(item):
        world = getattr(getattr(item, "function", None), "shared_world", None)
        return (world or 0, world is None and _runs_examples(item))
    items.sort(key=key)


def _runs_examples(item) -> bool:
    from pathlib import Path
    return Path(str(item.fspath)).parent.name == "examples"


def start_shared_worlds(items: list) -> None:
    """Run the session's worlds one after another in the background from now on (one at
    a time: the world of 4 already oversubscribes two cores). The first world test
    takes them over (``_shared_world``)."""
    import threading

    sizes = sorted({n for n in (getattr(getattr(item, "function", None), "shared_world",
                                        None) for item in items) if n})

    def run():
        for k, n in enumerate(sizes):
            world = _SHARED[n] = SharedWorld(n, _world_names(items, n))
            world.world = World(n, "mp", world.names, timeout=CHECK_TIMEOUT, lazy=True)
            if k + 1 < len(sizes):
                world.wait()

    if sizes:
        starter = threading.Thread(target=run, name="shared-worlds", daemon=True)
        _STARTER.append(starter)
        starter.start()


def close_shared_worlds() -> None:
    """End the session's worlds (at the end of the session, also an interrupted one)."""
    while _STARTER:
        starter = _STARTER.pop()
        for world in list(_SHARED.values()):     # a world still running ends at once
            if world.world is not None and starter.is_alive():
                world.world.kill()
        starter.join()
    while _SHARED:
        _SHARED.popitem()[1].close()


def _shared_world(n: int, request) -> SharedWorld:
    """The session's world of ``n`` (started in the background, or made now for every
    check that the session selected in a world of ``n``). One world runs at a time: the
    others first finish what they run (their results wait for their tests)."""
    while _STARTER:
        _STARTER.pop().join()
    for m, other in _SHARED.items():
        if m != n:
            other.wait()
    if n not in _SHARED:
        _SHARED[n] = SharedWorld(n, _world_names(request.session.items, n))
    return _SHARED[n]


def world_test(module: str, n: int, names: list):
    """A test parametrized over ``names`` (functions of ``module``), each run on every
    rank of the session's world of ``n`` processes, marked ``multiprocess``. Checks must
    leave no state behind that a later check could see (they share the processes with
    other files' checks)."""
    import pytest

    # the test that starts a world first waits for the other worlds' remaining checks;
    # hangs are bounded per check (CHECK_TIMEOUT, collectives sooner)
    @pytest.mark.multiprocess
    @pytest.mark.timeout(1800)
    @pytest.mark.parametrize("name", list(names))
    def test(name, request):
        _shared_world(n, request).check(f"{module}:{name}")

    test.shared_world = n
    return test


def checks_in_worlds(module: str, checks, only_in_4=(), only_in_2=()):
    """Tests running ``checks`` (names of functions in ``module``) in the session's
    world of 2 and world of 4; ``only_in_4`` need 4 ranks, ``only_in_2`` learn nothing
    more from 4 (a measurement that costs time on the oversubscribed world). Use as
    ``test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)``."""
    return (world_test(module, 2, list(checks) + list(only_in_2)),
            world_test(module, 4, list(checks) + list(only_in_4)))


def _example_command(script: str, nproc: int, log_dir, args) -> tuple:
    """(the launcher's arguments, cwd, env) of running ``examples/<script>`` as the
    README does, through the launcher on a free port. One OpenMP thread per process, also
    for a 1-rank run, so runs do not oversubscribe the cores."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["--nproc_per_node", str(nproc), "--master_port", str(free_port()),
            "--log_dir", str(log_dir), str(root / "examples" / script), *args]
    return args, root, {**os.environ, "OMP_NUM_THREADS": "1"}


def launch_example(script: str, nproc: int, tmp_path, *args, timeout: float = 150):
    """Run ``examples/<script>`` through the launcher with its logs in ``tmp_path``;
    returns the CompletedProcess. The launcher is forked from the session's launcher
    server (``forked_launch``: no torch import per launch)."""
    import forked_launch

    args, cwd, env = _example_command(script, nproc, tmp_path / f"log{nproc}", args)
    return forked_launch.run(args, cwd, env, timeout)


def launch_examples_together(runs: list, tmp_path, timeout: float = 150) -> list:
    """``launch_example`` for each ``(script, nproc, *args)`` of ``runs``, all started
    at once (independent runs: a 1-rank run, or a launcher starting its workers, leaves
    a core idle that another run can use); returns their
    CompletedProcesses in order. Output goes to files (a full pipe would stall a run
    while another is waited for)."""
    import subprocess
    import time

    import forked_launch

    started = []
    try:
        for k, (script, nproc, *args) in enumerate(runs):
            args, cwd, env = _example_command(script, nproc, tmp_path / f"log{k}-{nproc}", args)
            out, err = (open(tmp_path / f"run{k}.{name}", "w+") for name in ("out", "err"))
            started.append((args, out, err, forked_launch.start(args, cwd, env, out.fileno(),
                                                                err.fileno())))
        deadline = time.monotonic() + timeout
        done = []
        for args, out, err, proc in started:
            proc.wait(max(0.1, deadline - time.monotonic()))
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(),
                                                    err.read()))
        return done
    finally:
        for _, out, err, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


def run_example(script: str, nproc: int, tmp_path, *args, timeout: float = 150) -> str:
    """``launch_example`` that must succeed; returns its standard output."""
    out = launch_example(script, nproc, tmp_path, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_examples_together(runs: list, tmp_path, timeout: float = 150) -> list:
    """``launch_examples_together`` whose runs must all succeed; returns their standard
    outputs in order."""
    outs = launch_examples_together(runs, tmp_path, timeout=timeout)
    for run, out in zip(runs, outs):
        assert out.returncode == 0, f"{run}:\n{out.stdout}{out.stderr}"
    return [out.stdout for out in outs]


def example_module(name: str):
    """``examples/<name>.py`` imported as a module (its ``main`` not run): checks use its
    model and training functions in the session's worlds instead of launching it."""
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module       # as an import would (a dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported (with the benchmarks it imports) without leaving
    benchmarks/ on ``sys.path``, where its scripts would hide test helpers of the same
    name (``boxing``)."""
    import importlib
    import sys
    from pathlib import Path
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)

