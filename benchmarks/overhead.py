"""Host time per training step, by phase: plain torch vs DTensor vs ours vs the floor.

    python benchmarks/overhead.py                            # tiny GPT, cpu, every row
    python benchmarks/overhead.py --rows w1dp --optim foreach --iters 5
    python benchmarks/overhead.py --rows w1dp --compile --plot overhead.png
    python benchmarks/overhead.py --device cuda              # --size real: ~49M params
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/overhead.py --rows tp2

What: a nanoGPT-style GPT (positions from ``torch.arange`` inside forward, causal
``F.scaled_dot_product_attention``, GELU MLP, head tied to the token embedding, cross
entropy); per phase of a training step, the milliseconds the host spends: forward with
the loss, backward with the gradient reduction the layout needs, AdamW step with
``zero_grad``. ``--size tiny`` (cpu default: 2 layers, width 32) is overhead-bound, the
cpu's stand-in for a GPU step whose kernels outrun the host; ``--size real`` (cuda
default: 6 layers, width 768, vocab 8192, seq 256, batch 16) has 49M parameters
(``SIZES``; ``--layers`` etc. override). On cuda ``torch.cuda.synchronize()`` ends each
phase, so a phase's figure is its wall time (host and kernels).

Rows: world 1 data parallel (w1dp), n ranks data parallel (dp2) and Megatron tensor
parallel (tp2), n = ``--nproc``. Ways: plain (torch; DDP for dp, tp.py's Megatron by
hand for tp); dtensor (``parallelize_module`` for tp, ``distribute_module`` making the
rest Replicate, a Shard(0) batch for dp: see ``dtensor``); ours (``gt.nn.to_global``,
broadcast parameters and a split(0) batch, or tp.py's Megatron sbp); floor (plain on
dispatch.py's ``Floor``, a ``__torch_dispatch__`` subclass that only unwraps and
rewraps: what any Python tensor subclass pays). ``--compile`` adds plain, ours and
dtensor under ``torch.compile(model)`` at world 1 (``--backend``; eager optimizer).

How: AdamW with ``foreach=True`` and with ``fused=True`` (``--optim``); each case (row,
optimizer, way) has its own model copy and runs ``--warmup`` untimed steps (ours plans
from its 6th; compiled ways compile), then ``--iters`` rounds, each one step of every
case in a new shuffled order after a barrier, phases timed with ``time.perf_counter``;
medians, the slowest rank's.

Reading the table: ``step`` is the median of whole steps (not exactly the sum of the
phase medians); ``calls f/b/o``: ops entering a tensor subclass's
``__torch_dispatch__`` per phase (ours, DTensor, Floor; one extra step under a counting
TorchDispatchMode), so ours - floor is what ours adds in op count; ``colls``:
collective and point-to-point calls per phase (a send and its recv count two);
``/plain``, ``/dtensor``: step ratios in the same row and optimizer (compiled ways
against compiled ones). Below it: ours' ratios per phase, and the first-step loss of
every way against plain's (max abs difference, printed, not asserted).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import _Progress, bar_plot
from dispatch import Floor
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from tp import _copy_to_parallel, _megatron_sbp, _RowParallel

from globaltensor.testing import spawn

SIZES = {"tiny": dict(layers=2, dim=32, heads=2, vocab=64, seq=16, batch=8),
         "real": dict(layers=6, dim=768, heads=12, vocab=8192, seq=256, batch=16)}
WAYS = ["plain", "dtensor", "ours", "floor"]
COMPILED = ["plain compiled", "dtensor compiled", "ours compiled"]
PHASES = ("fwd", "bwd", "opt")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=tuple(SIZES), help="default: tiny on cpu, real on cuda")
    for dim in SIZES["tiny"]:
        ap.add_argument(f"--{dim}", type=int, help="overrides the size's")
    ap.add_argument("--rows", default="w1dp,dp2,tp2", help="comma list of w1dp, dp2, tp2")
    ap.add_argument("--optim", default="foreach,fused", help="AdamW kinds: foreach, fused")
    ap.add_argument("--iters", type=int, default=40, help="timed rounds (median taken)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps per case first")
    ap.add_argument("--compile", nargs="?", const="plain,dtensor,ours", default="",
                    help="add compiled ways at world 1 (all, or a comma list of plain, "
                         "dtensor, ours)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the dp and tp rows")
    ap.add_argument("--plot", help="write a PNG bar chart here")
    ap.add_argument("--json", help="also write the table's rows here (gpu_table.py reads it)")
    ap.add_argument("--out", help=argparse.SUPPRESS)   # where a spawned world puts results
    return ap


# --- the model, as nanoGPT writes it (q, k, v apart, so that they split as Megatron's) ---

class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        self.n_head = heads    # ways that run attention on local parts divide it

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = (lin(x).view(B, T, self.n_head, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (nn.LayerNorm(dim), Attention(dim, heads),
                                                     nn.LayerNorm(dim), MLP(dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():   # nanoGPT's init (N(0, 1) embeddings give denormals)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# --- the ways: each builds on its own copy of the model -------------------------------

@dataclass(frozen=True)
class Env:
    n: int
    rank: int
    device: torch.device
    placement: object     # gt placement of every rank
    mesh: object          # DTensor's 1-D mesh of every rank
    ids: torch.Tensor     # the whole batch, the same on every rank
    targets: torch.Tensor
    compile: Callable     # torch.compile with the chosen backend


@dataclass
class Run:
    """``loss()`` runs forward and loss inside ``scope()``, backward runs in it too,
    ``sync()`` finishes the gradients after it; ``value(loss)``: the whole batch's."""
    loss: Callable[[], torch.Tensor]
    model: nn.Module
    scope: Callable = contextlib.nullcontext
    sync: Callable[[], None] = lambda: None
    value: Callable[[torch.Tensor], float] = lambda loss: loss.item()


