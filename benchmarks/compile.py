"""One training step under torch.compile: ours vs DTensor vs plain tensors by hand.

    python benchmarks/compile.py                       # spawns 2 processes
    python benchmarks/compile.py --plot compile.png --iters 20
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/compile.py
    python benchmarks/compile.py --device cuda         # parameters and batch on the GPUs

``--device cpu|cuda`` (default cpu): where parameters, inputs, the placement and
DTensor's mesh live (cuda: GPU ``LOCAL_RANK % device_count``; ranks sharing a GPU
communicate through gloo, as the library does); on cuda each timed batch starts and ends
with ``torch.cuda.synchronize()``.

Two models, each one step (forward, loss, backward, gradients reduced where the layout
needs it) in five ways: GlobalTensors eager and compiled (``fullgraph=True``), DTensor
eager and compiled, and plain local tensors compiled with the collectives placed by
hand (Megatron's f/g operators; DDP's gradient all-reduce).

- ``tp_block``: a transformer block (layer norms, attention, MLP) tensor parallel:
  q/k/v and fc1 column-split, proj and fc2 row-split, so each rank holds its heads.
- ``tp_block+sbp``: the same with the residual stream annotated broadcast after each
  add (``to_global(sbp=broadcast)``, ours only): Megatron's communication plan, which
  DTensor picks on its own; unannotated, our per-op choice reduce-scatters for the
  layer norm (sequence parallel) and gathers again before the next layer.
- ``dp_mlp``: a 3-layer MLP, data parallel (broadcast parameters, batch split).

Every way's loss is checked against eager GlobalTensors first. Prints the median
milliseconds per step (slowest rank) and the ratios the compile issue targets:
compiled ours <= 1.05x compiled DTensor and <= 1.1x compiled plain.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from _common import bar_plot, local_device, round_robin_median

from globaltensor.testing import spawn

WAYS = ["ours eager", "ours compiled", "DTensor eager", "DTensor compiled", "plain compiled"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256, help="model width (tp_block, dp_mlp)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=15, help="timed batches (median taken)")
    ap.add_argument("--calls", type=int, default=5, help="steps per timed batch")
    ap.add_argument("--heads-major", action="store_true",
                    help="attention on (H, B, T, hd) instead of (B, H, T, hd); turns off "
                         "inductor's attention fusion, which crashes on that form when "
                         "H != B (a torch bug, also with plain tensors in one process)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (no RANK set)")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return ap


# --- the models, written once on global tensors (ours and DTensor run the same code) ---

def _block_params(dim: int, g: torch.Generator) -> dict:
    def w(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)
    return {"ln1.w": torch.ones(dim), "ln1.b": torch.zeros(dim),
            "q.w": w(dim, dim), "q.b": torch.zeros(dim), "k.w": w(dim, dim),
            "k.b": torch.zeros(dim), "v.w": w(dim, dim), "v.b": torch.zeros(dim),
            "proj.w": w(dim, dim), "proj.b": torch.zeros(dim),
            "ln2.w": torch.ones(dim), "ln2.b": torch.zeros(dim),
            "fc1.w": w(4 * dim, dim), "fc1.b": torch.zeros(4 * dim),
            "fc2.w": w(dim, 4 * dim), "fc2.b": torch.zeros(dim)}


# Megatron's split of each parameter: "col" splits output features (dim 0 of weight and
# bias), "row" splits input features (dim 1 of the weight), "rep" keeps it whole.
_TP = {"q.w": "col", "q.b": "col", "k.w": "col", "k.b": "col", "v.w": "col", "v.b": "col",
       "fc1.w": "col", "fc1.b": "col", "proj.w": "row", "fc2.w": "row"}


def _attention(q, k, v, heads):
    # The usual (B, H, T, hd): the batched matmuls merge (B, H) into one batch dim,
    # whose head split no split of the merged dim expresses: DTensor has a strided shard
    # for it, we box (all-to-alls). --heads-major runs (H, B, T, hd), where a head split
    # stays a split of the merged dim.
    B, T, C = q.shape
    if not _HEADS_MAJOR:
        q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // heads), dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)
    q, k, v = (t.view(B, T, heads, C // heads).permute(2, 0, 1, 3) for t in (q, k, v))
    att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // heads), dim=-1)
    return (att @ v).permute(1, 2, 0, 3).reshape(B, T, C)


_HEADS_MAJOR = False


def block_loss(p: dict, x, heads: int, settle: bool = False):
    """A pre-norm transformer block and a loss, on global tensors. ``settle``: the
    residual stream is annotated broadcast after each add (GlobalTensors only)."""
    h = F.layer_norm(x, x.shape[-1:], p["ln1.w"], p["ln1.b"])
    a = _attention(F.linear(h, p["q.w"], p["q.b"]), F.linear(h, p["k.w"], p["k.b"]),
                   F.linear(h, p["v.w"], p["v.b"]), heads)
    x = _settled(x + F.linear(a, p["proj.w"], p["proj.b"]), settle)
    h = F.layer_norm(x, x.shape[-1:], p["ln2.w"], p["ln2.b"])
    x = x + F.linear(F.gelu(F.linear(h, p["fc1.w"], p["fc1.b"])), p["fc2.w"], p["fc2.b"])
    return _settled(x, settle).pow(2).mean()


def _settled(x, settle: bool):
    # Our dispatch keeps the row-parallel output's sum partial through the residual add
    # and reduce-scatters it for the layer norm (sequence parallel): a reduce-scatter
    # now, an all-gather before the next column-parallel layer and more in backward.
    # Annotating the sum broadcast gives Megatron's plan (one all-reduce), which DTensor
    # picks on its own.
    import globaltensor as gt
    if settle and isinstance(x, gt.GlobalTensor):
        return x.to_global(sbp=gt.sbp.broadcast)
    return x


def _mlp_params(dim: int, g: torch.Generator) -> dict:
    out = {}
    for k in range(3):
        out[f"l{k}.w"] = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
        out[f"l{k}.b"] = torch.zeros(dim)
    return out


def mlp_loss(p: dict, x):
    for k in range(3):
        x = F.linear(x, p[f"l{k}.w"], p[f"l{k}.b"])
        x = torch.relu(x) if k < 2 else x
    return x.pow(2).mean()


# --- plain tensors with hand-placed collectives --------------------------------------

class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


def plain_block_loss(p: dict, x, heads: int):
    """``block_loss`` on this rank's parameter parts (its heads, its MLP columns)."""
    h = _CopyToParallel.apply(F.layer_norm(x, x.shape[-1:], p["ln1.w"], p["ln1.b"]))
    a = _attention(F.linear(h, p["q.w"], p["q.b"]), F.linear(h, p["k.w"], p["k.b"]),
                   F.linear(h, p["v.w"], p["v.b"]), heads)
    x = x + _ReduceFromParallel.apply(F.linear(a, p["proj.w"])) + p["proj.b"]
    h = _CopyToParallel.apply(F.layer_norm(x, x.shape[-1:], p["ln2.w"], p["ln2.b"]))
    x = x + _ReduceFromParallel.apply(F.linear(F.gelu(F.linear(h, p["fc1.w"], p["fc1.b"])),
                                               p["fc2.w"])) + p["fc2.b"]
    return x.pow(2).mean()


