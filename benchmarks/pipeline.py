"""Pipeline parallelism: torch.distributed.pipelining vs gt.pipeline, one run.

    python benchmarks/pipeline.py                 # spawns 2 processes on this machine
    python benchmarks/pipeline.py --rows 1024 --iters 11 --plot pipeline.png

The same MLP (``--width`` x ``--layers`` Linear+ReLU, cut in two equal stages, one per
rank) trained with the same schedule and micro-batches: torch's ``PipelineStage`` with
``ScheduleGPipe`` / ``Schedule1F1B`` on plain modules (gloo, CPU), and ours with the
stages made global on placements [0] and [1]. Two worlds are started in turn:

1. time: every case is built first, then timed round-robin (one step of each case in
   turn, ``--iters`` rounds, median; slowest rank), so drift on a busy machine hits
   all cases alike. Also each framework's step with one micro-batch, for the speedup
   of pipelining (ideal for GPipe with 2 stages: 2m / (m + 1)). Bubble fraction:
   1 - (this rank's compute alone) / (step time), where the compute alone is the
   stage's forward and backward of every micro-batch without any communication, as
   the framework runs it (ours: the plain module when its stages run on plain
   tensors), largest over the ranks.
2. memory: the rise of resident memory (VmHWM, reset before the step) during one
   step, per rank, in a world whose glibc maps every block over 64 KiB, so freed
   activations leave the resident size (that slows every step, so it is not timed).
   1F1B must hold fewer micro-batches than GPipe.

The default batch (2048 rows, micro-batches of 256) keeps the stages compute-bound:
here 8 micro-batches of 256 rows take the compute of one batch of 2048 rows, where 8
of 128 rows take 1.16x that of 1024 rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import bar_plot, round_robin_median

from globaltensor.testing import peak_rise, spawn

SCHEDULES = ("gpipe", "1f1b")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers (both stages)")
    ap.add_argument("--rows", type=int, default=2048, help="batch rows per step")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--iters", type=int, default=7, help="timed rounds (median taken)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every stage (both frameworks): no per-op dispatch")
    ap.add_argument("--plot", metavar="PNG", help="write the step times as a bar plot")
    ap.add_argument("--phase", choices=("time", "memory", "both"), default="both",
                    help=argparse.SUPPRESS)  # set per spawned world
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
    return _slowest(best)


def torch_case(args, schedule: str, m: int):
    """A step of torch's pipelining, and this rank's stage module."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank = dist.get_rank()
    stage_mod = _compiled(args, _stage(args.width, args.layers, rank))
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, m, loss_fn=F.mse_loss)
    x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)

    def step():
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        stage_mod.zero_grad(set_to_none=False)  # the rise is activations
    return step, stage_mod


def ours_case(args, schedule: str, m: int):
    """A step of gt.pipeline, and this rank's stage module."""
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
    step.runs_plain = lambda: all(rank in r.local for r in pipe._routes.values())
    return step, stages[rank]


def _cases(args) -> dict:
    """(framework, schedule, micro-batches) -> (step, stage module), every case built."""
    m = args.micro_batches
    keys = [(fw, s, m) for s in SCHEDULES for fw in ("torch", "ours")]
    keys += [("torch", "gpipe", 1), ("ours", "gpipe", 1)]
    make = {"torch": torch_case, "ours": ours_case}
    return {key: make[key[0]](args, key[1], key[2]) for key in keys}


