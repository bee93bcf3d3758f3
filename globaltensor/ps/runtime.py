"""Roles, start-up and shut-down of a parameter-server job.

The launcher (``--server_num S --worker_num W``) starts S + W processes running one
script and tells each its role in ``GLOBALTENSOR_PS_ROLE`` / ``GLOBALTENSOR_PS_RANK``:
global ranks ``0..W-1`` are workers, ``W..W+S-1`` servers. ``init`` joins every
process to the default process group (the workers' dense data parallelism uses a
members-only group of the workers from it) and to the RPC world (pulls and pushes).

Example (the whole script; every process runs it)::

    import globaltensor as gt
    gt.ps.init(gt.ps.Strategy(mode="sync"))
    if gt.ps.is_server():
        gt.ps.run_server()          # serves until every worker is done
    else:
        table = gt.ps.EmbeddingTable(100_000, 16, optimizer="adagrad", lr=0.05)
        ...                         # train; see globaltensor.ps
        gt.ps.stop_worker()         # also called at exit
"""
from __future__ import annotations

import atexit
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .. import comm, env
from ..comm import rpc
from . import server

__all__ = ["Strategy", "init", "is_server", "is_worker", "run_server", "stop_worker",
           "worker_rank", "server_rank", "worker_num", "server_num", "MODES", "ServerError", "worker_group"]

MODES = ("sync", "async", "geo")


@dataclass(frozen=True)
class Strategy:
    """How workers and servers combine updates.

    - ``sync``: every step, the servers apply the mean of all workers' gradients
      once, before any worker's next pull (equals one process training on the global
      batch); dense parameters are all-reduced among the workers.
    - ``async``: servers apply each push when it arrives; workers never wait for each
      other (dense parameters live on the servers too).
    - ``geo``: each worker trains a local copy of the rows it touched (and of the dense
      parameters) and every ``k_steps`` steps pushes the change since its last pull,
      then pulls fresh values.

    >>> Strategy(mode="geo", k_steps=10).k_steps
    10
    """

    mode: str = "sync"
    k_steps: int = 10

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.k_steps, int) or self.k_steps < 1:
            raise ValueError(f"k_steps must be an int >= 1, got {self.k_steps!r}")


class _State:
    def __init__(self) -> None:
        self.strategy: Optional[Strategy] = None
        self.role = ""
        self.rank = self.servers = self.workers = 0
        self.stopped = self.failed = False
        self.tables: list = []         # this worker's tables, in creation order
        self.optimizers: list = []     # this worker's dense optimizers
        self.pending: list = []        # Calls (pushes) not yet answered


state = _State()


def _env_int(name: str) -> int:
    value = env.ps_count(name)
    if value is None:
        raise RuntimeError(f"GLOBALTENSOR_PS_{name} is not set: this is not a parameter-server "
                           f"job (start it with python -m globaltensor.launch --server_num S "
                           f"--worker_num W)")
    return value


def init(strategy: Optional[Strategy] = None) -> None:
    """Join the job as the role the launcher gave this process (blocks until all joined).

    Every process must call it, with the same strategy.
    """
    if state.strategy is not None:
        return
    strategy = strategy or Strategy()
    role = env.ps_role()
    if role not in ("server", "worker"):
        raise RuntimeError(f"GLOBALTENSOR_PS_ROLE is {role!r}: this is not a parameter-server job "
                           f"(start it with python -m globaltensor.launch --server_num S --worker_num W)")
    state.role, state.rank = role, _env_int("RANK")
    state.servers = _env_int("SERVER_NUM")
    state.workers = _env_int("WORKER_NUM")
    comm.init()  # the default group of all processes; the workers' dense sync splits from it
    world = state.servers + state.workers
    if comm.get_world_size() != world:
        raise RuntimeError(f"world of {comm.get_world_size()} processes, but {state.servers} "
                           f"servers + {state.workers} workers")
    if role == "server":
        server.configure(state.rank, state.servers, state.workers)
    # A server answers every worker from its RPC threads; sync pushes do not hold one.
    rpc.init(comm.get_rank(), world, threads=max(8, 2 * state.workers + 2))
    state.strategy = strategy
    if role == "worker":
        _watch_failures()
        atexit.register(_at_exit)  # runs before comm's group teardown (registered earlier)


def _watch_failures() -> None:
    """Note an uncaught exception (the launcher's worker bootstrap and plain Python both
    report it through sys.excepthook before exiting): a failed worker must not wait at
    exit for its peers to finish, or the launcher would learn of the failure late."""
    previous = sys.excepthook
    if env.under_launcher():
        # Under our launcher, skip torch.distributed's "[rankN]: " wrapper as the
        # launcher's bootstrap does: the launcher prefixes every line already.
        # (torch's wrapper keeps the hook it replaced in its closure as ``old_hook``; a
        # torch that names it otherwise keeps its wrapper: a doubled prefix, no failure)
        while getattr(previous, "__name__", "") == "_distributed_excepthook":
            cells = dict(zip(previous.__code__.co_freevars, previous.__closure__ or ()))
            if "old_hook" not in cells:
                break
            previous = cells["old_hook"].cell_contents

    def hook(*args):  # type: ignore[no-untyped-def]
        state.failed = True
        previous(*args)

    sys.excepthook = hook


