"""Workers forked from a copy of the launcher: a worker starts in milliseconds instead of
the 1.5-2 s a fresh interpreter spends importing torch (the launcher imported torch and
globaltensor already, and the server imports what a worker's first op would: dynamo and
DTensor; ``--start_method spawn`` starts fresh interpreters instead).

The launcher forks this server once, before it starts any thread (forking a process
with threads copies locks that no thread will release). The server stays
single-threaded and runs no user code: for each worker the agent asks for, it forks a
child that becomes what ``python -u boot.py [-m] target args`` would be, and it reports
each child's exit code. A worker is the server's child, so the launcher cannot wait for
it; ``ForkedProcess`` stands in for the ``Popen`` torch's agent polls, waits for and
signals (by process group, as with ``Popen(start_new_session=True)``).

What a forked worker gets that a fresh interpreter would: the job's environment (the
launcher's plus the rank's variables), globaltensor's settings read from it
(``env.reread``), OpenMP threads set from ``OMP_NUM_THREADS`` (the OpenMP runtime read
the launcher's environment when it loaded), its log files as stdout/stderr,
unbuffered, default signal handlers, fresh ``random`` state, and at exit threading's
exit hooks, its non-daemon threads joined and its ``atexit`` handlers. What it does not: a library that
reads an environment variable when it is imported reads the launcher's value, so a
script that sets such a variable before ``import torch`` needs ``--start_method spawn``.

Death: the server gets SIGKILL when the launcher dies, and a worker when the server
dies (``boot._die_with_launcher``, with ``GLOBALTENSOR_LAUNCHER_PID`` naming the server).

Example (what ``job`` does)::

    if can_fork() is None:                                       # else: spawn
        server = ForkServer.start(close_fds=[listen_fd, lock_fd])
        proc = server.spawn(["-u", boot.__file__, "train.py"], env, stdout_fd, stderr_fd)
        proc.poll(), proc.wait(5.0)
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional

from . import boot

__all__ = ["ForkServer", "ForkedProcess", "can_fork", "handler_factory"]

# A request carries the worker's environment (a few KiB) in one message, which must fit
# the socket's buffer (about 200 KiB by default on Linux).
_MAX_ENVIRONMENT = 64 << 10
_MAX_MESSAGE = 1 << 20


def can_fork() -> Optional[str]:
    """Why this process cannot start a fork server (None: it can)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "forked workers need Linux and Python >= 3.9"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return "this kernel has no pidfd_open (Linux < 5.3)"
    # Native pools that import started (OpenBLAS's, under numpy) have fork handlers; a
    # Python thread could hold a lock that no thread of a forked copy releases.
    if threading.active_count() != 1:
        return "the launcher runs threads already"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the launcher initialized CUDA"
    if len(json.dumps(dict(os.environ))) > _MAX_ENVIRONMENT:
        return f"the environment is over {_MAX_ENVIRONMENT >> 10} KiB"
    return None


