"""End-to-end tests of ``python -m globaltensor.launch`` (real worker processes, gloo on CPU).

Each launcher run costs a few seconds (the launcher imports torch; its workers are
forked from it), so one run checks several things at once. Every run gets its own free
port and log dir.
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
    return subprocess.run(
        [sys.executable, "-m", "globaltensor.launch", *args],
        cwd=cwd, env=env or launcher_env(), capture_output=True, text=True, timeout=timeout,
    )


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


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_raise_while_peer_waits_in_barrier_ends_promptly(tmp_path: Path) -> None:
    # Rank 0 would wait in the barrier for the default 30 min: the timeout is the check.
    r = launch(["--nproc_per_node", "2", "--master_port", str(free_port()), "--log_dir", str(tmp_path / "log"),
                str(SCRIPTS / "fail.py"), "raise"], cwd=tmp_path, timeout=45)
    assert r.returncode != 0, r.stdout + r.stderr
    assert re.search(r"rank 1 exited with code 1", r.stderr), r.stderr
    assert "RuntimeError: boom from rank 1" in r.stderr  # exception (from @record) and log tail
    assert "passed the barrier" not in r.stdout
    # One rank prefix per line (torch's excepthook adds its own after init_process_group),
    # and the traceback starts at the script (no frames of the launcher's bootstrap).
    assert "[rank1]: Traceback" in r.stdout and "[rank1]: [rank1]" not in r.stdout, r.stdout
    assert '"<string>"' not in r.stdout and "runpy" not in r.stdout, r.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    port = free_port()
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(port),
                          "--log_dir", str(tmp_path / f"node{node}"), str(SCRIPTS / "report_env.py"),
                          "node-arg"] for node in (0, 1)], tmp_path, timeout=100)
    for node, (code, out, err, _) in enumerate(runs):
        assert code == 0, out + err
        assert re.search(r"world size\s*:\s*4", err)
        reports = env_reports(out)
        assert sorted(reports) == [2 * node, 2 * node + 1]
        for rank, rep in reports.items():
            assert rep["WORLD_SIZE"] == "4" and rep["LOCAL_WORLD_SIZE"] == "2"
            assert rep["LOCAL_RANK"] == str(rank - 2 * node)
            assert rep["MASTER_PORT"] == str(port)
            assert rep["allreduce"] == 10.0  # 1 + 2 + 3 + 4 across both nodes
            assert f"[rank{rank}]: ENV" in out
            assert (tmp_path / f"node{node}" / f"workerlog.{rank}").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_nodes_on_their_own_loopback_addresses(tmp_path: Path) -> None:
    # node 0 on 127.0.0.2 (--master_addr: the store's address, and by default its gloo
    # address), node 1 on 127.0.0.3 (--local_addr); the hostname here resolves to 127.0.0.1
    port = free_port()
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.2",
                          "--master_port", str(port), *local, "--log_dir", str(tmp_path / f"node{node}"),
                          str(SCRIPTS / "addresses.py")]
                         for node, local in ((0, []), (1, ["--local_addr", "127.0.0.3"]))], tmp_path, timeout=60)
    reports = []
    for node, (code, out, err, _) in enumerate(runs):
        assert code == 0, out + err
        assert f"local address   : 127.0.0.{2 + node}" in err, err
        reports.append(json.loads(re.search(r"SOCKETS (\{.*\})", out).group(1)))
        assert reports[node]["rank"] == node and reports[node]["sum"] == 2.0, reports[node]
        # gloo listens on the node's address only
        assert [a.split(":")[0] for a in reports[node]["listening"]] == [f"127.0.0.{2 + node}"], reports[node]
    # and the ranks' pair was made through one of these listeners (an accepted connection
    # keeps the listener's address and port; the connecting side's source the kernel picks)
    pair = [(rank, local, remote) for rank, r in enumerate(reports) for local, remote in r["connected"]
            if local in r["listening"] or remote in reports[1 - rank]["listening"]]
    assert pair, reports
    # an address that is not this machine's is refused before anything starts
    r = launch(["--nnodes", "2", "--node_rank", "1", "--local_addr", "192.0.2.1", str(SCRIPTS / "addresses.py")],
               cwd=tmp_path, timeout=30)
    assert r.returncode == 1 and "--local_addr 192.0.2.1 is not an address of this machine" in r.stderr, r.stderr


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
def test_bad_arguments_fail_fast(tmp_path: Path, args: list[str], message: str, capsys,
                                monkeypatch) -> None:
    # in this process (the checks come before anything starts): an exception other
    # than the one-line exit would fail the test here
    from globaltensor.launch import main
    monkeypatch.chdir(tmp_path)
    args = [str(SCRIPTS / "report_env.py") if a == "SCRIPT" else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(["--log_dir", str(tmp_path / "log"), *args])
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "log").exists()  # nothing was started


# --- faults: the summary names the rank that caused them (#16 item 6, #10 item 17) ----

def summary(stderr: str) -> str:
    """The launcher's own lines (the failure summary), without the banner."""
    return "\n".join(line for line in stderr.splitlines() if line.startswith(("globaltensor.launch", "  ")))


