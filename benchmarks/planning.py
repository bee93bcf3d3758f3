"""Whole-step planning and the first step on 1-D and 2-D placements.

    python benchmarks/planning.py                                # 12 layers: 1x4, 2x2, 2x4
    python benchmarks/planning.py --meshes 2x2 --layers 2 --profile plan.prof

The nanoGPT-style GPT of ``benchmarks/tp.py`` (``--layers`` blocks) trained one step at a
time (zero_grad, forward, cross entropy, backward) on each placement in its own world:
``1x4`` is Megatron tensor parallelism on 4 ranks (1-D: q/k/v/fc1 split(0), proj/fc2
weight split(1), the rest broadcast, ids broadcast); ``RxC`` is data x tensor parallel on
an R x C mesh: ids split(0) on axis 0, Megatron's layout on axis 1, parameters broadcast
on axis 0 (``(broadcast, split(0))`` / ``(broadcast, split(1))``).

Columns (rank 0's, seconds):

- first step: wall and CPU time of the first training step (every op decided op by op,
  the boxing and decision caches empty; whole-step planning does not take part yet);
- planning: the recorded step planned on rank 0 alone (``alone``; the other ranks
  wait), the boxing caches as the first steps left them, as a rank on a core of its
  own plans it; then in the world (``planning``: every rank at once,
  ``step.state.last.seconds``; rank 0's tables priced again, as ``alone`` forgot
  them); then again on rank 0 alone with every boxing cache emptied (``cold``), wall time,
  and that cold planning's CPU time (``cold cpu``: what other work on the machine
  inflates least); then once more as a step recorded again plans (an ``Autosave``
  save, a model built again: ``again``, the choice remembered, ``planner/reuse.py``);
- planned step: median wall time of the replayed steps after it.

Every rank of an 8-rank world on a 2-core machine shares the cores, so wall times there
are inflated; CPU times and rank 0's planning alone are not. ``--profile PREFIX`` writes
rank 0's cProfile of the first step and of the cold planning, per mesh, to
``PREFIX.<mesh>.step1`` and ``PREFIX.<mesh>.plan``.
"""
from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tp import GPT, Config, _megatron_sbp

from globaltensor.testing import spawn


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", default="1x4,2x2,2x4",
                    help="comma-separated: 1xN (1-D Megatron) or RxC (data x tensor)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--replays", type=int, default=3, help="planned steps timed")
    ap.add_argument("--profile", default=None,
                    help="write rank 0's cProfile of step 1 and of the cold planning here")
    ap.add_argument("--mesh", default=None, help=argparse.SUPPRESS)   # one world's
    return ap


def _placement_and_layouts(mesh: str):
    import globaltensor as gt
    rows, cols = (int(k) for k in mesh.split("x"))
    B = gt.sbp.broadcast
    if rows == 1:
        return gt.placement("cpu", list(range(cols))), \
            (lambda name, t: _megatron_sbp(name)), B
    P = gt.placement("cpu", [[r * cols + c for c in range(cols)] for r in range(rows)])
    return P, (lambda name, t: (B, _megatron_sbp(name))), (gt.sbp.split(0), B)