def _at_exit() -> None:
    if state.failed and not state.stopped:
        state.stopped = True
        rpc.shutdown(graceful=False)  # the launcher stops the others
        return
    stop_worker()


def _need_init() -> None:
    if state.strategy is None:
        raise RuntimeError("call gt.ps.init(strategy) first")


def is_server() -> bool:
    """True in a server process (after ``init``, or from the launcher's variables)."""
    return (state.role or env.ps_role()) == "server"


def is_worker() -> bool:
    """True in a worker process."""
    return (state.role or env.ps_role()) == "worker"


def worker_rank() -> int:
    """This worker's rank among the workers (0..worker_num()-1)."""
    _need_init()
    if state.role != "worker":
        raise RuntimeError("worker_rank() in a server process")
    return state.rank


def server_rank() -> int:
    """This server's rank among the servers (0..server_num()-1)."""
    _need_init()
    if state.role != "server":
        raise RuntimeError("server_rank() in a worker process")
    return state.rank


def worker_num() -> int:
    _need_init()
    return state.workers


def server_num() -> int:
    _need_init()
    return state.servers


def worker_group():  # type: ignore[no-untyped-def]
    """The process group of the workers (global ranks ``0..W-1``, the same ranks in the
    group): pass it to ``dcp.save`` / ``dcp.load`` (``process_group=``), whose
    collectives the servers take no part in.

    Example (in every worker)::

        dcp.save({"model": model_sd}, checkpoint_id=path, process_group=gt.ps.worker_group())
    """
    _need_init()
    if state.role != "worker":
        raise RuntimeError("worker_group() in a server process")
    return comm.get_group(tuple(range(state.workers)))


def server_rank_of(server: int) -> int:
    """Global rank of server ``server`` (servers follow the workers)."""
    return state.workers + server


def run_server() -> None:
    """Serve table shards until every worker called ``stop_worker`` (or exited), then
    leave. Call it in server processes after ``init``."""
    _need_init()
    if state.role != "server":
        raise RuntimeError("run_server() in a worker process")
    server.serve()
    rpc.shutdown(graceful=True)


class ServerError(RuntimeError):
    """A server could not be reached or failed while serving a call (it died, or its
    connection broke): names the server and the table."""


@dataclass(frozen=True)
class Call:
    """A call in flight to ``server`` (its rank among the servers) about ``table``."""

    server: int
    table: str
    what: str
    future: Any

    @staticmethod
    def start(server: int, table: str, what: str, fn: Any, args: Sequence[Any]) -> "Call":
        return Call(server, table, what, rpc.call_async(server_rank_of(server), fn, args))


def _remote_message(error: BaseException) -> str:
    # RPC re-raises a server's exception as "On WorkerInfo(...):\nValueError('msg')\nTraceback..."
    text = str(error)
    m = re.search(r"^\w+\((['\"])(.*?)\1\)$", text, re.M | re.S)
    return m.group(2) if m else " ".join(text.split("Traceback")[0].split())


def wait_calls(calls: Sequence[Call]) -> list:
    """Results of ``calls``; the first failure is raised naming its server and table:
    ``ValueError`` when the server refused the call, ``ServerError`` when the server
    is gone (TensorPipe's EOF / connection reset / timeout name no server)."""
    results = []
    for c in calls:
        try:
            result = c.future.wait()
            if isinstance(result, server.Refusal):
                raise ValueError(result.message)
            results.append(result)
        except ValueError as e:
            raise ValueError(f"server {c.server} (rank {server_rank_of(c.server)}) refused the "
                             f"{c.what} of table {c.table!r}: {_remote_message(e)}") from None
        except Exception as e:
            raise ServerError(
                f"server {c.server} (rank {server_rank_of(c.server)}) failed during the {c.what} "
                f"of table {c.table!r}: it is unreachable (died or closed its connection; see "
                f"its log serverlog.{c.server}): {' '.join(str(e).split())[:300]}") from None
    return results


def wait_pending() -> None:
    """Wait for this worker's pushes still in flight (raising the first failure)."""
    pending, state.pending = state.pending, []
    wait_calls(pending)


def stop_worker() -> None:
    """Finish this worker: push what geo mode still holds, wait for pushes in flight,
    tell the servers, leave the RPC world. Idempotent; also runs at exit."""
    if state.role != "worker" or state.stopped or state.strategy is None:
        return
    state.stopped = True
    try:
        if state.strategy.mode == "geo":
            for owner in state.tables + state.optimizers:
                owner.flush()
        wait_pending()
    finally:
        # Tell every server even after a failure: they must not serve forever.
        wait_calls([Call.start(s, "-", "end of the worker", server.worker_done, (state.rank,))
                    for s in range(state.servers)])
        rpc.shutdown(graceful=True)
