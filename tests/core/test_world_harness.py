"""The test harness: its world fails fast when a process dies without reporting, a
simulated world runs its ranks in one process and names a failing rank, and the
launcher the suite forks for its jobs runs as `python -m globaltensor.launch`."""
import os

import pytest
import torch
from mp import World


def check_rank_one_dies():
    if os.environ["RANK"] == "1":
        os._exit(3)     # no report, no exception: as a crash or a kill would leave it


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_process_that_dies_without_reporting_is_named():
    # the world's deadline is 60 s; the dead rank is named as soon as it has exited
    world = World(2, __name__, ["check_rank_one_dies"], timeout=60)
    with pytest.raises(AssertionError, match="rank 1 exited with code 3 before reporting"):
        world.check("check_rank_one_dies")


def check_ranks_see_each_other():
    import globaltensor as gt
    p = gt.placement("cpu", ranks=[0, 1, 2])
    x = gt.from_local(torch.full((1, 2), 1.0 + gt.get_rank()), placement=p, sbp=gt.sbp.split(0))
    total = x.to_global(sbp=gt.sbp.broadcast).to_local().sum().item()
    assert total == 12.0, total     # every rank holds every rank's row
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"{gt.get_rank()} {os.getpid()}\n")


def check_a_worlds_processes_start_with_imports_done_and_their_own_settings():
    # The fork server imported what a first op imports (``launch.forkserver.FIRST_OP_IMPORTS``), and the
    # settings globaltensor read at import there come from this world's environment.
    import sys

    from globaltensor.comm import fingerprint
    assert "torch._dynamo" in sys.modules and "torch.distributed.tensor" in sys.modules
    assert os.environ["GLOBALTENSOR_FINGERPRINTS"] == "0" and fingerprint.ON is False


def check_rank_two_fails():
    import globaltensor as gt
    assert gt.get_rank() != 2, "rank two fails"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_simulated_world_runs_every_rank_in_one_process_and_names_a_failing_rank(tmp_path):
    seen = tmp_path / "seen"
    world = World(3, __name__, [
        "check_a_worlds_processes_start_with_imports_done_and_their_own_settings",
        "check_ranks_see_each_other", "check_rank_two_fails"], timeout=60, lazy=True,
        simulated=True, env={"SEEN": str(seen), "GLOBALTENSOR_FINGERPRINTS": "0"})
    world.check("check_a_worlds_processes_start_with_imports_done_and_their_own_settings")
    world.check("check_ranks_see_each_other")
    ranks, pids = zip(*(line.split() for line in seen.read_text().splitlines()))
    assert sorted(ranks) == ["0", "1", "2"] and len(set(pids)) == 1 and pids[0] != str(os.getpid())
    with pytest.raises(AssertionError, match=r"(?s)rank 2:.*rank two fails"):
        world.check("check_rank_two_fails")


JOB = """
import os, sys, time
print("out", os.environ["RANK"], os.getcwd(), os.environ["MARK"], flush=True)
print("err", os.environ["RANK"], file=sys.stderr, flush=True)
with open(f"pid{os.environ['RANK']}", "w") as f:
    f.write(str(os.getpid()))
time.sleep(float(sys.argv[1]))
sys.exit(3 if os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_forked_launcher_runs_as_python_m_would_and_its_job_dies_with_a_timeout(tmp_path):
    """The suite's launches (tests/forked_launch.py): the job's directory, environment,
    separate stdout and stderr and exit code; at a timeout, no process is left."""
    import subprocess
    import time

    import forked_launch
    from mp import free_port

    (tmp_path / "job.py").write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MARK": "m1"}

    def args(seconds):
        return ["--nproc_per_node", "2", "--master_port", str(free_port()), "--log_dir",
                str(tmp_path / f"log{seconds}"), str(tmp_path / "job.py"), str(seconds)]

    done = forked_launch.run(args(0), tmp_path, env, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr          # rank 1's code
    assert f"out 0 {tmp_path} m1" in done.stdout and "out 1" in done.stdout, done.stdout
    # the workers' output (stdout and stderr, one log per rank) on the launcher's stdout,
    # its own report on its stderr
    assert "[rank1]: err 1" in done.stdout and "world size" not in done.stdout, done.stdout
    assert "world size      : 2" in done.stderr and "[rank1]" not in done.stderr, done.stderr
    assert "rank 1 exited with code 3" in done.stderr, done.stderr

    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_launch.run(args(60), tmp_path, env, timeout=5)
    assert time.monotonic() - start < 30          # killed, not waited for (60 s)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_free_ports_are_apart_from_connections_and_from_each_other():
    # a job's store port taken from the kernel's range for outgoing connections was at
    # times given to another job's gloo connection before the job bound it
    from mp import free_port
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports), ports
    assert all(20000 <= p < 29000 for p in ports), ports
