"""What the benchmarks share: time cases round-robin, draw bars, load an example's
module (worlds are started with ``globaltensor.testing.spawn``)."""
from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def round_robin_median(fns, iters: int, calls: int = 1, warmup: int = 3,
                       sync: Optional[Callable[[], None]] = None) -> list:
    """Median seconds per call of each fn; one timed batch of ``calls`` calls per fn in
    turn (a new order each round), so drift on a busy machine hits all cases alike.
    Every rank reports its medians and the slowest rank's are returned (it bounds a
    collective step). On a long run (over ``PROGRESS_AFTER_S``) rank 0 prints its progress
    to stderr every few seconds, so a slow benchmark is seen working. ``sync`` (e.g.
    ``torch.cuda.synchronize`` on cuda, where calls return before their kernels finish)
    is called before each batch's clock starts and after its calls, before the clock is
    read; None (cpu): nothing is."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    progress = _Progress(iters)
    for it in range(iters):
        progress.update(it)
        # each round in its own order (the same on every rank), so that no case always
        # follows the same one: a case can leave caches, the allocator's free lists or
        # the peer's queue in another state (a fixed order, or forwards then backwards,
        # put P->B 3-8 % over the same work by hand in boxing.py, where it is at par
        # in a shuffled order)
        order = list(range(len(fns)))
        random.Random(it).shuffle(order)
        for k in order:
            fn = fns[k]
            dist.barrier()
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if sync is not None:
                sync()
            times[k].append((time.perf_counter() - t0) / calls)
    progress.done()
    medians = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


def local_device(kind: str, local_rank: int) -> torch.device:
    """The device of ``--device kind`` for a rank: cpu, or for cuda GPU ``local_rank %
    device_count`` (overhead.py's and the library's choice; local ranks share GPUs when
    they outnumber them), made current. Without a GPU a clear error, before any world
    or model is made."""
    if kind != "cuda":
        return torch.device(kind)
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} finds no CUDA GPU "
                           f"(built with CUDA: {torch.backends.cuda.is_built()})")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


PROGRESS_AFTER_S = 10.0
PROGRESS_EVERY_S = 5.0


class _Progress:
    """Round k of n on stderr (rank 0), once a timing has run for ``PROGRESS_AFTER_S``."""

    def __init__(self, total: int):
        self.total, self.start = total, time.monotonic()
        self.last = self.start + PROGRESS_AFTER_S - PROGRESS_EVERY_S
        self.speaks = not dist.is_initialized() or dist.get_rank() == 0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.speaks and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            left = (now - self.start) / max(done, 1) * (self.total - done)
            print(f"  timing: round {done}/{self.total}, about {left:.0f} s left",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        took = time.monotonic() - self.start
        if self.speaks and took >= PROGRESS_AFTER_S:
            print(f"  timing: {self.total} rounds in {took:.0f} s", file=sys.stderr, flush=True)


def bar_plot(path: str, names, series: dict, ylabel: str, title: str) -> None:
    """Grouped bars: one group per name, one bar per series (label -> values)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no plot written")
        return
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 4))
    for k, (label, values) in enumerate(series.items()):
        offset = width * (k - (len(series) - 1) / 2)
        ax.bar([x + offset for x in range(len(names))], [v or 0 for v in values], width,
               label=label)
    ax.set_xticks(list(range(len(names))), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def example_module(name: str):
    """``examples/<name>.py`` imported as the module ``name`` (its ``main`` not run),
    once per process: a benchmark uses its model and training functions."""
    import importlib.util
    from pathlib import Path
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)  # as an import
        spec.loader.exec_module(module)
    return sys.modules[name]
