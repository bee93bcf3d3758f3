"""gt.checkpoint.Autosave: bad arguments, save/restore in one process (model, optimizer,
random state, user state, keep, half-written checkpoints), and jobs whose rank is
SIGKILLed (at a random step, or in the middle of a save) that resume to the parameters
of an uninterrupted run."""
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import globaltensor as gt
from mp import free_port

JOB = Path(__file__).with_name("autosave_job.py")


def small_model():
    torch.manual_seed(0)
    return gt.nn.to_global(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3),
                                               torch.nn.Linear(8, 2)),
                           gt.placement("cpu", [0]), gt.sbp.broadcast)


@pytest.mark.parametrize("kwargs, error", [
    ({"every": 0}, r"every must be an int >= 1, got 0"),
    ({"every": 2.5}, r"every must be an int >= 1, got 2\.5"),
    ({"keep": 0}, r"keep must be an int >= 1, got 0"),
    ({"optimizer": "sgd"}, r"optimizer must be a torch\.optim\.Optimizer or None, got str"),
])
def test_bad_arguments_raise(tmp_path, kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        gt.checkpoint.Autosave(tmp_path, small_model(), **kwargs)


def test_a_path_that_is_a_file_raises(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"exists and is not a directory"):
        gt.checkpoint.Autosave(tmp_path / "f", small_model())
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        gt.checkpoint.Autosave(tmp_path, {})


def train(model, opt, saver, start: int, stop: int) -> None:
    for step in range(start, stop):
        x = gt.randn(6, 4, placement=gt.placement("cpu", [0]), sbp=gt.sbp.broadcast)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        saver.state["sched"].step()
        saver.state["seen"].append(step)
        saver.step(step + 1)


def fresh(path):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    saver = gt.checkpoint.Autosave(path, model, opt, every=2, keep=2)
    saver.state["sched"] = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    saver.state["seen"] = []
    return model, opt, saver


def test_restore_resumes_everything_and_keeps_the_newest(tmp_path):
    gt.manual_seed(5)
    model, opt, saver = fresh(tmp_path / "run")
    assert saver.restore() == 0
    train(model, opt, saver, 0, 7)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_4", "step_6"]   # keep=2
    # a save of step 8 that died before its .metadata: not restored, then replaced
    (tmp_path / "run" / "step_8").mkdir()
    (tmp_path / "run" / "step_8" / "__0_0.distcp").write_bytes(b"half")

    gt.manual_seed(99)                     # another run's random state: replaced
    model, opt, saver = fresh(tmp_path / "run")
    start = saver.restore()
    assert start == 6 and saver.state["seen"] == list(range(6))
    assert saver.state["sched"].last_epoch == 6 and opt.param_groups[0]["lr"] == 0.05 * 0.25
    assert float(opt.state[next(iter(model.parameters()))]["step"]) == 6
    train(model, opt, saver, start, 9)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_6", "step_8"]
    assert gt.checkpoint.is_complete(tmp_path / "run" / "step_8")

    gt.manual_seed(5)                      # the uninterrupted run
    ref, ref_opt, ref_saver = fresh(tmp_path / "ref")
    train(ref, ref_opt, ref_saver, 0, 9)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.full(), b.full())


# --- jobs through the launcher, killed and resumed ---------------------------------------

def launch(tmp_path, name: str, *args):
    cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", "2",
           "--master_port", str(free_port()),
           "--log_dir", str(tmp_path / f"log-{name}-{len(list(tmp_path.glob(f'log-{name}-*')))}"),
           str(JOB),
           "--ckpt", str(tmp_path / name), "--out", str(tmp_path / f"{name}.pt"), *args]
    out = open(tmp_path / f"{name}.out", "w+")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}), out


def finish(runs: dict, timeout: float = 120) -> dict:
    texts = {}
    for name, (proc, out) in runs.items():
        try:
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        texts[name] = (proc.returncode, out.read())
        out.close()
    return texts


def worker_logs(tmp_path, name: str) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in sorted(tmp_path.glob(f"log-{name}-*/**/workerlog*")) if p.is_file())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_killed_jobs_resume_to_the_parameters_of_an_uninterrupted_run(tmp_path):
    """SGD with momentum and dropout on 2 ranks, a checkpoint every 2 of 10 steps. One
    job loses rank 1 after a random step, one in the middle of the save of step 6 (its
    data written, no .metadata). Each is launched again (as ``--max_restarts`` does; the
    launcher's own restarts are tested with the launcher) and ends with exactly the
    uninterrupted run's parameters."""
    kill_step = random.Random().randint(1, 9)
    why = f"(killed after step {kill_step})"
    runs = {"plain": launch(tmp_path, "plain"),
            "step": launch(tmp_path, "step", "--kill-rank", "1", "--kill-step",
                           str(kill_step)),
            "save": launch(tmp_path, "save", "--kill-rank", "1", "--kill-step", "6",
                           "--kill-in-save")}
    done = finish(runs)
    assert done["plain"][0] == 0, done["plain"][1]
    for name in ("step", "save"):
        assert done[name][0] != 0 and (tmp_path / name / "killed").exists(), done[name][1]
    done.update(finish({name: launch(tmp_path, name) for name in ("step", "save")}))
    for name in ("step", "save"):
        assert done[name][0] == 0, (why, done[name][1])
    logs = {name: worker_logs(tmp_path, name) for name in ("step", "save")}
    assert "killed in the save of step 6" in logs["save"], logs["save"]
    # resumed from the newest complete checkpoint: the half-written step_6 is skipped
    assert re.search(r"rank 1 starts at step 4, batch 4", logs["save"]), logs["save"]
    resumed_at = kill_step // 2 * 2
    assert re.search(rf"rank 1 starts at step {resumed_at}, batch {resumed_at}",
                     logs["step"]), (why, logs["step"])
    want = torch.load(tmp_path / "plain.pt")
    for name in ("step", "save"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key, why)
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == \
            ["killed", "step_10", "step_8"]
