"""The first code of every worker process: prepare the process, then run the target in
it as ``python [-m] target args`` would.

The agent starts ``python -u <this file> [-m] target args`` (``--start_method spawn``;
by default the fork server runs ``main`` in a forked copy of the launcher as if it had,
see ``forkserver``): run as a file, not with ``-m globaltensor.launch.boot``, so that a
spawned worker imports neither globaltensor nor torch before its script asks for them.
It imports only the standard library (the directory of this file is ``sys.path[0]``
until the target's replaces it; none of the launcher's module names is a standard
library one). The launcher sets ``GLOBALTENSOR_LAUNCHER_PID`` and, in a
parameter-server job, ``GLOBALTENSOR_PS_WORKER_NUM``.

What it does, in order, and why:

- Linux: asks for SIGKILL when the launcher dies (even a SIGKILLed launcher leaves no
  orphaned workers), and exits if the launcher died before that took effect;
- sends stderr into stdout: one log per rank, both streams in the order written;
- on SIGTERM (the launcher stopping this rank because a peer failed) prints every
  thread's stack before ending: a rank stuck outside a collective shows where it is;
- in a parameter-server job, sets ``GLOBALTENSOR_PS_ROLE`` / ``GLOBALTENSOR_PS_RANK``;
- runs the target; an uncaught exception is printed without this file's and runpy's
  frames and without torch's second ``[rankN]:`` prefix, and exits with code 1;
- when the target ends (returns, ``sys.exit``, an uncaught exception), writes when and
  with which code into ``.left.<rank>`` in the job's log directory (``write_left``),
  before the interpreter's exit: the exit closes the rank's connections (its process
  groups are destroyed then), so its peers fail while it still runs, and the time its
  process ended would put it after them. The launcher reads these files (``read_left``)
  to name the rank that left first.

Example (what the agent runs for ``launch ... -m mypkg.train --lr 0.1``)::

    python -u .../globaltensor/launch/boot.py -m mypkg.train --lr 0.1
"""

import os
import sys
import time
from typing import Iterable, NamedTuple, Optional

# The file a rank's worker writes when its program ends, in the job's log directory.
LEFT_FILE = ".left.{rank}"


class Left(NamedTuple):
    """When a rank's program ended, as its worker wrote it (``write_left``)."""

    pid: int
    at: float  # time.monotonic(): one clock for every process of a machine (Linux), the launcher's too
    wall: float  # time.time(), for the summary
    code: int  # the exit code the program asked for


def main() -> None:
    """Prepare this worker process, then run ``sys.argv[1:]`` (``[-m] target args``)."""
    _die_with_launcher()
    os.dup2(1, 2)  # one log per rank, stdout and stderr in the order written
    _dump_stacks_on_sigterm()
    _set_ps_role()
    # Where to say when the target ended, read before it runs: it may change its environment.
    left = _left_path()
    as_module = sys.argv[1] == "-m"
    target = sys.argv[2] if as_module else sys.argv[1]
    sys.argv = sys.argv[2:] if as_module else sys.argv[1:]
    try:
        _run(target, as_module)
    except SystemExit as e:
        write_left(left, _exit_status(e.code))
        raise
    except BaseException as e:
        write_left(left, 1)
        _print_exception(e)
        sys.exit(1)
    write_left(left, 0)


def left_file(log_dir: str, rank: int) -> str:
    """The file in which rank ``rank``'s worker says when its program ended.

    >>> left_file("log/run", 3)
    'log/run/.left.3'
    """
    return os.path.join(log_dir, LEFT_FILE.format(rank=rank))


def _left_path() -> Optional[tuple[str, int]]:
    """(this rank's left file, this process's pid); None when not started by the launcher.

    The launcher names each rank's error file (``TORCHELASTIC_ERROR_FILE``) in the job's
    log directory (see ``logs.make_logs_specs``): the left file goes next to it."""
    error_file, rank = os.environ.get("TORCHELASTIC_ERROR_FILE"), os.environ.get("RANK", "")
    if not error_file or not rank.isdigit():
        return None
    return left_file(os.path.dirname(error_file), int(rank)), os.getpid()