def _mine(t: torch.Tensor, env: Env) -> torch.Tensor:
    return t.tensor_split(env.n)[env.rank].contiguous()   # = split(0) / Shard(0)


def _megatron(model: GPT, n: int, rank: int) -> None:
    """tp.py's Megatron by hand: this rank's q/k/v/fc1 rows and proj/fc2 columns, f
    before attention and MLP, g after proj and fc2."""
    for block in model.h:
        attn, mlp = block.attn, block.mlp
        for lin in (attn.q, attn.k, attn.v, mlp.fc1):
            lin.weight = nn.Parameter(lin.weight.detach().chunk(n, 0)[rank].clone())
            lin.bias = nn.Parameter(lin.bias.detach().chunk(n, 0)[rank].clone())
        attn.proj, mlp.fc2 = _RowParallel(attn.proj, rank, n), _RowParallel(mlp.fc2, rank, n)
        attn.n_head //= n
        for m in (attn, mlp):
            m.register_forward_pre_hook(_copy_to_parallel, with_kwargs=True)


def _to_floor(model: nn.Module) -> Callable:
    """Every parameter and buffer wrapped in ``Floor`` (as tp.py's megatron_wrapped);
    returns the wrapper for the inputs."""
    wrapped: dict = {}                   # a tied parameter stays one parameter
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = wrapped.setdefault(p, nn.Parameter(Floor(p.detach())))
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = Floor(b)
    return Floor


def plain(model: GPT, env: Env, kind: str, compiled: bool, floor: bool = False) -> Run:
    """Plain torch (Megatron for tp, DDP for dp at n ranks); ``floor``: on Floor tensors."""
    if kind == "tp":
        _megatron(model, env.n, env.rank)
    wrap = _to_floor(model) if floor else (lambda t: t)
    ids, targets, fn, value = env.ids, env.targets, model, Run.value
    if kind == "dp" and env.n > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        fn = DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)
        ids, targets = _mine(ids, env), _mine(targets, env)

        def value(loss):   # equal parts (checked in main): the mean of the ranks' means
            t = torch.tensor(loss.item(), device=env.device)
            dist.all_reduce(t)
            return t.item() / env.n
    elif compiled:
        fn = env.compile(model)
    ids, targets = wrap(ids), wrap(targets)
    return Run(lambda: fn(ids, targets), model, value=value)


