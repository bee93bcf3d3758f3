"""The GPU suite's worlds (see cuda_suite.py), one per test module and world size,
running the checks the session selected. With 8 or more cores they all start with the
suite's first test and run side by side (their checks are mostly waiting: process and
CUDA start, compilation, gloo); with fewer, each starts with its first test. All end at
the end of the session (also an interrupted one)."""
import os

import pytest
from cuda_suite import plan_worlds


@pytest.fixture(scope="session")
def cuda_worlds(request):
    worlds = plan_worlds(request.session.items)
    if (os.cpu_count() or 1) >= 8:
        for world in worlds.values():
            world.start()
    try:
        yield worlds
    finally:
        while worlds:
            worlds.popitem()[1].close()
