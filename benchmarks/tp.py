"""Tensor parallelism on a nanoGPT-style model: ours vs DTensor vs Megatron by hand.

    python benchmarks/tp.py                          # spawns 2 processes, eager + compiled
    python benchmarks/tp.py --nproc 4 --no-compile --plot tp.png
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/tp.py
    python benchmarks/tp.py --device cuda --no-compile   # every way on the GPUs

``--device cpu|cuda`` (default cpu): where the model, the ids, the placement and
DTensor's mesh live (cuda: rank r on GPU ``LOCAL_RANK % device_count``; ranks sharing a
GPU communicate through gloo, as the library does); on cuda each timed batch starts and
ends with ``torch.cuda.synchronize()``.

A GPT written as nanoGPT and Hugging Face write it (token + position embedding; per
block LayerNorm, attention with separate q/k/v Linear(C, C), ``view(B, T, H, hd)
.transpose(1, 2)``, a causal tril buffer with masked_fill, softmax, ``att @ v``,
``transpose(1, 2).contiguous().view``, proj; LayerNorm, MLP fc1 GELU fc2; final
LayerNorm, lm head tied to the token embedding; cross entropy). One training step
(forward, loss, backward, the gradient reduction the layout needs) in seven ways, eager
and under ``torch.compile(fullgraph=True)`` (``--no-compile`` skips those):

- ours annotated: ``gt.nn.to_global`` with Megatron's parameter layout (q/k/v/fc1
  weight and bias split(0), proj/fc2 weight split(1), the rest broadcast), input ids
  broadcast, every activation's layout left to the framework (compiled: one eager step
  is planned first with ``gt.debug.explain_step``, and the traced graphs follow the
  plan);
- ours compiled as is (compiled only): the same model compiled with no eager step
  first: the first call's graphs are traced op by op and recorded, the next call plans
  them and traces again (the measured step);
- ours pinned: the same, and the forward pins Megatron's activation layouts with
  ``to_global``: residual stream broadcast after the embedding and each add, q/k/v and
  attention weights split on heads, merged heads and MLP hidden split on features;
- ours auto_parallel: ``gt.nn.auto_parallel(model, placement, (ids, targets))``, no
  annotation (it times data parallel, Megatron and fully sharded layouts and keeps the
  fastest);
- DTensor TP: ``parallelize_module``, ColwiseParallel (q, k, v, fc1), RowwiseParallel
  (proj, fc2), attention on the local heads as torch's tutorial sets it up;
- DTensor TP+SP: torch's sequence-parallel plan on top (SequenceParallel layer norms,
  PrepareModuleInput gathering the sequence before attention and MLP, proj/fc2
  reduce-scattering onto it); embeddings and lm head replicated as above;
- Megatron by hand: plain tensors, each rank holding its heads and MLP columns, f
  (gradient all-reduce) before attention and MLP, g (all-reduce) after proj and fc2;
- Megatron wrapped (eager only): the same with every parameter, buffer and input
  wrapped in ``dispatch.py``'s ``Floor``, a Python tensor subclass that only unwraps and
  rewraps: what any Python ``__torch_dispatch__`` subclass (ours, DTensor) pays per op
  over plain tensors, with no layout logic at all.

Each way's loss is first checked against the whole model's in one process (1e-4
relative); a way that raises or differs shows why in its row and is not timed. Time:
median ms per step of the slowest rank (``round_robin_median``).

Bytes sent per step per rank, one accounting for all ways, globaltensor's own
(``globaltensor/comm/collectives.py``) for payload N among n ranks: all-reduce
2N(n-1)/n (ring), all-gather N(n-1) of the input, reduce-scatter N(n-1)/n of the input,
all-to-all the bytes addressed to other ranks, broadcast N(n-1) on the source, N per
point-to-point send. Ours eager: ``gt.debug.comm_stats()``. DTensor and Megatron
eager: a dispatch mode applying the formulas to every functional collective
(``_c10d_functional.*``, what DTensor and the f/g here call; like torch's CommDebugMode
it lets DTensor desugar first). Compiled: an inductor post-grad pass applies them to
the collectives of every graph compiled (forward and backward, shapes from the nodes'
fake values), plus whatever runs eagerly around the graphs (DTensor's gradient
reduction, ours' eager leftovers). The pass sees every graph only with inductor's
caches off: compiled ways compile from scratch (minutes).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import bar_plot, local_device, round_robin_median
from compile import _CopyToParallel, _ReduceFromParallel
from dispatch import Floor
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._python_dispatch import TorchDispatchMode

from globaltensor.testing import spawn

LOSS_RTOL = 1e-4
COLUMN, ROW = {"q", "k", "v", "fc1"}, {"proj", "fc2"}    # Megatron's split per Linear
WAYS = ["ours annotated", "ours compiled as is", "ours pinned", "ours auto_parallel",
        "DTensor TP", "DTensor TP+SP", "Megatron by hand", "Megatron wrapped"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10, help="timed batches (median taken)")
    ap.add_argument("--calls", type=int, default=3, help="steps per timed batch")
    ap.add_argument("--no-compile", action="store_true", help="eager ways only")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (no RANK set)")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return ap


# --- the model, as nanoGPT writes it ----------------------------------------------------

@dataclass(frozen=True)
class Config:
    vocab: int
    block: int
    dim: int
    heads: int
    layers: int


def _pin(x, where: str, pins: Optional[dict]):
    """``x`` moved to the layout pinned for ``where`` (ours pinned only)."""
    return x if pins is None else x.to_global(sbp=pins[where])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.n_head, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block, cfg.block))
                             .view(1, 1, cfg.block, cfg.block))

    def forward(self, x, pins=None):
        B, T, _ = x.size()
        q, k, v = (_pin(lin(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2),
                        "heads", pins) for lin in (self.q, self.k, self.v))
        att = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = _pin(F.softmax(att, dim=-1), "heads", pins)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.proj(_pin(y, "features", pins))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x, pins=None):
        return self.fc2(_pin(F.gelu(self.fc1(x)), "features", pins))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.dim), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x, pins=None):
        x = _pin(x + self.attn(self.ln_1(x), pins=pins), "stream", pins)
        return _pin(x + self.mlp(self.ln_2(x), pins=pins), "stream", pins)


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.dim), nn.Embedding(cfg.block, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        # nanoGPT's and HF GPT-2's initialisation. Embedding's default N(0, 1), tied to
        # the head, makes logits so large that half the softmax gradient is denormal
        # floats, and the head's backward products then run 40x slower on a CPU.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets, pins=None):
        _, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = _pin(self.wte(idx) + self.wpe(pos), "stream", pins)
        for block in self.h:
            x = block(x, pins=pins)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# --- byte accounting (one formula for every way) ----------------------------------------

_SENDS_NOTHING = {"wait_tensor", "_wrap_tensor_autograd"}


def collective_bytes(op, args, kwargs) -> int:
    """Bytes this rank sends for one functional collective (0 for any other op)."""
    if getattr(op, "namespace", None) == "c10d":
        raise NotImplementedError(f"{op}: eager c10d collectives are not counted here")
    if getattr(op, "namespace", None) != "_c10d_functional" or op._opname in _SENDS_NOTHING:
        return 0
    from torch.distributed.distributed_c10d import _resolve_process_group
    bound = {a.name: v for a, v in zip(op._schema.arguments, args)} | dict(kwargs)
    group = bound["group_name"]
    group = _resolve_process_group(group) if isinstance(group, str) else group
    n, me = group.size(), dist.get_rank(group)
    inputs = bound["inputs"] if "inputs" in bound else [bound["input"]]
    size = sum(t.numel() * t.element_size() for t in inputs)
    kind = op._opname.rstrip("_").removesuffix("_out").removesuffix("_coalesced")
    if kind == "all_reduce":
        return 2 * size * (n - 1) // n
    if kind == "all_gather_into_tensor":
        return size * (n - 1)
    if kind == "reduce_scatter_tensor":
        return size * (n - 1) // n
    if kind == "all_to_all_single":
        splits = bound["input_split_sizes"]
        if not splits:
            return size * (n - 1) // n
        return size - int(splits[me]) * (size // max(int(bound["input"].shape[0]), 1))
    if kind == "broadcast":
        return size * (n - 1) if me == bound["src"] else 0
    raise NotImplementedError(f"{op}: no byte formula")


class EagerBytes(TorchDispatchMode):
    """Adds up ``collective_bytes`` of every functional collective run eagerly."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):   # DTensor desugars into collectives first
            return NotImplemented
        self.total += collective_bytes(func, args, kwargs)
        return func(*args, **kwargs)


