"""Embedding lookups (row-split, i.e. vocab-parallel, tables; padding_idx; repeated
indices accumulate their gradient; sparse gradients refused before backward, the lookup
of a sparse=True table without a gradient is the dense one).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import B, P, S, battery_tests, case, checked, close, guard, line, placements, raises, randint, randn

import globaltensor as gt


@checked
def check_embedding():
    weight = randn((7, 4), "ew")
    idx = randint(7, (2, 3), "eidx")
    idx[0, 0] = idx[1, 2] = 3   # a repeated index accumulates its gradient
    case("embedding", F.embedding, [idx, weight], choices=[[B, S(0), S(1)], [B, S(0), S(1), P]],
         must=[(B, S(0)), (S(0), S(0)), (S(1), S(0)), (S(0), B)], places=placements(12, 1, 6))
    idx0 = idx.clone()
    idx0[1, 0] = 0
    case("embedding padding_idx=0", lambda i, w: F.embedding(i, w, padding_idx=0),
         [idx0, weight], choices=[[B, S(0)], [B, S(0)]], places=placements(4, 0, 3))
    case("embedding then sum", lambda i, w: F.embedding(i, w).sum(1), [idx, weight],
         choices=[[B, S(0)], [B, S(0)]], places=placements(4, 0, 2))
    # a plain index of one element (T5's relative position bucket for one query, one key)
    case("embedding of a plain one-element index", lambda w: F.embedding(torch.tensor([[5]]), w),
         [weight], choices=[[B, S(0), S(1), P]], places=placements(4, 1, 3))
    table = gt.tensor(weight, placement=line(), sbp=S(0)).requires_grad_()
    split_idx = gt.tensor(idx, placement=line(), sbp=S(0))
    raises("embedding sparse=True with a gradient", lambda: F.embedding(
        split_idx, table, sparse=True), ValueError, "sparse gradients")
    with torch.no_grad():
        got = guard("embedding sparse=True without a gradient",
                    lambda: F.embedding(split_idx, table, sparse=True))
    if got is not None:
        close(got.full(), F.embedding(idx, weight), "embedding sparse=True without a gradient")


CHECKS = ["check_embedding"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
