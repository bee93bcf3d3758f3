"""Out-of-range indices (rules/indices.py; issue #16 item 1): embedding and
cross_entropy raise IndexError on every rank of the placement, whatever the layouts,
as plain torch does; the ranks outside the placement take no part in the check. In
worlds of 2 and 4 processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from check_helpers import B, S, _close, _g, _gen
from mp import checks_in_worlds

import globaltensor as gt


def check_out_of_range_indices_raise_everywhere():
    w = torch.randn(10, 3, generator=_gen(12))
    for bad in ([1, 99, 2, 3], [-1, 2, 0, 0]):
        for w_sbp in (S(0), S(1), B):
            for i_sbp in (S(0), B):
                with pytest.raises(IndexError):
                    F.embedding(_g(torch.tensor(bad), i_sbp), _g(w, w_sbp))
    good = torch.tensor([9, 0, 4, 3])
    _close(F.embedding(_g(good, S(0)), _g(w, S(0))), F.embedding(good, w), "embedding")
    logits = torch.randn(4, 3, generator=_gen(13))
    for x_sbp, t_sbp in [(S(1), B), (S(0), S(0)), (B, B), (S(0), B)]:
        for bad in ([0, 1, 2, 7], [0, -5, 1, 1]):
            with pytest.raises(IndexError):
                F.cross_entropy(_g(logits, x_sbp), _g(torch.tensor(bad), t_sbp))
        ok = torch.tensor([0, -100, 2, 1])
        _close(F.cross_entropy(_g(logits, x_sbp), _g(ok, t_sbp)), F.cross_entropy(logits, ok),
               f"cross_entropy with an ignored target {x_sbp}")


def check_index_check_stays_on_the_placement():
    """Indices on ranks [0, 1] of a world of 4: its members raise; the ranks outside hold
    no index and take no part in the check (in a pipeline they run another stage)."""
    if gt.get_world_size() < 4:
        return
    part = gt.placement("cpu", [0, 1])
    w = _g(torch.randn(10, 3), S(0), placement=part)
    ids = _g(torch.tensor([3, 10]), S(0), placement=part)
    if gt.get_rank() in part:
        with pytest.raises(IndexError):
            F.embedding(ids, w)
    else:
        with gt.debug.comm_stats() as stats:
            out = F.embedding(ids, w)
        assert stats.total_calls == 0 and out.to_local().numel() == 0, stats


CHECKS = ["check_out_of_range_indices_raise_everywhere", "check_index_check_stays_on_the_placement"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
