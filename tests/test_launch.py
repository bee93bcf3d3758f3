"""End-to-end tests of ``python -m globaltensor.launch`` (real worker processes, gloo on CPU).

Each launcher run costs a few seconds (torch import in every process), so one run
checks several things at once. Every run gets its own free port and log dir.
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

REPO = Path(__file__).resolve().parents[1]
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
    return subprocess.run(
        [sys.executable, "-m", "globaltensor.launch", *args],
        cwd=cwd, env=env or launcher_env(), capture_output=True, text=True, timeout=timeout,
    )


def env_reports(text: str) -> dict[int, dict]:
    """{rank: report} from the `ENV {...}` lines the workers print (prefix allowed)."""
    reports = [json.loads(m) for m in re.findall(r"ENV (\{.*\})", text)]
    return {int(r["RANK"]): r for r in reports}


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
        assert rep["allreduce"] == 3.0  # 1 + 2
        assert rep["argv"] == script_args  # untouched, option-looking ones included
        assert rep["module"] is None  # script mode

    # Console: every worker line carries its global rank.
    for rank in (0, 1):
        assert re.search(rf"^\[rank{rank}\]: ENV .*\"RANK\": \"{rank}\"", r.stdout, re.M)
        assert f"[rank{rank}]: stderr-line-from-rank-{rank}" in r.stdout

    # One log per global rank: stdout and stderr merged in the order written.
    for rank in (0, 1):
        lines = (log_dir / f"workerlog.{rank}").read_text().splitlines()
        assert lines[0].startswith("ENV ") and json.loads(lines[0][4:])["RANK"] == str(rank)
        assert lines[1:] == [f"stderr-line-from-rank-{rank}", f"stdout-after-stderr-rank-{rank}"]

    # Banner, once.
    assert r.stderr.count("world size") == 1
    assert re.search(r"world size\s*:\s*2", r.stderr)
    assert f"127.0.0.1:{port}" in r.stderr and str(log_dir) in r.stderr
    assert "OMP_NUM_THREADS" in r.stderr


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
        assert rep["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in r.stderr  # the banner does not claim to have set it


@pytest.mark.timeout(90)
def test_rank_exit_code_is_reported_with_log_tail(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    r = launch(["--nproc_per_node", "2", "--master_port", str(free_port()), "--log_dir", str(log_dir),
                str(SCRIPTS / "fail.py"), "exit"], cwd=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert re.search(r"rank 1 exited with code 3", r.stderr), r.stderr
    assert "rank1 line 29" in r.stderr and "rank1 line 10" in r.stderr  # last 20 lines ...
    assert "rank1 line 09" not in r.stderr  # ... and only those
    assert "Traceback" not in r.stderr  # a clean summary, not the launcher's stack
    assert "rank1 line 00" in (log_dir / "workerlog.1").read_text()
    assert "passed the barrier" not in r.stdout


@pytest.mark.timeout(60)
def test_raise_while_peer_waits_in_barrier_ends_promptly(tmp_path: Path) -> None:
    start = time.monotonic()
    r = launch(["--nproc_per_node", "2", "--master_port", str(free_port()), "--log_dir", str(tmp_path / "log"),
                str(SCRIPTS / "fail.py"), "raise"], cwd=tmp_path, timeout=45)
    elapsed = time.monotonic() - start
    assert r.returncode != 0, r.stdout + r.stderr
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert re.search(r"rank 1 exited with code 1", r.stderr), r.stderr
    assert "RuntimeError: boom from rank 1" in r.stderr  # exception (from @record) and log tail
    assert "passed the barrier" not in r.stdout


@pytest.mark.timeout(120)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "globaltensor.launch", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
             "--log_dir", str(tmp_path / f"node{node}"), str(SCRIPTS / "report_env.py"), "node-arg"],
            cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        assert re.search(r"world size\s*:\s*4", err)
    for node, (out, _) in enumerate(outs):
        reports = env_reports(out)
        assert sorted(reports) == [2 * node, 2 * node + 1]
        for rank, rep in reports.items():
            assert rep["WORLD_SIZE"] == "4" and rep["LOCAL_WORLD_SIZE"] == "2"
            assert rep["LOCAL_RANK"] == str(rank - 2 * node)
            assert rep["MASTER_PORT"] == str(port)
            assert rep["allreduce"] == 10.0  # 1 + 2 + 3 + 4 across both nodes
            assert f"[rank{rank}]: ENV" in out
            assert (tmp_path / f"node{node}" / f"workerlog.{rank}").is_file()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc_per_node", "0", "SCRIPT"], "nproc_per_node"),
        (["--nnodes", "0", "SCRIPT"], "nnodes"),
        (["--nnodes", "2", "--node_rank", "2", "SCRIPT"], "node_rank"),
        (["--master_port", "0", "SCRIPT"], "master_port"),
        (["--master_port", "65536", "SCRIPT"], "master_port"),
        (["does_not_exist.py"], "not found"),
        ([], "no script"),
    ],
)
def test_bad_arguments_fail_fast(tmp_path: Path, args: list[str], message: str) -> None:
    args = [str(SCRIPTS / "report_env.py") if a == "SCRIPT" else a for a in args]
    start = time.monotonic()
    r = launch(["--log_dir", str(tmp_path / "log"), *args], cwd=tmp_path, timeout=30)
    assert r.returncode != 0
    assert time.monotonic() - start < 10
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "log").exists()  # nothing was started
