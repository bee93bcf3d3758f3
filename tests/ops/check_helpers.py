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
