"""Start one worker process per device: a thin layer over ``torch.distributed.elastic``.

The elastic agent behind ``torchrun`` (``torch.distributed.launcher.api``) does the
real work: it spawns the workers, sets RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them and stops the rest when
one fails. This module adds a Paddle-style front end on top of it: a start banner,
one ``<log_dir>/workerlog.<global rank>`` file per rank (stdout and stderr
combined, also echoed to the console as ``[rank<N>]: ...``) in a directory of the
job's own (``log/<run id>/`` by default, see ``globaltensor.launch_logs``), and a short
failure summary that names the rank that caused the failure instead of a traceback.
``--standalone`` and ``--nproc_per_node auto`` mean what they mean to torchrun.

What it adds to the agent, and why:

- the rendezvous store (a TCPStore on node 0) listens on ``--master_addr`` only
  (loopback by default), not on every interface: anyone who reaches the store can
  write into the job;
- nodes wait for each other for ``--rdzv_timeout`` seconds, saying what they wait for;
- workers die with the launcher (Linux parent-death signal), even when it is SIGKILLed;
- a worker stopped by the launcher prints where it was (``faulthandler``), so a hung
  rank shows up as the hung rank, not as its peer's failure;
- log files are opened without following symbolic links, and a job locks its log
  directory: a second job started there is refused instead of truncating the logs;
- when a worker fails, the others get ``FAILURE_GRACE_S`` to end on their own before
  they are stopped, so ranks that fail together (a bad config) are all reported as
  failed, with their exit codes, instead of as stopped by the launcher.

Parameter-server jobs (``--server_num S --worker_num W``, one node): S + W processes
run the same script; global ranks ``0..W-1`` are the workers and ``W..W+S-1`` the
servers. Each process finds its role in ``GLOBALTENSOR_PS_ROLE`` (``server`` or
``worker``) and its rank within the role in ``GLOBALTENSOR_PS_RANK``
(``GLOBALTENSOR_PS_SERVER_NUM`` / ``GLOBALTENSOR_PS_WORKER_NUM`` hold the counts; see
``globaltensor.ps``). Logs are ``serverlog.<N>`` and ``workerlog.<N>`` by role rank, and
the failure summary names the role: ``server 1 (rank 3) exited with code 1``. Servers
end when every worker has said it is done (``gt.ps.run_server`` returns), so a job
whose workers all finish exits 0.

Example::

    python -m globaltensor.launch --nproc_per_node 4 train.py --lr 0.1
    python -m globaltensor.launch --standalone --nproc_per_node auto train.py
    python -m globaltensor.launch --server_num 2 --worker_num 2 train.py
    # two machines, run once on each (node_rank 0 hosts the rendezvous store):
    python -m globaltensor.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr NODE0_ADDR --master_port 29500 train.py
"""

from __future__ import annotations

import argparse
import datetime
import errno
import logging
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn, Optional, Sequence

from .launch_logs import (DEFAULT_LOG_ROOT, LATEST_LINK, LaunchError, lock_log_dir, make_logs_specs, new_run_dir,
                          read_log, worker_log)
from .launch_logs import log_name as _log_name  # noqa: F401  (tests/test_ps.py checks the names here)

__all__ = ["main", "parse_args"]

# How often the agent polls its workers. Small, so that one rank dying while the
# others block in a collective ends the job promptly.
MONITOR_INTERVAL_S = 0.2
FAILURE_GRACE_S = 1.0
LOG_TAIL_LINES = 20
# Same id on every node: the rendezvous prefixes its TCPStore keys with it.
RUN_ID = "globaltensor"
# Our rendezvous backend's name in torch's handler registry (see _Rendezvous).
RDZV_BACKEND = "globaltensor-static"
_STOPPED_BY_AGENT = {-signal.SIGTERM, -signal.SIGKILL}

