"""gt.checkpoint.Autosave: bad arguments, save/restore in one process (model, optimizer,
random state, user state, keep, half-written checkpoints), and jobs whose rank is
SIGKILLed in the middle of a save that resumes to the parameters of an uninterrupted run
(kills at random steps, under the launcher's restarts: benchmarks/faults.py)."""
import os
import re
from pathlib import Path

import forked_launch
import pytest
import torch
from mp import checks_in_worlds, free_port

import globaltensor as gt

JOB = Path(__file__).resolve().parents[2] / "benchmarks" / "fault_job.py"


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


def test_autosave_checkpoints_are_verified(tmp_path):
    """Autosave writes a CRC-32 per chunk and restore checks it: a damaged checkpoint
    fails the restore naming the file, instead of loading a wrong value."""
    import torch.distributed.checkpoint as dcp
    gt.manual_seed(5)
    model, opt, saver = fresh(tmp_path / "run")
    train(model, opt, saver, 0, 2)
    path = tmp_path / "run" / "step_2"
    md = dcp.FileSystemReader(str(path)).read_metadata()
    assert all(isinstance(getattr(i, "crc32", None), int) for i in md.storage_data.values())
    info = max(md.storage_data.values(), key=lambda i: i.length)
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    model, opt, saver = fresh(tmp_path / "run")
    # the only checkpoint is damaged: nothing to fall back to, it raises naming it
    with pytest.raises(gt.checkpoint.ChecksumError, match=r"every complete checkpoint "
                       r"under .* is damaged: .*step_2 \(.*does not hold what was saved"):
        saver.restore()


