"""What the benchmarks share: time cases round-robin, draw bars (worlds are started
with ``globaltensor.testing.spawn``)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def round_robin_median(fns, iters: int, calls: int = 1, warmup: int = 3) -> list:
    """Median seconds per call of each fn; one timed batch of ``calls`` calls per fn in
    turn (forwards, then backwards), so drift on a busy machine hits all cases alike.
    Every rank reports its medians and the slowest rank's are returned (it bounds a
    collective step)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for it in range(iters):
        # every other round runs backwards, so that no case always follows the same one
        # (a case can leave caches, allocator or the peer's queue in another state)
        for k in (range(len(fns)) if it % 2 == 0 else reversed(range(len(fns)))):
            fn = fns[k]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[k].append((time.perf_counter() - t0) / calls)
    medians = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


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