class GraphBytes(CustomGraphPass):
    """Inductor post-grad pass adding up ``collective_bytes`` of each graph compiled
    while ``counting()`` is open (changes nothing)."""

    def __init__(self):
        self.total: Optional[int] = None     # bytes so far while counting, else None
        self.total_seen = 0                  # bytes of the last counting() block

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.total is None:
            return
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                     lambda a: a.meta["val"])
                self.total += collective_bytes(node.target, args, kwargs)

    def uuid(self):
        return None     # no cache entry: the pass must see every graph

    @contextlib.contextmanager
    def counting(self):
        self.total = 0
        try:
            yield self
        finally:
            self.total_seen, self.total = self.total, None


# --- the ways -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Way:
    """One way's model and step: ``loss()`` runs forward and loss, ``sync()`` reduces
    gradients after backward; ``torch_comm``: its collectives are torch's functional ones
    (else ours, counted by ``gt.debug.comm_stats``)."""
    model: nn.Module
    loss: Callable[[], torch.Tensor]
    compiled: bool
    torch_comm: bool
    sync: Callable[[], None] = field(default=lambda: None)

    def step(self, torch_counter=contextlib.nullcontext()):
        self.model.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if self.compiled else torch_counter:
            loss = self.loss()
            loss.backward()
        with torch_counter:
            self.sync()
        return loss