def _dtensor_cpu_attention() -> None:
    """DTensor has sharding strategies for the cuda attention kernels only (2.13): batch
    and head sharding for the cpu one, with its public ``register_sharding``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if fwd in getattr(DTensor._op_dispatcher.sharding_propagator, "op_strategy_funcs", {}):
        return
    layouts = (Replicate(), Shard(0), Shard(1))     # whole, batch split, heads split
    register_sharding(fwd)(lambda *a, **k: [([p] * 2, [p] * 3 + [None] * 2) for p in layouts])
    register_sharding(bwd)(lambda *a, **k: [([p] * 3, [p] * 6 + [None] * 2) for p in layouts])


def dtensor(model: GPT, env: Env, kind: str, compiled: bool) -> Run:
    """tp: ColwiseParallel q/k/v/fc1 (attention on the local heads), RowwiseParallel
    proj/fc2; then every other parameter Replicate (for dp all; batch Shard(0)). Torch's
    only DTensor-based DDP is FSDP2's: a Partial gradient is redistributed after
    backward, one all-reduce per parameter."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_module
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    ids, targets = env.ids, env.targets   # tp: plain ids, taken as Replicate
    if kind == "tp":
        plan = {}
        for i, block in enumerate(model.h):
            plan |= {f"h.{i}.attn.{m}": ColwiseParallel() for m in ("q", "k", "v")}
            plan |= {f"h.{i}.attn.proj": RowwiseParallel(use_local_output=False),
                     f"h.{i}.mlp.fc1": ColwiseParallel(),
                     f"h.{i}.mlp.fc2": RowwiseParallel(use_local_output=False)}
            block.attn.n_head //= env.n     # torch's tutorial: the local heads
        parallelize_module(model, env.mesh, plan)
    else:
        if env.device.type == "cpu":
            _dtensor_cpu_attention()
        ids, targets = (DTensor.from_local(_mine(t, env), env.mesh, [Shard(0)],
                                           run_check=False) for t in (ids, targets))
    # The rest Replicate: the residual stream is a DTensor (tp: proj/fc2 hand it
    # DTensors, q/k/v/fc1 local parts to attention and GELU), and the optimizer's
    # foreach and fused kernels take no mix of plain tensors and DTensors. It replicates
    # each module's own parameters: the head is tied again.
    distribute_module(model, env.mesh)
    model.lm_head.weight = model.wte.weight
    fn = env.compile(model) if compiled else model

    def sync():   # a Replicate parameter used on sharded activations has a Partial grad
        for p in model.parameters():
            if p.grad is not None and any(isinstance(q, Partial) for q in p.grad.placements):
                p.grad = p.grad.redistribute(placements=p.placements)
    # implicit_replication: the plain positions, saved for backward too, are Replicate
    return Run(lambda: fn(ids, targets), model, implicit_replication, sync,
               lambda loss: loss.full_tensor().item())


def ours(model: GPT, env: Env, kind: str, compiled: bool) -> Run:
    import globaltensor as gt
    P = env.placement
    gt.nn.to_global(model, P, (lambda name, t: _megatron_sbp(name)) if kind == "tp"
                    else gt.sbp.broadcast)
    data = gt.sbp.broadcast if kind == "tp" else gt.sbp.split(0)
    ids, targets = (gt.tensor(t, placement=P, sbp=data) for t in (env.ids, env.targets))
    fn = env.compile(model) if compiled else model
    return Run(lambda: fn(ids, targets), model)


BUILDERS = {"plain": plain, "dtensor": dtensor, "ours": ours,
            "floor": lambda *a: plain(*a, floor=True)}


# --- one case: a way with its optimizer; counting and timing --------------------------

class DispatchCount(TorchDispatchMode):
    """Per phase: ops entering a tensor subclass's ``__torch_dispatch__`` (an argument of a
    subclass type: ours, DTensor's C++ fast path, Floor), handed on (NotImplemented);
    the plain ops those run come back here, and their collectives are counted (c10d and
    functional ones, DDP's reducer's too)."""

    def __init__(self):
        super().__init__()
        self.sub, self.colls, self.now = dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0), ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            self.sub[self.now] += 1
            return NotImplemented
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional") and \
                func._opname not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.colls[self.now] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def phase(self, name: str):
        self.now = name
        with self:
            yield


