"""DCP loads into GlobalTensors read only the overlap of each saved chunk with the part
(``interop/dcp_reads.py``): no saved chunk is ``torch.load``-ed whole, whole rows land
in the part directly, and other overlaps go through a bounded buffer (made tiny here,
so that a chunk takes many reads). Values are exact, across layouts, dtypes (a cast on
load) and 3-D chunks, in worlds of 2 and 4; other targets (plain tensors) still load
DCP's way."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.interop import dcp_reads

S, B = gt.sbp.split, gt.sbp.broadcast


def _value(shape, dtype=torch.float32):
    return (torch.arange(torch.Size(shape).numel()) % 37).reshape(shape).to(dtype)


SAVED = {"w": ((10, 6), torch.float32, S(0)), "bf16": ((7,), torch.bfloat16, S(0)),
         "cube": ((4, 3, 5), torch.float32, S(1))}
# target layouts: whole rows (split(0) elsewhere), columns (split(1)), all (broadcast),
# on a sub-placement, and fp64 targets of fp32 chunks (read, then cast)
TARGETS = {"w": [((S(1),), torch.float32, None), ((B,), torch.float64, None),
                 ((S(0),), torch.float32, [0])],
           "bf16": [((B,), torch.bfloat16, None)],
           "cube": [((S(2),), torch.float32, None), ((S(0),), torch.float32, None)]}


class _CountingLoads:
    """Counts torch.load calls (DCP's whole-chunk reads) while active."""

    def __enter__(self):
        self.calls, self.original = 0, torch.load

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)
        torch.load = counting
        return self

    def __exit__(self, *exc):
        torch.load = self.original


def check_resharding_load_reads_only_overlaps():
    p = gt.placement.all("cpu")
    path = f"/tmp/gt_lean_load_{os.getppid()}_{gt.get_world_size()}"
    saved = {k: gt.tensor(_value(shape, dtype), placement=p, sbp=sbp)
             for k, (shape, dtype, sbp) in SAVED.items()}
    dcp.save(saved, checkpoint_id=path)
    bounce = dcp_reads.BOUNCE_BYTES
    try:
        for k in range(3):
            targets = {}
            for name, options in TARGETS.items():
                sbp, dtype, ranks = options[k % len(options)]
                where = p if ranks is None else gt.placement("cpu", ranks)
                targets[name] = gt.zeros(SAVED[name][0], dtype=dtype, placement=where, sbp=sbp)
            dcp_reads.BOUNCE_BYTES = 8 if k == 1 else bounce   # many small reads
            with _CountingLoads() as loads:
                dcp.load(targets, checkpoint_id=path)
            assert loads.calls == 0, loads.calls
            for name, t in targets.items():
                want = _value(SAVED[name][0], SAVED[name][1]).to(t.dtype)
                assert torch.equal(t.full(), want), (name, k, t.sbp)
        plain = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, _) in SAVED.items()}
        with _CountingLoads() as loads:
            dcp.load(plain, checkpoint_id=path)
        assert loads.calls > 0   # not ours: DCP's own reads
        assert all(torch.equal(plain[n], _value(SAVED[n][0], SAVED[n][1])) for n in SAVED)
    finally:
        dcp_reads.BOUNCE_BYTES = bounce
        dist.barrier()
        if gt.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


CHECKS = ["check_resharding_load_reads_only_overlaps"]

# (a read size set per load, and torch.load's calls counted: the process's)
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, in_processes=["check_resharding_load_reads_only_overlaps"])