FAULT_CASES = [
    # rank 1 exits 0 at once (os._exit: it says nothing, its process's end counts); rank 0's
    # all_reduce then fails: rank 1 is named first (rank 0 then exits 1, or gloo's threads
    # abort it at exit: that is torch's, not the summary's)
    ("early", [r"rank 1 exited with code 0 at \d\d:\d\d:\d\d\.\d{3}, before the others finished: the first "
               r"to leave; then rank 0 (exited with code 1|was killed by signal SIGABRT)"]),
    # rank 1 is stuck outside the barrier, rank 0 times out: rank 1 is named, with where it was
    ("hang", [r"rank 0 exited with code 1 after a timeout; rank 1 was still running",
              r"rank 1: still running, stopped by the launcher in File .*faults\.py.* in stuck_here"]),
    # every rank exits 1, only rank 0 says why: rank 0 and its reason, not rank 1's empty log
    ("quiet", [r"rank 0 exited with code 1", r"config error: the reason everyone stops",
               r"other failed ranks on this node: 1 \(exit code 1, no output\)"]),
    # rank 1 killed from outside (the OOM killer's signal) or ended silently while rank 0
    # waits in an all_reduce: rank 1 is named with its signal or code, not its peer; the
    # launcher exits with that code (128 + N for signal N)
    # (rank 0 fails on "connection reset by peer"; on a loaded machine its teardown may
    # outlast the grace period and the launcher stops it: either way it is not named)
    ("sigkill", [r"^globaltensor.launch: rank 1 was killed by signal SIGKILL"]),
    ("sigterm", [r"^globaltensor.launch: rank 1 was killed by signal SIGTERM"]),
    ("silent", [r"^globaltensor.launch: rank 1 exited with code 3"]),
]


@pytest.fixture(scope="module")
def fault_jobs(tmp_path_factory) -> dict:
    """Every job of ``faults.py``'s summary cases, started together (each is mostly
    process start-up and waiting): {mode: (CompletedProcess, its directory)}."""
    tmp = tmp_path_factory.mktemp("faults")
    started = {}
    try:
        for mode, _ in FAULT_CASES:
            where = tmp / mode
            where.mkdir()
            # "quiet" runs with the default log directory: the summary reads the job's own one
            log_args = [] if mode == "quiet" else ["--log_dir", str(where / "log")]
            cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), *log_args, str(SCRIPTS / "faults.py"), mode]
            out, err = open(where / "out", "w+"), open(where / "err", "w+")
            started[mode] = (where, out, err, subprocess.Popen(cmd, cwd=where, env=launcher_env(),
                                                                stdout=out, stderr=err, text=True))
        done, deadline = {}, time.monotonic() + 60
        for mode, (where, out, err, proc) in started.items():
            proc.wait(max(0.1, deadline - time.monotonic()))
            out.seek(0)
            err.seek(0)
            done[mode] = (subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()), where)
        return done
    finally:
        for _, out, err, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode, expected", FAULT_CASES)
def test_summary_names_the_rank_that_caused_the_failure(fault_jobs: dict, mode: str, expected: list[str]) -> None:
    r, tmp_path = fault_jobs[mode]
    # "early": rank 0's own failure gives the code, 1, or 134 when gloo's threads abort it
    codes = {"sigkill": {137}, "sigterm": {143}, "silent": {3}, "early": {1, 134}}.get(mode, {1})
    assert r.returncode in codes, r.stdout + r.stderr
    text = summary(r.stderr)
    for pattern in expected:
        assert re.search(pattern, text, re.M), text
    assert "rank 1: still running" not in text or mode == "hang", text
    assert "got through" not in r.stdout
    if mode == "quiet":
        assert "rank 1 exited" not in text
        run_dir = (tmp_path / "log" / "latest").resolve()
        assert f"last 1 lines of {run_dir.relative_to(tmp_path)}/workerlog.0:" in text, text
        assert re.fullmatch(r"\d{8}-\d{6}-\d+", run_dir.name), run_dir