def flip_chunk_byte(path) -> str:
    """Flip a byte in the middle of the largest chunk of checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(str(path)).read_metadata()
    info = max(md.storage_data.values(), key=lambda i: i.length)
    flip(path / info.relative_path, info.offset + info.length // 2)
    return info.relative_path


def flip(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def parameters_after(tmp_path, steps: int) -> list:
    gt.manual_seed(5)
    model, opt, saver = fresh(tmp_path / f"ref{steps}")
    train(model, opt, saver, 0, steps)
    return [p.full().clone() for p in model.parameters()]


@pytest.mark.parametrize("damage", ["chunk", "metadata"])
def test_restore_falls_back_to_the_newest_intact_checkpoint(tmp_path, damage):
    """keep=2 kept step_4 and step_6; step_6 is damaged (a flipped byte in a chunk, or in
    its .metadata): restore warns naming it and why, and resumes from step_4."""
    gt.manual_seed(5)
    model, opt, saver = fresh(tmp_path / "run")
    train(model, opt, saver, 0, 6)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_4", "step_6"]
    newest = tmp_path / "run" / "step_6"
    if damage == "chunk":
        file, why = flip_chunk_byte(newest), "does not hold what was saved"
    else:
        flip(newest / ".metadata", (newest / ".metadata").stat().st_size // 2)
        file, why = "", "its metadata file .metadata .* is damaged"
    model, opt, saver = fresh(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match=rf"skipped damaged checkpoint\(s\) \S*step_6 "
                                            rf"\(.*{file}.*{why}.*\); restored \S*step_4 "
                                            rf"\(step 4\) instead"):
        start = saver.restore()
    assert start == 4 and saver.state["seen"] == list(range(4))
    for a, b in zip(model.parameters(), parameters_after(tmp_path, 4)):
        assert torch.equal(a.full(), b)
    # the run goes on: the next save of step 6 replaces the damaged one
    train(model, opt, saver, start, 7)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_4", "step_6"]
    model, opt, saver = fresh(tmp_path / "run")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert saver.restore() == 6


def test_restore_raises_other_errors_without_falling_back(tmp_path):
    """A checkpoint that does not match the model is no damage: raised, not skipped."""
    from torch.distributed.checkpoint.api import CheckpointException
    gt.manual_seed(5)
    model, opt, saver = fresh(tmp_path / "run")
    train(model, opt, saver, 0, 4)
    other = gt.nn.to_global(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3),
                                                torch.nn.Linear(8, 3)),
                            gt.placement("cpu", [0]), gt.sbp.broadcast)
    saver = gt.checkpoint.Autosave(tmp_path / "run", other, every=2, keep=2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(CheckpointException, match="Size mismatch"):
            saver.restore()


# --- in a world of processes: the ranks agree on what they restore --------------------

def check_a_damage_one_rank_sees_falls_back_on_every_rank():
    """A split model saved at steps 1 and 2 (each rank writes its own chunk). A byte of
    the last rank's chunk of step_2 flips: only that rank reads it, yet every rank warns
    and restores step 1. Then .metadata found damaged by the last rank only (its read
    made to fail): every rank again chooses step 1, none hangs in a load the others
    skipped."""
    import shutil
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank, n = gt.get_rank(), gt.get_world_size()
    P = gt.placement.all("cpu")
    path = f"/tmp/globaltensor-autosave-{os.getppid()}-{n}"

    def model():
        torch.manual_seed(0)
        return gt.nn.to_global(torch.nn.Linear(4, 4 * n), P, gt.sbp.split(0))

    try:
        m = model()
        saver = gt.checkpoint.Autosave(path, m, every=1, keep=2)
        saver.step(1)
        at_1 = [p.full().clone() for p in m.parameters()]
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(2)
        saver.step(2)
        dist.barrier()
        if rank == 0:
            md = dcp.FileSystemReader(f"{path}/step_2").read_metadata()
            info = next(i for index, i in md.storage_data.items() if index.fqn ==
                        "model.weight" and i.relative_path.startswith(f"__{n - 1}_"))
            flip(f"{path}/step_2/{info.relative_path}", info.offset + info.length // 2)
        dist.barrier()
        m = model()
        saver = gt.checkpoint.Autosave(path, m, every=1, keep=2)
        with pytest.warns(RuntimeWarning, match=r"skipped damaged checkpoint\(s\) \S*step_2 "
                          rf"\(rank {n - 1}: .*does not hold what was saved.*restored "
                          r"\S*step_1 \(step 1\)"):
            assert saver.restore() == 1
        for a, b in zip(m.parameters(), at_1):
            assert torch.equal(a.full(), b)

        original = gt.checkpoint.Autosave._check_metadata

        def seen_damaged(directory):
            if rank == n - 1 and directory.endswith("step_2"):
                return 1, "its .metadata is damaged (test)", None
            return original(directory)

        m = model()
        saver = gt.checkpoint.Autosave(path, m, every=1, keep=2)
        saver._check_metadata = seen_damaged
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert saver.restore() == 1
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        want = "(its .metadata is damaged (test))" if rank == n - 1 else \
            f"(damaged on rank(s) [{n - 1}])"
        assert any(want in text and "restored" in text for text in messages), messages
        for a, b in zip(m.parameters(), at_1):
            assert torch.equal(a.full(), b)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


CHECKS = ["check_a_damage_one_rank_sees_falls_back_on_every_rank"]

# (warnings are the process's)
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, in_processes=[
    "check_a_damage_one_rank_sees_falls_back_on_every_rank"])


# --- jobs through the launcher, killed and resumed ---------------------------------------

def launch(tmp_path, name: str, *args):
    args = ["--nproc_per_node", "2", "--master_port", str(free_port()),
            "--log_dir", str(tmp_path / f"log-{name}-{len(list(tmp_path.glob(f'log-{name}-*')))}"),
            str(JOB),
            "--ckpt", str(tmp_path / name), "--out", str(tmp_path / f"{name}.pt"), *args]
    out = open(tmp_path / f"{name}.out", "w+")     # stdout and stderr, in the order written
    return forked_launch.start(args, os.getcwd(), {**os.environ, "OMP_NUM_THREADS": "1"},
                               out.fileno(), out.fileno()), out


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
def test_a_job_killed_in_a_save_resumes_to_the_parameters_of_an_uninterrupted_run(tmp_path):
    """SGD with momentum and dropout on 2 ranks, a checkpoint every 2 of 10 steps; rank 1
    is SIGKILLed in the middle of the save of step 6 (its data written, no .metadata).
    Launched again (as ``--max_restarts`` does; benchmarks/faults.py runs the launcher's
    own restarts, 20 kills at random steps among them), it resumes from step 4 and ends
    with exactly the uninterrupted run's parameters."""
    runs = {"plain": launch(tmp_path, "plain"),
            "save": launch(tmp_path, "save", "--fault", "kill_in_save", "--fault-step", "6")}
    done = finish(runs)
    assert done["plain"][0] == 0, done["plain"][1]
    assert done["save"][0] != 0 and (tmp_path / "save" / "killed").exists(), done["save"][1]
    done.update(finish({"save": launch(tmp_path, "save")}))
    assert done["save"][0] == 0, done["save"][1]
    log = worker_logs(tmp_path, "save")
    assert "killed in the save of step 6" in log, log
    # resumed from the newest complete checkpoint: the half-written step_6 is skipped
    assert re.search(r"rank 1 starts at step 4, batch 4", log), log
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "save.pt")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert sorted(p.name for p in (tmp_path / "save").iterdir()) == ["killed", "step_10", "step_8"]
