"""Parameter-server training (gt.ps) through the launcher's server/worker roles.

Few launches, several checks each (a job of 2 servers + 2 workers takes seconds):
sync vs one plain-torch process, async with a slowed worker, geo, and a job with bad
input and a failing worker.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mp import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wide_and_deep_ps.py"
SCRIPTS = Path(__file__).resolve().parents[1] / "launch" / "launch_scripts"
# The parity runs use SGD: Adagrad divides by the root of the summed squares, which
# turns float rounding in a near-zero gradient into a visible step.
SGD = ("--optimizer", "sgd", "--lr", "0.5", "--dense_lr", "0.1")


def ps_launch(log_dir: Path, script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "globaltensor.launch", "--server_num", "2", "--worker_num", "2",
           "--master_port", str(free_port()), "--log_dir", str(log_dir), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def _value(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text}"
    return float(m.group(1))


def _auc(out: str) -> float:
    return _value(r"\[rank0\]: held-out AUC ([\d.]+)", out)


def _loss_falls(out: str) -> None:
    m = re.search(r"training loss: ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.02, out


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync")
    r = ps_launch(tmp / "log", EXAMPLE, "--mode", "sync", "--save", str(tmp / "sync.pt"), *SGD)
    return r, tmp


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_sync_equals_one_process_and_roles_end_cleanly(sync_run) -> None:
    r, tmp = sync_run
    assert r.returncode == 0, r.stdout + r.stderr
    # logs by role (and the launcher's .lock); the servers ended on their own once the workers were done
    assert sorted(p.name for p in (tmp / "log").iterdir()) == [
        ".lock", "serverlog.0", "serverlog.1", "workerlog.0", "workerlog.1"]
    assert "ps roles        : 2 workers (ranks 0-1), 2 servers (ranks 2-3)" in r.stderr
    assert "worker 1:" in (tmp / "log" / "workerlog.1").read_text()
    for s in (0, 1):
        assert f"server {s}: every worker is done, stopping" in (tmp / "log" / f"serverlog.{s}").read_text()
    assert _auc(r.stdout) > 0.7
    _loss_falls(r.stdout)

    # the same training in this process with plain torch (nn.Embedding(sparse=True), SGD)
    spec = importlib.util.spec_from_file_location("wide_and_deep_ps", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        example.main(["--reference", "--save", str(tmp / "ref.pt"), *SGD])
    finally:
        torch.set_num_threads(threads)
    ours, ref = torch.load(tmp / "sync.pt"), torch.load(tmp / "ref.pt")
    assert sorted(ours) == sorted(ref) and "embedding.weight" in ours and "mlp.0.weight" in ours
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-5, msg=name)
    # and training moved the tables' rows far beyond the tolerance (the wide table
    # starts at zero)
    start = example.gt.ps.EmbeddingTable.initial_weight(26000, 8, 0.1, seed=1)
    assert (ref["embedding.weight"] - start).abs().max() > 5e-4
    assert ref["wide.weight"].abs().max() > 0.03


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_async_worker_does_not_wait_for_a_slow_one(tmp_path: Path) -> None:
    r = ps_launch(tmp_path / "log", EXAMPLE, "--mode", "async", "--slow_worker", "1",
                  "--slow_factor", "3", "--steps", "80", *SGD)   # the slowed worker sets the pace
    assert r.returncode == 0, r.stdout + r.stderr
    fast = _value(r"worker 0: (\d+) examples/s", r.stdout)
    slow = _value(r"worker 1: (\d+) examples/s", r.stdout)
    # worker 1's steps take 3x as long (it sleeps twice its step time: a ratio, so load
    # on the machine slows both alike); worker 0 keeps its own pace (sync ties them)
    assert fast > 2 * slow, (fast, slow)
    assert _auc(r.stdout) > 0.7
    _loss_falls(r.stdout)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_geo_trains(tmp_path: Path) -> None:
    r = ps_launch(tmp_path / "log", EXAMPLE, "--mode", "geo", "--k_steps", "10", "--steps", "80",
                  *SGD)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _auc(r.stdout) > 0.7
    _loss_falls(r.stdout)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_bad_input_is_refused_and_a_failing_worker_is_named(tmp_path: Path) -> None:
    r = ps_launch(tmp_path / "log", SCRIPTS / "ps_checks.py", "--fail")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "globaltensor.launch: worker 1 (rank 1) exited with code 1" in r.stderr, r.stderr
    assert "last " in r.stderr and "workerlog.1:" in r.stderr
    assert "planted failure on worker 1" in r.stderr
    for s in (0, 1):  # servers (still serving) were stopped, and named by role
        assert f"server {s} (rank {2 + s}): still running, stopped by the launcher" in r.stderr
    checks = [line for line in (tmp_path / "log" / "workerlog.0").read_text().splitlines()
              if line.startswith("CHECK")]
    assert len(checks) == 8, checks
    assert "IndexError: EmbeddingTable id 10 out of range: the table has 10 rows" in checks[0]
    assert "IndexError: EmbeddingTable id -1 out of range" in checks[1]
    assert "TypeError: EmbeddingTable ids must be an integer tensor" in checks[2]
    assert "torch.bool" in checks[3]
    assert "rows out of range for a shard of 5 rows" in checks[4]
    assert "rows must be a 1-D int64 tensor" in checks[5] and "rows must be" in checks[6]
    assert checks[7] == "CHECK lookup after bad input equal: True"  # the server lives on


def test_launcher_role_arguments(capsys) -> None:
    from globaltensor.launch import _log_name, _who, parse_args

    script = str(SCRIPTS / "report_env.py")
    args = parse_args(["--server_num", "2", "--worker_num", "3", script, "--x"])
    assert args.nproc_per_node == 5 and args.ps == (2, 3) and args.script_args == ["--x"]
    assert parse_args([script]).ps is None and parse_args([script]).nproc_per_node == 1
    assert [_log_name(r, (2, 3)) for r in range(5)] == [
        "workerlog.0", "workerlog.1", "workerlog.2", "serverlog.0", "serverlog.1"]
    assert _who(3, (2, 3)) == "server 0 (rank 3)" and _who(1, (2, 3)) == "worker 1 (rank 1)"
    assert _who(3) == "rank 3" and _log_name(3) == "workerlog.3"
    for argv, message in [
            (["--server_num", "2", script], "--server_num and --worker_num go together"),
            (["--server_num", "0", "--worker_num", "2", script], "must be >= 1, got 0 and 2"),
            (["--server_num", "1", "--worker_num", "1", "--nproc_per_node", "3", script],
             "--nproc_per_node 3 disagrees"),
            (["--server_num", "1", "--worker_num", "1", "--nnodes", "2", script], "run on one node")]:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_ps_api_checks_and_row_optimizers(monkeypatch) -> None:
    import globaltensor as gt
    from globaltensor.ps.optim import RowOptimizer, coalesce

    monkeypatch.delenv("GLOBALTENSOR_PS_ROLE", raising=False)
    with pytest.raises(RuntimeError, match="--server_num S --worker_num W"):
        gt.ps.init()
    with pytest.raises(ValueError, match="mode must be one of"):
        gt.ps.Strategy(mode="bogus")
    with pytest.raises(ValueError, match="k_steps"):
        gt.ps.Strategy(mode="geo", k_steps=0)
    assert not gt.ps.is_server() and not gt.ps.is_worker()
    with pytest.raises(RuntimeError, match="gt.ps.init"):
        gt.ps.EmbeddingTable(10, 2)

    # the servers' sparse updates are torch's, repeated rows summed first
    g = torch.Generator().manual_seed(0)
    for kind, torch_opt in (("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)):
        emb = torch.nn.Embedding(20, 3, sparse=True)
        ours = emb.weight.detach().clone()
        opt, row_opt = torch_opt(emb.parameters(), lr=0.3), RowOptimizer(kind, 0.3, (20, 3))
        for _ in range(3):
            ids = torch.randint(0, 20, (12,), generator=g)
            w = torch.randn(12, 3, generator=g)
            opt.zero_grad()
            (emb(ids) * w).sum().backward()
            opt.step()
            row_opt.apply(ours, *coalesce(ids, w))
        torch.testing.assert_close(ours, emb.weight.detach(), rtol=1e-6, atol=1e-6)
