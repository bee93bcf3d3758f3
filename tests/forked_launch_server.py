"""The server of ``forked_launch.py`` (run as a script, one per test session): it
imports torch and globaltensor (and dynamo and DTensor, which every launcher's fork
server imports for its workers) once and forks, per request, a launcher that runs
``python -m globaltensor.launch`` as a fresh interpreter would (see there): with the
job's environment, from which each launcher reads globaltensor's settings again.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading

_MAX_MESSAGE = 1 << 20


def _die_with_parent() -> None:
    """SIGKILL when the parent (the test process, or for a launcher the server) dies."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _serve(fd: int) -> None:
    # Imported once here, instead of once per launcher: torch, globaltensor (its
    # settings read again from each launcher's environment, ``_run_launcher``), and what
    # the launcher's own fork server imports for its workers' first op
    # (launch/forkserver.py).
    import torch  # noqa: F401

    import globaltensor.launch.job  # noqa: F401
    from globaltensor.launch.forkserver import import_what_a_first_op_imports
    import_what_a_first_op_imports()

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
            # The test kills a launcher by its session: it must lead one (setsid) before
            # its pid is reported
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()
                os.close(ready_r)
                os.close(ready_w)                  # the server's read returns
                sock.close()
                for other in children:
                    os.close(other)
                os._exit(_run_launcher(json.loads(data), fds))
            os.close(ready_w)
            os.read(ready_r, 1)
            os.close(ready_r)
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

    _die_with_parent()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from globaltensor import env
    env.reread()                                   # the settings globaltensor read here
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
