"""Run ``python -m globaltensor.launch ...`` without a new interpreter's torch import.

A job the suite launches (an example, a parameter-server job, a run killed and resumed)
spends about 1.5 CPU-seconds of its launcher importing torch before it starts anything;
the suite launches about thirty of them. Here a server process imports torch once for
the session and forks, per job, a launcher that runs the launcher's ``__main__`` as
``python -m globaltensor.launch`` would: in its own session (``setsid``), with the job's
environment, working directory, ``sys.path`` and output files, default signal
handlers, and at its end threading's exit hooks and the ``atexit`` handlers. The
launcher's own start of its workers, its rendezvous and its reports are unchanged.

What such a launcher does not get that a fresh interpreter would: a library that reads
an environment variable when it is imported (torch, and what torch imports) read the
server's. Real interpreters still start the launchers of the tests that run several
nodes at once, signal a launcher or read its output while it runs (``tests/launch/``),
so the command itself stays tested as users type it.

>>> proc = start(["--nproc_per_node", "2", "train.py"], cwd, env, out_fd, err_fd)  # doctest: +SKIP
>>> proc.wait(150)                                                                  # doctest: +SKIP
0
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

_MAX_MESSAGE = 1 << 20
_server: "_Server | None" = None
_server_lock = threading.Lock()


class _Server:
    """The test process's end of the server: ``start`` jobs, learn their exit codes."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # torch reads OMP_NUM_THREADS at its import: the server's is torch's default, and
        # each launcher sets its own job's (as a fresh torch would read it)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._sock, self._lock, self._exit_codes = ours, threading.Lock(), {}

    def start(self, args: list, cwd: str, env: dict, stdout: int, stderr: int) -> "Forked":
        message = json.dumps({"args": list(args), "cwd": str(cwd), "env": env}).encode()
        with self._lock:
            socket.send_fds(self._sock, [message], [stdout, stderr])
            while True:
                kind, pid, _ = self._receive(None)
                if kind == "started":
                    return Forked(self, pid, [sys.executable, "-m", "globaltensor.launch", *args])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while pid not in self._exit_codes:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._receive(left) is None:
                    break
            return self._exit_codes.get(pid)

    def _receive(self, timeout: float | None):
        if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
            return None
        data = self._sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError("the suite's launcher server ended unexpectedly")
        kind, pid, code = data.decode().split()
        if kind == "exited":
            self._exit_codes[int(pid)] = int(code)
        return kind, int(pid), int(code)


class Forked:
    """What the tests use of ``subprocess.Popen``, for a launcher the server forked."""

    def __init__(self, server: _Server, pid: int, args: list):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the launcher's session; its workers die with it (their fork server
        gets SIGKILL when the launcher dies, and they when the server does)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(args: list, cwd, env: dict, stdout: int, stderr: int) -> Forked:
    """``python -m globaltensor.launch *args`` in ``cwd`` with environment ``env``, its
    output to the descriptors ``stdout`` and ``stderr``, forked from the session's
    server (started at first use)."""
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
    return _server.start(args, cwd, env, stdout, stderr)


def run(args: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "globaltensor.launch", *args], capture_output=True,
    text=True, timeout=timeout, cwd=cwd, env=env)``, the launcher forked (``start``)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = start(args, cwd, env, out.fileno(), err.fileno())
        try:
            code = proc.wait(timeout)
        except BaseException:              # the timeout, or the test's own (as run's)
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


# --------------------------------------------------------------------------------------
# the server process (this file run as a script)
# --------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL when the parent (the test process, or for a launcher the server) dies."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _serve(fd: int) -> None:
    import torch  # noqa: F401  (imported once here, instead of once per launcher)

    _die_with_parent()
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the test process's to handle
    children: dict = {}                            # pidfd -> pid
    while True:
        for ready in select.select([sock, *children], [], [])[0]:
            if ready in children:
                pid = children.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                sock.send(f"exited {pid} {os.waitstatus_to_exitcode(status)}".encode())
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            if not data:
                os._exit(0)                        # the test process is done
            pid = os.fork()
            if pid == 0:
                sock.close()
                for other in children:
                    os.close(other)
                os._exit(_run_launcher(json.loads(data), fds))
            for child_fd in fds:
                os.close(child_fd)
            children[os.pidfd_open(pid)] = pid
            sock.send(f"started {pid} 0".encode())


def _run_launcher(request: dict, fds: list) -> int:
    """Become ``python -m globaltensor.launch *args`` and run it; its exit code once it
    has done what python does at exit."""
    import atexit
    import io
    import random
    import runpy
    import traceback

    os.setsid()                                    # its own session, as the tests kill it
    _die_with_parent()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()
    if "OMP_NUM_THREADS" in os.environ:            # as a fresh torch reads it at its load
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # sys.path as `python -m` makes it here: the working directory, then PYTHONPATH
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *(p for p in sys.path[1:] if p not in extra)]
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.argv = ["-m", *request["args"]]
    code = 0
    try:
        runpy.run_module("globaltensor.launch", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()                          # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code & 0xFF


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