@dataclass
class Case:
    row: str
    optim: str
    way: str
    run: Optional[Run] = None
    opt: Optional[torch.optim.Optimizer] = None
    why: Optional[str] = None        # why it did not run
    loss: Optional[float] = None     # the first step's
    calls: Optional[list] = None     # subclass dispatches per phase
    colls: Optional[list] = None     # collectives per phase
    ms: list = field(default_factory=list)

    def step(self, wait: Callable[[], None], count: Optional[DispatchCount] = None):
        """The loss, and seconds of the step, forward, backward, optimizer (``wait``
        ends each phase: the cuda synchronize)."""
        phase = count.phase if count else lambda name: contextlib.nullcontext()
        t0 = time.perf_counter()
        with phase("fwd"), self.run.scope():
            loss = self.run.loss()
        wait()
        t1 = time.perf_counter()
        with phase("bwd"), self.run.scope():
            loss.backward()
            self.run.sync()
        wait()
        t2 = time.perf_counter()
        with phase("opt"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        wait()
        t3 = time.perf_counter()
        return loss, [t3 - t0, t1 - t0, t2 - t1, t3 - t2]

    def prepare(self, base: GPT, env: Env, kind: str, warmup: int, wait) -> None:
        """Build, run the warm-up steps (the first gives the loss) and one counted step;
        a failure (the same on every rank) becomes the reason in its row."""
        name = self.way.removesuffix(" compiled")
        try:
            self.run = BUILDERS[name](copy.deepcopy(base), env, kind, self.way != name)
            self.opt = torch.optim.AdamW(self.run.model.parameters(), lr=1e-3,
                                         **{self.optim: True})
            for i in range(warmup):
                loss, _ = self.step(wait)
                if i == 0:
                    self.loss = self.run.value(loss)
            if self.way == name:   # compiled code would recompile under the mode
                count = DispatchCount()
                self.step(wait, count)
                self.calls = None if name == "plain" else [count.sub[p] for p in PHASES]
                self.colls = [count.colls[p] for p in PHASES]
        except Exception as e:  # noqa: BLE001 (a way that cannot run shows why in its row)
            self.why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def _time(cases: list, iters: int, wait) -> None:
    """_common.round_robin_median per phase: each round runs one step of every case in
    a new order (the same on every rank), each after a barrier; medians in ms, the
    slowest rank's (it bounds a collective step)."""
    live = [c for c in cases if c.why is None]
    progress = _Progress(iters)
    for it in range(iters):
        progress.update(it)
        order = list(range(len(live)))
        random.Random(it).shuffle(order)
        for k in order:
            dist.barrier()
            live[k].ms.append(live[k].step(wait)[1])
    progress.done()
    if not live:
        return
    med = torch.tensor([[statistics.median(col) for col in zip(*c.ms)] for c in live],
                       dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    for c, m in zip(live, med.tolist()):
        c.ms = [t * 1e3 for t in m]


# --- a world's rows; the report ---------------------------------------------------------

def _kind(row: str) -> str:
    return "w1" if row == "w1dp" else row.rstrip("0123456789")


def main(argv: Optional[list] = None) -> None:
    args = _parser().parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    import globaltensor as gt
    gt.init()
    n, rank = gt.get_world_size(), gt.get_rank()
    s = dict(SIZES[args.size or ("real" if args.device == "cuda" else "tiny")])
    s.update({k: getattr(args, k) for k in s if getattr(args, k) is not None})
    if n > 1 and (s["heads"] % n or s["batch"] % n or s["dim"] % s["heads"]):
        raise SystemExit(f"--heads and --batch must divide by {n} ranks, --dim by --heads")
    device, wait = torch.device("cpu"), lambda: None
    if args.device == "cuda":
        device = torch.device("cuda", gt.get_local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        wait = torch.cuda.synchronize
    torch.manual_seed(0)      # the same model and batch on every rank
    base = GPT(s["vocab"], s["seq"], s["dim"], s["heads"], s["layers"]).to(device)
    ids, targets = (torch.randint(s["vocab"], (s["batch"], s["seq"]), device=device)
                    for _ in range(2))
    env = Env(n, rank, device, gt.placement.all(args.device),
              init_device_mesh(args.device, (n,)), ids, targets,
              lambda m: torch.compile(m, backend=args.backend))
    cases = []
    for row in args.rows.split(","):
        if (_kind(row) == "w1") != (n == 1):
            continue          # a row of the other world
        kind = "dp" if _kind(row) == "w1" else _kind(row)
        compiled = [f"{w} compiled" for w in args.compile.split(",") if w] if n == 1 else []
        ways = WAYS + [w for w in COMPILED if w in compiled]
        for optim in args.optim.split(","):
            for way in ways:
                cases.append(Case(row if n == 1 else f"{kind}{n}", optim, way))
                cases[-1].prepare(base, env, kind, args.warmup, wait)
    _time(cases, args.iters, wait)
    results = [{k: getattr(c, k) for k in ("row", "optim", "way", "why", "loss", "calls",
                                           "colls", "ms")} for c in cases]
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=results, size=s), f)
    elif rank == 0:
        report(args, results, s)
    dist.barrier()


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def report(args, results: list, size: dict) -> None:
    ms = {(r["row"], r["optim"], r["way"]): r["ms"] or [None] * 4 for r in results}
    print(f"\nhost ms per training step by phase ({args.device}; "
          + ", ".join(f"{k} {v}" for k, v in size.items())
          + f"): medians of {args.iters} rounds, slowest rank"
          + ("; phases end with cuda.synchronize" if args.device == "cuda" else ""))
    head = (f"{'row':<6}{'optim':<8}{'way':<17}{'step':>8}{'fwd':>8}{'bwd':>8}{'opt':>8}"
            f"{'calls f/b/o':>13}{'colls':>8}{'/plain':>7}{'/dtensor':>9}")
    print(head + "\n" + "-" * len(head))
    for r in results:
        front = f"{r['row']:<6}{r['optim']:<8}{r['way']:<17}"
        if r["why"]:
            print(front + f"  n/a ({r['why']})")
            continue
        calls, colls = ("/".join(map(str, r[k])) if r[k] else "-" for k in ("calls", "colls"))
        tail = " compiled" if r["way"].endswith(" compiled") else ""
        ref = [ms.get((r["row"], r["optim"], w + tail), [None])[0] for w in ("plain", "dtensor")]
        print(front + "".join(f"{t:8.2f}" for t in r["ms"]) + f"{calls:>13}{colls:>8}"
              f"{_ratio(r['ms'][0], ref[0]):>7}{_ratio(r['ms'][0], ref[1]):>9}")
    keys = list(dict.fromkeys((r["row"], r["optim"]) for r in results))
    print("\nours per phase, fwd/bwd/opt (x):")
    for row, optim in keys:
        o = ms.get((row, optim, "ours"), [None] * 4)
        print(f"  {row:<6}{optim:<9}" + "   ".join(
            f"/{w} " + "/".join(_ratio(o[i], ms[row, optim, w][i]) for i in (1, 2, 3))
            for w in ("plain", "dtensor", "floor") if (row, optim, w) in ms))
    print("first-step loss, max |way - plain| (same row and optimizer):")
    for row in dict.fromkeys(r["row"] for r in results):
        plain_loss = {r["optim"]: r["loss"] for r in results
                      if r["row"] == row and r["way"] == "plain"}
        diffs = [(abs(r["loss"] - plain_loss[r["optim"]]), r["way"]) for r in results
                 if r["row"] == row and r["loss"] is not None
                 and plain_loss.get(r["optim"]) is not None]
        worst = max(diffs, default=None)
        print(f"  {row:<6}" + ("-" if worst is None else "0 (every way equal)" if not worst[0]
                               else f"{worst[0]:.2e} ({worst[1]})"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(row=r["row"], optim=r["optim"], way=r["way"], why=r["why"],
                            **dict(zip(("step_ms", "forward_ms", "backward_ms",
                                        "optimizer_ms"), r["ms"] or [None] * 4)))
                       for r in results], f, indent=1)
    if args.plot:
        bar_plot(args.plot, [f"{row}\n{optim}" for row, optim in keys],
                 {w: [ms.get((row, optim, w), [None])[0] for row, optim in keys]
                  for w in WAYS + COMPILED if any(r["way"] == w for r in results)},
                 "median ms per step", "host time per training step")


def run_worlds(argv: list) -> None:
    """World 1's rows in a spawned world of one process, the others in one of
    ``--nproc``; one table of both."""
    args = _parser().parse_args(argv)
    rows = args.rows.split(",")
    if any(_kind(r) not in ("w1", "dp", "tp") for r in rows):
        raise SystemExit(f"unknown --rows {args.rows}; choose from w1dp, dp2, tp2")
    results, size = [], None
    for world, mine in ((1, [r for r in rows if _kind(r) == "w1"]),
                        (args.nproc, [r for r in rows if _kind(r) != "w1"])):
        if mine:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "results.json")
                spawn(main, world, argv + ["--rows", ",".join(mine), "--out", out])
                with open(out) as f:
                    got = json.load(f)
            results, size = results + got["results"], got["size"]
    report(args, results, size)


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("overhead"):   # --write-docs: its table into docs/benchmarks.md
        if "RANK" in os.environ:     # started by a launcher: this world's rows only
            main()
        else:
            run_worlds(sys.argv[1:])
