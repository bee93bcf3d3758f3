"""Memory per rank: broadcast parameters vs gt.nn.fully_shard (its default units, and
FSDP2's: ``unit="call"`` on the modules FSDP2 wraps, then the root) vs torch FSDP2 vs DDP.

    python benchmarks/memory.py                       # 2 ranks, ~256 MiB of parameters
    python benchmarks/memory.py --dims 1024,1024,1024 --steps 2 --plot memory.png
    python benchmarks/memory.py --model gpt --batch 8 --timeline gpt.png
    python benchmarks/memory.py --device cuda --steps 2   # device memory, not RSS

``--device cpu|cuda`` (default cpu) says where models, batches, placements, FSDP2's mesh
and DDP live, and which memory a run reports: cpu, process resident memory (RSS, as
below); cuda (rank r on GPU ``r % device_count``), device memory as torch's caching
allocator counts it, per process even when ranks share a GPU: peaks are
``torch.cuda.max_memory_allocated`` rises (``reset_peak_memory_stats`` at each reset and
each phase mark), the second column is the allocator's reserved peak
(``max_memory_reserved``: its cache included) instead of resident data, the timeline
samples ``torch.cuda.memory_allocated``; timed steps start and end with
``torch.cuda.synchronize()``. The table headers name which memory a run reports.

Each mode trains one MLP (Linear layers of ``--dims``, GELU, AdamW, F.mse_loss, global
batch split over the ranks; ``--model gpt``: tp.py's GPT with activation checkpointing
per block, FSDP2 wrapping each block) in a fresh world of ``--nproc`` processes, so peak resident
memory is the mode's own. Peak is the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs) sampled per rank over the training steps, minus the resident
size before the model was built, after one step of a tiny model of the same mode (what
any first step imports and caches is not the model's: ~75 MiB). "Data" is the same less
the code pages of torch's libraries that the first calls read in (the anonymous memory
alone). The step time is the median of ``--steps`` timed steps (slowest rank). Every
mode starts from the same weights and the final parameters are compared with
single-process torch (max abs difference). FSDP2 is
``torch.distributed.fsdp.fully_shard`` on a DeviceMesh of ``--device`` (cpu: gloo).

One more step runs with a ``memory_phases.PhaseRecorder``: the peak resident data of
each phase (each Linear's forward and backward, each gradient-reduction collective,
the optimizer step), tabled per mode next to the ZeRO floor (parameters + gradients +
2 AdamW moments, divided by the ranks), and with ``--timeline`` a PNG of resident
data over that step, one panel per mode. ``--param-dtype bf16`` (with
``--reduce-dtype``) and ``--reshard-after-forward`` set the mixed-precision policy and
resharding of fully_shard and FSDP2 alike.

Then initialisation: building the whole module and moving it to split(0) vs building it
on the meta device, ``gt.nn.to_global`` (each rank allocates its part) and
``reset_parameters()`` (each rank draws its part): peak rise per rank vs the part.
Last, the random generator alone (one process, one thread): ns per element of the
counter-based generator vs torch's generator for the same count (on ``--device``).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import tempfile
import time

import torch
from _common import local_device
from memory_models import Spec
from memory_phases import PhaseRecorder

MODES = ["broadcast", "fully_shard", "fully_shard_call", "fsdp2", "ddp"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: device memory (the caching allocator's), not RSS")
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    ap.add_argument("--dims", default="4096,4096,4096,4096,4096", help="MLP widths")
    ap.add_argument("--gpt", default="768,8,12,8192,256",
                    help="GPT dim, layers, heads, vocab, block length (--model gpt)")
    ap.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=3, help="timed AdamW steps (after 1 untimed)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    ap.add_argument("--timeline", default=None, help="write a PNG of memory over a step here")
    ap.add_argument("--param-dtype", default=None, help="e.g. bf16 (fully_shard and FSDP2)")
    ap.add_argument("--reduce-dtype", default=None, help="e.g. fp32 (fully_shard and FSDP2)")
    ap.add_argument("--reshard-after-forward", default="true", help="true, false or an int")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the initialisation and random-generator tables")
    return ap


_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _reshard(text: str):
    return {"true": True, "false": False}.get(text.lower()) if not text.isdigit() else int(text)


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


def _cuda_mib(what: str, device: torch.device) -> float:
    """The caching allocator's ``what`` (e.g. "max_memory_allocated") on ``device``, MiB."""
    return getattr(torch.cuda, what)(device) / 2 ** 20


