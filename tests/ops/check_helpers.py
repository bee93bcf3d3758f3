"""Helpers of the ops checks that are not battery families (test_attention.py,
test_complex.py, test_functional.py, test_indices.py, test_optim.py, test_resample.py):
GlobalTensors made from whole values on a placement of every rank, compared with
plain torch on the whole tensors. Run inside the spawned worlds (tests/mp.py's
``checks_in_worlds``); the names keep the leading underscore the checks use them by.
"""
from __future__ import annotations

import torch

import globaltensor as gt

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _line():
    return gt.placement("cpu", list(range(gt.get_world_size())))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _g(value, sbp, grad=False, placement=None):
    x = gt.tensor(value, placement=placement or _line(), sbp=sbp)
    return x.requires_grad_() if grad else x


def _close(got, want, what, **tol):
    got = got.full() if isinstance(got, gt.GlobalTensor) else got
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


def _attention_equal(stats, out, ref, ins, want, what, ring=True, **tol):
    """Attention of q, k, v (``ins``) split on the sequence against one process's
    (``ref`` from ``want``): with ``ring``, nothing gathered nor moved to a head split
    (the blocks went round as messages); the output and the three gradients equal."""
    if ring:
        assert stats.calls["all_gather"] == stats.calls["all_to_all"] == 0, (what, stats)
        assert stats.calls["send"] > 0, (what, stats)
    _close(out, ref.detach(), what, **tol)
    for name, x, w in zip("qkv", ins, want):
        _close(x.grad, w.grad, f"{what}: gradient of {name}", **tol)
