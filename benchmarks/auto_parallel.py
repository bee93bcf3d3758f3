"""gt.nn.auto_parallel vs data parallel, Megatron and fully_shard written by hand.

    python benchmarks/auto_parallel.py                     # spawns 2 processes
    python benchmarks/auto_parallel.py --nproc 4 --plot auto_parallel.png
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/auto_parallel.py

Three models, each trained one step at a time (zero_grad, forward, loss, backward) in
five ways, side by side in one run:

- MLP: ``--mlp-layers`` x Linear(``--mlp-width``) with ReLU between, batch
  ``--mlp-batch``; loss: mean of the output's squares;
- GPT: the 2-layer nanoGPT-style GPT of ``benchmarks/tp.py`` (its forward returns the
  cross-entropy loss of (ids, targets));
- conv net: three Conv2d(3x3) + ReLU, two MaxPool2d(2), a Linear head, on 32x32 images,
  batch ``--conv-batch``; loss: mean of the output's squares.

Ways: data parallel (``gt.nn.to_global(model, P, broadcast)``, inputs split(0));
Megatron (``gt.nn.to_global`` with column-parallel Linears split(0), the row-parallel
Linear after each split(1) on its weight, the rest broadcast, inputs broadcast: q/k/v ->
proj and fc1 -> fc2 in the GPT, Linear pairs (1st, 2nd), (3rd, 4th)... in the MLP; the
conv net has no pair); fully_shard (``gt.nn.fully_shard(model, P)``, inputs split(0));
``gt.nn.auto_parallel(model, P, inputs)`` (it times data parallel, Megatron and fully
sharded candidates itself and keeps the fastest; the timed step then gets its inputs in
the plan's layout); and auto_parallel again with ``memory_budget`` one byte below data
parallel's footprint (``globaltensor.nn.auto._bytes_per_rank``), so that it must choose
another layout.

Each way's first loss is checked against the same model's in one process (1e-4
relative); a way that raises or differs shows why in its row and is not timed. Time:
median ms per step of the slowest rank (``round_robin_median``, the ways of one model
round-robin). "x best" divides by the fastest hand-written way of the same model.
"KiB/rank": the largest rank's parameter bytes as stored, times 4 (parameter, gradient,
two Adam moments) plus buffers, as auto_parallel counts a footprint.
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from _common import bar_plot, round_robin_median
from torch import nn
from tp import COLUMN, GPT, ROW, Config

from globaltensor.testing import spawn

LOSS_RTOL = 1e-4
HAND = ["data parallel", "Megatron", "fully_shard"]
AUTO, BUDGET = "auto_parallel", "auto_parallel, budget < DP"
WAYS = HAND + [AUTO, BUDGET]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlp-width", type=int, default=256)
    ap.add_argument("--mlp-layers", type=int, default=4, help="Linear layers (even)")
    ap.add_argument("--mlp-batch", type=int, default=32)
    ap.add_argument("--gpt-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--conv-batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10, help="timed batches (median taken)")
    ap.add_argument("--calls", type=int, default=3, help="steps per timed batch")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (no RANK set)")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return ap


# --- the models ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A model (built the same on every rank), its whole batch, and Megatron's
    column-parallel and row-parallel Linears by qualified name (none: no Megatron)."""
    name: str
    model: nn.Module
    inputs: tuple
    columns: frozenset
    rows: frozenset
    no_megatron: str = ""


def _mlp_case(args) -> Case:
    torch.manual_seed(0)
    layers = []
    for i in range(args.mlp_layers):
        layers += [nn.Linear(args.mlp_width, args.mlp_width)]
        layers += [nn.ReLU()] if i < args.mlp_layers - 1 else []
    model = nn.Sequential(*layers)
    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    x = torch.randn(args.mlp_batch, args.mlp_width)
    return Case("MLP", model, (x,), frozenset(linears[0::2]), frozenset(linears[1::2]))


