"""Run ``python -m globaltensor.launch ...`` without a new interpreter's torch import.

A job the suite launches (an example, a parameter-server job, a run killed and resumed)
spends about 1.5 CPU-seconds of its launcher importing torch before it starts anything;
the suite launches about forty of them. Here a server process
(``forked_launch_server.py``) imports torch once for the session and forks, per job, a
launcher that runs the launcher's ``__main__`` as
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
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from globaltensor.launch.forkserver import ForkedProcess, ForkServer

SERVER = Path(__file__).with_name("forked_launch_server.py")
_server: "_Server | None" = None
_server_lock = threading.Lock()


class _Server(ForkServer):
    """The test process's end of the server: ``start`` jobs; learning their exit codes
    is the launcher's own fork server's (``globaltensor/launch/forkserver.py``)."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # torch reads OMP_NUM_THREADS at its import: the server's is torch's default, and
        # each launcher sets its own job's (as a fresh torch would read it)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        super().__init__(self.proc.pid, ours)

    def start(self, args: list, cwd: str, env: dict, stdout: int, stderr: int) -> "Forked":
        message = json.dumps({"args": list(args), "cwd": str(cwd), "env": env}).encode()
        with self._lock:
            socket.send_fds(self._sock, [message], [stdout, stderr])
            while True:
                kind, pid, _ = self._receive(None)
                if kind == "started":
                    return Forked(self, pid, [sys.executable, "-m", "globaltensor.launch", *args])


class Forked(ForkedProcess):
    """What the tests use of ``subprocess.Popen``, for a launcher the server forked."""

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
