"""Parameter servers: examples/s of sync, async, geo (2 servers x 2 workers) and of the
collective split(0)-embedding version, in one run.

    python benchmarks/ps.py                       # the three groups: about 8 minutes on 2 cores
    python benchmarks/ps.py --groups short --steps 300 --repeats 3
    python benchmarks/ps.py --groups long --long_vocab 2000

Every case trains the wide & deep model of ``examples/wide_and_deep_ps.py`` (26 slots
x ``--vocab`` hashed ids, 8-wide embeddings, 13 dense features, MLP 64-32) with SGD on
the same synthetic data and global batch, and is started through the launcher the way
a user would start it (so the times include every pull, push and all-reduce but not
the start-up). Per case it prints examples/s (the job's: the workers' rates summed),
the ratio to sync, and the held-out AUC of worker 0:

- ``sync``, ``async``, ``geo K=<k>``: ``--server_num 2 --worker_num 2``;
- ``async, worker 1 slowed 2x``: worker 1 sleeps after each step as long as the step
  took; the row gives worker 0's rate alone, against worker 0's rate in ``async``;
- ``collective split(0)``: ``--nproc_per_node 2``, the tables split(0) over both
  ranks as in ``examples/wide_and_deep.py`` (every rank is server and worker, an
  all-reduce/reduce-scatter per lookup instead of RPCs);
- ``1 process, plain torch``: the reference (``--reference``), for scale.

Cases run round-robin ``--repeats`` times; the median is reported.

Two more groups (``--groups``):

- ``long``: sync and geo K=``--k_steps`` over ``--long_steps`` (1,000) steps of a table
  of 26 x ``--long_vocab`` ids, each worker's examples/s per tenth of the run (does geo
  stay fast as its workers touch more of the table?);
- ``hashed``: sync with hashed tables fed the raw ids (26 x 10^6 possible, about
  1.6 million distinct in 150 steps, 1.8 with the evaluation's): ``--hash_capacity``
  rows per server with LRU eviction, with and without a count filter (2 lookups),
  against a table that never evicts (``--hash_unbounded`` rows per server): held-out
  AUC and rows kept.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "wide_and_deep_ps.py"
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--dense_lr", "0.1"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=512, help="global batch")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--k_steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--groups", default="short,long,hashed")
    ap.add_argument("--long_steps", type=int, default=1000)
    ap.add_argument("--long_vocab", type=int, default=1000)
    ap.add_argument("--hash_capacity", type=int, default=5000)
    ap.add_argument("--hash_unbounded", type=int, default=1_000_000)
    ap.add_argument("--collective", action="store_true", help=argparse.SUPPRESS)
    return ap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(launch: list, script: Path, args: list, log_dir: str) -> str:
    cmd = [sys.executable, "-m", "globaltensor.launch", *launch, "--master_port", str(_free_port()),
           "--log_dir", log_dir, str(script), *args]
    if not launch:
        cmd = [sys.executable, str(script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def _rates(out: str) -> dict:
    rates = {int(w): float(v) for w, v in re.findall(r"worker (\d+): (\d+) examples/s", out)}
    m = re.search(r"(?:reference|collective): (\d+) examples/s", out)
    if m:
        rates[0] = float(m.group(1))
    auc = re.search(r"held-out AUC ([\d.]+)", out)
    windows = {int(w): [float(v) for v in vals.split()]
               for w, vals in re.findall(r"worker (\d+): windows of \d+ steps: ([\d ]+) examples/s", out)}
    rows = re.search(r"table embedding: TableStats\(rows=(\d+)", out)
    return {"rates": rates, "auc": float(auc.group(1)) if auc else float("nan"), "windows": windows,
            "rows": int(rows.group(1)) if rows else None}


def collective(args: argparse.Namespace) -> None:
    """The split(0)-table version on every rank of a 2-process world (examples/wide_and_deep.py)."""
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    sys.path.insert(0, str(ROOT / "examples"))
    import wide_and_deep as wd
    import wide_and_deep_ps as wdps

    torch.set_num_threads(1)
    S = gt.sbp.split
    P = gt.placement.all("cpu")
    slots, num_ids = wdps.SLOTS, wdps.SLOTS * args.vocab
    torch.manual_seed(0)
    model = wd.WideAndDeep(num_ids, slots, 8)
    gt.nn.to_global(model, P, wd.param_sbp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truth = wdps.make_truth(slots, args.vocab)
    g = torch.Generator().manual_seed(0)

    def step():
        ids, dense, labels = wdps.make_batch(args.batch, slots, args.vocab, g, truth)
        ids, dense, labels = (gt.tensor(t, placement=P, sbp=S(0)) for t in (ids, dense, labels))
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if gt.get_rank() == 0:
        print(f"collective: {args.batch * args.steps / (time.perf_counter() - t0):.0f} examples/s")


def _measure(cases: dict, repeats: int) -> dict:
    import tempfile
    results: dict = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for name, (launch, script, script_args) in cases.items():
                results[name].append(_rates(_run(launch, script, script_args, f"{tmp}/log")))
    return results


def _rate(results: dict, name: str, worker=None) -> float:
    runs = results[name]
    if worker is None:
        return statistics.median(sum(r["rates"].values()) for r in runs)
    return statistics.median(r["rates"][worker] for r in runs)


def _auc(results: dict, name: str) -> float:
    return statistics.median(r["auc"] for r in results[name])


def short(args: argparse.Namespace) -> None:
    common = ["--steps", str(args.steps), "--batch", str(args.batch), "--vocab", str(args.vocab), *SGD]
    ps = ["--server_num", "2", "--worker_num", "2"]
    cases = {
        "sync": (ps, EXAMPLE, ["--mode", "sync", *common]),
        "async": (ps, EXAMPLE, ["--mode", "async", *common]),
        "async, worker 1 slowed 2x": (ps, EXAMPLE, ["--mode", "async", "--slow_worker", "1",
                                                    "--slow_factor", "2", *common]),
        f"geo K={args.k_steps}": (ps, EXAMPLE, ["--mode", "geo", "--k_steps", str(args.k_steps), *common]),
        "collective split(0)": (["--nproc_per_node", "2"], Path(__file__).resolve(),
                                ["--collective", "--steps", str(args.steps), "--batch", str(args.batch),
                                 "--vocab", str(args.vocab)]),
        "1 process, plain torch": ([], EXAMPLE, ["--reference", *common]),
    }
    results = _measure(cases, args.repeats)
    print(f"wide & deep, {len(cases)} cases, {args.steps} steps of a global batch of {args.batch}, "
          f"26 slots x {args.vocab} ids, SGD; median of {args.repeats} runs")
    print(f"| {'case':34s} | examples/s | vs sync | held-out AUC |")
    print(f"|{'-' * 36}|-----------:|--------:|-------------:|")
    base = _rate(results, "sync")
    for name in cases:
        if name.startswith("async, worker 1"):
            continue
        a = _auc(results, name)
        print(f"| {name:34s} | {_rate(results, name):10.0f} | {_rate(results, name) / base:6.2f}x | "
              f"{'-' if a != a else f'{a:.4f}':>12s} |")
    slowed, unslowed = _rate(results, "async, worker 1 slowed 2x", 0), _rate(results, "async", 0)
    print(f"async with worker 1 slowed 2x: worker 0 {slowed:.0f} examples/s, "
          f"{slowed / unslowed:.2f}x its rate when no worker is slowed ({unslowed:.0f}); "
          f"worker 1 {_rate(results, 'async, worker 1 slowed 2x', 1):.0f} "
          f"(AUC {_auc(results, 'async, worker 1 slowed 2x'):.4f})")


def long(args: argparse.Namespace) -> None:
    common = ["--steps", str(args.long_steps), "--batch", str(args.batch), "--vocab", str(args.long_vocab),
              "--windows", "10", "--log_every", str(args.long_steps), *SGD]
    ps = ["--server_num", "2", "--worker_num", "2"]
    geo = f"geo K={args.k_steps}"
    cases = {"sync": (ps, EXAMPLE, ["--mode", "sync", *common]),
             geo: (ps, EXAMPLE, ["--mode", "geo", "--k_steps", str(args.k_steps), *common])}
    results = _measure(cases, args.repeats)
    print(f"\n{args.long_steps} steps, 26 slots x {args.long_vocab} ids, global batch {args.batch}; "
          f"job examples/s per tenth of the run (median of {args.repeats})")
    base = _rate(results, "sync")
    for name in cases:
        per_window = [statistics.median(sum(w[k] for w in r["windows"].values()) for r in results[name])
                      for k in range(10)]
        print(f"| {name:10s} | {_rate(results, name):7.0f} | {_rate(results, name) / base:5.2f}x sync | "
              f"AUC {_auc(results, name):.4f} | windows " + " ".join(f"{v:.0f}" for v in per_window)
              + f" | last / first {per_window[-1] / per_window[0]:.2f} |")


def hashed(args: argparse.Namespace) -> None:
    common = ["--mode", "sync", "--steps", "150", "--batch", str(args.batch), *SGD]
    ps = ["--server_num", "2", "--worker_num", "2"]
    cap = str(args.hash_capacity)
    cases = {f"unbounded ({args.hash_unbounded} rows/server)": ["--hashed", str(args.hash_unbounded)],
             f"capacity {cap}/server, LRU": ["--hashed", cap],
             f"capacity {cap}/server, LRU, count filter 2": ["--hashed", cap, "--admit_count", "2"]}
    results = _measure({k: (ps, EXAMPLE, common + v) for k, v in cases.items()}, args.repeats)
    print(f"\nhashed tables on raw ids, sync, 150 steps (median of {args.repeats})")
    first = next(iter(cases))
    for name in cases:
        rows = results[name][0]["rows"]
        print(f"| {name:42s} | {_rate(results, name):7.0f} examples/s | rows {rows:9d} | "
              f"AUC {_auc(results, name):.4f} ({_auc(results, name) - _auc(results, first):+.4f}) |")


def main() -> None:
    args = _parser().parse_args()
    if args.collective:
        collective(args)
        return
    groups = {"short": short, "long": long, "hashed": hashed}
    for group in args.groups.split(","):
        groups[group](args)


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("ps"):   # --write-docs: its table into docs/benchmarks.md
        main()