def time_phase(args) -> None:
    import globaltensor as gt
    cases = _cases(args)
    times = dict(zip(cases, round_robin_median([step for step, _ in cases.values()],
                                               args.iters)))
    rank, m = dist.get_rank(), args.micro_batches
    rows = args.rows // m
    x = torch.randn(rows, args.width)
    alone = {"torch": _compute_alone(cases[("torch", "gpipe", m)][1], x, m, rank == 1)}
    step, stage = cases[("ours", "gpipe", m)]
    # stages that run on plain tensors (on every rank) compute what torch's modules do
    every_plain = _slowest(0.0 if step.runs_plain() else 1.0) == 0.0
    alone["ours"] = alone["torch"] if every_plain else _compute_alone(
        stage, gt.tensor(x, placement=gt.placement("cpu", ranks=[rank]), sbp=gt.sbp.broadcast),
        m, rank == 1)
    if rank != 0:
        return
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}) + ReLU in 2 stages on 2 "
          f"ranks, batch {args.rows} rows (gloo, CPU)"
          + (", stages compiled (inductor)" if args.compile else ""))
    print(f"{'schedule':<8} {'micro-batches':>13} {'torch ms':>9} {'ours ms':>8} "
          f"{'ours/torch':>10} {'bubble torch':>12} {'bubble ours':>11}")
    for s, mb in [(s, m) for s in SCHEDULES] + [("gpipe", 1)]:
        th, ou = times[("torch", s, mb)], times[("ours", s, mb)]
        bubbles = (f"{1 - alone['torch'] / th:>12.0%} {1 - alone['ours'] / ou:>11.0%}"
                   if mb == m else "")
        print(f"{s:<8} {mb:>13} {th * 1e3:>9.1f} {ou * 1e3:>8.1f} {ou / th:>10.2f} {bubbles}")
    speedup = {fw: times[(fw, "gpipe", 1)] / times[(fw, "gpipe", m)] for fw in ("torch", "ours")}
    print(f"gpipe, {m} micro-batches vs 1: torch {speedup['torch']:.2f}x faster, ours "
          f"{speedup['ours']:.2f}x (ideal {2 * m / (m + 1):.2f}x)")
    if args.plot:
        names = [f"{s}, {mb} mb" for s, mb in [(s, m) for s in SCHEDULES] + [("gpipe", 1)]]
        bar_plot(args.plot, names,
                 {fw: [times[(fw, s, mb)] * 1e3 for s, mb in [(s, m) for s in SCHEDULES]
                       + [("gpipe", 1)]] for fw in ("torch", "ours")},
                 "ms per step", "pipeline step, torch.distributed.pipelining vs gt.pipeline")


def memory_phase(args) -> None:
    cases = {key: case for key, case in _cases(args).items() if key[2] > 1}
    rises = []
    for step, _ in cases.values():
        step()
        step()  # warm-up (shape inference, allocator)
        dist.barrier()
        with peak_rise() as p:
            step()
        rises.append(p.mib)
    # one micro-batch's activations: this rank's (plain) stage forward, graph kept
    m, module = args.micro_batches, cases[("torch", "gpipe", args.micro_batches)][1]
    x = torch.randn(args.rows // m, args.width, requires_grad=True)
    module(x)  # a compiled module compiles for this input first
    with peak_rise() as p:
        out = module(x)
    rises.append(p.mib)
    del out
    every = [torch.zeros(len(rises), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(rises, dtype=torch.float64))
    if dist.get_rank() != 0:
        return
    glibc = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    ranks = range(len(every))
    print(f"peak resident memory rise during one step, MiB per rank "
          f"(MALLOC_MMAP_THRESHOLD_={glibc})")
    if glibc is None:
        print("  (glibc keeps freed blocks in the heap here, so these rises hide freed "
              "activations; run without a launcher for the memory world)")
    print(f"{'schedule':<8} {'torch':>16} {'ours':>16}")
    for s in SCHEDULES:
        per = {fw: " ".join(f"{every[r][list(cases).index((fw, s, m))]:7.1f}" for r in ranks)
               for fw in ("torch", "ours")}
        print(f"{s:<8} {per['torch']:>16} {per['ours']:>16}")
    one = [every[r][-1].item() for r in ranks]
    gpipe = [every[r][list(cases).index(("ours", "gpipe", m))].item() for r in ranks]
    print("one micro-batch's activations: " + " ".join(f"{v:.1f}" for v in one) + " MiB; "
          f"1F1B bound (2 / {m} x GPipe's + one micro-batch), ours: "
          + " ".join(f"{2 / m * g + o:.1f}" for g, o in zip(gpipe, one)))


def main(argv) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    gt.init()
    if args.phase in ("time", "both"):
        time_phase(args)
    if args.phase in ("memory", "both"):
        memory_phase(args)


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("pipeline"):   # --write-docs: its table into docs/benchmarks.md
        if "RANK" in os.environ:  # under a launcher: one world, the malloc settings it has
            spawn(main, 0)
        else:
            args, argv = _parser().parse_args(), sys.argv[1:]
            spawn(main, args.nproc, argv + ["--phase", "time"])
            os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave RSS
            spawn(main, args.nproc, argv + ["--phase", "memory"])
