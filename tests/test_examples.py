"""The examples run as the README says, through the launcher."""
import subprocess
import sys
from pathlib import Path

import pytest

from mp import free_port

ROOT = Path(__file__).resolve().parents[1]


def launch(script, nproc, tmp_path, *args, timeout=180):
    cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "--log_dir", str(tmp_path / "log"),
           str(ROOT / "examples" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(200)
def test_quickstart_on_four_ranks(tmp_path):
    out = launch("quickstart.py", 4, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "data parallel x @ w          shape=(4, 8)    sbp=(split(dim=0),)" in out.stdout
    assert "model parallel x @ w         shape=(4, 8)    sbp=(split(dim=1),)" in out.stdout
    assert "all results equal the single-process values (4 ranks)" in out.stdout