def write_left(left: Optional[tuple[str, int]], code: int) -> None:
    """Say in ``left`` (from ``_left_path``) that this rank's program ended now with ``code``.

    Only the process that started the program writes: a child it forked (``os.fork``)
    may return through here too, and must not speak for the rank."""
    if left is None or os.getpid() != left[1]:
        return
    line = f"{os.getpid()} {time.monotonic()!r} {time.time()!r} {code}\n"
    try:
        fd = os.open(left[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return  # a planted link, a read-only directory: the summary falls back on exit times
    try:
        os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def read_left(log_dir: str, ranks: Iterable[int], pids: dict[int, int]) -> dict[int, Left]:
    """{rank: Left} for the ranks among ``ranks`` whose program's end is in ``log_dir``.

    ``pids`` ({rank: pid of its newest worker}, where known) drops a file an earlier
    attempt's worker wrote; a rank without a known pid takes the file as it is."""
    found = {}
    for rank in ranks:
        try:
            fd = os.open(left_file(log_dir, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        with open(fd) as f:
            fields = f.read().split()
        try:
            left = Left(int(fields[0]), float(fields[1]), float(fields[2]), int(fields[3]))
        except (IndexError, ValueError):
            continue  # cut short (the worker was killed while writing)
        if pids.get(rank, left.pid) == left.pid:
            found[rank] = left
    return found


def remove_left(log_dir: str, ranks: Iterable[int]) -> None:
    """Remove the left files of ``ranks`` (before an attempt: a stale one must not be
    read as this attempt's; at the end: the log directory keeps the logs only)."""
    for rank in ranks:
        try:
            os.remove(left_file(log_dir, rank))  # a link is removed, never followed
        except OSError:
            pass


def _exit_status(code: object) -> int:
    """The process exit code ``SystemExit(code)`` gives, as python computes it.

    >>> _exit_status(None), _exit_status(3), _exit_status("bye")
    (0, 3, 1)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _die_with_launcher() -> None:
    """Die with the launcher, even when it is SIGKILLed: no orphaned workers (Linux).
    A worker forked by the launcher's fork server dies with that server, which dies with
    the launcher (``GLOBALTENSOR_LAUNCHER_PID`` then names the server)."""
    _die_with_parent(int(os.environ["GLOBALTENSOR_LAUNCHER_PID"]))


def _die_with_parent(parent: int) -> None:
    """Get SIGKILL when ``parent`` (this process's parent) dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)  # the parent died before prctl took effect


def _dump_stacks_on_sigterm() -> None:
    """When the launcher stops this rank (a peer failed), print where it was: a rank
    stuck outside a collective is then visible. chain=True still terminates."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # Forked children (DataLoader workers, ...) are routinely ended by SIGTERM: no dumps from them.
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))


def _set_ps_role() -> None:
    """In a parameter-server job, global ranks below W are the workers, the rest servers."""
    workers = os.environ.get("GLOBALTENSOR_PS_WORKER_NUM")
    if workers is None:
        return
    rank, workers = int(os.environ["RANK"]), int(workers)
    os.environ["GLOBALTENSOR_PS_ROLE"] = "worker" if rank < workers else "server"
    os.environ["GLOBALTENSOR_PS_RANK"] = str(rank if rank < workers else rank - workers)


def _run(target: str, as_module: bool) -> None:
    """Run ``target`` as ``__main__``, with the ``sys.path[0]`` python would give it."""
    import runpy

    if as_module:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def _print_exception(e: BaseException) -> None:
    """Print an uncaught exception as python would, starting at the target's frames.

    torch.distributed wraps sys.excepthook to prefix "[rankN]: "; the launcher prefixes
    console lines already, so print through the hook it wrapped."""
    hook = sys.excepthook
    while getattr(hook, "__name__", "") == "_distributed_excepthook":
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
        hook = cells["old_hook"].cell_contents
    tb = e.__traceback__  # without this file's and runpy's frames
    while tb is not None and (tb.tb_frame.f_globals is globals()
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    hook(type(e), e.with_traceback(tb), tb)


if __name__ == "__main__":
    main()