def _gpt_case(args) -> Case:
    torch.manual_seed(0)
    model = GPT(Config(args.vocab, args.seq, args.dim, args.heads, layers=2))
    ids, targets = (torch.randint(args.vocab, (args.gpt_batch, args.seq)) for _ in range(2))
    leaves = {name: name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return Case("GPT", model, (ids, targets),
                frozenset(n for n, leaf in leaves.items() if leaf in COLUMN),
                frozenset(n for n, leaf in leaves.items() if leaf in ROW))


def _conv_case(args) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    images = torch.randn(args.conv_batch, 3, 32, 32)
    return Case("conv net", model, (images,), frozenset(), frozenset(),
                no_megatron="skipped: one Linear (the head), no column/row pair")


def _loss(out: torch.Tensor) -> torch.Tensor:
    """The GPT's own loss, else the mean of the output's squares (auto_parallel's default)."""
    return out if out.dim() == 0 else out.float().square().mean()


# --- the ways -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Way:
    """One way's model and inputs; ``chose``: what auto_parallel picked (else "")."""
    model: nn.Module
    inputs: tuple
    chose: str = ""
    measured: Optional[dict] = None

    def step(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss = _loss(self.model(*self.inputs))
        loss.backward()
        return loss


class Skipped(Exception):
    """This way does not apply to this model (the message says why)."""


def _global_inputs(case: Case, placement, sbp) -> tuple:
    import globaltensor as gt
    return tuple(gt.tensor(x, placement=placement, sbp=sbp) for x in case.inputs)


def _megatron_layout(case: Case):
    import globaltensor as gt

    def sbp(name: str, t: torch.Tensor):
        module, param = name.rsplit(".", 1)
        if module in case.columns:
            return gt.sbp.split(0)
        if module in case.rows and param == "weight":
            return gt.sbp.split(1)
        return gt.sbp.broadcast
    return sbp


def data_parallel(case: Case, model: nn.Module, placement) -> Way:
    import globaltensor as gt
    gt.nn.to_global(model, placement, gt.sbp.broadcast)
    return Way(model, _global_inputs(case, placement, gt.sbp.split(0)))


def megatron(case: Case, model: nn.Module, placement) -> Way:
    import globaltensor as gt
    if not case.columns:
        raise Skipped(case.no_megatron)
    gt.nn.to_global(model, placement, _megatron_layout(case))
    return Way(model, _global_inputs(case, placement, gt.sbp.broadcast))


def fully_shard(case: Case, model: nn.Module, placement) -> Way:
    import globaltensor as gt
    gt.nn.fully_shard(model, placement)
    return Way(model, _global_inputs(case, placement, gt.sbp.split(0)))


def data_parallel_bytes(case: Case, placement) -> int:
    """Data parallel's footprint per rank as auto_parallel computes it."""
    from globaltensor.nn.auto import _bytes_per_rank, _candidates
    plain = copy.deepcopy(case.model)
    candidates = _candidates(plain, placement, case.inputs)
    return _bytes_per_rank(plain, candidates["data parallel"])


def auto(case: Case, model: nn.Module, placement, budget: bool = False) -> Way:
    import globaltensor as gt
    examples = _global_inputs(case, placement, gt.sbp.broadcast)
    limit = data_parallel_bytes(case, placement) - 1 if budget else None
    started = time.perf_counter()
    plan = gt.nn.auto_parallel(model, placement, examples, memory_budget=limit,
                               loss_fn=_loss)
    took = time.perf_counter() - started
    inputs = tuple(x.to_global(sbp=s) for x, s in zip(examples, plan.inputs))
    chose = f"{plan.strategy} ({took:.1f} s to choose)"
    if budget:
        chose += f"; budget {limit} B"
    return Way(model, inputs, chose, plan.measured)


BUILDERS: dict[str, Callable] = {
    "data parallel": data_parallel, "Megatron": megatron, "fully_shard": fully_shard,
    AUTO: auto, BUDGET: lambda c, m, p: auto(c, m, p, budget=True)}


# --- run ----------------------------------------------------------------------------------

def _state_bytes(model: nn.Module) -> int:
    """The largest rank's parameter bytes as stored x4 (gradient, two Adam moments)
    plus buffer bytes (``globaltensor.nn.auto.STATE_COPIES`` as auto_parallel counts)."""
    from globaltensor.nn.auto import STATE_COPIES
    local = lambda t: getattr(t, "local_part", t)
    mine = sum(local(p).numel() * p.element_size() * STATE_COPIES for p in model.parameters())
    mine += sum(local(b).numel() * b.element_size() for b in model.buffers())
    most = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _value(loss: torch.Tensor) -> float:
    import globaltensor as gt
    return (loss.full() if isinstance(loss, gt.GlobalTensor) else loss).item()


def _build_ways(case: Case, placement, rank: int) -> tuple[dict, dict]:
    """{way: Way} of the ways that ran and matched the reference loss, {way: why not}."""
    reference = _loss(copy.deepcopy(case.model)(*case.inputs)).item()
    ways, failed = {}, {}
    for name, build in BUILDERS.items():
        try:
            way = build(case, copy.deepcopy(case.model), placement)
            loss = _value(way.step())
        except Skipped as e:
            failed[name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 (a way that cannot run shows why)
            failed[name] = f"{type(e).__name__}: {str(e)[:120]}"
            if rank == 0:
                print(f"{case.name}, {name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        off = abs(loss - reference) / abs(reference)
        if off > LOSS_RTOL:
            failed[name] = f"loss off by {off:.1e}"
            continue
        ways[name] = way
    return ways, failed


@dataclass(frozen=True)
class Result:
    """One model's row per way: ms, KiB per rank and auto's choice, or why it did not run."""
    case: Case
    ms: dict
    kib: dict
    ways: dict
    failed: dict

    def best_hand(self) -> Optional[float]:
        hand = [self.ms[w] for w in HAND if w in self.ms]
        return min(hand) if hand else None


def _measure(case: Case, placement, args, rank: int) -> Result:
    ways, failed = _build_ways(case, placement, rank)
    kib = {name: _state_bytes(way.model) / 1024 for name, way in ways.items()}
    times = round_robin_median([w.step for w in ways.values()], args.iters, args.calls,
                               warmup=2)
    ms = {name: t * 1e3 for name, t in zip(ways, times)}
    return Result(case, ms, kib, ways, failed)


def _print_table(results: list, n: int) -> None:
    print(f"\n{n} ranks; one training step (zero_grad, forward, loss, backward): median ms "
          f"(slowest rank); x best: over the fastest hand-written way; KiB/rank: "
          f"parameters x4 + buffers")
    head = f"{'model':<10}{'way':<28}{'ms':>9}{'x best':>8}{'KiB/rank':>10}  chose"
    print(head + "\n" + "-" * (len(head) + 40))
    for r in results:
        best = r.best_hand()
        for name in WAYS:
            if name not in r.ms:
                print(f"{r.case.name:<10}{name:<28}  {r.failed.get(name, '-')}")
                continue
            ratio = f"{r.ms[name] / best:.2f}" if best else "-"
            print(f"{r.case.name:<10}{name:<28}{r.ms[name]:9.2f}{ratio:>8}"
                  f"{r.kib[name]:10.1f}  {r.ways[name].chose}")
    print("\nauto_parallel's own timings of its candidates (its few steps, this run):")
    for r in results:
        for name in (AUTO, BUDGET):
            if name in r.ways:
                shown = "; ".join(f"{k}: {v}" for k, v in r.ways[name].measured.items())
                print(f"  {r.case.name}, {name}: {shown}")


def _check_sizes(args, n: int) -> None:
    problems = []
    if args.mlp_layers % 2:
        problems.append("--mlp-layers must be even (Megatron pairs Linears)")
    if args.heads % n or args.dim % args.heads:
        problems.append(f"--heads must divide by {n} ranks, --dim by --heads")
    if args.mlp_width % n:
        problems.append(f"--mlp-width must divide by {n} ranks")
    if min(args.mlp_batch, args.gpt_batch, args.conv_batch) < n:
        problems.append(f"every batch must have at least {n} rows (one per rank)")
    if problems:
        raise SystemExit("; ".join(problems))


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    gt.init()
    n, rank = dist.get_world_size(), dist.get_rank()
    _check_sizes(args, n)
    placement = gt.placement.all("cpu")
    results = [_measure(build(args), placement, args, rank)
               for build in (_mlp_case, _gpt_case, _conv_case)]
    if rank == 0:
        _print_table(results, n)
        if args.plot:
            bar_plot(args.plot, [r.case.name for r in results],
                     {w: [r.ms[w] / r.best_hand() if w in r.ms and r.best_hand() else None
                          for r in results] for w in WAYS},
                     "step time / fastest hand-written way",
                     f"auto_parallel vs by hand, {n} ranks")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("auto_parallel"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
