"""Where a launcher job's log files go, how they are opened, and how they are read back.

Part of the launcher (``globaltensor.launch``), and the bottom of its layers: it imports
the standard library only (torch's elastic LogsSpecs where one is built). By default
each job writes into a new directory of its own, ``log/<run id>/`` (``log/latest``
links to the newest); an explicit ``--log_dir`` is used as given. Either way the job
locks the directory for its whole life, so a second job cannot truncate the first one's
logs and interleave its lines with them. Every file is opened without following
symbolic links.

Example::

    log_dir = new_run_dir("log")             # log/20250101-120000-4242, log/latest -> it
    lock = lock_log_dir(log_dir, range(0, 2))  # held until the launcher exits
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import sys
import time
from typing import Any, Optional

DEFAULT_LOG_ROOT = "log"
LATEST_LINK = "latest"
LOCK_FILE = ".lock"


class LaunchError(Exception):
    """A problem the launcher reports in one line (exit code 1)."""


def say(message: str) -> None:
    """Print one of the launcher's own lines (``globaltensor.launch: ...``) on stderr.

    Flushed at once: the workers' output and ours share the console.

    >>> say("node 1: waiting")  # doctest: +SKIP
    """
    print(f"globaltensor.launch: {message}", file=sys.stderr, flush=True)


def log_name(rank: int, ps: Optional[tuple[int, int]] = None) -> str:
    """``workerlog.<rank>``; in a parameter-server job (``ps`` = (servers, workers))
    ``workerlog.<worker rank>`` or ``serverlog.<server rank>``.

    >>> log_name(3), log_name(3, (2, 3))
    ('workerlog.3', 'serverlog.0')
    """
    if ps is not None and rank >= ps[1]:
        return f"serverlog.{rank - ps[1]}"
    return f"workerlog.{rank}"


def worker_log(log_dir: str, rank: int, ps: Optional[tuple[int, int]] = None) -> str:
    """The path of a rank's log file in ``log_dir`` (see ``log_name``).

    >>> worker_log("log/run", 3)
    'log/run/workerlog.3'
    """
    return os.path.join(log_dir, log_name(rank, ps))


def open_nofollow(name: str, flags: int, dir_fd: Optional[int] = None) -> int:
    """os.open that refuses a symbolic link as the last component (ELOOP -> LaunchError)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and dir_fd is None and os.path.islink(name)):
            raise LaunchError(f"{name} is a symbolic link; refusing to write worker logs through it") from None
        raise LaunchError(f"cannot open {name}: {e.strerror}") from None


def new_run_dir(root: str = DEFAULT_LOG_ROOT) -> str:
    """Create this job's own directory ``<root>/<start time>-<launcher pid>`` and point
    ``<root>/latest`` at it; returns its path.

    The pid makes the name unique among jobs started in the same second on this
    machine; an exclusive mkdir makes it unique anyway (a suffix on collision). The
    link is swapped in atomically, so a reader never finds it missing or half made.
    """
    os.makedirs(root, exist_ok=True)
    root_fd = open_nofollow(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        base = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for n in itertools.count():
            run_id = base if n == 0 else f"{base}.{n}"
            try:
                os.mkdir(run_id, 0o755, dir_fd=root_fd)
                break
            except FileExistsError:
                continue
        new_link = f".{LATEST_LINK}.{run_id}"
        os.symlink(run_id, new_link, dir_fd=root_fd)
        try:
            os.replace(new_link, LATEST_LINK, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError as e:  # e.g. a directory named "latest": leave it, the job runs on
            os.unlink(new_link, dir_fd=root_fd)
            say(f"{os.path.join(root, LATEST_LINK)} not updated ({e.strerror})")
    finally:
        os.close(root_fd)
    return os.path.join(root, run_id)


def lock_log_dir(log_dir: str, ranks: range) -> int:
    """Lock ``log_dir`` for this job's life: returns the descriptor holding the lock.

    Raises LaunchError, naming the directory, while another live job holds a lock on
    any of ``ranks`` there. The lock is a POSIX record lock on the bytes ``ranks`` of
    ``<log_dir>/.lock``: the nodes of one multi-node job writing into a shared directory
    lock different ranks and go together, while two jobs writing the same
    ``workerlog.N`` do not. The kernel drops the lock when the holder dies, so the file
    a killed job leaves behind blocks nobody.
    """
    os.makedirs(log_dir, exist_ok=True)
    dir_fd = open_nofollow(log_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_nofollow(LOCK_FILE, os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, len(ranks), ranks.start, os.SEEK_SET)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise LaunchError(f"cannot lock {os.path.join(log_dir, LOCK_FILE)}: {e.strerror}") from None
        raise LaunchError(
            f"--log_dir {log_dir} is in use by a job that is still running (it holds "
            f"{os.path.join(log_dir, LOCK_FILE)}); wait for it to end or choose another --log_dir "
            f"(without --log_dir each job gets its own directory under {DEFAULT_LOG_ROOT}/)") from None
    return fd


def make_logs_specs(log_dir: str, ps: Optional[tuple[int, int]] = None) -> Any:
    """A LogsSpecs that sends each worker's output to <log_dir>/workerlog.<global rank>
    (by role in a parameter-server job, see ``log_name``).

    The agent redirects the worker's stdout (stderr is merged into it by the worker
    bootstrap) to that file and tails it to our stdout with a rank prefix. We open the
    directory and each file ourselves without following symbolic links, and hand the
    agent ``/proc/self/fd/N``: it reopens the file we opened, whatever is planted at
    the path meanwhile.
    """
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.api import LogsDest

    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"

    class WorkerLogSpecs(LogsSpecs):
        @property
        def root_log_dir(self) -> str:
            return log_dir

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            os.makedirs(log_dir, exist_ok=True)
            dir_fd = open_nofollow(log_dir, os.O_RDONLY | os.O_DIRECTORY)
            dest = LogsDest()
            try:
                for local_rank, env in envs.items():
                    rank = int(env["RANK"])
                    name = log_name(rank, ps)
                    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                    if attempt > 0 and os.path.lexists(os.path.join(log_dir, name)):
                        # Keep the log of the attempt that failed (rename moves a link, never follows it).
                        os.replace(name, f"{name}.attempt{attempt - 1}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    fd = open_nofollow(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=dir_fd)
                    dest.stdouts[local_rank] = dest.tee_stdouts[local_rank] = f"{fd_dir}/{fd}"
                    dest.stderrs[local_rank] = ""  # nothing left on stderr after the merge
                    # Workers decorated with elastic's @record write their exception
                    # here; drop a stale one so it is not mistaken for this run's.
                    error_name = f"error.{rank}.json"
                    if os.path.lexists(os.path.join(log_dir, error_name)):
                        os.remove(error_name, dir_fd=dir_fd)
                    error_file = os.path.join(log_dir, error_name)
                    dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = error_file
            finally:
                os.close(dir_fd)
            return dest

    return WorkerLogSpecs(log_dir=log_dir)


def read_log(log_dir: str, rank: int, ps: Optional[tuple[int, int]] = None) -> Optional[list[str]]:
    """The lines of a rank's log (None if it cannot be read), opened without following links."""
    try:
        fd = os.open(worker_log(log_dir, rank, ps), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with open(fd, errors="replace") as f:
        return f.read().splitlines()
