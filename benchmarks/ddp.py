"""Data-parallel training step: torch DistributedDataParallel vs globaltensor, one run.

    python benchmarks/ddp.py                     # spawns 2 processes on this machine
    python benchmarks/ddp.py --iters 20 --batch 128 --plot ddp.png
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/ddp.py

An MLP of ~10M parameters (1024-2560-2048-1024, ReLU) trained with SGD (lr 0.01) on
F.mse_loss. DDP (gloo, CPU) sees this rank's rows of each batch; ours is the same model
made global with gt.nn.to_global(model, placement.all("cpu"), broadcast) and fed the
whole batch as split(0). A step = zero_grad + forward + backward + optimizer.step. The
warmup steps double as a check: afterwards both models must hold the same parameters
(max abs diff printed). Also times gradient accumulation over 2 micro-batches with
gt.no_sync() vs DDP's no_sync() (n/a while gt.no_sync does not exist). Prints median ms
per step (slowest rank) and ours/DDP (target <= 1.05).
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import bar_plot, round_robin_median

from globaltensor.testing import spawn

TARGET = 1.05
ATOL = 1e-4  # parameters after the warmup steps (fp32, reduction order differs)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="1024,2560,2048,1024", help="MLP layer widths")
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows)")
    ap.add_argument("--iters", type=int, default=10, help="timed steps (median taken)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed (checked) steps first")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (no RANK set)")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return ap



def _max_param_diff(ddp, ours) -> float:
    import globaltensor as gt
    diff = 0.0
    for (name, a), b in zip(ddp.module.named_parameters(), ours.parameters()):
        assert isinstance(b, gt.GlobalTensor), f"{name} is not a GlobalTensor: {type(b)}"
        assert b.shape == a.shape, f"{name}: shape {tuple(b.shape)} != {tuple(a.shape)}"
        diff = max(diff, (a.detach() - b.detach().full()).abs().max().item())
    return diff


def main(argv=None) -> None:
    args = _parser().parse_args(argv)

    from torch.nn.parallel import DistributedDataParallel as DDP

    import globaltensor as gt
    gt.init()
    n, rank = gt.get_world_size(), gt.get_rank()
    assert args.batch % (2 * n) == 0, "--batch must split evenly into 2 micro-batches per rank"
    dims = [int(d) for d in args.dims.split(",")]
    torch.manual_seed(0)  # the same initial weights on every rank and in both models
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
    base = torch.nn.Sequential(*layers)
    nparams = sum(q.numel() for q in base.parameters())

    p, S0, B = gt.placement.all("cpu"), gt.sbp.split(0), gt.sbp.broadcast
    ddp = DDP(copy.deepcopy(base))
    ours = gt.nn.to_global(copy.deepcopy(base), p, B)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.01)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(1)
    full = [(torch.randn(args.batch, dims[0], generator=g),
             torch.randn(args.batch, dims[-1], generator=g)) for _ in range(4)]
    mine = lambda t: t.tensor_split(n)[rank].contiguous()  # balanced split = split(0)
    glob = lambda t: gt.tensor(t, placement=p, sbp=S0)
    batches = [((mine(x), mine(y)), (glob(x), glob(y))) for x, y in full]
    micro = [[((mine(x), mine(y)), (glob(x), glob(y)))
              for x, y in zip(xf.chunk(2), yf.chunk(2))] for xf, yf in full]
    it = {"ddp": 0, "ours": 0, "ddp_acc": 0, "ours_acc": 0}

    def nxt(key, seq):
        it[key] += 1
        return seq[(it[key] - 1) % len(seq)]

    def step_ddp():
        (x, y), _ = nxt("ddp", batches)
        opt_ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt_ddp.step()

    def step_ours():
        _, (x, y) = nxt("ours", batches)
        opt_ours.zero_grad()
        F.mse_loss(ours(x), y).backward()
        opt_ours.step()

    def accum_ddp():
        (m1, _), (m2, _) = nxt("ddp_acc", micro)
        opt_ddp.zero_grad()
        with ddp.no_sync():
            (F.mse_loss(ddp(m1[0]), m1[1]) / 2).backward()
        (F.mse_loss(ddp(m2[0]), m2[1]) / 2).backward()
        opt_ddp.step()

    def accum_ours():
        (_, m1), (_, m2) = nxt("ours_acc", micro)
        opt_ours.zero_grad()
        with gt.no_sync():
            (F.mse_loss(ours(m1[0]), m1[1]) / 2).backward()
        (F.mse_loss(ours(m2[0]), m2[1]) / 2).backward()
        opt_ours.step()

    rows = [("step", step_ddp, step_ours)]
    if hasattr(gt, "no_sync"):
        rows.append(("no_sync x2 micro", accum_ddp, accum_ours))
    results, diffs = [], []
    for name, f_ddp, f_ours in rows:
        for _ in range(args.warmup):  # same batches, same order: must stay equal
            f_ddp()
            f_ours()
        d = _max_param_diff(ddp, ours)
        moved = max((a.detach() - b).abs().max().item()
                    for a, b in zip(ddp.module.parameters(), base.parameters()))
        assert moved > 0, "DDP parameters did not change: the check would be vacuous"
        diffs.append((name, d, moved))
        assert d <= ATOL, f"{name}: parameters differ from DDP after {args.warmup} steps " \
                          f"(max abs diff {d:.3g} > {ATOL})"
        results.append((name, *[v * 1e3 for v in
                                round_robin_median([f_ddp, f_ours], args.iters, warmup=0)]))
    if not hasattr(gt, "no_sync"):
        results.append(("no_sync x2 micro", None, None))

    if rank == 0:
        print(f"\n{n} processes, MLP {args.dims} ({nparams / 1e6:.2f}M params), global batch "
              f"{args.batch}, SGD, median of {args.iters} steps (ms, slowest rank)")
        for name, d, moved in diffs:
            print(f"check [{name}]: max |param_DDP - param_ours| after {args.warmup} steps "
                  f"= {d:.3g} (params moved up to {moved:.3g} from init)")
        head = f"{'case':<20}{'DDP':>9}{'ours':>9}{'ours/DDP':>10}  target<={TARGET}"
        print(head)
        print("-" * len(head))
        for name, t_d, t_o in results:
            if t_d is None:
                print(f"{name:<20}{'n/a':>9}{'n/a':>9}{'n/a':>10}  (gt.no_sync missing)")
                continue
            r = t_o / t_d
            print(f"{name:<20}{t_d:9.2f}{t_o:9.2f}{r:10.2f}  "
                  f"{'ok' if r <= TARGET else 'MISSED'}")
        if args.plot:
            shown = [r for r in results if r[1] is not None]
            bar_plot(args.plot, [r[0] for r in shown],
                     {"DDP": [r[1] for r in shown], "ours": [r[2] for r in shown]},
                     "median ms per step", "data-parallel step: DDP vs ours")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("ddp"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
