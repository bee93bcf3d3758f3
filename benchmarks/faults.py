"""Fault injection: training jobs under the launcher with ``--max_restarts 1`` and one
injected fault each. Every fault must either be survived (the launcher restarts the
workers, ``gt.checkpoint.Autosave`` resumes from the newest complete checkpoint, and the
job ends with the parameters of an uninterrupted run, bit for bit) or end the job within
the timeout with the right process named. Prints one row per fault.

Faults (benchmarks/fault_job.py: data-parallel SGD on 2 ranks, a checkpoint every 2 of
10 steps; a rank is faulted once per checkpoint directory):

- SIGKILL of rank 1 after a random step, ``--repeat`` times in a row (default 20);
- SIGKILL of rank 1 in the middle of a save (data written, no .metadata yet);
- SIGSTOP of rank 1 (a hung rank: rank 0 times out in its next collective after
  GLOBALTENSOR_TIMEOUT, set to 10 s here);
- a RuntimeError raised on rank 1;
- a full disk during a save (the file size limit: writes fail with EFBIG);
- SIGKILL of parameter server 0 in examples/wide_and_deep_ps.py (its checkpoints every
  10 steps).

Run::

    python benchmarks/faults.py                 # about 4 minutes here
    python benchmarks/faults.py --repeat 3      # a quick look
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from globaltensor.testing import free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "fault_job.py"
PS_EXAMPLE = HERE.parent / "examples" / "wide_and_deep_ps.py"
STEPS, EVERY = 10, 2


def launch(args: list, log_dir: Path, timeout: float, extra_env: dict | None = None):
    """(exit code, seconds, stderr) of one launcher run (killed at ``timeout``)."""
    cmd = [sys.executable, "-m", "globaltensor.launch", "--master_port", str(free_port()),
           "--log_dir", str(log_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return r.returncode, time.monotonic() - start, r.stderr
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, time.monotonic() - start, err


def job_args(work: Path, name: str, *fault: str) -> list:
    return ["--nproc_per_node", "2", "--max_restarts", "1", str(JOB), "--ckpt", str(work / name),
            "--out", str(work / f"{name}.pt"), "--steps", str(STEPS), "--every", str(EVERY), *fault]


def restart_reason(stderr: str) -> str:
    """The launcher's restart line without its prefix, or ''."""
    m = re.search(r"globaltensor\.launch: (.*); restarting every worker", stderr)
    return m.group(1) if m else ""


def failure_line(stderr: str) -> str:
    m = re.search(r"^globaltensor\.launch: (rank .*|server .*|worker .*)$", stderr, re.M)
    return m.group(1) if m else stderr.strip().splitlines()[-1] if stderr.strip() else ""


def same_parameters(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run_training_fault(work: Path, name: str, fault: list, expect: str, timeout: float,
                       env: dict | None = None) -> dict:
    """One faulted job: survived when it restarted once, naming rank 1 as ``expect``
    says, and ended with the reference's parameters."""
    code, seconds, err = launch(job_args(work, name, *fault), work / f"log-{name}", timeout, env)
    reason = restart_reason(err)
    named = bool(re.search(expect, reason))
    equal = same_parameters(work / "reference.pt", work / f"{name}.pt")
    ok = code == 0 and named and equal
    return {"fault": name, "outcome": "survived" if ok else "FAILED", "seconds": seconds,
            "detail": reason or failure_line(err), "equal": equal, "ok": ok,
            "log": "" if ok else err[-3000:]}


def run_ps_server_kill(work: Path, timeout: float) -> dict:
    """Server 0 killed by worker 0 after step 30 of 40 (checkpoints every 10): the
    launcher names the server, restarts, and the job resumes and finishes."""
    args = ["--max_restarts", "1", "--server_num", "2", "--worker_num", "2", str(PS_EXAMPLE),
            "--mode", "sync", "--steps", "40", "--batch", "256", "--eval_size", "1024",
            "--checkpoint", str(work / "ps"), "--checkpoint_every", "10", "--kill_server_at", "30"]
    code, seconds, err = launch(args, work / "log-ps", timeout)
    reason = restart_reason(err)
    ok = code == 0 and reason.startswith("server 0")
    return {"fault": "SIGKILL of parameter server 0", "outcome": "survived" if ok else "FAILED",
            "seconds": seconds, "detail": reason or failure_line(err), "equal": None, "ok": ok,
            "log": "" if ok else err[-3000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20, help="SIGKILLs at random steps, in a row")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per job")
    ap.add_argument("--seed", type=int, default=None, help="of the random kill steps")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--only", default="", help="run the faults whose name contains this")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gt-faults-"))
    rng = random.Random(args.seed)
    rows = []
    try:
        code, seconds, err = launch(job_args(work, "reference"), work / "log-reference", args.timeout)
        if code != 0:
            print(f"the uninterrupted reference run failed (exit {code}):\n{err[-3000:]}")
            return 1
        print(f"uninterrupted reference: {seconds:.1f} s", flush=True)
        cases = [(f"SIGKILL of rank 1 after step {s} (run {i + 1}/{args.repeat})", f"kill{i}",
                  ["--fault", "kill", "--fault-step", str(s)], r"rank 1 was killed by signal SIGKILL", None)
                 for i, s in enumerate(rng.randint(1, STEPS - 1) for _ in range(args.repeat))]
        cases += [
            ("SIGKILL of rank 1 in the save of step 6", "kill_in_save",
             ["--fault", "kill_in_save", "--fault-step", "6"], r"rank 1 was killed by signal SIGKILL", None),
            ("SIGSTOP of rank 1 after step 5", "stop", ["--fault", "stop", "--fault-step", "5"],
             r"rank 0 exited with code 1 after a timeout; rank 1 was still running",
             {"GLOBALTENSOR_TIMEOUT": "10"}),
            ("RuntimeError on rank 1 after step 5", "exception",
             ["--fault", "exception", "--fault-step", "5"], r"rank 1 exited with code 1", None),
            ("full disk in the save of step 6 on rank 1", "disk_full",
             ["--fault", "disk_full", "--fault-step", "6"], r"rank 1 exited with code 1", None),
        ]
        for title, name, fault, expect, env in cases:
            if args.only not in title:
                continue
            row = run_training_fault(work, name, fault, expect, args.timeout, env)
            row["fault"] = title
            rows.append(row)
            print(f"  {row['outcome']:8s} {row['seconds']:5.1f} s  {title}: {row['detail']}", flush=True)
        if args.only in "SIGKILL of parameter server 0":
            rows.append(run_ps_server_kill(work, args.timeout))
            print(f"  {rows[-1]['outcome']:8s} {rows[-1]['seconds']:5.1f} s  {rows[-1]['fault']}: "
                  f"{rows[-1]['detail']}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    for row in rows:
        if not row["ok"]:
            print(f"\n--- {row['fault']}: launcher output (end) ---\n{row['log']}")
    return 0 if all(r["ok"] for r in rows) else 1


def print_table(rows: list) -> None:
    print(f"\n{'fault':52s} {'outcome':9s} {'s':>6s}  {'params equal':12s} launcher named")
    for r in rows:
        equal = "-" if r["equal"] is None else ("yes" if r["equal"] else "NO")
        print(f"{r['fault']:52s} {r['outcome']:9s} {r['seconds']:6.1f}  {equal:12s} {r['detail']}")
    survived = sum(r["ok"] for r in rows)
    print(f"\n{survived}/{len(rows)} faults survived with the uninterrupted run's parameters "
          f"(or, for the server, resumed and finished)")


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("faults"):   # --write-docs: its table into docs/benchmarks.md
        sys.exit(main())
