"""The launcher's elastic agent: torch's, with a grace period after a failure, and a
watcher that records when each worker ended.

Both serve the failure summary (``report``): ranks that fail together (a bad config)
get ``FAILURE_GRACE_S`` to end on their own, so they are reported as failed with their
exit codes, not as stopped by the launcher; when every rank ended tells the rank that
caused a failure from the peers that failed because of it; and when the agent began
stopping workers tells a rank the launcher signalled from one killed from outside (the
OOM killer's SIGKILL looks the same in an exit code).

Example::

    exit_times = ExitTimes(nproc=2); exit_times.start()
    launcher_api.LocalElasticAgent = grace_agent_class(exit_times, on_restart)
    ...; ended = exit_times.stop()            # {rank: monotonic end time}
    exit_times.stopping_since                 # when the agent first signalled a worker
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["FAILURE_GRACE_S", "MONITOR_INTERVAL_S", "ExitTimes", "alive", "grace_agent_class"]

# How often the agent polls its workers. Small, so that one rank dying while the
# others block in a collective ends the job promptly.
MONITOR_INTERVAL_S = 0.2
FAILURE_GRACE_S = 1.0
# How often ExitTimes looks at /proc. Ranks that end within one interval of each other
# cannot be ordered (a rank leaving early and the peer failing because of it end a few
# milliseconds apart); a poll reads one small file per worker.
EXIT_POLL_S = 0.01


class ExitTimes(threading.Thread):
    """Records when each worker process of this node ended, by watching /proc.

    The agent reports failed ranks only; to tell "rank 1 left early with code 0, then
    rank 0 failed in a collective" from "rank 0 failed", we need when every rank ended.
    Reading /proc never reaps a child, so it does not interfere with the agent's waits.
    """

    def __init__(self, nproc: int, find_workers: bool = True):
        super().__init__(name="globaltensor-exit-times", daemon=True)
        # False: workers are not the launcher's children (the fork server's); the
        # launcher names them with ``add_worker`` instead of a scan of /proc.
        self.find_workers = find_workers
        self.nproc, self.rank_of, self.ended_at = nproc, {}, {}  # pid -> rank / monotonic time
        self.latest: dict[int, int] = {}  # rank -> pid of its newest attempt
        # When the agent began stopping the newest attempt's workers (None: it has not):
        # only processes that ended after it can have been ended by the launcher.
        self.stopping_since: Optional[float] = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.enabled = os.path.isfile(f"/proc/{os.getpid()}/stat")

    def run(self) -> None:
        while self.enabled and not self._done.wait(EXIT_POLL_S):
            self.poll()

    def stop(self) -> dict[int, float]:
        """Stop watching; {rank: when its newest process ended} for ranks that ended."""
        self._done.set()
        return self.ended()

    def ended(self) -> dict[int, float]:
        """{rank: when its newest process ended} for ranks that ended (polls first)."""
        if self.enabled:
            self.poll()
        return {r: self.ended_at[p] for r, p in self.latest.items() if p in self.ended_at}

    def agent_stops_workers(self) -> None:
        """Called by the agent just before it signals its workers (the first time per
        attempt counts): note who had already ended (on their own or by someone else's
        signal), then the time."""
        if self.stopping_since is not None:
            return
        if self.enabled:
            self.poll()
        self.stopping_since = time.monotonic()

    def new_attempt(self) -> None:
        """The agent starts a new attempt's workers: none of them is being stopped."""
        self.stopping_since = None

    def add_worker(self, pid: int, rank: int) -> None:
        """Worker process ``pid`` of global rank ``rank`` started."""
        self.rank_of[pid] = rank
        self.latest[rank] = pid

    def poll(self) -> None:
        """Find new worker processes and note the ones that ended since the last poll."""
        # the agent's thread polls too (ended, agent_stops_workers): one scan at a time
        with self._lock:
            if self.find_workers and len(self.rank_of) - len(self.ended_at) < self.nproc:
                self._find_workers()
            dead: set[int] = set()
            # Scan again while a scan finds a new death: a process that ended before one
            # found ended is then found too, even if the scan looked at it just before it
            # ended (a rank that left first must never be dated after the peer it failed).
            while True:
                found = {pid for pid in list(self.rank_of) if pid not in self.ended_at and not alive(pid)}
                if found <= dead:
                    break
                dead |= found
            # One time for them all: they cannot be ordered. The time after the scan, not its
            # start: a slow scan of /proc (a loaded machine) must not date a death before the
            # launcher's signal.
            now = time.monotonic()
            for pid in dead:
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
                self.add_worker(int(name), int(env[b"RANK"]))


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not), from /proc; False without /proc.

    >>> alive(os.getpid())  # doctest: +SKIP
    True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def grace_agent_class(exit_times: ExitTimes, on_restart: Callable[[Any, int], None]) -> type:
    """torch's LocalElasticAgent, except that

    - after a failure the other workers get ``FAILURE_GRACE_S`` to end on their own
      before they are stopped (torch stops them at once: a rank that was about to fail
      the same way would be reported as stopped);
    - ``exit_times`` learns when the agent starts stopping workers (``report`` tells
      collateral ranks from the cause by it);
    - before a restart, ``on_restart(run_result, restarts_left)`` says why the attempt
      failed.

    Built on call: torch's elastic agent is imported only when a job starts."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class GraceAgent(LocalElasticAgent):
        _last_result = None

        def _start_workers(self, worker_group):
            exit_times.new_attempt()
            result = super()._start_workers(worker_group)
            _graceful_close(self._pcontext, exit_times)
            return result

        def _monitor_workers(self, worker_group):
            self._last_result = super()._monitor_workers(worker_group)
            return self._last_result

        def _restart_workers(self, worker_group):
            if self._last_result is not None and self._last_result.failures:
                on_restart(self._last_result, self._remaining_restarts)
            return super()._restart_workers(worker_group)

    return GraceAgent


def _graceful_close(pcontext: Any, exit_times: ExitTimes) -> None:
    """Wrap the process context's ``close``, which torch calls as soon as one worker
    failed (and again when it stops or restarts the group): give the others
    ``FAILURE_GRACE_S`` to end on their own first, and tell ``exit_times`` when the
    first signal goes out."""
    close = pcontext.close

    def graceful_close(*args: Any, **kwargs: Any) -> None:
        if getattr(pcontext, "_failures", None):
            deadline = time.monotonic() + FAILURE_GRACE_S
            while time.monotonic() < deadline and any(alive(pid) for pid in pcontext.pids().values()):
                time.sleep(0.02)  # a poll of the workers' state, not synchronisation
        exit_times.agent_stops_workers()
        for pid in pcontext.pids().values():
            # a stopped worker (SIGSTOP, a debugger's) handles torch's SIGTERM only once it
            # runs again: without this, close waits its full timeout before SIGKILL
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        close(*args, **kwargs)

    pcontext.close = graceful_close
