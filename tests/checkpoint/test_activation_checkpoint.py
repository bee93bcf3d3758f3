"""Activation checkpointing (torch.utils.checkpoint, both implementations) on global
tensors with dropout inside: the recompute in backward replays the forward's draws
(torch.get/set_rng_state carry the draw number), so gradients equal the unchecked
run's exactly, and the draws after the checkpointed block continue in step."""
from __future__ import annotations

import torch
from mp import checks_in_worlds
from torch.utils.checkpoint import checkpoint

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.GELU(),
                               torch.nn.Linear(16, 8), torch.nn.Dropout(0.3))


def _run(placement, sbp, mode):
    """(output, input gradient, parameter gradients, a draw after backward)."""
    block = gt.nn.to_global(_block(), placement, lambda name, t: B)
    gt.manual_seed(11)
    x = gt.randn(6, 8, placement=placement, sbp=sbp).detach().requires_grad_()
    if mode is None:
        y = block(x)
    else:
        y = checkpoint(block, x, use_reentrant=mode)
    (y * y).sum().backward()
    after = gt.rand(3, placement=placement, sbp=B).full()
    return (y.full().detach(), x.grad.full(),
            [p.grad.full() for p in block.parameters()], after)


def check_checkpoint_replays_dropout():
    p = gt.placement.all("cpu")
    for sbp in (S(0), B):
        plain = _run(p, sbp, None)
        for reentrant in (True, False):
            got = _run(p, sbp, reentrant)
            where = f"use_reentrant={reentrant}, input {sbp}"
            assert torch.equal(got[0], plain[0]), f"{where}: outputs differ"
            assert torch.equal(got[1], plain[1]), f"{where}: input gradients differ"
            for a, b in zip(got[2], plain[2]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert torch.equal(got[3], plain[3]), f"{where}: later draws out of step"


def check_fork_rng_restores_the_draw_number():
    p = gt.placement.all("cpu")
    gt.manual_seed(2)
    with torch.random.fork_rng():
        inside = gt.randn(4, placement=p, sbp=S(0)).full()
    again = gt.randn(4, placement=p, sbp=S(0)).full()
    assert torch.equal(inside, again)


CHECKS = ["check_checkpoint_replays_dropout", "check_fork_rng_restores_the_draw_number"]

test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