@dataclass(frozen=True)
class Env:
    placement: object
    mesh: object
    ids: torch.Tensor
    targets: torch.Tensor
    n: int
    rank: int
    backend: str


def _maybe_compiled(fn, env: Env, compiled: bool):
    return torch.compile(fn, backend=env.backend, fullgraph=True, dynamic=False) \
        if compiled else fn


def _megatron_sbp(name: str):
    import globaltensor as gt
    module, param = name.split(".")[-2:]
    if module in COLUMN or (module in ROW and param == "weight"):
        return gt.sbp.split(0 if module in COLUMN else 1)
    return gt.sbp.broadcast


class NotBuilt(Exception):
    """The framework has no such function yet."""


class EagerOnly(Exception):
    """A way measured in eager mode only."""


def ours(model: GPT, env: Env, compiled: bool, pinned: bool = False, auto: bool = False,
         traced: bool = False) -> Way:
    import globaltensor as gt
    bcast, P = gt.sbp.broadcast, env.placement
    ids, targets = (gt.tensor(t, placement=P, sbp=bcast) for t in (env.ids, env.targets))
    if auto:
        if not hasattr(gt.nn, "auto_parallel"):
            raise NotBuilt
        gt.nn.auto_parallel(model, P, (ids, targets))
    else:
        gt.nn.to_global(model, P, lambda name, t: _megatron_sbp(name))
    pins = {"stream": bcast, "heads": gt.sbp.split(1), "features": gt.sbp.split(2)} \
        if pinned else None
    if traced and not compiled:
        raise NotBuilt    # the same as "ours annotated" in eager mode
    if traced:            # as a fresh program: no plan from the ways before
        from globaltensor.planner import record as step
        kept = dict(step.state.plans)
        step.state.plans.clear()
    if compiled and not auto and not traced:   # one eager step planned; traces replay it
        gt.debug.explain_step(lambda: model(ids, targets, pins).backward())
        model.zero_grad(set_to_none=True)
    fn = _maybe_compiled(lambda i, t: model(i, t, pins), env, compiled)

    def loss():
        # compiled code skips the modules' own implicit-broadcast scope
        with gt.implicit_broadcast():
            return fn(ids, targets)
    if traced:   # the first call's trace is recorded; the measured step traces it again
        loss().backward()
        model.zero_grad(set_to_none=True)
        step.state.plans.update(kept)   # (the newest plan of a first call is replayed)
    return Way(model, loss, compiled, torch_comm=False)


def dtensor(model: GPT, env: Env, compiled: bool, sp: bool = False) -> Way:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    out = Shard(1) if sp else Replicate()
    plan = {}
    for i in range(len(model.h)):
        plan |= {f"h.{i}.attn.{m}": ColwiseParallel() for m in ("q", "k", "v")}
        plan |= {f"h.{i}.attn.proj": RowwiseParallel(output_layouts=out),
                 f"h.{i}.mlp.fc1": ColwiseParallel(),
                 f"h.{i}.mlp.fc2": RowwiseParallel(output_layouts=out)}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
            plan |= {f"h.{i}.ln_1": SequenceParallel(), f"h.{i}.attn": gather,
                     f"h.{i}.ln_2": SequenceParallel(), f"h.{i}.mlp": gather}
    if sp:   # enter the sequence split after the embeddings, leave it before the lm head
        plan |= {"h.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                           desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
                 "ln_f": SequenceParallel(),
                 "lm_head": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),),
                                               use_local_output=True)}
    parallelize_module(model, env.mesh, plan)
    for block in model.h:   # torch's tutorial: attention runs on this rank's heads
        block.attn.n_head //= env.n
    fn = _maybe_compiled(lambda i, t: model(i, t), env, compiled)

    def sync():   # a replicated parameter used on sharded activations has a partial grad
        for p in model.parameters():
            if p.grad is not None and any(isinstance(pl, Partial)
                                          for pl in getattr(p.grad, "placements", ())):
                p.grad = p.grad.redistribute(placements=p.placements)
    return Way(model, lambda: fn(env.ids, env.targets), compiled, torch_comm=True,
               sync=sync)


