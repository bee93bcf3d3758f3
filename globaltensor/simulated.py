"""Simulated worlds: an SPMD function run as n ranks in this one process
(``gt.testing.simulated_world``).

Each rank is a thread with its own default process group, on which collectives run in
memory (``comm/simulated.py``). The ranks take turns: one runs at a time and hands the
turn on only where it waits for the others (a collective, a receive, a store wait).
At every turn the rank's own state is put in place: what globaltensor keeps per rank
(``PER_RANK``: the modes and the planner's steps, comm's groups, meetings and
counters, the decision cache, gradient sync, the random counters), torch's default
generator and its environment variables (the launcher's and globaltensor's, ``_ENV``).
So a program runs through the same dispatch, boxing, autograd, gradient sync and
checkpoint code as in a world of processes, the same way every time, and a debugger
steps through any rank in one Python process.
Caches that do not depend on the rank (boxing plans, layouts, rules, each decision's
choice of layouts, the planner's solved steps) are shared.

Limits (what needs real processes): the launcher, faults and restarts, gloo and NCCL
themselves, timeouts inside a collective (a rank that never comes ends the world after
``timeout`` seconds), CUDA placements, ``torch.compile`` (dynamo's cache is shared by
the threads, so a graph compiled on one rank would serve another), the parameter
servers (RPC), the torch profiler (one session per process: a second rank's crashes
it), DTensor's all-gather of uneven parts, and anything a program does with its process
(``os.getpid``, files named by rank are fine).

>>> import globaltensor as gt                                        # doctest: +SKIP
>>> def step():
...     p = gt.placement("cpu", ranks=[0, 1])
...     x = gt.ones(4, 2, placement=p, sbp=gt.sbp.split(0))
...     return x.to_global(sbp=gt.sbp.broadcast).to_local().sum().item()
>>> gt.testing.simulated_world(2)(step)
[8.0, 8.0]
"""
from __future__ import annotations

import importlib
import os
import re
import threading
import time
from typing import Callable

import torch

from . import comm, env, modes
from .propagation import cache as decisions

# What globaltensor keeps per rank: module -> {name: fresh value (made from the module)}.
PER_RANK: dict[str, dict[str, Callable]] = {
    "globaltensor.comm.collectives": {"_rank": lambda m: None},
    "globaltensor.comm.groups": {"_groups": lambda m: {}, "_ready": lambda m: False,
                                 "_device_backends": lambda m: {},
                                 "_local_devices": lambda m: {},
                                 "_cuda_via_gloo_why": lambda m: "",
                                 "_priced_as": lambda m: {}},
    "globaltensor.comm.guard": {"_doing": lambda m: [], "_claims": lambda m: {}},
    "globaltensor.comm.meet": {"_round": lambda m: {}, "_cleaned": lambda m: {},
                               "_met": lambda m: {}},
    "globaltensor.comm.stats": {"_active": lambda m: [], "_dry": lambda m: 0},
    "globaltensor.modes": {"_stack": lambda m: [], "active": lambda m: None,
                           "checking": lambda m: False, "implicit": lambda m: False},
    "globaltensor.planner.record": {"state": lambda m: m.StepState(),
                                    "STEP": lambda m: m.StepMode(),
                                    "WATCH": lambda m: m.FunctionalSteps()},
    "globaltensor.origins": {"_DEBUG": lambda m: m.Checking()},
    "globaltensor.gradsync": {"_sync": lambda m: True, "_serial": lambda m: 0,
                              "_pending": lambda m: None, "_kept_grads": lambda m: [],
                              "_last_order": lambda m: [], "_decided_task": lambda m: -1},
    "globaltensor.random": {"_seed": lambda m: m._DEFAULT_SEED, "_draw": lambda m: 0},
    "globaltensor.propagation.cache": {"_cache": lambda m: {}, "_by_value": lambda m: {}},
    "globaltensor.explicit_mode": {"_lines": lambda m: [], "_written": lambda m: 0},
    "globaltensor.nn.module": {"_scopes": lambda m: []},
    "globaltensor.rules.losses": {"_targets_checked": lambda m: False},
    "globaltensor.interop.dtensor": {"_meshes": lambda m: {}},
    "globaltensor.boxing.run": {"_observers": lambda m: []},
    "globaltensor.boxing.reuse": {"_kept": lambda m: []},
    "globaltensor.retrace": {"_pending": lambda m: None},
    "globaltensor.comm.fingerprint": {"_seq": lambda m: {}, "_pairs": lambda m: {},
                                      "_rank": lambda m: None},
    "globaltensor.heap": {"faulting": lambda m: False},
}
# A rank's own variables, as a process's are: the launcher's, and every GLOBALTENSOR_
# knob (a rank that sets one for itself, as a test setting a read timeout does, sets it
# for itself only; shared, another rank leaving its block would put it back under it).
_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK") + tuple(env.VARIABLES)


