"""What the launcher's tests (tests/launch/test_*.py) share: the repository and the
worker scripts, a free port, the launcher's environment, running the launcher (one
node, several nodes at once, or its ``main`` in this process) and reading what its
workers print.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    # The package may not be installed; SCRIPTS makes the worker module importable for -m.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPTS), env.get("PYTHONPATH", "")])
    env.update(overrides)
    return env


def launch(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60):
    """``python -m globaltensor.launch *args`` run to its end (a CompletedProcess), the
    launcher forked from the suite's launcher server (``tests/forked_launch.py``: no
    torch import per launch); ``launch_nodes`` and the tests that signal a launcher
    start real interpreters."""
    import forked_launch
    return forked_launch.run(args, cwd, env or launcher_env(), timeout)


def launch_nodes(per_node: list[list[str]], cwd: Path, timeout: float) -> list[tuple]:
    """One launcher per entry of ``per_node`` (that node's arguments), started together:
    per node (exit code, stdout, stderr, seconds until it had ended)."""
    procs = [subprocess.Popen([sys.executable, "-m", "globaltensor.launch", *args], cwd=cwd,
                              env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in per_node]
    start, done = time.monotonic(), []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append((p.returncode, out, err, time.monotonic() - start))
    finally:
        for p in procs:
            p.kill()
    return done


def env_reports(text: str) -> dict[int, dict]:
    """{rank: report} from the `ENV {...}` lines the workers print (prefix allowed)."""
    reports = [json.loads(m) for m in re.findall(r"ENV (\{.*\})", text)]
    return {int(r["RANK"]): r for r in reports}


def wait_for_lines(proc: subprocess.Popen, prefix: str, count: int, timeout: float) -> list[str]:
    """The first ``count`` stdout lines of ``proc`` containing ``prefix`` (or fail at ``timeout``)."""
    import selectors

    # Read the pipe's fd directly: readline() on the text stream may buffer a second
    # line that arrived with the first, and select() on the fd would not see it again.
    found, sel, pending = [], selectors.DefaultSelector(), ""
    fd = proc.stdout.fileno()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while len(found) < count:
        while "\n" not in pending:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"no {count} {prefix!r} lines within {timeout} s: {found}"
            chunk = os.read(fd, 65536)
            assert chunk, f"launcher ended before printing {count} {prefix!r} lines"
            pending += chunk.decode(errors="replace")
        line, pending = pending.split("\n", 1)
        if prefix in line:
            found.append(line + "\n")
    return found


def run_in_process(argv: list[str], capfd) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the launcher's ``main(argv)`` in this process, which
    must exit before starting anything (a refusal, --version: as in
    test_bad_arguments_fail_fast, this saves a launcher start, ~1.7 s of torch import);
    stdout and stderr are read at the file descriptors (all that was written)."""
    from globaltensor.launch import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capfd.readouterr()
    return exit_.value.code, out, err


def auto_nproc() -> int:
    """torchrun's --nproc_per_node auto: one process per GPU, else one per usable CPU core."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))

