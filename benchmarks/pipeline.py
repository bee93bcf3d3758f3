"""Pipeline parallelism: torch.distributed.pipelining vs gt.pipeline, one run.

    python benchmarks/pipeline.py                 # spawns 2 processes on this machine
    python benchmarks/pipeline.py --rows 2048 --micro-batches 8 --iters 5

The same MLP (``--width`` x ``--layers`` Linear+ReLU, cut in two equal stages, one per
rank) trained with the same schedule and micro-batches: torch's ``PipelineStage`` with
``ScheduleGPipe`` / ``Schedule1F1B`` on plain modules (gloo, CPU), and ours with the
stages made global on placements [0] and [1]. Per schedule it prints:

- time per step (median of ``--iters``, slowest rank) and ours / torch;
- bubble fraction: 1 - (this rank's compute alone) / (step time), where the compute
  alone is the stage's forward+backward of every micro-batch timed without any
  communication, in the same framework (largest over the ranks);
- peak memory: the rise of resident memory (VmHWM, reset before the step) during one
  step, per rank, with glibc returning large blocks to the system so freed
  activations do not hide the peak. 1F1B must hold fewer micro-batches than GPipe.
Also the step time with 1 micro-batch (ours, gpipe) for the speedup of pipelining.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave RSS

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from rss import peak_rise  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers (both stages)")
    ap.add_argument("--rows", type=int, default=1024, help="batch rows per step")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5, help="timed steps (median taken)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every stage (both frameworks): no per-op dispatch")
    return ap


def _stage(width: int, layers: int, rank: int) -> torch.nn.Sequential:
    torch.manual_seed(rank)
    mods = []
    for _ in range(layers // 2):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _compiled(args, module: torch.nn.Module) -> torch.nn.Module:
    if not args.compile:
        return module
    # Every case builds new stage modules over the same forward code (a recompile each,
    # also for the no-grad shape pass): more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(module, fullgraph=True)


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _median_step(step, iters: int) -> float:
    step()
    step()  # warm-up (shape inference, allocator)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return _slowest(statistics.median(times))


def _peak(step) -> float:
    dist.barrier()
    with peak_rise() as p:
        step()
    return p.mib


def _compute_alone(stage, x, m: int, last: bool, iters: int = 3) -> float:
    """Forward+backward of ``m`` micro-batches of ``x`` through ``stage``, no messages."""
    def run():
        for _ in range(m):
            out = stage(x)
            (out.square().mean() if last else out).backward(
                None if last else torch.ones_like(out))
    run()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    for p in stage.parameters():
        p.grad = None
    return best


def torch_case(args, schedule_cls):
    from torch.distributed.pipelining import PipelineStage
    rank, m = dist.get_rank(), args.micro_batches
    stage_mod = _compiled(args, _stage(args.width, args.layers, rank))
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    sched = schedule_cls(stage, m, loss_fn=F.mse_loss)
    x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)

    def step():
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        stage_mod.zero_grad(set_to_none=False)  # the rise is activations
    t = _median_step(step, args.iters)
    mem = _peak(step)
    alone = _compute_alone(stage_mod, x[:args.rows // m], m, rank == 1)
    return t, 1 - _slowest(alone) / t, mem


def ours_case(args, schedule: str, m: int):
    import globaltensor as gt
    rank = dist.get_rank()
    stages = [_stage(args.width, args.layers, k) for k in range(2)]
    for k, s in enumerate(stages):
        gt.nn.to_global(s, gt.placement("cpu", ranks=[k]), gt.sbp.broadcast)
    stages = [_compiled(args, s) for s in stages]
    pipe = gt.pipeline.Pipeline(stages, micro_batches=m, schedule=schedule, loss_fn=F.mse_loss)
    x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)

    def step():
        pipe.step(x, y)
        for s in stages:
            s.zero_grad(set_to_none=False)
    t = _median_step(step, args.iters)
    mem = _peak(step)
    mine = stages[rank]
    xl = gt.tensor(x[:args.rows // m], placement=gt.placement("cpu", ranks=[rank]),
                   sbp=gt.sbp.broadcast)
    alone = _compute_alone(mine, xl, m, rank == 1)
    return t, 1 - _slowest(alone) / t, mem


def main(argv) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    gt.init()
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    rows = []
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        theirs = torch_case(args, cls)
        ours = ours_case(args, name, args.micro_batches)
        rows.append((name, theirs, ours))
    one = ours_case(args, "gpipe", 1)
    mems = [torch.zeros(2 * len(rows), dtype=torch.float64) for _ in range(dist.get_world_size())]
    mine = torch.tensor([v for _, th, ou in rows for v in (th[2], ou[2])], dtype=torch.float64)
    dist.all_gather(mems, mine)
    if dist.get_rank() != 0:
        return
    m = args.micro_batches
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}) + ReLU in 2 stages on 2 "
          f"ranks, batch {args.rows} rows, {m} micro-batches (gloo, CPU)"
          + (", stages compiled (inductor)" if args.compile else ""))
    print(f"{'schedule':<8} {'torch ms':>9} {'ours ms':>8} {'ours/torch':>10} "
          f"{'bubble torch':>12} {'bubble ours':>11}  peak MiB per rank torch | ours")
    for j, (name, th, ou) in enumerate(rows):
        t_mem = " ".join(f"{mems[r][2 * j]:6.1f}" for r in range(len(mems)))
        o_mem = " ".join(f"{mems[r][2 * j + 1]:6.1f}" for r in range(len(mems)))
        print(f"{name:<8} {th[0] * 1e3:>9.1f} {ou[0] * 1e3:>8.1f} {ou[0] / th[0]:>10.2f} "
              f"{th[1]:>12.0%} {ou[1]:>11.0%}  {t_mem} | {o_mem}")
    print(f"ours, gpipe, 1 micro-batch: {one[0] * 1e3:.1f} ms per step; {m} micro-batches "
          f"are {one[0] / rows[0][2][0]:.2f}x faster")


if __name__ == "__main__":
    launch(main, _parser().parse_args().nproc)