class ForkServer:
    """The launcher's end of the fork server: ``spawn`` workers, learn their exits."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self._sock = pid, sock
        self._lock = threading.Lock()
        self._exit_codes: dict[int, int] = {}

    @classmethod
    def start(cls, close_fds: Iterable[int] = ()) -> "ForkServer":
        """Fork the server from this (single-threaded) process; ``close_fds`` are
        descriptors the workers must not hold (the rendezvous socket, the log lock)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server, then (after _serve returns) one of its workers
            code = 1
            try:
                ours.close()
                for fd in close_fds:
                    os.close(fd)
                code = _run_worker(*_serve(theirs, launcher))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the launcher's code
        theirs.close()
        return cls(pid, ours)

    def close(self) -> None:
        """End the server (it exits when its socket closes) and reap it."""
        self._sock.close()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            time.sleep(0.01)  # a poll of the server's exit, bounded

    def spawn(self, args: list[str], env: dict[str, str], stdout: Optional[int],
              stderr: Optional[int]) -> "ForkedProcess":
        """Start a worker as ``python *args`` would with environment ``env`` and the given
        output descriptors (None: the launcher's)."""
        if args[:2] != ["-u", boot.__file__]:
            raise ValueError(f"the fork server starts only the launcher's boot file, not {args}")
        fds = [1 if stdout is None else stdout, 2 if stderr is None else stderr]
        message = json.dumps({"argv": args[2:], "env": env}).encode()
        with self._lock:
            socket.send_fds(self._sock, [message], fds)
            while True:
                kind, pid, code = self._receive(None)
                if kind == "started":
                    return ForkedProcess(self, pid, args)

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The exit code of worker ``pid`` (negative: the signal that ended it), waiting
        at most ``timeout`` seconds (0: not at all; None: until it ends)."""
        with self._lock:
            if pid in self._exit_codes:
                return self._exit_codes[pid]
            deadline = None if timeout is None else time.monotonic() + timeout
            while pid not in self._exit_codes:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._receive(left) is None:  # nothing within the time left
                    break
            return self._exit_codes.get(pid)

    def _receive(self, timeout: Optional[float]):
        """One message from the server within ``timeout`` (None: wait), exits recorded."""
        if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
            return None
        data = self._sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError("the launcher's fork server ended unexpectedly")
        kind, pid, code = data.decode().split()
        if kind == "exited":
            self._exit_codes[int(pid)] = int(code)
        return kind, int(pid), int(code)


class ForkedProcess:
    """The part of ``subprocess.Popen`` torch's agent uses, for a forked worker."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def handler_factory(server: ForkServer, on_start: Callable[[int, dict], None]) -> Callable[..., Any]:
    """A stand-in for torch's ``get_subprocess_handler`` whose workers ``server`` forks;
    ``on_start(pid, env)`` is told of each worker. Built on call: torch's elastic modules
    are imported only when a job starts."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict) -> Any:
            proc = server.spawn(list(args[1:]), env, _fileno(self._stdout), _fileno(self._stderr))
            on_start(proc.pid, env)
            return proc

        def close(self, death_sig: Optional[signal.Signals] = None) -> None:
            # The server reaps a worker as it ends, before the agent hears of it: signalling
            # its group may then find no process, which is what the agent wanted.
            try:
                os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
            except ProcessLookupError:
                pass
            for stream in (self._stdout, self._stderr):
                if stream is not None:
                    stream.close()

    def get_subprocess_handler(entrypoint, args, env, stdout, stderr, local_rank_id,
                               numa_options=None):
        return ForkedHandler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

    return get_subprocess_handler


def _fileno(stream: Any) -> Optional[int]:
    return None if stream is None else stream.fileno()


# --------------------------------------------------------------------------------------
# the server process
# --------------------------------------------------------------------------------------

def _serve(sock: socket.socket, launcher: int) -> tuple[dict, list[int]]:
    """Fork a worker per request and report exits, until the launcher closes the socket
    (then exit). Returns ``(request, fds)`` in a forked worker only."""
    try:
        return _serve_until_closed(sock, launcher)
    except (BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the launcher went away while an exit was being reported


def _serve_until_closed(sock: socket.socket, launcher: int) -> tuple[dict, list[int]]:
    boot._die_with_parent(launcher)
    # Ctrl-C reaches the launcher's whole process group; the launcher stops the workers
    # itself (gracefully), so the server must outlive the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import_what_a_first_op_imports()
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        ready = select.select([sock, *children], [], [])[0]
        for fd in ready:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                sock.send(f"exited {pid} {os.waitstatus_to_exitcode(status)}".encode())
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            if not data:
                os._exit(0)  # the launcher is done (or gone): its workers have ended
            # The agent signals a worker's process group as soon as it knows the pid: the
            # worker must lead its own group (setsid) before the pid is reported.
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # as Popen(start_new_session=True)
                os.close(ready_r)
                os.close(ready_w)  # the server's read returns
                sock.close()
                for child_fd in children:
                    os.close(child_fd)
                return json.loads(data), fds
            os.close(ready_w)
            os.read(ready_r, 1)
            os.close(ready_r)
            for child_fd in fds:
                os.close(child_fd)
            children[os.pidfd_open(pid)] = pid
            sock.send(f"started {pid} 0".encode())


# What a process's first global op imports (a meta kernel written in Python imports
# dynamo; the first op of a tensor subclass, DTensor): 1.8 s of CPU per process. Fork
# servers import it once for their children (here, and globaltensor.testing's worlds).
FIRST_OP_IMPORTS = ("torch._dynamo", "torch.distributed.tensor")


def import_what_a_first_op_imports() -> None:
    """Import ``FIRST_OP_IMPORTS`` once here, for every worker, while the launcher forms
    its group. They start no thread and read the launcher's environment, as torch
    itself did."""
    if "torch" not in sys.modules:
        return
    import importlib
    for name in FIRST_OP_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (the worker imports it itself, or fails there)
            return


def _run_worker(request: dict, fds: list[int]) -> int:
    """Turn this forked process into the worker ``python -u boot.py *argv`` would be and
    run it; returns its exit code once it has done what python does at exit."""
    import atexit
    import io
    import random

    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["GLOBALTENSOR_LAUNCHER_PID"] = str(os.getppid())  # boot dies with the server
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    random.seed()  # a fresh interpreter seeds from the system, not from the launcher's state
    from .. import env
    env.reread()  # globaltensor's settings read at import, from this worker's environment
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in os.environ:
        try:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            pass  # as a fresh torch does with a malformed value: its default
    for name, fd in (("stdout", 1), ("stderr", 2)):  # python -u
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                  encoding=getattr(sys, name).encoding,
                                  errors="backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.argv = [boot.__file__, *request["argv"]]
    code = 0
    try:
        boot.main()
    except SystemExit as e:
        code = _exit_code(e.code)
    # What the interpreter does at exit: threading's own exit hooks (they stop the
    # workers of idle thread pools, torch.compile's among them), then wait for the
    # non-daemon threads, then the atexit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(code: object) -> int:
    """The process exit code of ``SystemExit(code)``, as python computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