def _reset_cuda_peak(device: torch.device) -> None:
    import gc
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)


class _CudaPhaseRecorder(PhaseRecorder):
    """``PhaseRecorder`` on device memory: a phase's peak is ``max_memory_allocated``
    (reset at each mark), the timeline samples ``memory_allocated``, both in MiB above
    ``base_mib`` (an allocation). The allocator books a block when its op is enqueued
    and frees it when the host drops the tensor, so the marks (host hooks) need no
    synchronize; the device is named, as the sampling thread has no current device."""

    def __init__(self, base_mib: float, device: torch.device, interval: float = 0.002):
        super().__init__(base_mib, interval)
        self.device = device

    def mark(self, label: str) -> None:
        if self.label is not None:
            peak = _cuda_mib("max_memory_allocated", self.device) - self.base
            self.peaks[self.label] = max(self.peaks.get(self.label, peak), peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.label = label
        self.marks.append((time.perf_counter() - self.t0, label))

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0,
                                 _cuda_mib("memory_allocated", self.device) - self.base,
                                 self.label))
            time.sleep(self.interval)


def _train_worker(rank, world, port, mode, spec, rows, steps, out_dir, policy, kind,
                  results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from memory_phases import data_hwm_mib, data_mib, instrument

    import globaltensor as gt
    device = local_device(kind, rank)
    cuda = device.type == "cuda"
    gt.init()
    _warm_up(mode, spec, world, rank, policy, device)
    x_all, y_all = (t.to(device) for t in spec.batch(rows))
    if cuda:   # allocated and reserved (the allocator's cache included), not RSS
        base, base_data = (_cuda_mib(w, device) for w in ("memory_allocated", "memory_reserved"))
        _reset_cuda_peak(device)
    else:
        base, base_data = _mib("VmRSS"), data_mib()
        _reset_peak()
    model, x, y = _build(mode, spec, x_all, y_all, rank, world, policy, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_peak = (_cuda_mib("max_memory_allocated", device) if cuda else _mib("VmHWM")) - base

    def step(rec=None):
        opt.zero_grad(set_to_none=True)
        loss = spec.loss(model, x, y)
        if rec is not None:
            rec.mark("loss")
        loss.backward()
        opt.step()

    step()
    if cuda:
        _reset_cuda_peak(device)
    else:
        _reset_peak()
    times = []
    for _ in range(steps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = _cuda_mib("max_memory_allocated", device) - base
        data_peak = _cuda_mib("max_memory_reserved", device) - base_data
    else:
        peak, data_peak = _mib("VmHWM") - base, data_hwm_mib() - base_data
    # one more step, instrumented: peaks per phase and the sampled timeline
    rec = _CudaPhaseRecorder(base, device) if cuda else PhaseRecorder(base_data)
    undo = instrument(spec.marked(model.module if mode == "ddp" else model), opt, rec)
    dist.barrier()
    rec.start()
    step(rec)
    rec.stop()
    undo()
    params = _full_params(model, mode)
    if rank == 0:
        torch.save(params, os.path.join(out_dir, f"{mode}.pt"))
    results.put((rank, mode, peak, init_peak, statistics.median(times), rec.peaks,
                 (rec.samples, rec.marks), data_peak))
    dist.barrier()
    dist.destroy_process_group()


def _warm_up(mode, spec, world, rank, policy, device) -> None:
    """One step of a tiny model of ``mode``, so that what the first step of any model
    imports and caches (torch._dynamo, FSDP2's and DTensor's modules, dispatch caches,
    gloo's buffers: ~75 MiB) is there before the base is taken; freed heap pages go back
    to the system (malloc_trim), as ``gt.testing.peak_rise`` does (on cuda also the
    allocator's cached blocks, so that the reserved peak starts from the step's own)."""
    import gc

    from globaltensor.heap import release_free_heap
    tiny = Spec(spec.kind, (64, 64, 64) if spec.kind == "mlp" else (32, 1, 2, 64, 16))
    model, x, y = _build(mode, tiny, *(t.to(device) for t in tiny.batch(2 * world)), rank,
                         world, policy, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tiny.loss(model, x, y).backward()
    opt.step()
    del model, x, y, opt
    gc.collect()
    release_free_heap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _build(mode, spec, x_all, y_all, rank, world, policy, device):
    """The model of ``mode`` on ``device`` (built whole there, as on the cpu) and this
    rank's inputs (global tensors for ours)."""
    import globaltensor as gt
    model = spec.model().to(device)
    p = gt.placement.all(device.type)
    part = slice(rank * len(x_all) // world, (rank + 1) * len(x_all) // world)
    param_dtype, reduce_dtype, reshard = policy
    if mode in ("broadcast", "fully_shard", "fully_shard_call"):
        if mode == "broadcast":
            gt.nn.to_global(model, p, gt.sbp.broadcast)
        elif mode == "fully_shard_call":   # FSDP2's units: the modules it wraps, then the rest
            for unit in spec.fsdp2_units(model):
                gt.nn.fully_shard(unit, p, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                  reshard_after_forward=reshard, unit="call")
            gt.nn.fully_shard(model, p, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              reshard_after_forward=reshard, unit="call")
        elif param_dtype is None and reduce_dtype is None and reshard is True:
            gt.nn.fully_shard(model, p)    # the call every version of fully_shard takes
        else:
            gt.nn.fully_shard(model, p, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              reshard_after_forward=reshard)
        return model, *(gt.tensor(t, placement=p, sbp=gt.sbp.split(0)) for t in (x_all, y_all))
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (world,))
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for unit in spec.fsdp2_units(model):
            fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        return model, x_all[part], y_all[part]
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None), \
        x_all[part], y_all[part]


def _phase_table(phases: dict, whole: float, nproc: int, what: str = "resident data") -> None:
    """Peak per phase (max over ranks), MiB above the start and as x parameter bytes; the
    ZeRO floor (4 x parameters / N with AdamW) is what a sharded step must hold. ``what``:
    the memory measured (cuda: "cuda memory allocated")."""
    from memory_phases import phase_order
    modes = list(phases)
    print(f"\nPeak {what} per phase of one step (MiB above the start, max over "
          f"ranks; x parameter bytes). ZeRO floor, params + grads + 2 moments over "
          f"{nproc} ranks: {4 * whole / nproc:.0f} MiB = {4 / nproc:.2f}x")
    print("| phase | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    for label in phase_order(phases):
        cells = [f"{phases[m][label]:.0f} ({phases[m][label] / whole:.2f}x)"
                 if label in phases[m] else "" for m in modes]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _full_params(model, mode):
    """The whole parameters, on the cpu (main compares them with its own)."""
    if mode == "fsdp2":
        return [q.full_tensor().detach().cpu() for q in model.parameters()]
    if mode == "ddp":
        return [q.detach().clone().cpu() for q in model.module.parameters()]
    return [q.detach().full().cpu() for q in model.parameters()]


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
    out, deadline = [], time.monotonic() + 1800
    while len(out) < nproc:   # a rank that died (its traceback above) ends the world
        try:
            out.append(results.get(timeout=5))
        except queue.Empty:
            failed = [q.exitcode for q in procs if q.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for q in procs:
                    q.terminate()
                what = f"{target.__name__} ({args[0]})"
                raise RuntimeError(f"{what}: a rank exited with code(s) {failed}" if failed
                                   else f"{what}: no result in 1800 s") from None
    for q in procs:
        q.join(60)
    return out


def _reference(spec, rows, steps) -> list:
    model = spec.model()
    x, y = spec.batch(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        spec.loss(model, x, y).backward()
        opt.step()
    return [q.detach() for q in model.parameters()]


def _init_worker(rank, world, port, how, dims, kind, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import globaltensor as gt
    device = local_device(kind, rank)
    cuda = device.type == "cuda"
    gt.init()
    p = gt.placement.all(device.type)
    warm = torch.nn.Linear(8, 8, device=device)
    gt.nn.to_global(warm, p, gt.sbp.split(0))
    warm.reset_parameters()
    if cuda:
        _reset_cuda_peak(device)
        base = _cuda_mib("memory_allocated", device)
    else:
        _reset_peak()
        base = _mib("VmRSS")
    if how == "meta":
        with torch.device("meta"):
            m = torch.nn.Linear(dims[0], dims[1])
        gt.nn.to_global(m, p, gt.sbp.split(0))
        m.reset_parameters()
    else:   # built whole on the device
        m = torch.nn.Linear(dims[0], dims[1], device=device)
        gt.nn.to_global(m, p, gt.sbp.split(0))
    import gc
    gc.collect()
    part = sum(t.to_local().numel() * 4 for t in m.parameters()) / 2 ** 20
    if cuda:
        peak, kept = (_cuda_mib(w, device) - base
                      for w in ("max_memory_allocated", "memory_allocated"))
    else:
        peak, kept = _mib("VmHWM") - base, _mib("VmRSS") - base
    results.put((rank, how, peak, kept, part))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _rng_table(n: int = 1 << 22, iters: int = 9, device: str = "cpu"):
    """ns per element, median of round-robin runs, one thread; on cuda each call is
    synchronized before the clock starts and before it is read."""
    from globaltensor.layout import Region
    from globaltensor.random import sample
    torch.set_num_threads(1)
    cuda = device == "cuda"
    whole = Region((0,), (n,))
    g = torch.Generator(device).manual_seed(0)
    cases = [
        ("uniform fp32", lambda: torch.rand(n, generator=g, device=device),
         lambda: sample("uniform", (n,), whole, (0, 1), torch.float32, device=device)),
        ("normal fp32", lambda: torch.randn(n, generator=g, device=device),
         lambda: sample("normal", (n,), whole, (0, 1), torch.float32, device=device)),
        ("bernoulli(0.9) bool",
         lambda: torch.empty(n, dtype=torch.bool, device=device).bernoulli_(0.9, generator=g),
         lambda: sample("bernoulli", (n,), whole, (0, 1), torch.bool, device=device, p=0.9)),
        ("normal fp64", lambda: torch.randn(n, generator=g, dtype=torch.float64, device=device),
         lambda: sample("normal", (n,), whole, (0, 1), torch.float64, device=device)),
    ]
    rows = []
    for name, theirs, ours in cases:
        t_theirs, t_ours = [], []
        theirs(), ours()
        for _ in range(iters):
            for fn, acc in ((theirs, t_theirs), (ours, t_ours)):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                acc.append(time.perf_counter() - t0)
        a, b = statistics.median(t_theirs) / n * 1e9, statistics.median(t_ours) / n * 1e9
        rows.append((name, a, b))
    return rows


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    dims = [int(d) for d in (args.dims if args.model == "mlp" else args.gpt).split(",")]
    spec = Spec(args.model, tuple(dims))
    modes = args.modes.split(",")
    n_params = spec.parameters()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        local_device("cuda", 0)   # its no-GPU error here, before any world is spawned
    print(f"{spec.describe()}: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2 ** 20:.0f} "
          f"MiB fp32), AdamW, global batch {args.batch}, {args.nproc} ranks "
          + ("on cuda (rank r on GPU r % device_count, 1 thread each); memory: the cuda "
             "caching allocator's, not RSS" if cuda else "(gloo, 1 thread each)"))
    policy = (_DTYPES[args.param_dtype], _DTYPES[args.reduce_dtype],
              _reshard(args.reshard_after_forward))
    if policy != (None, None, True):
        print(f"fully_shard and FSDP2 with param_dtype={args.param_dtype}, "
              f"reduce_dtype={args.reduce_dtype}, "
              f"reshard_after_forward={args.reshard_after_forward}")
    peaks, data_peaks, times, phases, timelines = {}, {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as out_dir:
        for mode in modes:
            out = _world(_train_worker, args.nproc, mode, spec, args.batch, args.steps,
                         out_dir, policy, args.device)
            peaks[mode] = max(r[2] for r in out)
            data_peaks[mode] = max(r[7] for r in out)
            times[mode] = max(r[4] for r in out)
            phases[mode] = {label: max(r[5].get(label, 0.0) for r in out)
                            for label in out[0][5]}
            timelines[mode] = next(r[6] for r in out if r[0] == 0)
            print(f"  {mode:12s} done: "
                  + ("cuda allocated peak rise" if cuda else "peak rise")
                  + f" {peaks[mode]:.0f} MiB (" + ("reserved " if cuda else "data ")
                  + f"{data_peaks[mode]:.0f}, max over ranks), "
                  f"init {max(r[3] for r in out):.0f} MiB, step {times[mode] * 1e3:.0f} ms")
        reference = _reference(spec, args.batch, args.steps + 1)
        diffs = {}
        for mode in modes:
            got = torch.load(os.path.join(out_dir, f"{mode}.pt"))
            diffs[mode] = max((a.float() - b).abs().max().item() for a, b in zip(got, reference))
    whole = n_params * 4 / 2 ** 20
    if cuda:
        print("\n| mode | peak cuda allocated rise per rank (MiB) | x params | peak cuda "
              "reserved rise (MiB) | x params | step (ms) | vs FSDP2 | params vs 1 process |")
    else:
        print("\n| mode | peak memory rise per rank (MiB) | x params | of it data (MiB) "
              "| x params | step (ms) | vs FSDP2 | params vs 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        vs = f"{times[mode] / times['fsdp2']:.2f}x" if "fsdp2" in times else "n/a"
        print(f"| {mode} | {peaks[mode]:.0f} | {peaks[mode] / whole:.2f} | "
              f"{data_peaks[mode]:.0f} | {data_peaks[mode] / whole:.2f} | "
              f"{times[mode] * 1e3:.0f} | {vs} | {diffs[mode]:.1e} |")
    if "fully_shard" in peaks and "broadcast" in peaks:
        print(f"fully_shard / broadcast peak: {peaks['fully_shard'] / peaks['broadcast']:.2f}"
              + (f"; fully_shard / FSDP2 peak: {peaks['fully_shard'] / peaks['fsdp2']:.2f}"
                 if "fsdp2" in peaks else ""))
    _phase_table(phases, whole, args.nproc, "cuda memory allocated" if cuda else "resident data")
    if args.timeline:
        sys.path.insert(0, os.path.dirname(__file__))
        from memory_phases import timeline_plot
        floor = 4 * whole / args.nproc
        timeline_plot(args.timeline, timelines, {"params+grads+2 moments / N": floor},
                      f"{args.model.upper()} {n_params / 1e6:.0f}M params, AdamW, {args.nproc} ranks: "
                      f"one step, rank 0" + (" (cuda memory allocated)" if cuda else ""))
    if args.no_extras or args.model != "mlp":
        return

    print(f"\nInitialisation of Linear({dims[0]}, {dims[1]}) as split(0) on {args.nproc} ranks "
          + ("(peak cuda allocated rise per rank, MiB):" if cuda
             else "(peak rise per rank, MiB):"))
    print("| how | peak (max over ranks) | kept | local part | peak / part |")
    print("|---|---|---|---|---|")
    for how in ("whole", "meta"):
        out = _world(_init_worker, args.nproc, how, dims, args.device)
        peak, kept, part = max(r[2] for r in out), max(r[3] for r in out), out[0][4]
        label = {"whole": "build whole, to_global", "meta": "meta, to_global, reset_parameters"}[how]
        print(f"| {label} | {peak:.1f} | {kept:.1f} | {part:.1f} | {peak / part:.2f} |")

    print("\nRandom generation, one process, one thread (ns per element, medians"
          + ("; on cuda, synchronized):" if cuda else "):"))
    print("| values | torch's generator | globaltensor.random | ratio |")
    print("|---|---|---|---|")
    for name, a, b in _rng_table(device=args.device):
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")

    if args.plot:
        sys.path.insert(0, os.path.dirname(__file__))
        from _common import bar_plot
        bar_plot(args.plot, modes, {("peak cuda allocated rise per rank (MiB)" if cuda else
                                     "peak memory rise per rank (MiB)"): [peaks[m] for m in modes]},
                 "MiB", f"MLP {n_params / 1e6:.0f}M params, AdamW, {args.nproc} ranks")


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("memory"):   # --write-docs: its table into docs/benchmarks.md
        main()