# --- a rank that leaves early with code 0 is named, every time -----------------------

EARLY_LEAVER = re.compile(
    r"^globaltensor.launch: rank 1 exited with code 0 at \d\d:\d\d:\d\d\.\d{3}, before the others "
    # on a loaded machine rank 1's shutdown may outlast the grace period: it is stopped then
    r"finished: the first to leave( \(its process then was killed by signal SIG(TERM|KILL)\))?; "
    r"then rank 0 (exited with code 1|was killed by signal SIGABRT)$", re.M)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("how", ["exit", "return", "exit-again"])
def test_a_rank_that_leaves_early_with_code_0_is_named_every_time(tmp_path: Path, start_method: str,
                                                                   how: str) -> None:
    # Rank 1's exit destroys its gloo group while its process still runs: rank 0 fails and
    # its process ended first in most runs, so the summary used to name rank 0 alone. The
    # repetitions (two of sys.exit) are what made it show: each run must name rank 1.
    log_dir = tmp_path / "log"
    r = launch(["--nproc_per_node", "2", "--start_method", start_method, "--master_port", str(free_port()),
                "--log_dir", str(log_dir), str(SCRIPTS / "leave_early.py"), how.split("-")[0]],
               cwd=tmp_path, env=launcher_env(GLOBALTENSOR_TIMEOUT="5"), timeout=45)
    text = summary(r.stderr)
    assert r.returncode in (1, 134), r.stdout + r.stderr  # rank 0's: it failed
    assert EARLY_LEAVER.search(text), text
    assert re.search(r"^globaltensor.launch: rank 0 (exited with code 1|was killed by signal SIGABRT) "
                     r"\(local_rank 0, pid \d+\)$", text, re.M), text
    assert "still running" not in text and "got through" not in r.stdout, text
    assert sorted(p.name for p in log_dir.iterdir()) == [".lock", "workerlog.0", "workerlog.1"]  # no left files


