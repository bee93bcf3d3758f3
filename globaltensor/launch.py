"""Start one worker process per device: a thin layer over ``torch.distributed.elastic``.

The elastic agent behind ``torchrun`` (``torch.distributed.launcher.api``) does the
real work: it spawns the workers, sets RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them and stops the rest when
one fails. This module adds a Paddle-style front end on top of it: a start banner,
one ``<log_dir>/workerlog.<global rank>`` file per rank (stdout and stderr
combined, also echoed to the console as ``[rank<N>]: ...``), and a short failure
summary instead of a traceback.

Example::

    python -m globaltensor.launch --nproc_per_node 4 train.py --lr 0.1
    # two machines, run once on each (node_rank 0 hosts the rendezvous store):
    python -m globaltensor.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr NODE0_ADDR --master_port 29500 train.py
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from collections import deque
from typing import Any, NoReturn, Optional, Sequence

__all__ = ["main", "parse_args"]

# How often the agent polls its workers. Small, so that one rank dying while the
# others block in a collective ends the job promptly.
MONITOR_INTERVAL_S = 0.2
LOG_TAIL_LINES = 20
# Same id on every node: the static rendezvous prefixes its TCPStore keys with it.
RUN_ID = "globaltensor"
# Runs the worker with stderr merged into stdout, so each workerlog file keeps the
# two streams in the order they were written. `exec` keeps the worker's pid (the
# agent signals it directly).
_MERGE_STDERR = 'exec "$@" 2>&1'


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

    opt("nproc_per_node", type=int, default=1, help="worker processes on this node (default 1)")
    opt("nnodes", type=int, default=1, help="number of nodes (default 1)")
    opt("node_rank", type=int, default=0, help="rank of this node, 0..nnodes-1 (default 0)")
    opt("master_addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    opt("master_port", type=int, default=29500, help="port of the rendezvous store on node 0 (default 29500)")
    opt("log_dir", default="log", help="directory for workerlog.<rank> files (default ./log)")
    opt("max_restarts", type=int, default=0, help="restarts of the worker group before giving up (default 0)")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module, like python -m")
    p.add_argument("script", nargs="?", help="script path (or module name with -m)")
    # Only for --help: parse_args() hands everything after the script over untouched.
    p.add_argument("script_args", nargs="*", help="arguments for the script (even ones like --nnodes)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line; exits with a one-line message if invalid."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Split off the script ourselves: argparse's REMAINDER drops a "--" the script
    # may expect. Every launcher option takes one value, except these flags.
    flags = {"-m", "--module", "-h", "--help"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 1 if ("=" in argv[i] or argv[i] in flags) else 2
    i += argv[i:i + 1] == ["--"]  # "launch [opts] -- script.py": skip the separator
    args = _build_parser().parse_args(argv[:i + 1])
    args.script_args = argv[i + 1:]
    problems = [
        (args.script is None, "no script given (usage: python -m globaltensor.launch [options] script.py [args])"),
        (args.nproc_per_node < 1, f"--nproc_per_node must be >= 1, got {args.nproc_per_node}"),
        (args.nnodes < 1, f"--nnodes must be >= 1, got {args.nnodes}"),
        (not 0 <= args.node_rank < args.nnodes,
         f"--node_rank must be in [0, {args.nnodes}), got {args.node_rank}"),
        (not 1 <= args.master_port <= 65535, f"--master_port must be in 1..65535, got {args.master_port}"),
        (args.max_restarts < 0, f"--max_restarts must be >= 0, got {args.max_restarts}"),
        (os.path.isfile(args.log_dir), f"--log_dir {args.log_dir!r} is a file, not a directory"),
        (args.script is not None and not args.module and not os.path.isfile(args.script),
         f"script not found: {args.script!r}"),
    ]
    for bad, message in problems:
        if bad:
            _fail(message)
    return args


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"globaltensor.launch: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _worker_log(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"workerlog.{rank}")


def _make_logs_specs(log_dir: str) -> Any:
    """A LogsSpecs that sends each worker's output to <log_dir>/workerlog.<global rank>.

    The agent redirects the worker's stdout (stderr is merged into it by the
    `sh -c` wrapper) to that file and tails it to our stdout with a rank prefix.
    """
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.api import LogsDest

    class WorkerLogSpecs(LogsSpecs):
        @property
        def root_log_dir(self) -> str:
            return log_dir

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            os.makedirs(log_dir, exist_ok=True)
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank = int(env["RANK"])
                path = _worker_log(log_dir, rank)
                attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                if attempt > 0 and os.path.exists(path):
                    # Keep the log of the attempt that failed; the agent opens with "w".
                    os.replace(path, f"{path}.attempt{attempt - 1}")
                dest.stdouts[local_rank] = dest.tee_stdouts[local_rank] = path
                dest.stderrs[local_rank] = ""  # nothing left on stderr after 2>&1
                # Workers decorated with elastic's @record write their exception
                # here; drop a stale one so it is not mistaken for this run's.
                error_file = os.path.join(log_dir, f"error.{rank}.json")
                if os.path.exists(error_file):
                    os.remove(error_file)
                dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = error_file
            return dest

    return WorkerLogSpecs(log_dir=log_dir)


def _print_banner(args: argparse.Namespace, omp_set: bool) -> None:
    target = ("-m " if args.module else "") + shlex.join([args.script, *args.script_args])
    lines = [
        "----------- globaltensor.launch -----------",
        f"  world size      : {args.nnodes * args.nproc_per_node}",
        f"  nnodes          : {args.nnodes} (this is node_rank {args.node_rank})",
        f"  nproc_per_node  : {args.nproc_per_node}",
        f"  master endpoint : {args.master_addr}:{args.master_port}",
        f"  log directory   : {os.path.abspath(args.log_dir)} (workerlog.<rank>)",
        f"  command         : {target}",
    ]
    if omp_set:
        lines.append("  OMP_NUM_THREADS : set to 1 for each worker (was unset); export it to tune")
    lines.append("-------------------------------------------")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _report_failure(error: Any, log_dir: str) -> int:
    """Print which rank failed first, why, and its log tail; return our exit code."""
    failures = error.failures  # {global rank: ProcessFailure}, this node's workers only
    stopped_by_agent = {-signal.SIGTERM, -signal.SIGKILL}

    def root_cause_key(item: tuple[int, Any]) -> tuple[bool, float]:
        # Ranks the agent stopped are collateral. Among the rest, a rank that dies
        # makes its peers fail *afterwards* (e.g. gloo "connection closed"), and a
        # dying rank's last log write precedes theirs: its log has the oldest mtime.
        rank, failure = item
        try:
            when = os.path.getmtime(_worker_log(log_dir, rank))
        except OSError:
            when = float(failure.timestamp)
        return failure.exitcode in stopped_by_agent, when

    rank, first = min(failures.items(), key=root_cause_key)
    if first.exitcode < 0:
        how = f"was killed by signal {first.signal_name()}"
    else:
        how = f"exited with code {first.exitcode}"
    out = [f"globaltensor.launch: rank {rank} {how} (local_rank {first.local_rank}, pid {first.pid})"]
    if os.path.isfile(first.error_file):  # written by elastic's @record in the worker
        message = first.message
        out.append(f"  exception: {message.get('message') if isinstance(message, dict) else message}")
    others = [f"{r} (exit code {failures[r].exitcode})" for r in sorted(failures) if r != rank]
    if others:
        out.append(f"  other ranks stopped or failed on this node: {', '.join(others)}")
    path = _worker_log(log_dir, rank)
    try:
        with open(path, errors="replace") as f:
            tail = list(deque(f, maxlen=LOG_TAIL_LINES))
        out.append(f"  last {len(tail)} lines of {path}:")
        out.extend(f"    {line.rstrip()}" for line in tail)
    except OSError:
        out.append(f"  (no log file at {path})")
    print("\n".join(out), file=sys.stderr, flush=True)
    return first.exitcode if 0 < first.exitcode < 256 else 1


class _DropAgentFailureLine(logging.Filter):
    """Hide the agent's "failed (exitcode: N) ... of binary: /bin/sh" line: our
    summary says the same with the global rank, and the binary name would mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m globaltensor.launch`` and ``globaltensor-launch``."""
    args = parse_args(argv)
    if os.name != "posix":
        _fail("globaltensor.launch needs a POSIX system (use torchrun elsewhere)")

    # Several OpenMP pools on one machine oversubscribe the cores; torchrun does the same.
    omp_set = "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node > 1
    if omp_set:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers
    _print_banner(args, omp_set)
    # The rank-prefixed worker lines are written from tailer threads; flush per line
    # so they show up promptly even when our stdout is a pipe.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    # Imported only now: argument errors above should not pay for importing torch.
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropAgentFailureLine())

    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=RUN_ID,
        # Static rendezvous (torchrun's non-elastic mode): node 0 hosts a TCPStore at
        # master_addr:master_port and the workers get exactly that MASTER_ADDR/PORT.
        rdzv_backend="static",
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs={"rank": args.node_rank},
        max_restarts=args.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        logs_specs=_make_logs_specs(args.log_dir),
        log_line_prefix_template="[rank${rank}]: ",
    )
    command = [sys.executable, "-u", *(["-m"] if args.module else []), args.script, *args.script_args]
    # The agent runs string.Template over worker args (for its ${local_rank} macro);
    # doubling "$" makes that a no-op so script args arrive untouched.
    sh_args = ["-c", _MERGE_STDERR, "globaltensor-worker", *command]
    try:
        launch_agent(config, "/bin/sh", [a.replace("$", "$$") for a in sh_args])
    except ChildFailedError as e:
        sys.exit(_report_failure(e, args.log_dir))
    except SignalException as e:
        # Ctrl-C / SIGTERM: the agent has already stopped the workers.
        print(f"globaltensor.launch: interrupted by {e.sigval.name}, workers stopped", file=sys.stderr)
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
