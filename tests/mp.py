"""Run many checks in one spawned world of processes (spawning costs seconds).

The world itself is ``globaltensor.testing.World``; this module adds what is
particular to this suite: the session's shared worlds (every test file's checks for a
world of n run in one spawned world) and running the examples through the launcher.
"""
from __future__ import annotations

import contextlib
import os
import threading

from globaltensor.testing import World, free_port  # noqa: F401  (tests import them here)

# --------------------------------------------------------------------------------------
# session worlds: every test file's checks for a world of n run in one spawned world
# --------------------------------------------------------------------------------------

CHECK_TIMEOUT = 240         # seconds per check (collectives time out sooner: 60 s)


class SharedWorld:
    """Lazy ``World``s of ``n`` ranks running ``names`` ("module:check") in order: ``n``
    processes, or one process running each check in a simulated world of ``n``
    (``simulated``). A world ends at its first failing check; a check that did not get
    to run then runs in a new world together with the checks after it (so one failure
    does not fail the rest of the session)."""

    def __init__(self, n: int, simulated: bool, names: list):
        self.n, self.simulated, self.names = n, simulated, names
        self.world: World | None = None

    def start(self, names: list) -> World:
        return World(self.n, "mp", names, timeout=CHECK_TIMEOUT, lazy=True,
                     simulated=self.simulated)

    def check(self, name: str) -> None:
        w = self.world
        if w is None or name not in w.done or (w.errors and name not in w.errors
                                               and w.done[name] != self.n):
            if w is not None:
                w.close()
            w = self.world = self.start(self.names[self.names.index(name):])
        w.check(name)

    def wait(self) -> None:
        """Let the current world run its remaining checks (until done or an error)."""
        if self.world is not None:
            self.world.wait()

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


_SHARED: dict = {}          # (n, simulated) -> SharedWorld
_STARTER: dict = {}         # simulated -> the thread starting that chain's worlds, while it runs


def _world_of(item) -> tuple | None:
    """(n, simulated) of the session world that ``item`` checks in; None for a test
    that is not a world's."""
    function = getattr(item, "function", None)
    n = getattr(function, "shared_world", None)
    if not n:
        return None
    return n, item.callspec.params["name"] not in function.in_processes


def _world_names(items, key: tuple) -> list:
    """The checks ("module:check") that the selected ``items`` run in the world ``key``."""
    names = []
    for item in items:
        if _world_of(item) == key:
            name = f"{item.module.__name__}:{item.callspec.params['name']}"
            if name not in names:
                names.append(name)
    return names


def order_world_tests_last(items: list) -> None:
    """Put the shared worlds' tests after every other test (the simulated worlds' first,
    then those of processes, by size), in their order otherwise: the worlds then run
    behind the other tests, which leave cores idle while they wait for launched jobs,
    and their tests find them done. The examples' runs (several processes each, busy
    the whole time) go just before them: they then fill both cores once the worlds are
    done, where a test that waits or runs in one process would leave one idle."""
    def key(item):
        world = _world_of(item)
        return (_start_order(world) if world else (0, 0), world is None and _runs_examples(item))
    items.sort(key=key)


def _start_order(key: tuple) -> tuple:
    """Simulated worlds first (one process: a core stays free for the other tests),
    then the worlds of processes, smaller first."""
    n, simulated = key
    return (1 if simulated else 2, n)


def _runs_examples(item) -> bool:
    from pathlib import Path
    return Path(str(item.fspath)).parent.name == "examples"


def start_shared_worlds(items: list) -> None:
    """Run the session's worlds in the background from now on, in two chains side by
    side: the simulated worlds one after another (one process: one core), and the
    worlds of processes one after another (the world of 4 already oversubscribes two
    cores). The first test of a world takes it over (``_shared_world``)."""
    import threading

    keys = sorted({key for key in map(_world_of, items) if key}, key=_start_order)

    def run(chain: list):
        for k, key in enumerate(chain):
            world = _SHARED[key] = SharedWorld(*key, _world_names(items, key))
            world.world = world.start(world.names)
            if k + 1 < len(chain):
                world.wait()

    for simulated in (True, False):
        chain = [key for key in keys if key[1] == simulated]
        if chain:
            starter = threading.Thread(target=run, args=(chain,), daemon=True,
                                       name=f"shared-worlds-{'simulated' if simulated else 'processes'}")
            _STARTER[simulated] = starter
            starter.start()