@pytest.mark.timeout(60)
def test_a_worker_says_when_its_program_ended(tmp_path: Path) -> None:
    """boot alone: the left file names the worker's pid, a time between its start and
    end, and the code asked for; a file of another pid (an earlier attempt) is dropped."""
    from globaltensor.launch import boot

    (tmp_path / "prog.py").write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    env = {**os.environ, "GLOBALTENSOR_LAUNCHER_PID": str(os.getpid()), "RANK": "3",
           "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.3.json")}
    before = time.monotonic()
    r = subprocess.run([sys.executable, "-u", boot.__file__, str(tmp_path / "prog.py"), "7"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 7, r.stdout + r.stderr
    left = boot.read_left(str(tmp_path), range(4), {})
    assert list(left) == [3] and left[3].code == 7 and before < left[3].at < time.monotonic(), left
    assert boot.read_left(str(tmp_path), [3], {3: left[3].pid}) == left
    assert boot.read_left(str(tmp_path), [3], {3: left[3].pid + 1}) == {}
    boot.remove_left(str(tmp_path), range(4))
    assert not (tmp_path / ".left.3").exists()
    # a link planted where the file goes is not followed
    (tmp_path / ".left.3").symlink_to(tmp_path / "victim")
    r = subprocess.run([sys.executable, "-u", boot.__file__, str(tmp_path / "prog.py"), "0"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not (tmp_path / "victim").exists(), r.stdout + r.stderr


def test_the_summary_goes_by_when_programs_ended_not_processes(tmp_path: Path, capsys) -> None:
    """Rank 1 returned (code 0) before rank 0 failed, but its process ended after rank
    0's (its exit destroyed its process group, which failed rank 0): rank 1 is named."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from globaltensor.launch.boot import Left
    from globaltensor.launch.report import report_failure

    (tmp_path / "workerlog.0").write_text("RuntimeError: Connection reset by peer\n")
    error = SimpleNamespace(failures={0: ProcessFailure(0, 100, 1, str(tmp_path / "error.0.json"))})
    ended = {0: 50.0, 1: 50.05}  # monotonic: rank 1's process ended last
    left = {1: Left(101, 49.9, time.time(), 0), 0: Left(100, 49.95, time.time(), 1)}
    assert report_failure(error, str(tmp_path), ended, 51.0, None, left) == 1
    text = capsys.readouterr().err
    assert EARLY_LEAVER.search(text), text
    # without the programs' word, the processes' order stands: rank 0 alone
    assert report_failure(error, str(tmp_path), ended, 51.0, None, {}) == 1
    text = capsys.readouterr().err
    assert "rank 1" not in text and text.startswith("globaltensor.launch: rank 0 exited with code 1"), text


def test_a_poll_never_dates_the_rank_that_ended_first_after_its_peer(monkeypatch) -> None:
    """The scan looked at rank 1 just before it ended, then found rank 0 (which failed
    because rank 1 left) ended: rank 1 must not get a later time than rank 0."""
    from globaltensor.launch import agent

    exit_times = agent.ExitTimes(nproc=2, find_workers=False)
    exit_times.add_worker(11, rank=1)  # scanned first
    exit_times.add_worker(10, rank=0)
    looks = {10: iter([False]), 11: iter([True, False])}  # what each look at /proc says: running?
    monkeypatch.setattr(agent, "alive", lambda pid: next(looks[pid], False))
    exit_times.poll()
    ended = exit_times.ended()
    assert set(ended) == {0, 1} and ended[1] <= ended[0], ended


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_every_restart_forms_its_group_afresh(tmp_path: Path) -> None:
    # A restarted worker that reads the previous attempt's store keys connects to a dead
    # peer (gloo: "Connection refused") or waits forever: each restart has its own store.
    r = launch(["--nproc_per_node", "2", "--max_restarts", "2", "--master_port", str(free_port()),
                "--log_dir", str(tmp_path / "log"), str(SCRIPTS / "restarts.py")], cwd=tmp_path, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(re.findall(r"attempt (\d) done: 8", r.stdout)) == ["2", "2"], r.stdout
    restarts = re.findall(r"globaltensor.launch: (rank \d was killed by signal SIGKILL); restarting every "
                          r"worker \((\d) restarts? left", r.stderr)
    assert restarts == [("rank 1 was killed by signal SIGKILL", "1"),
                        ("rank 0 was killed by signal SIGKILL", "0")], r.stderr
    assert sorted(p.name for p in (tmp_path / "log").glob("workerlog.1*")) == [
        "workerlog.1", "workerlog.1.attempt0", "workerlog.1.attempt1"]


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


def has_exited(pid: int, timeout: float) -> bool:
    """Wait (without polling) until process ``pid`` (not our child) ends."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfd_open")
def test_sigkill_of_the_launcher_takes_the_workers_down(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "--log_dir", str(tmp_path / "log"), str(SCRIPTS / "faults.py"), "sleep"],
        cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = []
    try:
        pids = [int(line.split("PID ")[1]) for line in wait_for_lines(proc, "PID ", 2, timeout=40)]
        proc.kill()  # SIGKILL: the launcher cannot stop its workers itself
        proc.wait(10)
        survivors = [pid for pid in pids if not has_exited(pid, timeout=10)]
        assert not survivors, f"workers {survivors} outlived the launcher"
    finally:
        proc.kill()
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_missing_node_is_named_and_times_out(tmp_path: Path) -> None:
    # node 0 of 2 alone (waits for node 1); node 1 of 2 alone (no node 0 to reach)
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--master_port", str(free_port()),
                          "--rdzv_timeout", "2", "--log_dir", str(tmp_path / f"log{node}"),
                          str(SCRIPTS / "report_env.py")] for node in (0, 1)], tmp_path, timeout=40)
    for code, out, err, took in runs:
        assert code == 1, out + err
        assert "Traceback" not in err and "frame #" not in err, err  # no C++ stack dump either
        assert "ENV" not in out  # no worker started
        # --rdzv_timeout 2, plus the launcher's start (a torch import: seconds on a loaded machine)
        assert took < 2 + 12, took
    err0, err1 = runs[0][2], runs[1][2]
    assert re.search(r"node 0: waiting for 1 more of 2 nodes to join at 127\.0\.0\.1:\d+ \(up to 2 s", err0), err0
    assert re.search(r"timed out after 2 s waiting for nodes .*: 1 of 2 joined; missing node_rank 1", err0), err0
    assert "node 1: connecting to the rendezvous store of node 0" in err1, err1
    assert re.search(r"node 1 could not reach node 0's rendezvous store at 127\.0\.0\.1:\d+ within 2 s", err1), err1


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


