"""One run of the launcher, start to end: check the command line, claim node 0's port
and the job's log directory, set the workers' environment, print the banner, hand the
job to torch's elastic agent, and turn its outcome into our exit code and summary.

The steps live in their rooms (``cli``, ``logs``, ``rendezvous``, ``agent``, ``report``,
``boot``); this module puts them in order. torch's elastic modules are imported only
once the job starts: ``--help`` and a bad command line never wait for them.

Example::

    main(["--nproc_per_node", "2", "train.py", "--lr", "0.1"])  # exits with the job's code
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any, Optional, Sequence

from . import boot
from .agent import MONITOR_INTERVAL_S, ExitTimes, grace_agent_class
from .cli import fail, node_ranks, parse_args
from .forkserver import ForkServer, can_fork, handler_factory
from .logs import DEFAULT_LOG_ROOT, LaunchError, lock_log_dir, make_logs_specs, new_run_dir, say
from .rendezvous import RDZV_BACKEND, RUN_ID, create_rendezvous, listen
from .report import DropAgentFailureLine, print_banner, report_failure, restart_line

__all__ = ["main"]

# The workers' role variables (see boot._set_ps_role); never inherited from an outer job.
PS_VARIABLES = ("GLOBALTENSOR_PS_SERVER_NUM", "GLOBALTENSOR_PS_WORKER_NUM",
                "GLOBALTENSOR_PS_ROLE", "GLOBALTENSOR_PS_RANK")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m globaltensor.launch`` and ``globaltensor-launch``.

    Exits with the job's outcome: 0, the failed rank's exit code (128 + N when signal N
    ended it), 1 for a problem while starting, 2 for a bad command line.

    >>> main(["--nproc_per_node", "2", "train.py"])  # doctest: +SKIP
    """
    args = parse_args(argv)
    if os.name != "posix":
        fail("globaltensor.launch needs a POSIX system (use torchrun elsewhere)")
    try:
        listen_socket, log_lock = _claim_port_and_log_dir(args)  # log_lock: held until we exit
    except LaunchError as e:
        fail(str(e), 1)
    omp_set = _set_worker_environment(args)
    print_banner(args, omp_set)
    # The rank-prefixed worker lines are written from tailer threads; flush per line
    # so they show up promptly even when our stdout is a pipe.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _run_agent(args, listen_socket, log_lock)


def _claim_port_and_log_dir(args: argparse.Namespace) -> tuple[Optional[socket.socket], int]:
    """Bind node 0's rendezvous socket and lock this job's log directory (a new one per
    job unless --log_dir is given), before anything starts: a busy port or a log
    directory another job writes into is one line, not a traceback or mixed logs.
    Returns the socket (None off node 0) and the descriptor holding the lock."""
    listen_socket = listen(args.master_addr, args.master_port) if args.node_rank == 0 else None
    if args.local_addr is not None and args.local_addr != args.master_addr:
        listen(args.local_addr, 0, option="--local_addr").close()  # an address of this machine?
    if args.standalone:
        args.master_port = listen_socket.getsockname()[1]  # the free port the system chose
    args.log_dir_is_new = args.log_dir is None
    if args.log_dir_is_new:
        args.log_dir = new_run_dir(DEFAULT_LOG_ROOT)
    return listen_socket, lock_log_dir(args.log_dir, node_ranks(args))


def _set_worker_environment(args: argparse.Namespace) -> bool:
    """Set what the workers inherit from us; True if OMP_NUM_THREADS was set (the banner
    says so)."""
    # Several OpenMP pools on one machine oversubscribe the cores; torchrun does the same.
    omp_set = "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node > 1
    if omp_set:
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOBALTENSOR_LAUNCHER_PID"] = str(os.getpid())  # see boot._die_with_launcher
    os.environ.pop("GLOBALTENSOR_LOCAL_ADDR", None)
    if args.local_addr is not None:  # gloo binds there (comm.bind_gloo_to_address)
        os.environ["GLOBALTENSOR_LOCAL_ADDR"] = args.local_addr
    for var in PS_VARIABLES:
        os.environ.pop(var, None)
    if args.ps is not None:
        os.environ["GLOBALTENSOR_PS_SERVER_NUM"], os.environ["GLOBALTENSOR_PS_WORKER_NUM"] = map(str, args.ps)
    return omp_set


