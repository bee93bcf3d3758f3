"""Memory per rank: broadcast parameters vs gt.nn.fully_shard vs torch FSDP2 vs DDP.

    python benchmarks/memory.py                       # 2 ranks, ~256 MiB of parameters
    python benchmarks/memory.py --dims 1024,1024,1024 --steps 2 --plot memory.png

Each mode trains one MLP (Linear layers of ``--dims``, GELU, AdamW, F.mse_loss, global
batch split over the ranks) in a fresh world of ``--nproc`` processes, so peak resident
memory is the mode's own. Peak is the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs) sampled per rank over the training steps, minus the resident
size before the model was built; the step time is the median of ``--steps`` timed
steps (slowest rank). Every mode starts from the same weights and the final parameters
are compared with single-process torch (max abs difference). FSDP2 is
``torch.distributed.fsdp.fully_shard`` on a "cpu" DeviceMesh (gloo).

Then initialisation: building the whole module and moving it to split(0) vs building it
on the meta device, ``gt.nn.to_global`` (each rank allocates its part) and
``reset_parameters()`` (each rank draws its part): peak rise per rank vs the part.
Last, the random generator alone (one process, one thread): ns per element of the
counter-based generator vs torch's CPU generator for the same count.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

MODES = ["broadcast", "fully_shard", "fsdp2", "ddp"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="4096,4096,4096,4096,4096", help="MLP widths")
    ap.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=3, help="timed AdamW steps (after 1 untimed)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return ap


def _mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(key)


def _reset_peak() -> None:
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(dims):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(dims, rows):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, dims[0], generator=g), torch.randn(rows, dims[-1], generator=g)


def _train_worker(rank, world, port, mode, dims, rows, steps, out_dir, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F
    import globaltensor as gt
    gt.init()
    x_all, y_all = _batch(dims, rows)
    base = _mib("VmRSS")
    _reset_peak()
    model = _model(dims)
    p = gt.placement.all("cpu")
    part = slice(rank * rows // world, (rank + 1) * rows // world)
    if mode in ("broadcast", "fully_shard"):
        if mode == "broadcast":
            gt.nn.to_global(model, p, gt.sbp.broadcast)
        else:
            gt.nn.fully_shard(model, p)
        x, y = (gt.tensor(t, placement=p, sbp=gt.sbp.split(0)) for t in (x_all, y_all))
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x, y = x_all[part], y_all[part]
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        x, y = x_all[part], y_all[part]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_peak = _mib("VmHWM") - base

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    step()
    _reset_peak()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _mib("VmHWM") - base
    params = _full_params(model, mode)
    if rank == 0:
        torch.save(params, os.path.join(out_dir, f"{mode}.pt"))
    results.put((rank, mode, peak, init_peak, statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()


def _full_params(model, mode):
    if mode == "fsdp2":
        return [q.full_tensor().detach() for q in model.parameters()]
    if mode == "ddp":
        return [q.detach().clone() for q in model.module.parameters()]
    return [q.detach().full() for q in model.parameters()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(target, nproc, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, nproc, port, *args, results))
             for r in range(nproc)]
    for q in procs:
        q.start()
    out = [results.get(timeout=1800) for _ in procs]
    for q in procs:
        q.join(60)
    return out


def _reference(dims, rows, steps, out_dir) -> list:
    import torch.nn.functional as F
    model = _model(dims)
    x, y = _batch(dims, rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [q.detach() for q in model.parameters()]


def _init_worker(rank, world, port, how, dims, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import globaltensor as gt
    gt.init()
    p = gt.placement.all("cpu")
    warm = torch.nn.Linear(8, 8)
    gt.nn.to_global(warm, p, gt.sbp.split(0))
    warm.reset_parameters()
    _reset_peak()
    base = _mib("VmRSS")
    if how == "meta":
        with torch.device("meta"):
            m = torch.nn.Linear(dims[0], dims[1])
        gt.nn.to_global(m, p, gt.sbp.split(0))
        m.reset_parameters()
    else:
        m = torch.nn.Linear(dims[0], dims[1])
        gt.nn.to_global(m, p, gt.sbp.split(0))
    import gc
    gc.collect()
    part = sum(t.to_local().numel() * 4 for t in m.parameters()) / 2 ** 20
    results.put((rank, how, _mib("VmHWM") - base, _mib("VmRSS") - base, part))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _rng_table(n: int = 1 << 22, iters: int = 9):
    """ns per element, median of round-robin runs, one thread."""
    from globaltensor.layout import Region
    from globaltensor.random import sample
    torch.set_num_threads(1)
    whole = Region((0,), (n,))
    g = torch.Generator().manual_seed(0)
    cases = [
        ("uniform fp32", lambda: torch.rand(n, generator=g),
         lambda: sample("uniform", (n,), whole, (0, 1), torch.float32)),
        ("normal fp32", lambda: torch.randn(n, generator=g),
         lambda: sample("normal", (n,), whole, (0, 1), torch.float32)),
        ("bernoulli(0.9) bool", lambda: torch.empty(n, dtype=torch.bool).bernoulli_(0.9, generator=g),
         lambda: sample("bernoulli", (n,), whole, (0, 1), torch.bool, p=0.9)),
        ("normal fp64", lambda: torch.randn(n, generator=g, dtype=torch.float64),
         lambda: sample("normal", (n,), whole, (0, 1), torch.float64)),
    ]
    rows = []
    for name, theirs, ours in cases:
        t_theirs, t_ours = [], []
        theirs(), ours()
        for _ in range(iters):
            for fn, acc in ((theirs, t_theirs), (ours, t_ours)):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        a, b = statistics.median(t_theirs) / n * 1e9, statistics.median(t_ours) / n * 1e9
        rows.append((name, a, b))
    return rows


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    modes = args.modes.split(",")
    n_params = sum(a * b + b for a, b in zip(dims, dims[1:]))
    print(f"MLP {dims}: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2 ** 20:.0f} MiB fp32), "
          f"AdamW, global batch {args.batch}, {args.nproc} ranks (gloo, 1 thread each)")
    peaks, times = {}, {}
    with tempfile.TemporaryDirectory() as out_dir:
        for mode in modes:
            out = _world(_train_worker, args.nproc, mode, dims, args.batch, args.steps, out_dir)
            peaks[mode] = max(r[2] for r in out)
            times[mode] = max(r[4] for r in out)
            print(f"  {mode:12s} done: peak rise {peaks[mode]:.0f} MiB (max over ranks), "
                  f"init {max(r[3] for r in out):.0f} MiB, step {times[mode] * 1e3:.0f} ms")
        reference = _reference(dims, args.batch, args.steps, out_dir)
        diffs = {}
        for mode in modes:
            got = torch.load(os.path.join(out_dir, f"{mode}.pt"))
            diffs[mode] = max((a - b).abs().max().item() for a, b in zip(got, reference))
    whole = n_params * 4 / 2 ** 20
    print("\n| mode | peak memory rise per rank (MiB) | x params | step (ms) | "
          "vs FSDP2 | params vs 1 process |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        vs = f"{times[mode] / times['fsdp2']:.2f}x" if "fsdp2" in times else "n/a"
        print(f"| {mode} | {peaks[mode]:.0f} | {peaks[mode] / whole:.2f} | "
              f"{times[mode] * 1e3:.0f} | {vs} | {diffs[mode]:.1e} |")
    if "fully_shard" in peaks and "broadcast" in peaks:
        print(f"fully_shard / broadcast peak: {peaks['fully_shard'] / peaks['broadcast']:.2f}"
              + (f"; fully_shard / FSDP2 peak: {peaks['fully_shard'] / peaks['fsdp2']:.2f}"
                 if "fsdp2" in peaks else ""))

    print(f"\nInitialisation of Linear({dims[0]}, {dims[1]}) as split(0) on {args.nproc} ranks "
          f"(peak rise per rank, MiB):")
    print("| how | peak (max over ranks) | kept | local part | peak / part |")
    print("|---|---|---|---|---|")
    for how in ("whole", "meta"):
        out = _world(_init_worker, args.nproc, how, dims)
        peak, kept, part = max(r[2] for r in out), max(r[3] for r in out), out[0][4]
        label = {"whole": "build whole, to_global", "meta": "meta, to_global, reset_parameters"}[how]
        print(f"| {label} | {peak:.1f} | {kept:.1f} | {part:.1f} | {peak / part:.2f} |")

    print("\nRandom generation, one process, one thread (ns per element, medians):")
    print("| values | torch's generator | globaltensor.random | ratio |")
    print("|---|---|---|---|")
    for name, a, b in _rng_table():
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")

    if args.plot:
        sys.path.insert(0, os.path.dirname(__file__))
        from _common import bar_plot
        bar_plot(args.plot, modes, {"peak memory rise per rank (MiB)": [peaks[m] for m in modes]},
                 "MiB", f"MLP {n_params / 1e6:.0f}M params, AdamW, {args.nproc} ranks")


if __name__ == "__main__":
    main()
