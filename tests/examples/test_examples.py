"""The examples run as the README says, through the launcher."""
import pytest
from mp import launch_example as launch

pytestmark = pytest.mark.multiprocess  # every test here runs an example through the launcher


@pytest.mark.timeout(200)
def test_quickstart_on_four_ranks(tmp_path):
    out = launch("quickstart.py", 4, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "data parallel x @ w          shape=(4, 8)    sbp=(split(dim=0),)" in out.stdout
    assert "model parallel x @ w         shape=(4, 8)    sbp=(split(dim=1),)" in out.stdout
    assert "all results equal the single-process values (4 ranks)" in out.stdout