@pytest.mark.timeout(30)
def test_busy_master_port_is_one_line(tmp_path: Path, capfd, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run_in_process(["--nproc_per_node", "2", "--master_port", str(port), "--log_dir",
                                  str(tmp_path / "log"), str(SCRIPTS / "report_env.py")], capfd)
    assert code == 1
    assert err.strip().splitlines() == [
        f"globaltensor.launch: error: --master_port {port} is already in use on 127.0.0.1 "
        "(another job, or one still exiting?): choose another --master_port"], err
    assert "ENV" not in out


@pytest.mark.timeout(30)
def test_log_dir_symlinks_are_refused(tmp_path: Path, capfd, monkeypatch) -> None:
    """A planted link must not make the launcher write (truncate) a file elsewhere."""
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "real").mkdir()
    (tmp_path / "linked_dir").symlink_to(tmp_path / "real")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "workerlog.1").symlink_to(victim)
    for log_dir, message in [("linked_dir", "--log_dir 'linked_dir' is a symbolic link"),
                             ("logs", "workerlog.1 is a symbolic link")]:
        code, out, err = run_in_process(["--nproc_per_node", "2", "--master_port", str(free_port()),
                                  "--log_dir", log_dir, str(SCRIPTS / "report_env.py")], capfd)
        assert code == 2 and message in err, err
        assert "Traceback" not in err and "ENV" not in out
    assert victim.read_text() == "precious\n"
    assert list((tmp_path / "real").iterdir()) == []


def test_logs_are_opened_without_following_links(tmp_path: Path) -> None:
    """The open itself refuses links (a link planted after the up-front check)."""
    from globaltensor.launch.logs import LaunchError
    from globaltensor.launch.logs import make_logs_specs as _make_logs_specs

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "workerlog.0").symlink_to(victim)
    specs = _make_logs_specs(str(tmp_path / "log"))
    with pytest.raises(LaunchError, match="workerlog.0 is a symbolic link"):
        specs.reify({0: {"RANK": "0"}})
    assert victim.read_text() == "precious\n"
    (tmp_path / "log" / "workerlog.0").unlink()
    dest = specs.reify({0: {"RANK": "0"}})  # a regular file is fine, and handed over by fd
    with open(dest.stdouts[0], "w") as f:
        f.write("hello\n")
    assert (tmp_path / "log" / "workerlog.0").read_text() == "hello\n"
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "log")
    with pytest.raises(LaunchError, match="symbolic link"):
        _make_logs_specs(str(linked)).reify({0: {"RANK": "0"}})


# --- one log directory per job; torchrun's --standalone and --nproc_per_node auto ------

def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "globaltensor.launch", *args], cwd=cwd,
                            env=launcher_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def release(fifo: Path) -> None:
    """Let a hold.py job end: open its FIFO for writing and close it (its read returns)."""
    os.close(os.open(fifo, os.O_WRONLY))