def _local_part(full: torch.Tensor, kind: str, rank: int, n: int) -> torch.Tensor:
    if kind == "col":
        return full.chunk(n, 0)[rank].clone()
    if kind == "row":
        return full.chunk(n, 1)[rank].clone()
    return full.clone()


# --- the five ways ------------------------------------------------------------------

def _leaves(params: dict) -> dict:
    return {k: v.requires_grad_() for k, v in params.items()}


def _clear(params: dict) -> None:
    for v in params.values():
        v.grad = None


def _setup(model: str, args, full: dict, x_full: torch.Tensor):
    """Per way: a step function (forward, backward, reduced gradients) and its loss;
    ``full`` and ``x_full`` are on ``args.device`` already."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import globaltensor as gt

    n, rank = dist.get_world_size(), dist.get_rank()
    P = gt.placement.all(args.device)
    mesh = init_device_mesh(args.device, (n,))
    tp = model.startswith("tp_block")
    ours_sbp = {"col": gt.sbp.split(0), "row": gt.sbp.split(1), "rep": gt.sbp.broadcast}
    dt_pl = {"col": [Shard(0)], "row": [Shard(1)], "rep": [Replicate()]}
    kind = {k: _TP.get(k, "rep") if tp else "rep" for k in full}

    ours = _leaves({k: gt.tensor(v, placement=P, sbp=ours_sbp[kind[k]]) for k, v in full.items()})
    dtp = _leaves({k: distribute_tensor(v.clone(), mesh, dt_pl[kind[k]]) for k, v in full.items()})
    plain = _leaves({k: _local_part(v, kind[k], rank, n) for k, v in full.items()})
    data_sbp, data_dt = (gt.sbp.broadcast, [Replicate()]) if tp else (gt.sbp.split(0), [Shard(0)])
    x_ours = gt.tensor(x_full, placement=P, sbp=data_sbp)
    x_dt = distribute_tensor(x_full.clone(), mesh, data_dt)
    x_plain = x_full if tp else x_full.chunk(n, 0)[rank].contiguous()

    if tp:
        settle = model == "tp_block+sbp"
        loss_g = lambda p, x: block_loss(p, x, args.heads, settle)     # noqa: E731
        loss_p = lambda p, x: plain_block_loss(p, x, args.heads // n)  # noqa: E731
    else:
        loss_g = loss_p = mlp_loss

    def compiled(fn):
        return torch.compile(fn, backend=args.backend, fullgraph=True)

    def dtensor_sync(params):
        # What a DTensor user does for data parallelism: reduce partial gradients.
        for v in params.values():
            if any(isinstance(pl, Partial) for pl in v.grad.placements):
                v.grad = v.grad.redistribute(placements=v.placements)

    def plain_sync(params):
        if tp:  # Megatron: every gradient is already complete on its rank
            return
        grads = [v.grad for v in params.values()]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket, as DDP
        dist.all_reduce(flat)
        flat /= n
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def step_of(fn, params, x, sync=None):
        def step():
            _clear(params)
            loss = fn(params, x)
            loss.backward()
            if sync is not None:
                sync(params)
            return loss
        return step

    ours_c, dt_c, plain_c = compiled(loss_g), compiled(loss_g), compiled(loss_p)
    steps = {"ours eager": step_of(loss_g, ours, x_ours),
             "ours compiled": step_of(ours_c, ours, x_ours),
             "DTensor eager": step_of(loss_g, dtp, x_dt, dtensor_sync),
             "DTensor compiled": step_of(dt_c, dtp, x_dt, dtensor_sync),
             "plain compiled": step_of(plain_c, plain, x_plain, plain_sync)}

    def value(loss):  # the global loss on every rank
        if isinstance(loss, gt.GlobalTensor):
            return loss.full()
        if hasattr(loss, "full_tensor"):
            return loss.full_tensor()
        if tp:
            return loss.detach()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / n

    # Inductor fuses reductions in another order: its fp32 losses differ from eager's
    # in the 4th digit (so does a single process compiling the plain model).
    rtol = 1e-5 if args.backend in ("eager", "aot_eager") else 1e-3
    want = value(steps["ours eager"]())
    for way, step in steps.items():
        got = value(step())
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6,
                                   msg=lambda m: f"{model}, {way}: {m}")
    return steps


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    global _HEADS_MAJOR
    _HEADS_MAJOR = args.heads_major
    if _HEADS_MAJOR:
        from torch._inductor import config as inductor_config
        inductor_config.pattern_matcher = False
    import torch._dynamo

    import globaltensor as gt
    # block_loss's code is compiled for six ways here (ours, as traced and as planned,
    # DTensor and plain, with and without the annotation); a program compiles one
    torch._dynamo.config.recompile_limit = 64
    device = local_device(args.device, gt.get_local_rank())
    gt.init()
    n, rank = dist.get_world_size(), dist.get_rank()
    if args.heads % n or args.dim % args.heads or args.batch % n:
        raise SystemExit(f"--heads and --batch must divide by {n} ranks and --dim by --heads")
    g = torch.Generator().manual_seed(0)   # drawn on the cpu: the same values on cuda
    block = (_block_params(args.dim, g), torch.randn(args.batch, args.seq, args.dim, generator=g))
    cases = {"tp_block": block, "tp_block+sbp": block,
             "dp_mlp": (_mlp_params(args.dim, g),
                        torch.randn(args.batch * args.seq, args.dim, generator=g))}
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    results = {}
    for model, (params, x) in cases.items():
        params, x = {k: v.to(device) for k, v in params.items()}, x.to(device)
        steps = _setup(model, args, params, x)
        results[model] = [t * 1e3 for t in round_robin_median(
            list(steps.values()), args.iters, args.calls, warmup=3, sync=sync)]
    if rank == 0:
        print(f"\n{n} processes, batch {args.batch} x seq {args.seq}, width {args.dim}, "
              f"backend {args.backend}; median ms per training step (slowest rank)"
              + ("; on cuda, batches end with cuda.synchronize" if sync else ""))
        head = f"{'model':<14}" + "".join(f"{w:>18}" for w in WAYS) + \
            f"{'ours/DT comp':>14}{'ours/plain':>12}{'comp/eager':>12}"
        print(head)
        print("-" * len(head))
        for model, t in results.items():
            print(f"{model:<14}" + "".join(f"{v:18.2f}" for v in t) +
                  f"{t[1] / t[3]:14.2f}{t[1] / t[4]:12.2f}{t[1] / t[0]:12.2f}")
        print("targets: compiled ours <= 1.05x compiled DTensor, <= 1.1x compiled plain")
        if args.plot:
            bar_plot(args.plot, list(results), {w: [results[m][k] for m in results]
                                                for k, w in enumerate(WAYS)},
                     "median ms per training step", "one training step, 2 ranks")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("compile"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