def _alone(planner, record: tuple, rank: int) -> float:
    """Rank 0's wall seconds planning ``record`` alone (the other ranks wait) with the
    tables and searches its first steps left: what a rank on a core of its own spends
    planning in the program. (Planning forgets them at its end, so rank 0's planning
    in the world that follows prices its tables again.)"""
    dist.barrier()
    seconds = float("nan")
    if rank == 0:
        t0 = time.perf_counter()
        planner(*record, reuse=False)
        seconds = time.perf_counter() - t0
    dist.barrier()
    return seconds


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    from globaltensor.boxing import plan as boxing_plan
    from globaltensor.planner import record as step
    gt.init()
    rank = dist.get_rank()
    P, params, inputs = _placement_and_layouts(args.mesh)
    torch.manual_seed(0)
    model = GPT(Config(args.vocab, args.seq, args.dim, args.heads, args.layers))
    gt.nn.to_global(model, P, params)
    ids, targets = (gt.tensor(torch.randint(args.vocab, (args.batch, args.seq)),
                              placement=P, sbp=inputs) for _ in range(2))
    captured, alone = [], []
    planner = step.plan_step

    def capture(*a, **kw):
        captured.append(a)
        if len(captured) == 1:   # rank 0 plans the step alone first, as the steps left it
            alone.append(_alone(planner, a, rank))
        return planner(*a, **kw)
    step.plan_step = capture

    def train_step():
        model.zero_grad(set_to_none=True)
        model(ids, targets).backward()

    dist.barrier()
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    train_step()
    if profiler:
        profiler.disable()
        profiler.dump_stats(f"{args.profile}.{args.mesh}.step1")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for _ in range(step.RECORD_AT):   # the RECORD_AT-th is recorded, the next planned
        train_step()
    planned = step.state.last
    choices = [n.choice for n in planned.nodes] if planned is not None else []
    replays = []
    for _ in range(args.replays):
        dist.barrier()
        t0 = time.perf_counter()
        train_step()
        replays.append(time.perf_counter() - t0)
    step.plan_step = planner
    dist.barrier()
    cold = cold_cpu = remembered = float("nan")
    if rank == 0 and captured and planned is not None:
        record, sinks, pin_grads = captured[-1]
        boxing_plan.clear_caches()
        profiler = cProfile.Profile() if args.profile else None
        t0, c0 = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        again = planner(record, sinks, pin_grads, reuse=False)
        if profiler:
            profiler.disable()
            profiler.dump_stats(f"{args.profile}.{args.mesh}.plan")
        cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
        if [n.choice for n in again.nodes] != choices:
            print("warning: the cold planning chose differently", flush=True)
        t0 = time.perf_counter()
        again = planner(record, sinks, pin_grads)   # the step's remembered choice
        remembered = time.perf_counter() - t0
        if [n.choice for n in again.nodes] != choices:
            print("warning: the remembered plan chose differently", flush=True)
    dist.barrier()
    if rank == 0:
        calls = len(planned.nodes) if planned is not None else 0
        seconds = planned.seconds if planned is not None else float("nan")
        first = alone[0] if alone else float("nan")
        print(f"{args.mesh:<6}{args.layers:>7}{calls:>7}{wall:>11.2f}{cpu:>10.2f}"
              f"{seconds:>11.2f}{first:>7.2f}{cold:>9.2f}{cold_cpu:>9.2f}{remembered:>7.3f}"
              f"{statistics.median(replays) if replays else 0:>11.3f}", flush=True)


def _header(args) -> None:
    print(f"GPT, {args.layers} layers, batch {args.batch} x seq {args.seq}, width "
          f"{args.dim}, {args.heads} heads, vocab {args.vocab}; seconds (rank 0)")
    head = (f"{'mesh':<6}{'layers':>7}{'calls':>7}{'step1 wall':>11}{'step1 cpu':>10}"
            f"{'planning':>11}{'alone':>7}{'cold':>9}{'cold cpu':>9}{'again':>7}{'planned':>11}")
    print(head + "\n" + "-" * len(head), flush=True)


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("planning"):   # --write-docs: its table into docs/benchmarks.md
        import os
        args = _parser().parse_args()
        if "RANK" in os.environ:
            main(sys.argv[1:])
        else:
            # 8 ranks planning at once on a 2-core machine reach a scalar's read minutes
            # apart: give it time (only this benchmark's worlds)
            os.environ.setdefault("GLOBALTENSOR_READ_TIMEOUT", "900")
            _header(args)
            for mesh in args.meshes.split(","):
                rows, cols = (int(k) for k in mesh.split("x"))
                spawn(main, rows * cols, sys.argv[1:] + ["--mesh", mesh])