def auto_nproc() -> int:
    """torchrun's --nproc_per_node auto: one process per GPU, else one per usable CPU core."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))


def banner_log_dir(stderr: str) -> Path:
    return Path(re.search(r"log directory\s*: (\S+)", stderr).group(1))


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_standalone_jobs_in_one_directory_keep_their_own_logs(tmp_path: Path) -> None:
    """Default settings but --standalone --nproc_per_node auto, twice at once in one cwd:
    each job gets a free port and a log directory of its own; log/latest is the newer."""
    jobs = {}
    try:
        for tag in ("A", "B"):  # B starts while A runs (A holds until released)
            os.mkfifo(tmp_path / f"fifo{tag}")
            jobs[tag] = start(["--standalone", "--nproc_per_node", "auto", str(SCRIPTS / "hold.py"),
                               str(tmp_path / f"fifo{tag}")], cwd=tmp_path, JOB_TAG=tag)
            wait_for_lines(jobs[tag], "HOLDING", 1, timeout=40)
        for tag in ("A", "B"):
            release(tmp_path / f"fifo{tag}")
        outs = {tag: p.communicate(timeout=40) for tag, p in jobs.items()}
    finally:
        for p in jobs.values():
            p.kill()
    nproc, ports, dirs = auto_nproc(), set(), {}
    for tag, (out, err) in outs.items():
        assert jobs[tag].returncode == 0, out + err
        assert "--standalone: a free local port" in err
        dirs[tag] = banner_log_dir(err)
        assert dirs[tag].parent == tmp_path / "log"
        for rank in range(nproc):
            lines = (dirs[tag] / f"workerlog.{rank}").read_bytes().decode().splitlines()
            first = re.fullmatch(rf"RANK {rank} WORLD_SIZE {nproc} MASTER_PORT (\d+) JOB {tag}", lines[0])
            assert first and lines[-1] == f"rank {rank} done", lines  # whole, and this job's only
            ports.add(first.group(1))
        assert f"JOB {'B' if tag == 'A' else 'A'}" not in out  # the console shows this job only
    assert len(ports) == 2 and dirs["A"] != dirs["B"]
    assert sorted(p.name for p in (tmp_path / "log").iterdir()) == sorted([dirs["A"].name, dirs["B"].name, "latest"])
    assert os.readlink(tmp_path / "log" / "latest") == dirs["B"].name


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_an_explicit_log_dir_is_refused_while_a_job_writes_there(tmp_path: Path, capsys) -> None:
    from globaltensor.launch import main
    from globaltensor.launch.logs import LaunchError, lock_log_dir

    log_dir, fifo = tmp_path / "shared", tmp_path / "fifo"
    os.mkfifo(fifo)
    job = start(["--standalone", "--log_dir", str(log_dir), str(SCRIPTS / "hold.py"), str(fifo)], cwd=tmp_path)
    try:
        wait_for_lines(job, "HOLDING", 1, timeout=40)
        # a second job there (run in this process: it must stop before starting anything)
        with pytest.raises(SystemExit) as exit_:
            main(["--standalone", "--log_dir", str(log_dir), str(SCRIPTS / "hold.py")])
        assert exit_.value.code == 1
        assert f"--log_dir {log_dir} is in use by a job that is still running" in capsys.readouterr().err
        with pytest.raises(LaunchError, match="in use"):
            lock_log_dir(str(log_dir), range(0, 1))
        # node 1 of a two-node job sharing the directory writes other ranks' logs: allowed
        os.close(lock_log_dir(str(log_dir), range(1, 2)))
        release(fifo)
        out, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0, out + err
    assert (log_dir / "workerlog.0").read_text().splitlines()[-1] == "rank 0 done"  # untouched by the refusal
    os.close(lock_log_dir(str(log_dir), range(0, 1)))  # the job ended: the directory is free again


def test_new_run_dirs_are_unique_and_latest_follows(tmp_path: Path, monkeypatch, capsys) -> None:
    from globaltensor.launch.logs import LaunchError, lock_log_dir, new_run_dir

    monkeypatch.chdir(tmp_path)
    made = [new_run_dir("log") for _ in range(3)]  # same second, same pid
    assert len(set(made)) == 3 and all(os.path.isdir(d) for d in made)
    assert os.readlink("log/latest") == os.path.basename(made[-1])
    assert sorted(os.listdir("log")) == sorted([os.path.basename(d) for d in made] + ["latest"])
    os.remove("log/latest")
    os.mkdir("log/latest")  # not ours to replace: the job still gets its directory
    assert os.path.isdir(new_run_dir("log")) and "log/latest not updated" in capsys.readouterr().err
    os.symlink(tmp_path / "victim", os.path.join(made[0], ".lock"))
    with pytest.raises(LaunchError, match="symbolic link"):
        lock_log_dir(made[0], range(0, 1))
    assert not (tmp_path / "victim").exists()


def test_default_log_root_symlink_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    from globaltensor.launch import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "log").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit) as exit_:
        main([str(SCRIPTS / "hold.py")])
    assert exit_.value.code == 2 and "--log_dir 'log' is a symbolic link" in capsys.readouterr().err
    assert list((tmp_path / "elsewhere").iterdir()) == []


OPTION_VALUES = {"nproc_per_node": "3", "nnodes": "2", "node_rank": "1", "master_addr": "10.0.0.2",
                 "master_port": "1234", "log_dir": "mylogs", "max_restarts": "2", "rdzv_timeout": "7"}


@pytest.mark.parametrize("spell", [lambda name: f"--{name}", lambda name: f"--{name.replace('_', '-')}"],
                         ids=["snake_case", "kebab-case"])
def test_every_option_takes_both_spellings(spell, tmp_path: Path, monkeypatch) -> None:
    from globaltensor.launch import parse_args

    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "hold.py")
    argv = [a for name, value in OPTION_VALUES.items() for a in (spell(name), value)]
    args = parse_args([*argv, script, "--x"])
    assert {name: str(getattr(args, name)) for name in OPTION_VALUES} == {
        **OPTION_VALUES, "rdzv_timeout": "7.0"}
    assert args.script == script and args.script_args == ["--x"]
    equals = [f"{spell(name)}={value}" for name, value in OPTION_VALUES.items()]
    assert vars(parse_args([*equals, script, "--x"])) == vars(args)
    ps = parse_args([spell("server_num"), "1", spell("worker_num"), "2", "--standalone", "-m", "mod", "--y"])
    assert (ps.ps, ps.nproc_per_node, ps.standalone, ps.module, ps.script_args) == ((1, 2), 3, True, True, ["--y"])


def test_standalone_and_nproc_auto_are_parsed_as_torchrun(tmp_path: Path, monkeypatch, capsys) -> None:
    from globaltensor.launch import parse_args

    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "hold.py")
    args = parse_args(["--nproc_per_node", "auto", script])
    assert args.nproc_per_node == auto_nproc() and not args.standalone
    assert (args.master_addr, args.master_port) == ("127.0.0.1", 29500)
    assert parse_args(["--nproc-per-node=cpu", script]).nproc_per_node == len(os.sched_getaffinity(0))
    args = parse_args(["--standalone", "--master_addr", "10.1.1.1", "--master_port", "1234", script])
    # the endpoint is overridden: main binds a free port (0 here) on 127.0.0.1
    assert (args.master_addr, args.master_port, args.nnodes) == ("127.0.0.1", 0, 1)
    assert args.master_ignored == ["--master_addr", "--master_port"]
    for argv, message in [(["--nproc_per_node", "many", script], "--nproc_per_node 'many'"),
                          (["--standalone", "--nnodes", "2", script], "--standalone runs a single node")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


# --- the launcher package: one room per concern ----------------------------------------

def test_a_new_option_is_one_row_of_the_table_in_cli(tmp_path: Path, monkeypatch) -> None:
    """The parser, both spellings and the split between the launcher's arguments and the
    script's come from cli.OPTIONS: a new flag does not swallow the script as its value."""
    from globaltensor.launch import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "OPTIONS", (*cli.OPTIONS, cli.Option("dry_run", "only print", flag=True),
                                         cli.Option("retry_after", "seconds", type=float, default=1.0)))
    script = str(SCRIPTS / "hold.py")
    args = cli.parse_args(["--dry-run", "--retry_after", "2.5", script, "--dry_run"])
    assert (args.dry_run, args.retry_after, args.script, args.script_args) == (True, 2.5, script, ["--dry_run"])
    args = cli.parse_args(["--retry-after=4", script])
    assert (args.dry_run, args.retry_after, args.script_args) == (False, 4.0, [])
    assert "--dry_run, --dry-run" in cli.build_parser().format_help()


