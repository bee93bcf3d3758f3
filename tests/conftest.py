"""tests/ mirrors the package, one directory per part; the shared helpers are imported
by module name from any of them (``from mp import checks_in_worlds``), so the tests/
root goes on ``sys.path``. pytest puts each test file's own directory there (its
helpers sit beside it), and the spawned worlds, which import the test modules by name
(``"module:check"``), start with the parent's ``sys.path``."""
import os
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


import mp  # noqa: E402  (needs the tests/ root on sys.path)

# inductor compiles in a pool of worker processes by default (as many as the cores),
# each importing torch (3-4 CPU-seconds here): on the suite's two busy cores every
# process that compiles (this one, the worlds', the launched jobs') compiles in place.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(session, config, items):
    mp.order_world_tests_last(items)
    _skip_cuda_tests_without_a_gpu(items)


def _skip_cuda_tests_without_a_gpu(items) -> None:
    """Tests marked ``cuda`` need a CUDA device: skipped (with the reason) without one.
    ``GT_CUDA_TESTS_DEVICE=cpu`` runs tests/cuda/ on cpu placements instead (a dry run,
    tests/cuda/cuda_suite.py): those are then not skipped."""
    import os

    import pytest
    import torch

    dry_run = os.environ.get("GT_CUDA_TESTS_DEVICE", "cuda") != "cuda"
    needs_gpu = [item for item in items if item.get_closest_marker("cuda") and not (
        dry_run and Path(str(item.fspath)).parent == Path(_TESTS, "cuda"))]
    if needs_gpu and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in needs_gpu:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        mp.start_shared_worlds(session.items)


def pytest_sessionfinish(session, exitstatus):
    mp.close_shared_worlds()
