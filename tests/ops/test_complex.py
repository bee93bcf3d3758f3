"""The metadata queries of rules/complex.py (issue #10 item 4): is_pinned and
is_same_size answer without the broadcast fallback, in worlds of 2 and 4 processes.
"""
from __future__ import annotations

import torch
from check_helpers import B, S, _g
from mp import checks_in_worlds

from globaltensor.testing import no_fallback


def check_metadata_queries():
    x = _g(torch.randn(4, 4), S(0))
    assert no_fallback(lambda: x.is_pinned(), "is_pinned") is False
    assert no_fallback(lambda: x.is_same_size(_g(torch.randn(4, 4), B)), "is_same_size")


CHECKS = ["check_metadata_queries"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
