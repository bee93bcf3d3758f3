"""What the launcher tells the user: the start banner and, when a job fails, a summary
that names the rank that caused the failure instead of a traceback.

The summary reads the failed ranks' logs (``logs``) and when each rank ended
(``agent.ExitTimes``): a rank that ended by SIGTERM/SIGKILL after the agent began
stopping workers is collateral; a rank whose log says a peer went away (connection
reset, EOF) failed because of another; among the rest the first to end caused the
failure, and when several ended together one that said why is named before a silent one.
A rank whose program ended with code 0 before the failed rank's process ended is named
first (it left its peers waiting); when a program ended comes from the worker itself
(``boot.read_left``): its process ends later, after its exit closed its connections.

Example::

    try:
        launch_agent(config, sys.executable, command)
    except ChildFailedError as e:
        left = boot.read_left(args.log_dir, node_ranks(args), pids)
        sys.exit(report_failure(e, args.log_dir, exit_times.stop(), exit_times.stopping_since, args.ps, left))
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import sys
import time
from typing import Any, Optional, Sequence

from .logs import DEFAULT_LOG_ROOT, LATEST_LINK, read_log, worker_log

__all__ = ["LOG_TAIL_LINES", "DropAgentFailureLine", "exit_code", "print_banner", "report_failure",
           "restart_line", "where_stopped", "who"]

LOG_TAIL_LINES = 20
STOPPED_BY_AGENT = {-signal.SIGTERM, -signal.SIGKILL}
# Ranks whose processes ended within this many seconds of each other ended "together"
# (a config error every rank meets): the summary then prefers one that said why. On a
# loaded 2-core machine the rank that prints its reason ended 0.5 s and more after a
# silent one that met the same error (the suite's summary test, under its background
# worlds); a rank that fails because of another says so and is passed over anyway.
TOGETHER_S = 2.0
# What a rank's log says when it failed because a peer went away (gloo, TensorPipe, our
# own collective errors name the backend's line): such a rank is not the cause.
PEER_LOST = re.compile(r"connection (reset|closed) by peer|ECONNRESET|\bEOF\b|broken pipe|"
                       r"connection refused|peer .*(died|exited|closed)", re.I)
# a wait that timed out (a peer never came: stuck?)
TIMED_OUT = re.compile(r"timed? ?out", re.I)

Roles = Optional[tuple[int, int]]  # (servers, workers) of a parameter-server job, else None


def who(rank: int, ps: Roles = None) -> str:
    """How the summary names a rank: ``rank 3``, or ``server 1 (rank 3)`` in a PS job.

    >>> who(3), who(3, (2, 3))
    ('rank 3', 'server 0 (rank 3)')
    """
    if ps is None:
        return f"rank {rank}"
    role, role_rank = ("worker", rank) if rank < ps[1] else ("server", rank - ps[1])
    return f"{role} {role_rank} (rank {rank})"


def where_stopped(lines: list[str]) -> Optional[str]:
    """The innermost frame of the main thread in the traceback a stopped worker dumped
    (faulthandler lists threads newest first, so the main thread's block is the last).

    >>> where_stopped(['Current thread 0x1 (most recent call first):',
    ...                '  File "t.py", line 3 in stuck', '  File "t.py", line 9 in <module>'])
    'File "t.py", line 3 in stuck'
    """
    header = max((i for i, line in enumerate(lines) if line.endswith("(most recent call first):")), default=None)
    if header is None:
        return None
    frames = [line.strip() for line in lines[header + 1:] if line.strip().startswith("File ")]
    return frames[0] if frames else None


def report_failure(error: Any, log_dir: str, ended: dict[int, float], stopping_since: Optional[float],
                   ps: Roles = None, left: Optional[dict[int, Any]] = None) -> int:
    """Print which rank caused the failure, why, and its log tail; return our exit code.

    ``error`` is elastic's ChildFailedError (``failures``: {global rank: ProcessFailure},
    this node's workers only); ``ended`` is {rank: when its process ended} on this node
    (may be empty where /proc is missing); ``stopping_since`` when the agent began
    stopping workers; ``left`` is {rank: boot.Left} for this node's ranks whose program
    ended (said so itself). The exit code is the failed rank's, 128 + N for a signal N
    (as a shell's).
    """
    failures = error.failures
    logs = {rank: read_log(log_dir, rank, ps) for rank in failures}
    stopped = sorted(r for r in failures if _collateral(failures[r], ended.get(r), stopping_since))
    rank = _root_cause(failures, logs, ended, stopped, log_dir, ps)
    first = failures[rank]
    how = _how(first)
    tail = (logs[rank] or [])[-LOG_TAIL_LINES:]
    early = _left_early(rank, failures, ended, left or {})
    # an early leaver's line says what became of its process; it was not "still running"
    stopped = [r for r in stopped if r != rank and r not in early]
    out = _cause_lines(rank, how, tail, stopped, early, ended, left or {}, failures, logs, ps)
    out.append(f"globaltensor.launch: {who(rank, ps)} {how} (local_rank {first.local_rank}, pid {first.pid})")
    if os.path.isfile(first.error_file):  # written by elastic's @record in the worker
        message = first.message
        out.append(f"  exception: {message.get('message') if isinstance(message, dict) else message}")
    out += _other_rank_lines(rank, [*stopped, *early], failures, logs, log_dir, ps, shown=stopped)
    path = worker_log(log_dir, rank, ps)
    if logs[rank] is None:
        out.append(f"  (no log file at {path})")
    else:
        out.append(f"  last {len(tail)} lines of {path}:")
        out.extend(f"    {line.rstrip()}" for line in tail)
    print("\n".join(out), file=sys.stderr, flush=True)
    return exit_code(first.exitcode)


def exit_code(code: int) -> int:
    """The launcher's exit code for a rank's: the same, or 128 + N for signal N.

    >>> exit_code(3), exit_code(-9)
    (3, 137)
    """
    return 128 - code if code < 0 else (code if code < 256 else 1)


def restart_line(failures: dict[int, Any], log_dir: str, ended: dict[int, float], ps: Roles,
                 left: int, ranks: Sequence[int] = (), stopping_since: Optional[float] = None) -> str:
    """One line before a restart: which rank ended the attempt, and how; after a timeout,
    also which of this node's ``ranks`` were still running (a hung rank: stuck?).

    ``failures`` are the attempt's failed ranks ({global rank: ProcessFailure}),
    among them those the launcher stopped (ended after ``stopping_since``)."""
    logs = {rank: read_log(log_dir, rank, ps) for rank in failures}
    # ranks the launcher may have stopped already (torch closes at the first failure)
    stopped = sorted(r for r in failures if _collateral(failures[r], ended.get(r), stopping_since))
    rank = _root_cause(failures, logs, ended, stopped, log_dir, ps)
    how = _how(failures[rank])
    running = [r for r in ranks if r != rank and (r in stopped or r not in failures)]
    if running and _timed_out((logs[rank] or [])[-LOG_TAIL_LINES:]):
        how += (f" after a timeout; {', '.join(who(r, ps) for r in running)} "
                f"{'was' if len(running) == 1 else 'were'} still running (stuck?)")
    return (f"{who(rank, ps)} {how}; restarting every worker "
            f"({left} restart{'s' if left != 1 else ''} left, --max_restarts)")


def _how(failure: Any) -> str:
    return (f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0
            else f"exited with code {failure.exitcode}")


def _timed_out(lines: list[str]) -> bool:
    """Whether a log tail says a wait timed out (a peer never came: stuck?)."""
    return any(TIMED_OUT.search(line) for line in lines)


def _collateral(failure: Any, when: Optional[float], stopping_since: Optional[float]) -> bool:
    """Whether the launcher ended this process: a SIGTERM/SIGKILL exit after the agent
    began stopping workers (the same exit from outside, earlier, is a cause). Without
    end times (no /proc) every such exit counts as the launcher's."""
    return (failure.exitcode in STOPPED_BY_AGENT and stopping_since is not None
            and (when is None or when >= stopping_since))


def _root_cause(failures: dict[int, Any], logs: dict[int, Optional[list[str]]], ended: dict[int, float],
                stopped: list[int], log_dir: str, ps: Roles) -> int:
    """The failed rank the summary names: not one the launcher stopped, not one that
    failed because a peer went away (a peer of a dead rank fails *afterwards*, e.g.
    gloo "connection reset"); among the rest, the first to end, and among ranks that
    ended together (``TOGETHER_S``) one that said something. Without /proc, a log's
    last write stands in for the end time."""
    def when(rank: int) -> float:
        if rank in ended:
            return ended[rank]
        try:
            return os.path.getmtime(worker_log(log_dir, rank, ps))
        except OSError:
            return float(failures[rank].timestamp)

    def tier(rank: int) -> tuple[bool, bool]:
        return rank in stopped, _blames_peer(logs[rank])

    best = min(tier(r) for r in failures)
    candidates = sorted((r for r in failures if tier(r) == best), key=when)
    together = [r for r in candidates if when(r) - when(candidates[0]) <= TOGETHER_S]
    return next((r for r in together if logs[r]), candidates[0])


def _blames_peer(lines: Optional[list[str]]) -> bool:
    """Whether a log's tail says a peer went away: that rank failed because of another."""
    return any(PEER_LOST.search(line) for line in (lines or [])[-LOG_TAIL_LINES:])


def _left_at(rank: int, ended: dict[int, float], left: dict[int, Any]) -> Optional[float]:
    """When ``rank`` left: when its program ended if it said so, else when its process
    ended (None: unknown). Monotonic time."""
    return left[rank].at if rank in left else ended.get(rank)


def _left_early(rank: int, failures: dict[int, Any], ended: dict[int, float], left: dict[int, Any]) -> list[int]:
    """The ranks other than ``rank`` (the failed one named) that left with code 0 before
    ``rank``'s process ended, first to leave first.

    A program's own word on its end (``left``) counts, not its process's end: exiting
    destroys its process groups, which fails the peers while the process still runs.
    Only a rank that said nothing is judged by its process: one that ended and did not
    fail (code 0)."""
    def code_0(r: int) -> bool:
        return left[r].code == 0 if r in left else (r in ended and r not in failures)

    deadline = ended.get(rank, _left_at(rank, ended, left))
    deadline = float("inf") if deadline is None else deadline
    # <=: processes that one poll found ended share its time (agent.ExitTimes)
    early = [r for r in {*ended, *left} if r != rank and code_0(r) and _left_at(r, ended, left) <= deadline]
    return sorted(early, key=lambda r: (_left_at(r, ended, left), r))


def _clock(at: float, left: Optional[Any]) -> str:
    """``at`` (monotonic) as the time of day, to the millisecond: the worker's own clock
    reading when it said when it left (``left``), else converted from now."""
    wall = left.wall if left is not None else time.time() - (time.monotonic() - at)
    return f"{time.strftime('%H:%M:%S', time.localtime(wall))}.{int(wall % 1 * 1000):03d}"


def _cause_lines(rank: int, how: str, tail: list[str], stopped: list[int], early: list[int],
                 ended: dict[int, float], left: dict[int, Any], failures: dict[int, Any],
                 logs: dict[int, Optional[list[str]]], ps: Roles) -> list[str]:
    """The summary's opening, when the failed rank is not the whole story: a rank that
    left (code 0) before the failure left its peers waiting for it; a timeout while
    other ranks still ran points at those ranks (stuck?)."""
    if early:
        # A rank whose log says a peer went away left after that peer, whatever the times say:
        # a process's end is seen up to one poll late, a program's end when it happens.
        times = {r: t for r in {*ended, *left} if (t := _left_at(r, ended, left)) is not None
                 and not (r in logs and _blames_peer(logs[r]))}
        out = []
        for i, r in enumerate(early):
            at = _left_at(r, ended, left)
            first = ": the first to leave" if at <= min(times.values(), default=at) else ""
            then = f"; then {who(rank, ps)} {how}" if i == 0 else ""
            # its program ended, then its process failed or was stopped while it shut down
            after = f" (its process then {_how(failures[r])})" if r in failures else ""
            out.append(f"{'globaltensor.launch:' if i == 0 else ' '} {who(r, ps)} exited with code 0 at "
                       f"{_clock(at, left.get(r))}, before the others finished{first}{after}{then}")
        return out + ["  a rank that ends early leaves its peers waiting in collectives it never joins"]
    if stopped and _timed_out(tail):
        return [f"globaltensor.launch: {who(rank, ps)} {how} after a timeout; rank "
                f"{', '.join(map(str, stopped))} was still running then (stuck?), see where below"]
    return []


def _other_rank_lines(rank: int, skip: list[int], failures: dict[int, Any],
                      logs: dict[int, Optional[list[str]]], log_dir: str, ps: Roles,
                      shown: list[int]) -> list[str]:
    """Where each rank the launcher stopped (``shown``) was, and the exit codes of the
    failed ranks not named already (``rank``, ``skip``)."""
    out = []
    for r in shown:
        where = where_stopped(read_log(log_dir, r, ps) or [])
        out.append(f"  {who(r, ps)}: still running, stopped by the launcher" + (f" in {where}" if where else ""))
    others = [f"{r} (exit code {failures[r].exitcode}{'' if logs[r] else ', no output'})"
              for r in sorted(failures) if r != rank and r not in skip]
    if others:
        out.append(f"  other failed ranks on this node: {', '.join(others)}")
    return out


class DropAgentFailureLine(logging.Filter):
    """Hide the agent's "failed (exitcode: N) ... of binary" line: our summary says
    the same with the global rank, and the binary name would mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def print_banner(args: argparse.Namespace, omp_set: bool) -> None:
    """Print the start banner on stderr: world size, nodes, master endpoint, rendezvous
    timeout, log directory, the command, the parameter-server roles, OMP_NUM_THREADS."""
    target = ("-m " if args.module else "") + shlex.join([args.script, *args.script_args])
    lines = [
        "----------- globaltensor.launch -----------",
        f"  world size      : {args.nnodes * args.nproc_per_node}",
        f"  nnodes          : {args.nnodes} (this is node_rank {args.node_rank})",
        f"  nproc_per_node  : {args.nproc_per_node}",
        f"  master endpoint : {args.master_addr}:{args.master_port}{_endpoint_note(args)}",
        f"  local address   : {args.local_addr or 'as the hostname resolves'} (workers' gloo connections)",
        f"  rdzv timeout    : {args.rdzv_timeout:g} s",
        f"  log directory   : {os.path.abspath(args.log_dir)} ({_logs_note(args)})",
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


def _endpoint_note(args: argparse.Namespace) -> str:
    if args.standalone:
        ignored = f"; {' and '.join(args.master_ignored)} ignored" if args.master_ignored else ""
        return f" (--standalone: a free local port{ignored})"
    return " (store listens there only)" if args.node_rank == 0 else ""


def _logs_note(args: argparse.Namespace) -> str:
    logs = "workerlog.<rank>" if args.ps is None else "workerlog.<worker rank>, serverlog.<server rank>"
    if args.log_dir_is_new:
        logs += f"; {os.path.join(DEFAULT_LOG_ROOT, LATEST_LINK)} links here"
    return logs