def close_shared_worlds() -> None:
    """End the session's worlds (at the end of the session, also an interrupted one)."""
    while _STARTER:
        starter = _STARTER.popitem()[1]
        for world in list(_SHARED.values()):     # a world still running ends at once
            if world.world is not None and starter.is_alive():
                world.world.kill()
        starter.join()
    while _SHARED:
        _SHARED.popitem()[1].close()


def _shared_world(key: tuple, request) -> SharedWorld:
    """The session's world ``key`` (started in the background, or made now for every
    check that the session selected in it). One world of a chain runs at a time: the
    others of its chain first finish what they run (their results wait for their
    tests)."""
    if key[1] in _STARTER:
        _STARTER.pop(key[1]).join()
    for other_key, other in list(_SHARED.items()):
        if other_key != key and other_key[1] == key[1]:
            other.wait()
    if key not in _SHARED:
        _SHARED[key] = SharedWorld(*key, _world_names(request.session.items, key))
    return _SHARED[key]


def world_test(module: str, n: int, names: list, in_processes=()):
    """A test parametrized over ``names`` (functions of ``module``), each run on every
    rank of the session's world of ``n``, marked ``multiprocess``: a simulated world
    (every rank a thread of one process, ``gt.testing.simulated_world``: the same
    dispatch, boxing, autograd and checkpoint code on one core, without the processes'
    start and sockets), except the checks named in ``in_processes``, which need processes
    (torch.compile, the profiler, gloo itself, a timeout inside a collective: the
    limits in ``globaltensor/simulated.py``) and run in a world of ``n`` processes.
    Checks must leave no state behind that a later check could see (they share the
    processes with other files' checks). The ranks of a simulated world share one
    process: a check that changes a module's value for a while does it with ``patched``,
    and one whose ranks would each change it their own way (a counter per rank) runs
    in processes."""
    import pytest

    unknown = set(in_processes) - set(names)
    if unknown:
        raise ValueError(f"in_processes names checks that {module} does not run: {unknown}")

    # the test that starts a world first waits for the other worlds' remaining checks;
    # hangs are bounded per check (CHECK_TIMEOUT, collectives sooner)
    @pytest.mark.multiprocess
    @pytest.mark.timeout(1800)
    @pytest.mark.parametrize("name", list(names))
    def test(name, request):
        _shared_world((n, name not in test.in_processes), request).check(f"{module}:{name}")

    test.shared_world = n
    test.in_processes = frozenset(in_processes)
    return test


def checks_in_worlds(module: str, checks, only_in_4=(), only_in_2=(), in_processes=()):
    """Tests running ``checks`` (names of functions in ``module``) in the session's
    world of 2 and world of 4; ``only_in_4`` need 4 ranks, ``only_in_2`` learn nothing
    more from 4 (a measurement that costs time on the oversubscribed world);
    ``in_processes``: those that need processes (``world_test``). Use as
    ``test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)``."""
    two, four = list(checks) + list(only_in_2), list(checks) + list(only_in_4)
    return (world_test(module, 2, two, [c for c in in_processes if c in two]),
            world_test(module, 4, four, [c for c in in_processes if c in four]))


_PATCHES: dict = {}   # (id(target), name) -> [ranks inside, the value before]
_PATCHES_LOCK = threading.Lock()


@contextlib.contextmanager
def patched(target, name: str, value):
    """``target.name`` (``target[name]`` where ``target`` is a dict) is ``value`` while
    the block runs, as one change for the whole world: the ranks of a simulated world
    share the process, so the first rank in sets it and the last one out puts it back.
    (Each rank's own save and restore would put the old value back under a rank still
    inside, and the second rank in would save the first's value and leave it behind.)
    Every rank must set the same value. In a world of processes, a plain patch."""
    key = id(target), name
    get, put = ((target.__getitem__, target.__setitem__) if isinstance(target, dict) else
                (lambda n: getattr(target, n), lambda n, v: setattr(target, n, v)))
    with _PATCHES_LOCK:
        inside = _PATCHES.setdefault(key, [0, None])
        if inside[0] == 0:
            inside[1] = get(name)
            put(name, value)
        elif get(name) != value:
            raise AssertionError(f"ranks patch {name} with different values")
        inside[0] += 1
    try:
        yield
    finally:
        with _PATCHES_LOCK:
            inside[0] -= 1
            if inside[0] == 0:
                put(name, inside[1])
                del _PATCHES[key]


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