def test_every_launcher_option_is_in_the_readme_table() -> None:
    """docs/launching.md's launcher table lists every option of the parser, and nothing else
    (the dash spellings are covered by one sentence there)."""
    from globaltensor.launch.cli import build_parser

    text = (REPO / "docs" / "launching.md").read_text()
    section = text.split("<!-- launching:start -->")[1].split("<!-- launching:end -->")[0]
    documented = {name for row in section.splitlines() if row.startswith("| `")
                  for name in re.findall(r"`(-[^`]+)`", row.split("|")[1])}
    options = {spelling for action in build_parser()._actions for spelling in action.option_strings
               if "-" not in spelling.lstrip("-")} - {"-h", "--help"}
    assert options == documented, (f"not in the docs/launching.md table: {sorted(options - documented)}; "
                                   f"in the table, not an option: {sorted(documented - options)}")


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


def launcher_shape_problems(root: Path) -> list[str]:
    """Where the launcher's modules break the package's promise: a file over 450 lines, a
    function over 60, torch or the rest of globaltensor imported at module import."""
    import ast

    problems = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 450:
            problems.append(f"{path.name}: {len(text.splitlines())} lines")
        tree = ast.parse(text)
        problems += [f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > 60]
        for node in tree.body:  # module level: what importing the launcher costs
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                problems.append(f"{path.name}: imports torch at module level")
            if isinstance(node, ast.ImportFrom) and (node.level >= 2 or (node.module or "").startswith("torch")):
                problems.append(f"{path.name}: imports {'.' * node.level}{node.module or ''} at module level")
    return problems


def test_the_launcher_package_keeps_its_shape() -> None:
    assert launcher_shape_problems(REPO / "globaltensor" / "launch") == []


# --- version and packaging (#10 item 10) ---------------------------------------------