def _modules() -> dict:
    found = {}
    for name in PER_RANK:
        try:
            found[name] = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return found


# os.environ.get of an unset variable raises and catches a KeyError: reading the rank's
# variables that way took half of each turn's hand-over. CPython keeps the encoded table.
_ENCODED = tuple((k, os.environ.encodekey(k)) for k in _ENV) if hasattr(os.environ, "_data") \
    else ()


def _environ() -> dict:
    """The variables of ``_ENV`` as they are now (None: unset)."""
    if not _ENCODED:
        return {k: os.environ.get(k) for k in _ENV}
    data, decode = os.environ._data, os.environ.decodevalue
    return {k: None if (v := data.get(e)) is None else decode(v) for k, e in _ENCODED}


class _Ranks:
    """Each rank's saved state (and the caller's, as rank -1), swapped at every turn."""

    def __init__(self, n: int):
        self.mods = _modules()
        self.attrs = [(self.mods[name], attr) for name, attrs in PER_RANK.items()
                      if name in self.mods for attr in attrs]
        self.saved: dict[int, tuple] = {-1: self._current()}
        rng, inherited = torch.get_rng_state(), self.saved[-1][2]
        for rank in range(n):   # every rank starts as a process would: fresh state, the
            fresh = [PER_RANK[m.__name__][attr](m) for m, attr in self.attrs]   # caller's
            self.saved[rank] = (fresh, rng.clone(), {                         # environment
                **inherited, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)})

    def _current(self) -> tuple:
        return [getattr(m, attr) for m, attr in self.attrs], torch.get_rng_state(), _environ()

    def swap_out(self, rank: int) -> None:
        self.saved[rank] = self._current()

    def swap_in(self, rank: int) -> None:
        values, rng, environ = self.saved[rank]
        for (module, attr), value in zip(self.attrs, values):
            setattr(module, attr, value)
        torch.set_rng_state(rng)
        now = _environ()
        for key, value in environ.items():
            if now[key] == value:   # (a change of os.environ costs a putenv)
                continue
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def value(self, rank: int, module: str, attr: str):
        """The saved value of ``module.attr`` for ``rank``."""
        return self.saved[rank][0][self.attrs.index((self.mods[module], attr))]


def _sim():
    """``comm/simulated.py``, imported with the first simulated rank: it builds on torch's
    threaded process group, whose import registers a "threaded" backend with torch, which
    a program that simulates nothing must not find (importing globaltensor changes
    nothing of torch's: docs/torch_changes.md)."""
    from .comm import simulated
    return simulated


_NOTE = "(rank {rank} of a simulated world of {n})"   # on the error that ended a world
_NOTE_READ = re.compile(re.escape(_NOTE).replace(r"\{rank\}", r"(\d+)").replace(r"\{n\}", r"\d+") + "$")


def simulated_world(n: int, timeout: float | None = None) -> Callable:
    """``simulated_world(n)(fn, *args, **kwargs)`` runs ``fn`` as ``n`` ranks in this
    one process (module docstring) and returns their results as a list, rank by rank.
    A rank that raises ends the world: its exception is raised here, with a note naming
    the rank; a world still running after ``timeout`` seconds (default
    GLOBALTENSOR_TIMEOUT) raises ``TimeoutError`` naming what each rank was doing.

    >>> gt.testing.simulated_world(4)(train_step, batch)     # doctest: +SKIP
    """
    if n < 1:
        raise ValueError(f"simulated_world needs at least one rank, not {n}")
    limit = env.timeout_seconds() if timeout is None else float(timeout)

    def run(fn: Callable, *args, **kwargs) -> list:
        sim = _sim()
        ranks = _Ranks(n)
        turns = sim.Turns(n, ranks.swap_in, ranks.swap_out, limit)
        results, errors = [None] * n, {}
        store = sim.new_store(limit)
        ranks.swap_out(-1)     # the caller's state (and variables) come back at the end
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)   # one rank runs at a time: its ops need no pool
        decisions.share_choices(True)
        try:
            with sim.world(turns):
                threads = [threading.Thread(target=_rank_main, name=f"simulated rank {r}",
                                            args=(r, n, turns, store, limit, fn, args, kwargs,
                                                  results, errors), daemon=True)
                           for r in range(n)]
                for t in threads:
                    t.start()
                _join(threads, turns, ranks, limit)
        finally:
            ranks.swap_in(-1)
            torch.set_num_threads(threads_before)
            decisions.share_choices(False)
        if not errors and turns.stopped is not None:   # past the timeout
            raise turns.stopped
        if errors:
            rank = min(errors)
            error = errors[rank]
            error.add_note(_NOTE.format(rank=rank, n=n))
            raise error
        return results

    return run


