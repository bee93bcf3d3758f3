"""examples/resume_training.py: a run killed mid-training resumes from its last complete
checkpoint (gt.checkpoint.Autosave, keeping 2) on other world sizes and layouts (2 ranks
tensor parallel -> 4 ranks data parallel -> 1 rank), skipping a half-written checkpoint,
and ends with the parameters of an uninterrupted run."""
import re
import shutil

import pytest
import torch
from mp import launch_example, launch_examples_together, run_example

from globaltensor.checkpoint import is_complete as gt_complete

pytestmark = pytest.mark.multiprocess  # every test here runs an example through the launcher

ARGS = ["--steps", "12", "--save-every", "3"]


@pytest.mark.timeout(600)
def test_killed_run_resumes_on_other_layouts_to_the_uninterrupted_parameters(tmp_path):
    ckpt = tmp_path / "ckpt"
    # the uninterrupted reference runs alongside the first (crashing) run
    solo, first = launch_examples_together([
        ("resume_training.py", 1, *ARGS, "--ckpt", str(tmp_path / "solo"), "--no-resume",
         "--out", str(tmp_path / "uninterrupted.pt")),
        ("resume_training.py", 2, *ARGS, "--layout", "tp", "--ckpt", str(ckpt),
         "--crash-at", "8")], tmp_path)
    assert solo.returncode == 0, solo.stdout + solo.stderr
    assert first.returncode != 0 and "crashing after step 8" in first.stdout, first.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3", "step_6"]

    # A save that died before DCP wrote .metadata: never chosen for resuming.
    shutil.copytree(ckpt / "step_6", ckpt / "step_7", ignore=shutil.ignore_patterns(".metadata"))
    second = launch_example("resume_training.py", 4, tmp_path, *ARGS, "--layout", "dp",
                            "--ckpt", str(ckpt), "--crash-at", "10", timeout=300)
    assert re.search(r"resumed from \S+step_6 at step 6 on 4 rank\(s\), layout dp",
                     second.stdout), second.stdout
    assert second.returncode != 0 and "crashing after step 10" in second.stdout
    assert sorted(p.name for p in ckpt.iterdir() if gt_complete(p)) == ["step_6", "step_9"]

    out = run_example("resume_training.py", 1, tmp_path, *ARGS, "--layout", "dp",
                      "--ckpt", str(ckpt), "--out", str(tmp_path / "resumed.pt"))
    assert re.search(r"resumed from \S+step_9 at step 9 on 1 rank\(s\)", out), out
    want, got = torch.load(tmp_path / "uninterrupted.pt"), torch.load(tmp_path / "resumed.pt")
    assert want.keys() == got.keys() and len(want) == 4
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
