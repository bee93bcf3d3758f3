"""The test harness's world fails fast when a process dies without reporting."""
import os

import pytest
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
