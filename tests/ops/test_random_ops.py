"""Dropout and random-like ops: masks placement-invariant and reproducible from
gt.manual_seed, independent per split part, gradients through the mask.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ops_battery import F64, B, S, battery_tests, checked, close, expect, guard, line, mesh, nd, randn

import globaltensor as gt


def _allequal_locals(t, where):
    """A broadcast result: every rank of the placement holds the whole value (the same
    values on each); a rank outside it holds nothing."""
    if not expect(t.sbp == nd(B, t.placement), f"{where}: sbp {t.sbp}, not broadcast"):
        return
    full = t.full()
    parts = [None] * gt.get_world_size()
    dist.all_gather_object(parts, t.to_local())
    for rank, part in enumerate(parts):
        if rank in t.placement:
            expect(torch.equal(part, full), f"{where}: rank {rank} holds other values")
        else:
            expect(part.numel() == 0, f"{where}: rank {rank} outside holds {part.shape}")


def _dropout_mask_ok(full, scale, where, lo=0.3, hi=0.7):
    zeros = (full == 0).double().mean().item()
    expect(lo <= zeros <= hi, f"{where}: {zeros:.2f} of the elements are zero")
    kept = full[full != 0]
    expect(torch.allclose(kept, torch.full_like(kept, scale)),
           f"{where}: kept elements are not scaled by {scale}: {kept.unique()[:5]}")


@checked
def check_dropout_and_random():
    places = [line()] + ([mesh()] if gt.get_world_size() == 4 else [])
    ones = torch.ones(20, 10, dtype=F64)
    for p in places:
        where = f"[world {gt.get_world_size()}] dropout(p=0.5) broadcast on {p.ranks}"

        def broadcast_case():
            x = gt.tensor(ones, placement=p, sbp=nd(B, p), requires_grad=True)
            gt.manual_seed(11)
            y = F.dropout(x, 0.5, training=True)
            expect(y.placement == p and tuple(y.shape) == (20, 10), f"{where}: metadata")
            full = y.full()
            _allequal_locals(y, where)
            _dropout_mask_ok(full, 2.0, where)
            g = randn((20, 10), "dropg")
            (y * gt.tensor(g, placement=p, sbp=nd(B, p))).sum().backward()
            expect(x.grad.sbp == x.sbp, f"{where}: grad sbp {x.grad.sbp}")
            close(x.grad.full(), (full != 0).double() * 2.0 * g, f"{where} grad")
            gt.manual_seed(11)
            again = F.dropout(x, 0.5, training=True).full()
            close(again, full, f"{where}: gt.manual_seed(11) again")
            gt.manual_seed(12)
            other = F.dropout(x, 0.5, training=True).full()
            expect(not torch.equal(other, full), f"{where}: another seed, the same mask")
            close(F.dropout(x, 0.5, training=False).full(), ones, f"{where} training=False")
            close(F.dropout(x, 0.0, training=True).full(), ones, f"{where} p=0")

        guard(where, broadcast_case)
        for sbp in ((S(0),) * p.ndim, (S(1),) + (S(0),) * (p.ndim - 1)):
            where_s = f"[world {gt.get_world_size()}] dropout(p=0.25) sbp {sbp} on {p.ranks}"

            def split_case():
                x = gt.tensor(torch.ones(40, 6, dtype=F64), placement=p, sbp=sbp)
                gt.manual_seed(3)
                y = F.dropout(x, 0.25, training=True)
                expect(y.placement == p and tuple(y.shape) == (40, 6), f"{where_s}: metadata")
                full = y.full()
                _dropout_mask_ok(full, 1 / 0.75, where_s, 0.1, 0.4)
                # independent masks per part: the ranks' parts are not all the same
                parts = [full]
                for axis, s in enumerate(sbp):
                    parts = [q for t in parts for q in t.tensor_split(p.shape[axis], s.dim)]
                common = [min(t.shape[d] for t in parts) for d in range(2)]
                parts = [t[:common[0], :common[1]] for t in parts]
                expect(any(not torch.equal(parts[0], q) for q in parts[1:]),
                       f"{where_s}: every part has the same mask")
                gt.manual_seed(3)
                close(F.dropout(x, 0.25, training=True).full(), full,
                      f"{where_s}: gt.manual_seed(3) again")

            guard(where_s, split_case)
        where_r = f"[world {gt.get_world_size()}] rand_like on {p.ranks}"

        def rand_like_case():
            x = gt.tensor(ones, placement=p, sbp=nd(B, p))
            gt.manual_seed(5)
            r = torch.rand_like(x)
            expect(r.placement == p and tuple(r.shape) == (20, 10) and r.dtype == F64,
                   f"{where_r}: metadata")
            _allequal_locals(r, where_r)
            full = r.full()
            expect(bool(((full >= 0) & (full < 1)).all()) and full.std() > 0.1,
                   f"{where_r}: not uniform values")
            gt.manual_seed(5)
            close(torch.rand_like(x).full(), full, f"{where_r}: gt.manual_seed(5) again")
            xs = gt.tensor(ones, placement=p, sbp=nd(S(0), p))
            gt.manual_seed(5)
            a = torch.randn_like(xs).full()
            gt.manual_seed(5)
            close(torch.randn_like(xs).full(), a, f"{where_r}: randn_like split, seed again")

        guard(where_r, rand_like_case)


CHECKS = ["check_dropout_and_random"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