# The worker process: ``python -u -c _WORKER_BOOT [-m] target args``. It prepares the
# process, then runs the target in it as ``python [-m] target args`` would. Kept free of
# "$": the agent runs string.Template over worker arguments.
_WORKER_BOOT = r"""
import os, sys

def _boot():
    import faulthandler, runpy, signal, traceback
    if sys.platform.startswith("linux"):
        # Die with the launcher, even when it is SIGKILLed: no orphaned workers.
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != int(os.environ["GLOBALTENSOR_LAUNCHER_PID"]):
            os._exit(1)  # the launcher died before prctl took effect
    os.dup2(1, 2)  # one log per rank, stdout and stderr in the order written
    # When the launcher stops this rank (a peer failed), print where it was: a rank
    # stuck outside a collective is then visible. chain=True still terminates.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))
    workers = os.environ.get("GLOBALTENSOR_PS_WORKER_NUM")
    if workers is not None:  # a parameter-server job: ranks below W are the workers
        rank, workers = int(os.environ["RANK"]), int(workers)
        os.environ["GLOBALTENSOR_PS_ROLE"] = "worker" if rank < workers else "server"
        os.environ["GLOBALTENSOR_PS_RANK"] = str(rank if rank < workers else rank - workers)
    as_module = sys.argv[1] == "-m"
    target = sys.argv[2] if as_module else sys.argv[1]
    sys.argv = sys.argv[2:] if as_module else sys.argv[1:]
    try:
        if as_module:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        # torch.distributed wraps sys.excepthook to prefix "[rankN]: "; the launcher
        # prefixes console lines already, so print through the hook it wrapped.
        hook = sys.excepthook
        while getattr(hook, "__name__", "") == "_distributed_excepthook":
            cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
            hook = cells["old_hook"].cell_contents
        tb = e.__traceback__  # without this bootstrap's and runpy's frames
        while tb is not None and (tb.tb_frame.f_code.co_filename == "<string>"
                                  or tb.tb_frame.f_globals.get("__name__") == "runpy"):
            tb = tb.tb_next
        hook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)

_boot()
"""


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m globaltensor.launch",
        description="Launch a distributed globaltensor/torch.distributed job "
        "(one process per local rank) via torch.distributed.elastic.",
        allow_abbrev=False,  # never swallow a script option as an abbreviation
    )

    def opt(name: str, **kw: Any) -> None:
        # Accept both --snake_case and --kebab-case, like torchrun.
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        p.add_argument(*spellings, dest=name, **kw)

    opt("nproc_per_node", default=None,
        help="worker processes on this node: a number, or as torchrun auto (one per GPU, else one "
             "per CPU core), cpu, gpu (default 1)")
    opt("server_num", type=int, default=None,
        help="parameter-server job: number of server processes (with --worker_num; one node)")
    opt("worker_num", type=int, default=None,
        help="parameter-server job: number of worker processes (with --server_num)")
    opt("nnodes", type=int, default=1, help="number of nodes (default 1)")
    opt("node_rank", type=int, default=0, help="rank of this node, 0..nnodes-1 (default 0)")
    opt("master_addr", default=None,
        help="address of node 0; its rendezvous store listens there only (default 127.0.0.1)")
    opt("master_port", type=int, default=None, help="port of the rendezvous store on node 0 (default 29500)")
    p.add_argument("--standalone", action="store_true",
                   help="one node, rendezvous on a free local port (as torchrun; overrides --master_addr/port)")
    opt("log_dir", default=None,
        help=f"directory for the workerlog.<rank> files; only one job at a time may write into it "
             f"(default: a new {DEFAULT_LOG_ROOT}/<run id>/ per job, {DEFAULT_LOG_ROOT}/{LATEST_LINK} links to it)")
    opt("max_restarts", type=int, default=0, help="restarts of the worker group before giving up (default 0)")
    opt("rdzv_timeout", type=float, default=None,
        help="seconds to wait for the other nodes (default: GLOBALTENSOR_TIMEOUT, else 300)")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module, like python -m")
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("script", nargs="?", help="script path (or module name with -m)")
    # Only for --help: parse_args() hands everything after the script over untouched.
    p.add_argument("script_args", nargs="*", help="arguments for the script (even ones like --nnodes)")
    return p


