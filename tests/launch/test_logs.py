"""The launcher's log directories: links are refused (up front, and by the open
itself), one log directory per job (--standalone jobs in one directory keep their own
logs; log/latest follows the newer), and an explicit --log_dir is refused while a job
writes there.

Each launcher run costs a few seconds (the launcher imports torch; its workers are
forked from it), so one run checks several things at once. Every run gets its own free
port and log dir (tests/launch/launch_helpers.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, auto_nproc, free_port, launcher_env, run_in_process, wait_for_lines


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


# --- one log directory per job; torchrun's --standalone and --nproc_per_node auto ----------

def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "globaltensor.launch", *args], cwd=cwd,
                            env=launcher_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def release(fifo: Path) -> None:
    """Let a hold.py job end: open its FIFO for writing and close it (its read returns)."""
    os.close(os.open(fifo, os.O_WRONLY))


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
