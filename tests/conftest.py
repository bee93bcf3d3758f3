"""tests/ mirrors the package, one directory per part; the shared helpers are imported
by module name from any of them (``from mp import checks_in_worlds``), so the tests/
root goes on ``sys.path``. pytest puts each test file's own directory there (its
helpers sit beside it), and the spawned worlds, which import the test modules by name
(``"module:check"``), start with the parent's ``sys.path``."""
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


import mp  # noqa: E402  (needs the tests/ root on sys.path)


def pytest_collection_modifyitems(session, config, items):
    mp.order_world_tests_last(items)


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        mp.start_shared_worlds(session.items)


def pytest_sessionfinish(session, exitstatus):
    mp.close_shared_worlds()
