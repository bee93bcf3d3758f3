"""Job start-up: how long a job whose ranks import globaltensor and sum a split tensor
(the process group, one all-reduce) takes from the command to the launcher's exit, and the CPU
time it costs (the launcher and every worker), side by side:

- ours, workers forked from the launcher's fork server (``--start_method forkserver``,
  the default);
- ours, a fresh interpreter per worker (``--start_method spawn``);
- ``torchrun`` (a fresh interpreter per worker).

Runs alternate between the ways, so a slow moment of the machine hits all of them.

Run::

    python benchmarks/launch.py                      # 2 and 4 ranks, 5 rounds
    python benchmarks/launch.py --nproc 2 --rounds 3 --plot launch.png
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from _common import bar_plot

from globaltensor.testing import free_port

JOB = """
import globaltensor as gt
import torch
n = gt.get_world_size()
x = gt.ones(n, placement=gt.placement("cpu", ranks=list(range(n))), sbp=gt.sbp.split(0))
assert x.sum().item() == n  # one all-reduce
torch.distributed.destroy_process_group()
"""

WAYS = {
    "ours, forked": ["-m", "globaltensor.launch", "--start_method", "forkserver"],
    "ours, spawn": ["-m", "globaltensor.launch", "--start_method", "spawn"],
    "torchrun": ["-m", "torch.distributed.run"],
}


def run_once(way: list, nproc: int, script: str, log_dir: str) -> tuple[float, float]:
    """(seconds from start to exit, CPU seconds of the launcher and its workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    port = ["--master_port", str(free_port())]
    logs = ["--log_dir", log_dir] if way[1] == "globaltensor.launch" else []
    done = subprocess.run([sys.executable, *way, "--nproc_per_node", str(nproc), *port, *logs,
                           script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{way} failed:\n{done.stdout}{done.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot", default=None, help="write a PNG of the start times")
    args = ap.parse_args()
    # CPU time is counted for waited-for descendants only; torchrun's and our launcher's
    # workers are waited for by their launcher, which we wait for.
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        rows = {}
        for nproc in args.nproc:
            times: dict = {name: [] for name in WAYS}
            for r in range(args.rounds):
                for name, way in WAYS.items():
                    times[name].append(run_once(way, nproc, script, os.path.join(tmp, f"log{nproc}-{r}-{name[:4]}")))
            rows[nproc] = {name: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v))
                           for name, v in times.items()}
    print(f"\njob start-up: import globaltensor, make the group, one all-reduce, exit "
          f"(median of {args.rounds})")
    print(f"{'ranks':>5}  {'way':<14} {'seconds':>8} {'CPU s':>7} {'vs torchrun':>12}")
    for nproc, row in rows.items():
        for name, (took, cpu) in row.items():
            print(f"{nproc:>5}  {name:<14} {took:>8.2f} {cpu:>7.2f} {took / row['torchrun'][0]:>11.2f}x")
    if args.plot:
        bar_plot(args.plot, [f"{n} ranks" for n in rows],
                 {name: [rows[n][name][0] for n in rows] for name in WAYS},
                 "seconds to run the job", "job start-up (lower is better)")


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("launch"):   # --write-docs: its table into docs/benchmarks.md
        main()