def _worker_command(args: argparse.Namespace) -> list[str]:
    """The workers' arguments to ``python``: the boot file, then ``[-m] target args``.

    The agent runs string.Template over worker args (for its ${local_rank} macro);
    doubling "$" makes that a no-op so script args arrive untouched."""
    command = ["-u", boot.__file__, *(["-m"] if args.module else []), args.script, *args.script_args]
    return [a.replace("$", "$$") for a in command]


def _launch_config(args: argparse.Namespace, listen_socket: Optional[socket.socket]) -> Any:
    """torchrun's non-elastic mode (static rendezvous at master_addr:master_port; the
    workers get exactly that MASTER_ADDR/PORT), with our store (``rendezvous``), our
    log files (``logs``) and a quick monitor."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=RUN_ID,
        rdzv_backend=RDZV_BACKEND,
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs={"rank": args.node_rank, "timeout": args.rdzv_timeout, "listen_socket": listen_socket},
        max_restarts=args.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        logs_specs=make_logs_specs(args.log_dir, args.ps),
        log_line_prefix_template="[rank${rank}]: ",
    )


def _run_agent(args: argparse.Namespace, listen_socket: Optional[socket.socket], log_lock: int) -> None:
    """Run the job under torch's elastic agent; exit as its outcome says (returns on
    success)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing import api as processes_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher import api as launcher_api

    # Forked before any thread starts (the agent's, the store's, the log tailers').
    server = None
    if args.start_method == "forkserver" and can_fork() is None:
        held = [log_lock] + ([listen_socket.fileno()] if listen_socket is not None else [])
        server = ForkServer.start(close_fds=held)
    exit_times = ExitTimes(args.nproc_per_node, find_workers=server is None)
    if server is not None:
        processes_api.get_subprocess_handler = handler_factory(
            server, lambda pid, env: exit_times.add_worker(pid, int(env["RANK"])))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(DropAgentFailureLine())
    rendezvous_handler_registry.register(RDZV_BACKEND, create_rendezvous)

    def on_restart(result: Any, left: int) -> None:
        say(restart_line(result.failures, args.log_dir, exit_times.ended(), args.ps, left, node_ranks(args),
                         exit_times.stopping_since))
        boot.remove_left(args.log_dir, node_ranks(args))  # the attempt's workers have ended

    # launch_agent builds the agent by this name
    launcher_api.LocalElasticAgent = grace_agent_class(exit_times, on_restart)
    config = _launch_config(args, listen_socket)
    boot.remove_left(args.log_dir, node_ranks(args))  # a killed job's, in a --log_dir used again
    exit_times.start()
    try:
        launcher_api.launch_agent(config, sys.executable, _worker_command(args))
    except ChildFailedError as e:
        ended = exit_times.stop()
        left = boot.read_left(args.log_dir, node_ranks(args), _newest_pids(exit_times, e.failures))
        sys.exit(report_failure(e, args.log_dir, ended, exit_times.stopping_since, args.ps, left))
    except LaunchError as e:
        fail(str(e), 1)
    except SignalException as e:
        # Ctrl-C / SIGTERM: the agent has already stopped the workers.
        say(f"interrupted by {e.sigval.name}, workers stopped")
        sys.exit(128 + int(e.sigval))
    finally:
        boot.remove_left(args.log_dir, node_ranks(args))  # the log directory keeps the logs only
        if server is not None:
            server.close()


def _newest_pids(exit_times: ExitTimes, failures: dict[int, Any]) -> dict[int, int]:
    """{rank: pid of its newest worker} where known: a left file another pid wrote is an
    earlier attempt's (a restart another node caused leaves this node's files)."""
    return {**exit_times.latest, **{rank: failure.pid for rank, failure in failures.items()}}
