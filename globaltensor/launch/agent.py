"""The launcher's elastic agent: torch's, with a grace period after a failure, and a
watcher that records when each worker ended.

Both serve the failure summary (``report``): ranks that fail together (a bad config)
get ``FAILURE_GRACE_S`` to end on their own, so they are reported as failed with their
exit codes, not as stopped by the launcher; and when every rank ended tells the rank
that caused a failure from the peers that failed because of it.

Example::

    launcher_api.LocalElasticAgent = grace_agent_class()  # launch_agent builds it by name
    exit_times = ExitTimes(nproc=2); exit_times.start()
    ...; ended = exit_times.stop()                          # {rank: monotonic end time}
"""

from __future__ import annotations

import os
import threading
import time

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

    def __init__(self, nproc: int):
        super().__init__(name="globaltensor-exit-times", daemon=True)
        self.nproc, self.rank_of, self.ended_at = nproc, {}, {}  # pid -> rank / monotonic time
        self.latest: dict[int, int] = {}  # rank -> pid of its newest attempt
        self._done = threading.Event()
        self.enabled = os.path.isfile(f"/proc/{os.getpid()}/stat")

    def run(self) -> None:
        while self.enabled and not self._done.wait(EXIT_POLL_S):
            self.poll()

    def stop(self) -> dict[int, float]:
        """Stop watching; {rank: when its newest process ended} for ranks that ended."""
        self._done.set()
        if self.enabled:
            self.poll()
        return {r: self.ended_at[p] for r, p in self.latest.items() if p in self.ended_at}

    def poll(self) -> None:
        """Find new worker processes and note the ones that ended since the last poll."""
        now = time.monotonic()
        if len(self.rank_of) - len(self.ended_at) < self.nproc:  # workers still to find
            self._find_workers()
        for pid in self.rank_of:
            if pid not in self.ended_at and not alive(pid):
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


def grace_agent_class() -> type:
    """torch's LocalElasticAgent, except that a failure is reported once every worker
    has ended or ``FAILURE_GRACE_S`` has passed (torch stops the rest at once: a rank
    that was about to fail the same way would be reported as stopped).

    Built on call: torch's elastic agent is imported only when a job starts."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class GraceAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.FAILED or self._pcontext is None:
                return result
            deadline = time.monotonic() + FAILURE_GRACE_S
            while time.monotonic() < deadline and any(
                    alive(pid) for pid in self._pcontext.pids().values()):
                time.sleep(0.02)  # a poll of the workers' state, not synchronisation
            return super()._monitor_workers(worker_group)

    return GraceAgent
