"""Per-op dispatch overhead: plain torch vs our GlobalTensor vs DTensor, side by side.

    python benchmarks/dispatch.py                 # spawns 2 processes on this machine
    python benchmarks/dispatch.py --nproc 1       # a world of one
    python benchmarks/dispatch.py --size 8 --calls 2000 --iters 15 --plot dispatch.png
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/dispatch.py

Tensors are tiny (default 8x8 fp32) so compute is negligible and the time per op is
framework overhead. x, y are split(0) / Shard(0), w is broadcast / Replicate; the plain
torch baseline runs the same op on this rank's local parts. Every op is checked once
against plain torch on the full values before timing. Prints microseconds per op (median
of --iters batches of --calls calls, slowest rank), the overheads ours - torch and
DTensor - torch, and their ratio (target: ours <= 0.5x DTensor's overhead). "floor" is
a Python wrapper subclass that only unwraps and rewraps: no Python tensor subclass can
cost less.

A second table times ``torch.einsum`` forward + backward against the matmul-family
call it stands for (mm, bmm, 4-D matmul, dot, t, outer) on the same global shapes and
sbps (target: einsum <= 2x); ``--einsum-iters 0`` skips it.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _common import bar_plot, round_robin_median

from globaltensor.testing import spawn

TARGET = 0.5


class Floor(torch.Tensor):
    """The least any Python ``__torch_dispatch__`` wrapper costs: unwrap, run the op on
    the local tensor, rewrap; no layouts, no rules, no cache. Its overhead bounds from
    below what a tensor subclass written in Python can reach (DTensor dispatches cached
    ops in C++ inside torch)."""

    @staticmethod
    def __new__(cls, local):
        r = torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(),
                                                dtype=local.dtype, device=local.device)
        r.local = local
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # No pytree: a list of tensors (cat's) is the only nesting ops take, and tuples
        # (layer norm's three outputs) the only nesting they return.
        out = func(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in
                                                    (kwargs or {}).items()})
        if out.__class__ is tuple or out.__class__ is list:
            return out.__class__(Floor(o) if isinstance(o, torch.Tensor) else o for o in out)
        return Floor(out) if isinstance(out, torch.Tensor) else out


def _unwrap(a):
    if a.__class__ is Floor:
        return a.local
    if a.__class__ is list or a.__class__ is tuple:
        return a.__class__(e.local if e.__class__ is Floor else e for e in a)
    return a
OPS = {  # key: (label, op on (x, y, w))
    "add": ("x + y", lambda x, y, w: x + y),
    "mul": ("x * 2.0", lambda x, y, w: x * 2.0),
    "relu": ("torch.relu(x)", lambda x, y, w: torch.relu(x)),
    "matmul": ("x @ w", lambda x, y, w: x @ w),
    "sum": ("x.sum()", lambda x, y, w: x.sum()),
    "t": ("x.t()", lambda x, y, w: x.t()),
    "view": ("x.view(-1)", lambda x, y, w: x.view(-1)),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8, help="tensors are size x size fp32")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    ap.add_argument("--iters", type=int, default=15, help="timed batches (median taken)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls per case first")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list, from: " + ",".join(OPS))
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (no RANK set)")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    ap.add_argument("--einsum-iters", type=int, default=15,
                    help="timed rounds of the einsum table (0: skip it)")
    return ap


EINSUM_TARGET = 2.0


def _einsum_cases(gt) -> list:
    """(equation, per operand (shape of the dims' size s, sbp), the matmul-family call
    it stands for)."""
    S, B = gt.sbp.split, gt.sbp.broadcast
    return [
        ("ij,jk->ik", [(lambda s: (s, s), S(0)), (lambda s: (s, s), B)], lambda a, b: a @ b),
        ("bij,bjk->bik", [(lambda s: (2, s, s), S(0))] * 2, torch.bmm),
        ("bhqd,bhkd->bhqk", [(lambda s: (2, 2, s, s), S(1))] * 2,
         lambda q, k: q @ k.transpose(-1, -2)),
        ("i,i->", [(lambda s: (s * s,), S(0))] * 2, torch.dot),
        ("ij->ji", [(lambda s: (s, s), S(0))], lambda a: a.t()),
        ("i,j->ij", [(lambda s: (s,), S(0)), (lambda s: (s,), B)], torch.outer),
    ]


def _leaves(gt, operands, s: int) -> list:
    p, g = gt.placement.all("cpu"), torch.Generator().manual_seed(s)
    return [gt.tensor(torch.randn(shape(s), generator=g), placement=p, sbp=sbp,
                      requires_grad=True) for shape, sbp in operands]


def _steps(gt, operands, fn, sizes) -> list:
    """One forward + backward (of ``.sum()``) of ``fn`` per size, on its own leaves."""
    steps = []
    for s in sizes:
        def step(xs=_leaves(gt, operands, s)):
            for x in xs:
                x.grad = None
            fn(*xs).sum().backward()
        steps.append(step)
    return steps


def _first_calls(steps: list):
    """A callable that runs the next of ``steps`` (each of new shapes: nothing of it is
    decided or planned yet, as in a test that runs each case once)."""
    pending = iter(steps)
    return lambda: next(pending)()


def _einsum_table(args, gt) -> None:
    """einsum forward + backward against the matmul-family call it stands for, on the
    same global shapes and sbps: repeated (decisions cached), and first calls (new
    shapes each time); a table, target einsum <= 2x."""
    rows, n, s = [], args.einsum_iters, args.size
    for eq, operands, equivalent in _einsum_cases(gt):
        einsum = lambda *xs, eq=eq: torch.einsum(eq, *xs)  # noqa: E731
        xs = _leaves(gt, operands, s)
        torch.testing.assert_close(einsum(*xs).full(), equivalent(*xs).full())
        warm = [_steps(gt, operands, f, [s])[0] for f in (einsum, equivalent)]
        first = [_first_calls(_steps(gt, operands, f, range(s + 1 + k, s + 1 + 2 * n, 2)))
                 for k, f in enumerate((einsum, equivalent))]  # disjoint sizes
        times = round_robin_median(warm, n, max(args.calls // 100, 5)) + \
            round_robin_median(first, n, warmup=0)
        rows.append((eq, " ".join(str(sbp) for _, sbp in operands), *[t * 1e3 for t in times]))
    if gt.get_rank() == 0:
        print(f"\neinsum vs the matmul it stands for, forward + backward (.sum()), dims of "
              f"size {s} (ms per step, slowest rank; first call: new shapes)")
        head = (f"{'equation':<17}{'sbp':<12}{'einsum':>7}{'matmul':>7}{'ratio':>6}"
                f"{'first: einsum':>14}{'matmul':>7}{'ratio':>6}")
        print(head + f"  target<={EINSUM_TARGET}")
        print("-" * len(head))
        for eq, sbps, w_e, w_m, c_e, c_m in rows:
            sbps = sbps.replace("split(dim=", "S(").replace("broadcast", "B")
            met = max(w_e / w_m, c_e / c_m) <= EINSUM_TARGET
            print(f"{eq:<17}{sbps:<12}{w_e:7.2f}{w_m:7.2f}{w_e / w_m:6.2f}{c_e:14.2f}"
                  f"{c_m:7.2f}{c_e / c_m:6.2f}  {'ok' if met else 'MISSED'}")


def main(argv=None) -> None:
    args = _parser().parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import globaltensor as gt
    gt.init()
    n, rank = gt.get_world_size(), gt.get_rank()
    g = torch.Generator().manual_seed(0)  # identical full values on every rank
    fx, fy, fw = (torch.randn(args.size, args.size, generator=g) for _ in range(3))

    p = gt.placement.all("cpu")
    S0, B = gt.sbp.split(0), gt.sbp.broadcast
    gx, gy = gt.tensor(fx, placement=p, sbp=S0), gt.tensor(fy, placement=p, sbp=S0)
    gw = gt.tensor(fw, placement=p, sbp=B)
    mesh = init_device_mesh("cpu", (n,))
    dx, dy = distribute_tensor(fx, mesh, [Shard(0)]), distribute_tensor(fy, mesh, [Shard(0)])
    dw = distribute_tensor(fw, mesh, [Replicate()])
    lx, ly, lw = gx.to_local(), gy.to_local(), fw.clone()  # plain torch on local parts
    fx_, fy_, fw_ = Floor(lx), Floor(ly), Floor(lw)
    assert torch.equal(lx, dx.to_local()), "our split(0) layout differs from Shard(0)"

    keys = [k.strip() for k in args.ops.split(",") if k.strip()]
    unknown = [k for k in keys if k not in OPS]
    if unknown:
        raise SystemExit(f"unknown --ops {unknown}; choose from {list(OPS)}")
    ops = [OPS[k] for k in keys]
    results = []
    for name, op in ops:
        want = op(fx, fy, fw)
        got = op(gx, gy, gw)
        assert isinstance(got, gt.GlobalTensor), f"{name}: ours returned {type(got)}"
        torch.testing.assert_close(got.full(), want, msg=lambda m: f"{name} (ours): {m}")
        torch.testing.assert_close(op(dx, dy, dw).full_tensor(), want,
                                   msg=lambda m: f"{name} (DTensor): {m}")
        fns = [lambda op=op: op(lx, ly, lw), lambda op=op: op(gx, gy, gw),
               lambda op=op: op(dx, dy, dw), lambda op=op: op(fx_, fy_, fw_)]
        medians = round_robin_median(fns, args.iters, args.calls, args.warmup)
        results.append((name, *[v * 1e6 for v in medians]))

    if rank == 0:
        print(f"\n{n} process(es), {args.size}x{args.size} fp32, median of {args.iters} "
              f"batches x {args.calls} calls (µs per op, slowest rank)")
        head = (f"{'op':<15}{'torch':>8}{'ours':>9}{'DTensor':>9}{'floor':>8}{'ours-torch':>12}"
                f"{'DT-torch':>10}{'ours/DT':>9}{'floor/DT':>10}  target<={TARGET}")
        print(head)
        print("-" * len(head))
        ratios, floors = [], []
        for name, t_t, t_o, t_d, t_f in results:
            oo, od, of = t_o - t_t, t_d - t_t, t_f - t_t
            r = oo / od if od > 0 else float("inf")
            f = of / od if od > 0 else float("inf")
            ratios.append(r)
            floors.append(f)
            print(f"{name:<15}{t_t:8.2f}{t_o:9.2f}{t_d:9.2f}{t_f:8.2f}{oo:12.2f}{od:10.2f}{r:9.2f}"
                  f"{f:10.2f}  {'ok' if r <= TARGET else 'MISSED'}")
        geo = statistics.geometric_mean([max(r, 1e-9) for r in ratios])
        geo_floor = statistics.geometric_mean([max(f, 1e-9) for f in floors])
        met = sum(r <= TARGET for r in ratios)
        print(f"geometric mean ours/DTensor overhead: {geo:.2f} (target <= {TARGET}); "
              f"{met}/{len(ratios)} ops meet it")
        print(f"floor: a Python __torch_dispatch__ wrapper that only unwraps and rewraps costs "
              f"{geo_floor:.2f}x DTensor's overhead (geometric mean)")
        if args.plot:
            bar_plot(args.plot, [r[0] for r in results],
                     {label: [r[k] for r in results]
                      for k, label in enumerate(["torch", "ours", "DTensor", "floor"], 1)},
                     "median µs per op", "dispatch overhead on tiny tensors")
    if args.einsum_iters:
        _einsum_table(args, gt)
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("dispatch"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
