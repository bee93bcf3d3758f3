"""Checkpoint throughput through torch.distributed.checkpoint: GlobalTensor vs DTensor.

    python benchmarks/checkpoint.py                 # spawns 4 processes on this machine
    python benchmarks/checkpoint.py --mib 64 --iters 3

The same sharded state (``--tensors`` fp32 matrices, split(0) / Shard(0) over every
rank; the DTensors share the GlobalTensors' local parts) is saved and loaded with
``dcp.save`` / ``dcp.load``, round-robin so machine noise hits both alike; the slowest
rank's median counts. Then two resharding loads, with the peak rise of resident memory
on a loading rank measured (VmHWM), next to the largest local part it fills: (a) the
checkpoint of 4 ranks into a layout on ranks [0, 1] only (split(1) there); (b) a
checkpoint of whole tensors (broadcast / Replicate) into split(0) over every rank, where
each saved chunk is 4 parts (DCP's reader loads saved chunks whole; globaltensor's
loads read only the overlap, ``interop/dcp_reads.py``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import round_robin_median  # noqa: E402

import globaltensor as gt  # noqa: E402
from globaltensor.testing import peak_rise, spawn  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _reshard_load(kind, where, sbp, rows, cols, state, checkpoint_id):
    """(seconds, peak RSS rise in MiB on a loading rank) of loading ``checkpoint_id`` into
    ``rows x cols`` zeros laid out as ``sbp`` on ``where`` (DTensors for ``kind`` "dt"),
    checked against ``state`` for ours; slowest / largest over the ranks."""
    rank = gt.get_rank()
    target = {k: gt.zeros(rows, cols, placement=where, sbp=sbp) for k in state}
    if kind == "dt":
        target = {k: v.to_dtensor() for k, v in target.items()}
    dist.barrier()
    t0 = time.perf_counter()
    with peak_rise() as peak:
        dcp.load(target, checkpoint_id=checkpoint_id)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    rise = torch.tensor([peak.mib if rank in where else 0.0], dtype=torch.float64)
    dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    if kind == "gt":
        for k, v in target.items():
            assert torch.equal(v.full(), state[k].full()), f"reshard mismatch in {k}"
    return seconds.item(), rise.item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    gt.init()
    rank, world = gt.get_rank(), gt.get_world_size()
    P = gt.placement.all("cpu")
    cols = 1024
    rows = max(world, int(args.mib * 2**20 / 4 / args.tensors / cols))
    gt.manual_seed(0)
    state = {f"layer{i}.weight": gt.randn(rows, cols, placement=P, sbp=gt.sbp.split(0))
             for i in range(args.tensors)}
    dstate = {k: v.to_dtensor() for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    per_rank_mb = nbytes / world / 1e6

    root = tempfile.mkdtemp(prefix="gt_ckpt_bench_") if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    count = {"gt": 0, "dt": 0}

    def save(kind, sd):
        def run():
            count[kind] += 1
            dcp.save(sd, checkpoint_id=f"{root}/{kind}{count[kind]}")
        return run

    save_gt, save_dt = round_robin_median([save("gt", state), save("dt", dstate)],
                                          iters=args.iters, warmup=1)
    on_disk = {k: _dir_bytes(f"{root}/{k}1") / nbytes for k in ("gt", "dt")}
    load_gt, load_dt = round_robin_median(
        [lambda: dcp.load(state, checkpoint_id=f"{root}/gt1"),
         lambda: dcp.load(dstate, checkpoint_id=f"{root}/dt1")], iters=args.iters, warmup=1)

    # Resharding loads, timed once each with the peak memory rise of a loading rank: (a)
    # the 4 ranks' checkpoint into split(1) on ranks [0, 1] (DTensor: the same layout on
    # a sub-mesh); (b) a checkpoint of whole tensors (broadcast / Replicate: one chunk
    # each) into split(0) over every rank, where a saved chunk is `world` parts.
    two = gt.placement("cpu", [0, 1])
    whole_state = {k: v.to_global(sbp=gt.sbp.broadcast) for k, v in state.items()}
    dcp.save(whole_state, checkpoint_id=f"{root}/gt_whole")
    dcp.save({k: v.to_dtensor() for k, v in whole_state.items()},
             checkpoint_id=f"{root}/dt_whole")
    del whole_state
    cases = {"a": (two, gt.sbp.split(1), "1", rows * (cols // 2)),
             "b": (P, gt.sbp.split(0), "_whole", -(-rows // world) * cols)}
    reshard = {}
    for case, (where, sbp, saved, part_numel) in cases.items():
        for kind in ("gt", "dt"):
            reshard[case, kind] = _reshard_load(kind, where, sbp, rows, cols, state,
                                                f"{root}/{kind}{saved}")
    part_mib = {case: numel * 4 / 2**20 for case, (_, _, _, numel) in cases.items()}

    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        print(f"checkpoint: {world} ranks, {nbytes / 2**20:.1f} MiB state ({args.tensors} x "
              f"{rows}x{cols} fp32, split(0) / Shard(0)), {per_rank_mb:.1f} MB per rank; "
              f"medians of {args.iters}, slowest rank")
        rows_out = [
            ("save, MB/s per rank", per_rank_mb / save_gt, per_rank_mb / save_dt),
            ("load, MB/s per rank", per_rank_mb / load_gt, per_rank_mb / load_dt),
            ("bytes on disk / state bytes", on_disk["gt"], on_disk["dt"]),
            (f"reshard load (a) {world} -> 2 ranks, s", reshard["a", "gt"][0],
             reshard["a", "dt"][0]),
            ("  peak RSS rise on a loading rank, MiB", reshard["a", "gt"][1],
             reshard["a", "dt"][1]),
            (f"reshard load (b) whole -> {world} ranks, s", reshard["b", "gt"][0],
             reshard["b", "dt"][0]),
            ("  peak RSS rise on a loading rank, MiB", reshard["b", "gt"][1],
             reshard["b", "dt"][1]),
        ]
        print(f"| {'':40s} | globaltensor |  DTensor | gt / DTensor |")
        print(f"|{'-' * 42}|-------------:|---------:|-------------:|")
        for name, a, b in rows_out:
            print(f"| {name:40s} | {a:12.3f} | {b:8.3f} | {a / b:12.2f} |")
        for case in ("a", "b"):
            print(f"({case}) largest local part a loading rank fills: {part_mib[case]:.1f} MiB "
                  f"(peak rise / it: gt {reshard[case, 'gt'][1] / part_mib[case]:.2f}, "
                  f"DTensor {reshard[case, 'dt'][1] / part_mib[case]:.2f})")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("checkpoint"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, int(os.environ.get("NPROC", 4)))
