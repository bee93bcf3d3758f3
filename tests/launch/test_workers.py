"""End-to-end tests of ``python -m globaltensor.launch`` (real worker processes, gloo on
CPU): what a worker gets (environment, argv, script or module mode, OMP_NUM_THREADS,
rank prefixes, one log per rank), the start methods (forked from the fork server or
spawned) and the worker boot (launch/boot.py) on its own.

Each launcher run costs a few seconds (the launcher imports torch; its workers are
forked from it), so one run checks several things at once. Every run gets its own free
port and log dir (tests/launch/launch_helpers.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, env_reports, free_port, launch, launch_nodes, launcher_env


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_ranks_env_collective_logs_prefixes_and_args(tmp_path: Path) -> None:
    port, log_dir = free_port(), tmp_path / "logs"
    script_args = ["--nnodes", "3", "--", "a$$b", "${local_rank}", "-m", "x y"]
    # kebab-case spellings here, snake_case in the other tests
    r = launch(["--nproc-per-node", "2", "--master-port", str(port), "--log-dir", str(log_dir),
                str(SCRIPTS / "report_env.py"), *script_args], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    reports = env_reports(r.stdout)
    assert sorted(reports) == [0, 1]
    for rank, rep in reports.items():
        assert rep["WORLD_SIZE"] == "2" and rep["LOCAL_WORLD_SIZE"] == "2"
        assert rep["LOCAL_RANK"] == str(rank)
        assert (rep["MASTER_ADDR"], rep["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert rep["OMP_NUM_THREADS"] == "1"  # unset in our env, nproc_per_node > 1
        assert rep["threads"] == 1  # torch's threads follow it (the launcher's was unset)
        assert rep["allreduce"] == 3.0  # 1 + 2
        assert rep["argv"] == script_args  # untouched, option-looking ones included
        assert rep["module"] is None  # script mode
        # The rendezvous store (on the launcher) listens on the master address only (#10 item 7).
        assert rep["listening"] == ["127.0.0.1"], rep["listening"]

    # Console: every worker line carries its global rank.
    for rank in (0, 1):
        assert re.search(rf"^\[rank{rank}\]: ENV .*\"RANK\": \"{rank}\"", r.stdout, re.M)
        assert f"[rank{rank}]: stderr-line-from-rank-{rank}" in r.stdout

    # One log per global rank: stdout and stderr merged in the order written.
    for rank in (0, 1):
        lines = (log_dir / f"workerlog.{rank}").read_text().splitlines()
        assert lines[0].startswith("ENV ") and json.loads(lines[0][4:])["RANK"] == str(rank)
        assert lines[1:3] == [f"stderr-line-from-rank-{rank}", f"stdout-after-stderr-rank-{rank}"]

    # Banner, once.
    assert r.stderr.count("world size") == 1
    assert re.search(r"world size\s*:\s*2", r.stderr)
    assert f"127.0.0.1:{port}" in r.stderr and str(log_dir) in r.stderr
    assert "OMP_NUM_THREADS" in r.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_module_mode_and_omp_num_threads_left_alone(tmp_path: Path) -> None:
    port = free_port()
    r = launch(["--nproc_per_node", "2", "--master_port", str(port), "--log_dir", str(tmp_path / "log"),
                "-m", "report_env", "--flag"], cwd=tmp_path, env=launcher_env(OMP_NUM_THREADS="3"))
    assert r.returncode == 0, r.stdout + r.stderr
    reports = env_reports(r.stdout)
    assert sorted(reports) == [0, 1]
    for rep in reports.values():
        assert rep["module"] == "report_env"  # ran via `python -m`
        assert rep["argv"] == ["--flag"]
        assert rep["OMP_NUM_THREADS"] == "3" and rep["threads"] == 3
    assert "OMP_NUM_THREADS" not in r.stderr  # the banner does not claim to have set it


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_forked_and_spawned_workers_start_alike(tmp_path: Path) -> None:
    """The default start (forked from the launcher's fork server) gives a worker what a
    fresh interpreter (--start_method spawn) gives it; only the import is done already."""
    runs = {method: ["--nproc_per_node", "2", "--master_port", str(free_port()), "--log_dir",
                     str(tmp_path / method), "--start_method", method,
                     str(SCRIPTS / "report_env.py"), "x"]
            for method in ("forkserver", "spawn")}
    results = dict(zip(runs, launch_nodes(list(runs.values()), tmp_path, timeout=80)))
    same = {}
    for method, (code, out, err, _) in results.items():
        assert code == 0, out + err
        reports = env_reports(out)
        assert sorted(reports) == [0, 1], out
        assert all(rep["preloaded"] == (method == "forkserver") for rep in reports.values())
        assert reports[0]["random"] != reports[1]["random"]  # seeded per process
        for rank in (0, 1):
            log = (tmp_path / method / f"workerlog.{rank}").read_text().splitlines()
            assert log[-2:] == ["thread joined", "atexit ran"], log
        same[method] = {rank: {k: v for k, v in rep.items()
                               if k not in ("MASTER_PORT", "random", "preloaded")}
                        for rank, rep in reports.items()}
    assert same["forkserver"] == same["spawn"]
    bad = launch(["--start_method", "fork", str(SCRIPTS / "report_env.py")], cwd=tmp_path)
    assert bad.returncode == 2 and "--start_method must be one of forkserver, spawn, got 'fork'" in bad.stderr


def test_worker_boot_runs_the_target_as_python_would(tmp_path: Path) -> None:
    """launch/boot.py alone (no agent, no torch): stderr merged into stdout in order, the
    script's argv and sys.path[0], the parameter-server role, nothing imported before the
    script, exit codes, and a traceback that starts at the script."""
    from globaltensor.launch import boot

    (tmp_path / "prog.py").write_text(
        "import os, sys\n"
        "print('argv', sys.argv[1:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)), flush=True)\n"
        "print('role', os.environ.get('GLOBALTENSOR_PS_ROLE'), os.environ.get('GLOBALTENSOR_PS_RANK'),\n"
        "      file=sys.stderr, flush=True)\n"
        "print('loaded', sorted({'torch', 'globaltensor'} & set(sys.modules)), flush=True)\n"
        "def fails():\n"
        "    raise ValueError('from prog')\n"
        "if sys.argv[1] == 'raise':\n"
        "    fails()\n"
        "sys.exit(int(sys.argv[1]))\n")
    env = {**os.environ, "GLOBALTENSOR_LAUNCHER_PID": str(os.getpid()), "RANK": "3",
           "GLOBALTENSOR_PS_WORKER_NUM": "2"}
    r = subprocess.run([sys.executable, "-u", boot.__file__, str(tmp_path / "prog.py"), "raise", "a$b"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stderr) == (1, ""), r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["argv ['raise', 'a$b'] True", "role server 1", "loaded []",
                         "Traceback (most recent call last):"], r.stdout
    assert 'prog.py", line 9, in <module>' in lines[4] and lines[-1] == "ValueError: from prog", r.stdout
    assert "boot.py" not in r.stdout and "runpy" not in r.stdout, r.stdout
    del env["GLOBALTENSOR_PS_WORKER_NUM"]
    r = subprocess.run([sys.executable, "-u", boot.__file__, "-m", "prog", "7"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 7 and r.stdout.splitlines() == ["argv ['7'] True", "role None None", "loaded []"], r


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_fork_server_reports_exits_as_popen_and_survives_a_reaped_worker(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "forkserver_checks.py"), str(tmp_path)],
                       cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