@pytest.mark.timeout(60)
def test_version(capfd) -> None:
    import torch

    import globaltensor as gt

    code, out, _ = run_in_process(["--version"], capfd)
    assert code == 0
    assert out.strip() == f"globaltensor {gt.__version__} (torch {torch.__version__})"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", gt.__version__)


def test_packaging_metadata_is_complete_and_single_sourced() -> None:
    """pyproject reads the version from globaltensor.__version__; py.typed and LICENSE ship."""
    from setuptools.config.pyprojecttoml import read_configuration

    import globaltensor as gt

    project = read_configuration(REPO / "pyproject.toml")
    meta = project["project"]
    assert meta["version"] == gt.__version__  # resolved from the attr, statically
    assert any(c.startswith("License :: OSI Approved :: Apache") for c in meta["classifiers"])
    assert "Typing :: Typed" in meta["classifiers"]
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["globaltensor"]
    assert (REPO / "globaltensor" / "py.typed").is_file()
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text


# Import name -> distribution name, where the two differ.
_DISTRIBUTION_OF = {"sklearn": "scikit-learn", "functorch": "torch"}


def _third_party_imports(*roots: Path) -> dict[str, set[str]]:
    """{distribution: files importing it} for every non-stdlib, non-local import under
    ``roots``, except imports a file declares optional with ``pytest.importorskip``
    (a test of an optional integration, which also has coverage without it)."""
    import ast

    files = [p for root in roots for p in root.rglob("*.py")]
    # modules and folders of the roots (tests/boxing/boxing_cases.py is imported as
    # ``boxing_cases`` beside it and as ``boxing.boxing_cases`` from other folders)
    local = {p.stem for p in files} | {p.parent.name for p in files} | {"globaltensor"}
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        optional = set(re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", text))
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local | optional:
                    found.setdefault(_DISTRIBUTION_OF.get(top, top), set()).add(str(path.relative_to(REPO)))
    return found


def test_the_test_extra_covers_every_import_of_the_suite() -> None:
    """`pip install -e ".[test]"` on a fresh machine installs all that the tests, the
    examples they run and the package code they reach import (.ci/run checks it for real)."""
    from setuptools.config.pyprojecttoml import read_configuration

    meta = read_configuration(REPO / "pyproject.toml")["project"]
    requirements = [*meta["dependencies"], *meta["optional-dependencies"]["test"]]
    installed = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
    imports = _third_party_imports(REPO / "tests", REPO / "examples", REPO / "globaltensor")
    missing = {dist: sorted(files) for dist, files in imports.items() if dist.lower() not in installed}
    assert not missing, f"imported by the suite but not in the test extra: {missing}"
    ci = (REPO / ".ci" / "run").read_text()
    readme_install = 'pip install torch==2.13.0 && pip install -e ".[test]"'
    assert readme_install in (REPO / "README.md").read_text() and readme_install in ci
    assert re.search(r"^python3? -m venv ", ci, re.M) and "--system-site-packages" not in ci


def _lower_bounds() -> tuple[tuple[int, ...], tuple[int, ...]]:
    from setuptools.config.pyprojecttoml import read_configuration

    meta = read_configuration(REPO / "pyproject.toml")["project"]
    python = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", meta["requires-python"]).groups())
    (torch_req,) = [d for d in meta["dependencies"] if d.startswith("torch")]
    torch_min = tuple(int(x) for x in re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_req).groups())
    return python, torch_min


def test_the_stated_lower_bounds_hold() -> None:
    """Feature checks for what the package uses from torch (each present since the stated
    lower bound), and every source file parses with the oldest stated Python's grammar."""
    import ast
    import inspect

    import torch
    import torch.distributed as dist

    python_min, torch_min = _lower_bounds()
    assert torch_min >= (2, 5) and python_min >= (3, 9)
    assert tuple(int(x) for x in torch.__version__.split(".")[:2]) >= torch_min
    assert hasattr(torch.ops.aten, "_safe_softmax")  # torch 2.5: rules/softmax.py
    assert "device_id" in inspect.signature(dist.init_process_group).parameters  # 2.3: comm/
    from torch.distributed.elastic.multiprocessing import LogsSpecs  # noqa: F401  (2.3: launch/logs.py)
    assert "master_listen_fd" in (torch.distributed.TCPStore.__init__.__doc__ or "")  # launch/rendezvous.py
    for path in sorted((REPO / "globaltensor").rglob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=python_min)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_fork_server_reports_exits_as_popen_and_survives_a_reaped_worker(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "forkserver_checks.py"), str(tmp_path)],
                       cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