def failing_rank(error: BaseException) -> int | None:
    """The rank whose error ended a simulated world (named in the note ``simulated_world``
    adds to it); None for an error without one (a timeout)."""
    for note in getattr(error, "__notes__", ()):
        found = _NOTE_READ.match(note)
        if found:
            return int(found.group(1))
    return None


def _rank_main(rank: int, n: int, turns, store, limit: float, fn, args, kwargs, results,
               errors) -> None:
    sim = _sim()
    try:
        turns.take(rank)
    except sim.WorldStopped:
        return
    try:
        modes.reset()          # the modes a program starts with, this rank's own
        sim.init_rank(rank, n, store, limit)
        results[rank] = fn(*args, **kwargs)
        comm.finish()          # every rank gets here before the groups go
    except BaseException as e:  # noqa: BLE001  (the first is raised by the caller)
        if turns.stopped is None:   # the error that ends the world (the others follow it)
            errors[rank] = e if isinstance(e, Exception) else RuntimeError(str(e))
            turns.stop(e)
    finally:
        try:
            sim.end_rank()
        finally:
            if turns.holder == rank:   # (a rank stopped while waiting holds no turn)
                turns.give(rank)


def _join(threads: list, turns, ranks: _Ranks, limit: float) -> None:
    """Wait for every rank; past ``limit`` seconds, stop the world naming each rank's
    work (its saved ``comm.guard._doing``)."""
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        turns.put_away()   # the state in place is saved as its rank's, to be read here
        doing = []
        for rank in range(len(threads)):
            work = ranks.value(rank, "globaltensor.comm.guard", "_doing") or []
            doing.append(f"rank {rank}: {' <- '.join(map(str, reversed(work))) or 'its own code'}")
        turns.stop(TimeoutError(f"a simulated world of {len(threads)} ranks ran past "
                                f"{limit:g} s; " + "; ".join(doing)))
        for t in threads:
            t.join(5)


def run_as_rank(world: int, rank: int, fn: Callable, *args, local_world: int | None = None,
                backend: str = "gloo"):
    """``fn(*args)`` run as rank ``rank`` of a world of ``world`` processes that do not
    exist (``gt.debug.simulate_step``): in a thread of its own on torch's fake process
    group (collectives return at once; run them dry), with fresh globaltensor state and
    RANK variables as that rank's; the caller's state and world come back after.
    ``local_world``: ranks per node (LOCAL_WORLD_SIZE; default: all of them);
    ``backend``: what its cpu collectives are priced as (``sim.init_fake_rank``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of a world of {world}")
    local = world if local_world is None else local_world
    sim, ranks = _sim(), _Ranks(1)
    ranks.saved[0][2].update(RANK=str(rank), LOCAL_RANK=str(rank % local),
                             GROUP_RANK=str(rank // local), WORLD_SIZE=str(world),
                             LOCAL_WORLD_SIZE=str(local))
    result, errors = [None], []

    def main() -> None:
        try:
            sim.init_fake_rank(rank, world, backend)
            try:
                result[0] = fn(*args)
            finally:
                sim.end_rank()
        except BaseException as e:  # noqa: BLE001  (raised in the caller's thread)
            errors.append(e)

    ranks.swap_out(-1)   # (its variables too: WORLD_SIZE comes back with them)
    try:
        ranks.swap_in(0)
        with sim.thread_worlds():
            thread = threading.Thread(target=main, name=f"simulated rank {rank} of {world}")
            thread.start()
            thread.join()
    finally:
        ranks.swap_in(-1)
    if errors:
        raise errors[0]
    return result[0]