class _RowParallel(nn.Module):
    """Megatron's RowParallelLinear: this rank's input columns, g, then the bias."""

    def __init__(self, lin: nn.Linear, rank: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(lin.weight.detach().chunk(n, 1)[rank].clone())
        self.bias = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromParallel.apply(F.linear(x, self.weight)) + self.bias


def _copy_to_parallel(module, args, kwargs):
    return (_CopyToParallel.apply(args[0]),) + tuple(args[1:]), kwargs


def megatron(model: GPT, env: Env, compiled: bool) -> Way:
    for block in model.h:
        attn, mlp = block.attn, block.mlp
        for lin in (attn.q, attn.k, attn.v, mlp.fc1):    # this rank's output features
            lin.weight = nn.Parameter(lin.weight.detach().chunk(env.n, 0)[env.rank].clone())
            lin.bias = nn.Parameter(lin.bias.detach().chunk(env.n, 0)[env.rank].clone())
        attn.proj = _RowParallel(attn.proj, env.rank, env.n)
        mlp.fc2 = _RowParallel(mlp.fc2, env.rank, env.n)
        attn.n_head //= env.n
        # f once per attention and MLP input (q, k and v share it, as Megatron's fused qkv)
        attn.register_forward_pre_hook(_copy_to_parallel, with_kwargs=True)
        mlp.register_forward_pre_hook(_copy_to_parallel, with_kwargs=True)
    fn = _maybe_compiled(lambda i, t: model(i, t), env, compiled)
    return Way(model, lambda: fn(env.ids, env.targets), compiled, torch_comm=True)


def megatron_wrapped(model: GPT, env: Env, compiled: bool) -> Way:
    if compiled:   # Floor has no __tensor_flatten__: torch.compile cannot trace it
        raise EagerOnly
    megatron(model, env, False)
    wrapped: dict = {}     # a tied parameter stays one parameter
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if p not in wrapped:
                    wrapped[p] = nn.Parameter(Floor(p.detach()))
                module._parameters[name] = wrapped[p]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = Floor(b)
    ids, targets = Floor(env.ids), Floor(env.targets)
    return Way(model, lambda: model(ids, targets), False, torch_comm=True)


BUILDERS = {"ours annotated": ours,
            "ours pinned": lambda m, e, c: ours(m, e, c, pinned=True),
            "ours auto_parallel": lambda m, e, c: ours(m, e, c, auto=True),
            "ours compiled as is": lambda m, e, c: ours(m, e, c, traced=True),
            "DTensor TP": dtensor,
            "DTensor TP+SP": lambda m, e, c: dtensor(m, e, c, sp=True),
            "Megatron by hand": megatron,
            "Megatron wrapped": megatron_wrapped}


# --- run ----------------------------------------------------------------------------------

def _value(loss) -> float:
    import globaltensor as gt
    if isinstance(loss, gt.GlobalTensor):
        return loss.full().item()
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _measured(way: Way, graphs: GraphBytes) -> tuple[float, int]:
    """The first step of a way (compiled ways compile in it): its loss and the bytes
    this rank sent."""
    import globaltensor as gt
    eager = EagerBytes()
    with gt.debug.comm_stats() as ours_stats, graphs.counting():
        loss = way.step(eager if way.torch_comm else contextlib.nullcontext())
    return _value(loss), ours_stats.total_bytes + eager.total + graphs.total_seen


def _configure_compile(graphs: GraphBytes) -> None:
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    torch._inductor.config.post_grad_custom_pre_pass = graphs
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # one code object (GPT.forward) compiled once per way
    torch._dynamo.config.recompile_limit = 64


def _run_ways(base: GPT, env: Env, modes: list, reference: float) -> tuple[dict, dict]:
    """{(way, mode): bytes or the reason it did not run}, {(way, mode): step}."""
    graphs = GraphBytes()
    if "compiled" in modes:
        _configure_compile(graphs)
    rows, steps = {}, {}
    for mode in modes:
        for name, build in BUILDERS.items():
            try:
                way = build(copy.deepcopy(base), env, mode == "compiled")
                loss, nbytes = _measured(way, graphs)
            except NotBuilt:
                rows[name, mode] = "n/a (not built)"
                continue
            except EagerOnly:
                rows[name, mode] = "n/a (eager only)"
                continue
            except Exception as e:  # noqa: BLE001 (a way that cannot run shows why)
                rows[name, mode] = type(e).__name__
                if env.rank == 0:
                    print(f"{name} ({mode}): {type(e).__name__}: {str(e)[:300]}")
                continue
            off = abs(loss - reference) / abs(reference)
            if off > LOSS_RTOL:
                rows[name, mode] = f"loss off by {off:.1e}"
                continue
            if mode == "compiled" and env.backend != "inductor":
                nbytes = None       # the counting pass is inductor's
            elif mode == "eager":   # a planned step (ours records one, then plans)
                from globaltensor.planner.record import RECORD_AT, state
                last = state.last
                nbytes = [_measured(way, graphs)[1] for _ in range(RECORD_AT)][-1]
                if state.last is not last:
                    PLANNING[name] = (state.last.seconds, len(state.last.nodes))
            rows[name, mode], steps[name, mode] = nbytes, way.step
    return rows, steps


PLANNING: dict = {}   # way: (seconds its eager step took to plan, calls in it)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
        and b else "-"


def _print_table(args, n: int, modes: list, rows: dict, ms: dict) -> None:
    print(f"\n{n} ranks, batch {args.batch} x seq {args.seq}, width {args.dim}, "
          f"{args.heads} heads, vocab {args.vocab}, {args.layers} layers; one training "
          f"step: median ms (slowest rank), KiB sent per rank (see docstring)"
          + ("; on cuda, batches end with cuda.synchronize" if args.device == "cuda" else ""))
    head = (f"{'way':<22}{'mode':<10}{'ms':>9}{'KiB':>10}{'ms/DT':>8}{'ms/Meg':>8}"
            f"{'B/DT':>7}{'B/Meg':>7}")
    print(head + "\n" + "-" * len(head))
    for mode in modes:
        dt, meg = ("DTensor TP", mode), ("Megatron by hand", mode)
        for name in WAYS:
            key = (name, mode)
            if key not in ms:
                print(f"{name:<22}{mode:<10}  {rows[key]}")
                continue
            nbytes = rows[key]
            kib = "-" if nbytes is None else f"{nbytes / 1024:.1f}"
            print(f"{name:<22}{mode:<10}{ms[key]:9.2f}{kib:>10}"
                  f"{_ratio(ms[key], ms.get(dt)):>8}{_ratio(ms[key], ms.get(meg)):>8}"
                  f"{_ratio(nbytes, rows.get(dt)):>7}{_ratio(nbytes, rows.get(meg)):>7}")
    if PLANNING:
        print("planning the eager step, once: " + "; ".join(
            f"{name} {seconds:.2f} s ({calls} calls)"
            for name, (seconds, calls) in PLANNING.items()))


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    import globaltensor as gt
    device = local_device(args.device, gt.get_local_rank())
    gt.init()
    n, rank = dist.get_world_size(), dist.get_rank()
    if args.heads % n or args.dim % args.heads or args.seq % n:
        raise SystemExit(f"--heads and --seq must divide by {n} ranks, --dim by --heads")
    cfg = Config(args.vocab, args.seq, args.dim, args.heads, args.layers)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    ids, targets = (torch.randint(args.vocab, (args.batch, args.seq)).to(device)
                    for _ in range(2))
    reference = copy.deepcopy(base)(ids, targets).item()   # the whole model, one process
    env = Env(gt.placement.all(args.device), init_device_mesh(args.device, (n,)), ids,
              targets, n, rank, args.backend)
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    rows, steps = _run_ways(base, env, modes, reference)
    times = round_robin_median(list(steps.values()), args.iters, args.calls, warmup=2,
                               sync=torch.cuda.synchronize if args.device == "cuda" else None)
    ms = {key: t * 1e3 for key, t in zip(steps, times)}
    if rank == 0:
        _print_table(args, n, modes, rows, ms)
        if args.plot:
            bar_plot(args.plot, [w.replace(" ", "\n", 1) for w in WAYS],
                     {mode: [ms.get((w, mode)) for w in WAYS] for mode in modes},
                     "median ms per training step", f"tensor parallel GPT step, {n} ranks")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("tp"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