def _version_line() -> str:
    import torch

    from . import __version__
    return f"globaltensor {__version__} (torch {torch.__version__})"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line; exits with a one-line message if invalid.

    >>> parse_args(["--nproc_per_node", "2", "train.py", "--lr", "0.1"]).script_args
    ['--lr', '0.1']
    """
    from .env import timeout_seconds

    argv = list(sys.argv[1:] if argv is None else argv)
    # Split off the script ourselves: argparse's REMAINDER drops a "--" the script
    # may expect. Every launcher option takes one value, except these flags.
    flags = {"-m", "--module", "-h", "--help", "--version", "--standalone"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 1 if ("=" in argv[i] or argv[i] in flags) else 2
    i += argv[i:i + 1] == ["--"]  # "launch [opts] -- script.py": skip the separator
    args = _build_parser().parse_args(argv[:i + 1])
    args.script_args = argv[i + 1:]
    args.nproc_per_node = _local_world_size(args.nproc_per_node)
    _set_master_endpoint(args)
    if args.rdzv_timeout is None:
        try:
            args.rdzv_timeout = timeout_seconds()
        except ValueError as e:
            _fail(str(e))
    _set_ps_roles(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = 1
    log_dir = DEFAULT_LOG_ROOT if args.log_dir is None else args.log_dir  # the default's parent
    problems = [
        (args.script is None, "no script given (usage: python -m globaltensor.launch [options] script.py [args])"),
        (args.nproc_per_node < 1, f"--nproc_per_node must be >= 1, got {args.nproc_per_node}"),
        (args.nnodes < 1, f"--nnodes must be >= 1, got {args.nnodes}"),
        (not 0 <= args.node_rank < args.nnodes,
         f"--node_rank must be in [0, {args.nnodes}), got {args.node_rank}"),
        (not args.standalone and not 1 <= args.master_port <= 65535,
         f"--master_port must be in 1..65535, got {args.master_port}"),
        (args.max_restarts < 0, f"--max_restarts must be >= 0, got {args.max_restarts}"),
        (not args.rdzv_timeout > 0, f"--rdzv_timeout must be > 0 seconds, got {args.rdzv_timeout}"),
        (os.path.islink(log_dir),
         f"--log_dir {log_dir!r} is a symbolic link; refusing to write worker logs through it"),
        (os.path.isfile(log_dir), f"--log_dir {log_dir!r} is a file, not a directory"),
        (args.script is not None and not args.module and not os.path.isfile(args.script),
         f"script not found: {args.script!r}"),
    ]
    for rank in _node_ranks(args) if args.log_dir is not None else ():  # a new run dir is empty
        path = worker_log(args.log_dir, rank, args.ps)
        problems.append((os.path.islink(path),
                         f"{path} is a symbolic link; refusing to write the worker log through it"))
    for bad, message in problems:
        if bad:
            _fail(message)
    return args


def _set_ps_roles(args: argparse.Namespace) -> None:
    """``args.ps`` = (servers, workers) for a parameter-server job, else None."""
    args.ps = None
    if args.server_num is None and args.worker_num is None:
        return
    servers, workers = args.server_num, args.worker_num
    if servers is None or workers is None:
        _fail("--server_num and --worker_num go together (a parameter-server job needs both)")
    if servers < 1 or workers < 1:
        _fail(f"--server_num and --worker_num must be >= 1, got {servers} and {workers}")
    if args.nnodes != 1:
        _fail("parameter-server jobs (--server_num/--worker_num) run on one node (--nnodes 1)")
    if args.nproc_per_node not in (None, servers + workers):
        _fail(f"--nproc_per_node {args.nproc_per_node} disagrees with --server_num {servers} + "
              f"--worker_num {workers}; leave it out")
    args.nproc_per_node, args.ps = servers + workers, (servers, workers)


def _local_world_size(value: Optional[str]) -> Optional[int]:
    """--nproc_per_node as torchrun reads it: a number, ``auto`` (one process per GPU when
    there are GPUs, else one per CPU core), ``cpu`` or ``gpu``."""
    if value is None:
        return None
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as e:
        _fail(f"--nproc_per_node {value!r}: {e} (expected a number, auto, cpu or gpu)")


def _set_master_endpoint(args: argparse.Namespace) -> None:
    """Fill in the master endpoint; with --standalone, a free port on 127.0.0.1 (port 0
    here: main binds the socket and reads the port the system chose)."""
    args.master_ignored = []
    if not args.standalone:
        args.master_addr = "127.0.0.1" if args.master_addr is None else args.master_addr
        args.master_port = 29500 if args.master_port is None else args.master_port
        return
    if args.nnodes != 1:
        _fail(f"--standalone runs a single node; it conflicts with --nnodes {args.nnodes}")
    # torchrun's --standalone overrides the endpoint too; the banner says they were ignored.
    args.master_ignored = [f"--{name}" for name in ("master_addr", "master_port") if getattr(args, name) is not None]
    args.master_addr, args.master_port = "127.0.0.1", 0


def _node_ranks(args: argparse.Namespace) -> range:
    first = args.node_rank * args.nproc_per_node
    return range(first, first + args.nproc_per_node)


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"globaltensor.launch: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _who(rank: int, ps: Optional[tuple[int, int]] = None) -> str:
    """How the summary names a rank: ``rank 3``, or ``server 1 (rank 3)`` in a PS job."""
    if ps is None:
        return f"rank {rank}"
    role, role_rank = ("worker", rank) if rank < ps[1] else ("server", rank - ps[1])
    return f"{role} {role_rank} (rank {rank})"


# --- rendezvous: the store on node 0, bound to master_addr only ----------------------

def _listen(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr:port`` only (the rendezvous store's, on node 0)."""
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((addr, port), family=family, backlog=1024)
    except socket.gaierror as e:
        raise LaunchError(f"--master_addr {addr!r} does not resolve ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(f"--master_port {port} is already in use on {addr} (another job, or one "
                              f"still exiting?): choose another --master_port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LaunchError(f"--master_addr {addr} is not an address of this machine: run node_rank 0 "
                              f"on the machine --master_addr names") from None
        raise LaunchError(f"cannot listen on {addr}:{port}: {e.strerror}") from None


def _create_rendezvous(params: Any) -> Any:
    """torch's RendezvousHandler registry calls this with our LaunchConfig's rdzv settings."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    addr, port = parse_rendezvous_endpoint(params.endpoint, -1)
    cfg = params.config
    return _rendezvous_class()(addr, port, int(cfg["rank"]), params.max_nodes, params.run_id,
                               float(cfg["timeout"]), cfg.get("listen_socket"))


def _rendezvous_class() -> type:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class _Rendezvous(StaticTCPRendezvous):
        """torchrun's static rendezvous, with a store we open ourselves: node 0's listens
        on the socket the launcher bound to master_addr (TCPStore's master_listen_fd),
        and every node says what it waits for and gives up after ``timeout`` seconds."""

        def __init__(self, addr: str, port: int, node_rank: int, nnodes: int, run_id: str,
                     timeout: float, listen_socket: Optional[socket.socket]):
            super().__init__(addr, port, node_rank, nnodes, run_id, int(timeout))
            self.timeout_s, self.listen_socket, self.round = timeout, listen_socket, 0

        def get_backend(self) -> str:
            return RDZV_BACKEND

        def next_rendezvous(self) -> Any:
            if self._store is None:
                self._store = self._open_store()
            self.round += 1
            self._wait_for_nodes()
            return super().next_rendezvous()

        def _open_store(self) -> Any:
            where = f"{self.master_addr}:{self.master_port}"
            timeout = datetime.timedelta(seconds=self.timeout_s)
            if self.rank == 0:
                return TCPStore(self.master_addr, self.master_port, self.world_size, True, timeout,
                                wait_for_workers=False, master_listen_fd=self.listen_socket.fileno())
            _say(f"node {self.rank}: connecting to the rendezvous store of node 0 at {where} "
                 f"(up to {self.timeout_s:g} s, --rdzv_timeout)")
            try:
                return TCPStore(self.master_addr, self.master_port, self.world_size, False, timeout)
            except Exception as e:
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise LaunchError(f"node {self.rank} could not reach node 0's rendezvous store at {where} "
                                  f"within {self.timeout_s:g} s (is node 0's launcher running with this "
                                  f"--master_addr/--master_port?): {first_line}") from None

        def _wait_for_nodes(self) -> None:
            key = f"{self.run_id}/nodes_joined/{self.round}"
            self._store.set(f"{key}/{self.rank}", "1")
            joined = self._store.add(key, 1)
            if joined < self.world_size:
                _say(f"node {self.rank}: waiting for {self.world_size - joined} more of {self.world_size} "
                     f"nodes to join at {self.master_addr}:{self.master_port} "
                     f"(up to {self.timeout_s:g} s, --rdzv_timeout)")
            deadline = time.monotonic() + self.timeout_s
            while joined < self.world_size:
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if not self._store.check([f"{key}/{r}"])]
                    raise LaunchError(f"timed out after {self.timeout_s:g} s waiting for nodes at "
                                      f"{self.master_addr}:{self.master_port}: {joined} of {self.world_size} "
                                      f"joined; missing node_rank {', '.join(map(str, missing))}")
                time.sleep(0.1)  # a poll of the store, not synchronisation of workers
                joined = self._store.add(key, 0)

    return _Rendezvous


def _say(message: str) -> None:
    print(f"globaltensor.launch: {message}", file=sys.stderr, flush=True)


# --- when each worker ended (Linux) --------------------------------------------------

class _ExitTimes(threading.Thread):
    """Records when each worker process of this node ended, by watching /proc.

    The agent reports failed ranks only; to tell "rank 1 left early with code 0, then
    rank 0 failed in a collective" from "rank 0 failed", we need when every rank ended.
    Reading /proc never reaps a child, so it does not interfere with the agent's waits.
    """

    def __init__(self, nproc: int):
        super().__init__(name="globaltensor-exit-times", daemon=True)
        self.nproc, self.rank_of, self.ended_at = nproc, {}, {}  # pid -> rank / monotonic time
        self.latest: dict[int, int] = {}  # rank -> pid of its newest attempt
        self._done = threading.Event()
        self.enabled = os.path.isfile(f"/proc/{os.getpid()}/stat")

    def run(self) -> None:
        while self.enabled and not self._done.wait(0.05):
            self.poll()

    def stop(self) -> dict[int, float]:
        """Stop watching; {rank: when its newest process ended} for ranks that ended."""
        self._done.set()
        if self.enabled:
            self.poll()
        return {r: self.ended_at[p] for r, p in self.latest.items() if p in self.ended_at}

    def poll(self) -> None:
        now = time.monotonic()
        if len(self.rank_of) - len(self.ended_at) < self.nproc:  # workers still to find
            self._find_workers()
        for pid in self.rank_of:
            if pid not in self.ended_at and not _alive(pid):
                self.ended_at[pid] = now

    def _find_workers(self) -> None:
        me = str(os.getpid())
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self.rank_of:
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
                if ppid != me:
                    continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except (OSError, IndexError):
                continue
            if b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env:  # exec'ed as a worker
                self.rank_of[int(name)] = rank = int(env[b"RANK"])
                self.latest[rank] = int(name)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --- the agent ---------------------------------------------------------------------

def _grace_agent_class():
    """torch's LocalElasticAgent, except that a failure is reported once every worker
    has ended or ``FAILURE_GRACE_S`` has passed (torch stops the rest at once: a rank
    that was about to fail the same way would be reported as stopped)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class GraceAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.FAILED or self._pcontext is None:
                return result
            deadline = time.monotonic() + FAILURE_GRACE_S
            while time.monotonic() < deadline and any(
                    _alive(pid) for pid in self._pcontext.pids().values()):
                time.sleep(0.02)  # a poll of the workers' state, not synchronisation
            return super()._monitor_workers(worker_group)

    return GraceAgent


# --- the failure summary -------------------------------------------------------------

def _where_stopped(lines: list[str]) -> Optional[str]:
    """The innermost frame of the main thread in the traceback a stopped worker dumped
    (faulthandler lists threads newest first, so the main thread's block is the last)."""
    header = max((i for i, line in enumerate(lines) if line.endswith("(most recent call first):")), default=None)
    if header is None:
        return None
    frames = [line.strip() for line in lines[header + 1:] if line.strip().startswith("File ")]
    return frames[0] if frames else None


def _report_failure(error: Any, log_dir: str, ended: dict[int, float],
                    ps: Optional[tuple[int, int]] = None) -> int:
    """Print which rank caused the failure, why, and its log tail; return our exit code.

    ``ended`` is {rank: when it ended} on this node (may be empty where /proc is missing).
    """
    failures = error.failures  # {global rank: ProcessFailure}, this node's workers only
    logs = {rank: read_log(log_dir, rank, ps) for rank in failures}

    def root_cause_key(rank: int) -> tuple[bool, bool, float]:
        # Ranks the agent stopped are collateral; a rank that said nothing explains
        # nothing; among the rest, the first to end caused the others to fail (a peer
        # of a dead rank fails *afterwards*, e.g. gloo "connection closed").
        failure = failures[rank]
        when = ended.get(rank)
        if when is None:
            try:
                when = os.path.getmtime(worker_log(log_dir, rank, ps))
            except OSError:
                when = float(failure.timestamp)
        return failure.exitcode in _STOPPED_BY_AGENT, not logs[rank], when

    rank = min(failures, key=root_cause_key)
    first = failures[rank]
    how = (f"was killed by signal {first.signal_name()}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    tail = (logs[rank] or [])[-LOG_TAIL_LINES:]
    stopped = sorted(r for r in failures if r != rank and failures[r].exitcode in _STOPPED_BY_AGENT)
    # A rank that ended (code 0) before the failure left its peers waiting for it.
    early = sorted(r for r, t in ended.items() if r not in failures and t < ended.get(rank, float("inf")))
    timed_out = any(re.search(r"timed? ?out", line, re.I) for line in tail)

    who = _who(rank, ps)
    out = []
    if early:
        out.append(f"globaltensor.launch: rank {', '.join(map(str, early))} exited with code 0 while other "
                   f"ranks were still running; then {who} {how}")
        out.append("  a rank that ends early leaves its peers waiting in collectives it never joins")
    elif timed_out and stopped:
        out.append(f"globaltensor.launch: {who} {how} after a timeout; rank "
                   f"{', '.join(map(str, stopped))} was still running then (stuck?), see where below")
    out.append(f"globaltensor.launch: {who} {how} (local_rank {first.local_rank}, pid {first.pid})")
    if os.path.isfile(first.error_file):  # written by elastic's @record in the worker
        message = first.message
        out.append(f"  exception: {message.get('message') if isinstance(message, dict) else message}")
    for r in stopped:
        where = _where_stopped(read_log(log_dir, r, ps) or [])
        out.append(f"  {_who(r, ps)}: still running, stopped by the launcher" + (f" in {where}" if where else ""))
    others = [f"{r} (exit code {failures[r].exitcode}{'' if logs[r] else ', no output'})"
              for r in sorted(failures) if r != rank and r not in stopped]
    if others:
        out.append(f"  other failed ranks on this node: {', '.join(others)}")
    path = worker_log(log_dir, rank, ps)
    if logs[rank] is None:
        out.append(f"  (no log file at {path})")
    else:
        out.append(f"  last {len(tail)} lines of {path}:")
        out.extend(f"    {line.rstrip()}" for line in tail)
    print("\n".join(out), file=sys.stderr, flush=True)
    return first.exitcode if 0 < first.exitcode < 256 else 1


class _DropAgentFailureLine(logging.Filter):
    """Hide the agent's "failed (exitcode: N) ... of binary" line: our summary says
    the same with the global rank, and the binary name would mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _print_banner(args: argparse.Namespace, omp_set: bool) -> None:
    target = ("-m " if args.module else "") + shlex.join([args.script, *args.script_args])
    endpoint_note = " (store listens there only)" if args.node_rank == 0 else ""
    if args.standalone:
        ignored = f"; {' and '.join(args.master_ignored)} ignored" if args.master_ignored else ""
        endpoint_note = f" (--standalone: a free local port{ignored})"
    logs = "workerlog.<rank>" if args.ps is None else "workerlog.<worker rank>, serverlog.<server rank>"
    if args.log_dir_is_new:
        logs += f"; {os.path.join(DEFAULT_LOG_ROOT, LATEST_LINK)} links here"
    lines = [
        "----------- globaltensor.launch -----------",
        f"  world size      : {args.nnodes * args.nproc_per_node}",
        f"  nnodes          : {args.nnodes} (this is node_rank {args.node_rank})",
        f"  nproc_per_node  : {args.nproc_per_node}",
        f"  master endpoint : {args.master_addr}:{args.master_port}{endpoint_note}",
        f"  rdzv timeout    : {args.rdzv_timeout:g} s",
        f"  log directory   : {os.path.abspath(args.log_dir)} ({logs})",
        f"  command         : {target}",
    ]
    if args.ps is not None:
        servers, workers = args.ps
        lines.append(f"  ps roles        : {workers} workers (ranks 0-{workers - 1}), {servers} servers "
                     f"(ranks {workers}-{workers + servers - 1})")
    if omp_set:
        lines.append("  OMP_NUM_THREADS : set to 1 for each worker (was unset); export it to tune")
    lines.append("-------------------------------------------")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _claim_port_and_log_dir(args: argparse.Namespace) -> tuple[Optional[socket.socket], int]:
    """Bind node 0's rendezvous socket and lock this job's log directory (a new one per
    job unless --log_dir is given), before anything starts: a busy port or a log
    directory another job writes into is one line, not a traceback or mixed logs.
    Returns the socket (None off node 0) and the descriptor holding the lock."""
    listen_socket = _listen(args.master_addr, args.master_port) if args.node_rank == 0 else None
    if args.standalone:
        args.master_port = listen_socket.getsockname()[1]  # the free port the system chose
    args.log_dir_is_new = args.log_dir is None
    if args.log_dir_is_new:
        args.log_dir = new_run_dir(DEFAULT_LOG_ROOT)
    return listen_socket, lock_log_dir(args.log_dir, _node_ranks(args))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m globaltensor.launch`` and ``globaltensor-launch``."""
    args = parse_args(argv)
    if os.name != "posix":
        _fail("globaltensor.launch needs a POSIX system (use torchrun elsewhere)")
    try:
        listen_socket, log_lock = _claim_port_and_log_dir(args)  # log_lock: held until we exit
    except LaunchError as e:
        _fail(str(e), 1)

    # Several OpenMP pools on one machine oversubscribe the cores; torchrun does the same.
    omp_set = "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node > 1
    if omp_set:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers
    os.environ["GLOBALTENSOR_LAUNCHER_PID"] = str(os.getpid())  # see _WORKER_BOOT
    # The workers' role variables (see _WORKER_BOOT); never inherited from an outer job.
    for var in ("GLOBALTENSOR_PS_SERVER_NUM", "GLOBALTENSOR_PS_WORKER_NUM",
                "GLOBALTENSOR_PS_ROLE", "GLOBALTENSOR_PS_RANK"):
        os.environ.pop(var, None)
    if args.ps is not None:
        os.environ["GLOBALTENSOR_PS_SERVER_NUM"], os.environ["GLOBALTENSOR_PS_WORKER_NUM"] = map(str, args.ps)
    _print_banner(args, omp_set)
    # The rank-prefixed worker lines are written from tailer threads; flush per line
    # so they show up promptly even when our stdout is a pipe.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher import api as launcher_api
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropAgentFailureLine())
    rendezvous_handler_registry.register(RDZV_BACKEND, _create_rendezvous)
    launcher_api.LocalElasticAgent = _grace_agent_class()  # launch_agent builds the agent by this name
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=RUN_ID,
        # torchrun's non-elastic mode (static rendezvous at master_addr:master_port; the
        # workers get exactly that MASTER_ADDR/PORT), with our store (_Rendezvous).
        rdzv_backend=RDZV_BACKEND,
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs={"rank": args.node_rank, "timeout": args.rdzv_timeout, "listen_socket": listen_socket},
        max_restarts=args.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        logs_specs=make_logs_specs(args.log_dir, args.ps),
        log_line_prefix_template="[rank${rank}]: ",
    )
    command = ["-u", "-c", _WORKER_BOOT, *(["-m"] if args.module else []), args.script, *args.script_args]
    exit_times = _ExitTimes(args.nproc_per_node)
    exit_times.start()
    try:
        # The agent runs string.Template over worker args (for its ${local_rank} macro);
        # doubling "$" makes that a no-op so script args arrive untouched.
        launch_agent(config, sys.executable, [a.replace("$", "$$") for a in command])
    except ChildFailedError as e:
        sys.exit(_report_failure(e, args.log_dir, exit_times.stop(), args.ps))
    except LaunchError as e:
        _fail(str(e), 1)
    except SignalException as e:
        # Ctrl-C / SIGTERM: the agent has already stopped the workers.
        print(f"globaltensor.launch: interrupted by {e.sigval.name}, workers stopped", file=sys.stderr)
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
