"""A training job with one injected fault, run through the launcher (benchmarks/faults.py,
tests/checkpoint/test_autosave.py): data-parallel SGD with momentum and dropout, an
Autosave every ``--every`` steps, and at most one fault of rank ``--fault-rank`` per
checkpoint directory (a marker file there says it happened, so a restarted job runs
clean), at step ``--fault-step``:

- ``kill``: SIGKILL after that many steps (the OOM killer's signal);
- ``kill_in_save``: SIGKILL in the middle of that step's save (its data written, before
  the checkpoint's .metadata exists);
- ``stop``: SIGSTOP (a hung rank: its peers time out in their next collective);
- ``exception``: a RuntimeError;
- ``disk_full``: the save of that step fails writing its data (the file size limit is
  set to a few bytes: EFBIG, as ENOSPC would be).

The final whole parameters go to ``--out`` (rank 0).
"""
import argparse
import os
import resource
import signal

import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.interop import checksums


def batch(index: int):
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(8, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


def first_time(ckpt: str, why: str) -> bool:
    """True once per checkpoint directory (the marker file "killed" records it)."""
    marker = os.path.join(ckpt, "killed")
    if os.path.exists(marker):
        return False
    os.makedirs(ckpt, exist_ok=True)
    with open(marker, "w") as f:
        f.write(why)
    print(f"rank {gt.get_rank()} killed {why}", flush=True)
    return True


def inject(fault: str, ckpt: str, why: str) -> None:
    if not first_time(ckpt, why):
        return
    if fault in ("kill", "kill_in_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "exception":
        raise RuntimeError(f"injected fault {why}")


def in_save(fault: str, ckpt: str, step: int) -> None:
    """The fault inside the save of ``step``: SIGKILL once this rank's data file is
    written, or a full disk while it is written."""
    write_data = checksums.ChecksummedWriter.write_data

    def faulty(self, plan, planner):
        if os.path.basename(os.fspath(self.path)) != f"step_{step}":
            return write_data(self, plan, planner)
        if fault == "disk_full" and first_time(ckpt, f"by a full disk in the save of step {step}"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit raise EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
        done = write_data(self, plan, planner)
        if fault == "kill_in_save":
            inject(fault, ckpt, f"in the save of step {step}")
        return done
    checksums.ChecksummedWriter.write_data = faulty


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--fault", choices=["kill", "kill_in_save", "stop", "exception", "disk_full"],
                    default=None)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=None)
    args = ap.parse_args()

    gt.manual_seed(7)
    torch.manual_seed(0)
    P = gt.placement.all("cpu")
    model = gt.nn.to_global(torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 2)),
        P, gt.sbp.broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = gt.checkpoint.Autosave(args.ckpt, model, opt, every=args.every, keep=2)
    saver.state["batch"] = 0
    faulty = args.fault is not None and gt.get_rank() == args.fault_rank
    during_save = args.fault in ("kill_in_save", "disk_full")
    if faulty and during_save:
        in_save(args.fault, args.ckpt, args.fault_step)
    start = saver.restore()
    print(f"rank {gt.get_rank()} starts at step {start}, batch {saver.state['batch']}",
          flush=True)
    for step in range(start, args.steps):
        if faulty and not during_save and step == args.fault_step:
            inject(args.fault, args.ckpt, f"after step {step}")
        x, y = batch(saver.state["batch"])
        loss = F.cross_entropy(model(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))),
                               gt.tensor(y, placement=P, sbp=gt.sbp.split(0)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        saver.state["batch"] += 1
        saver.step(step + 1)
    whole = {name: p.full() for name, p in model.named_parameters()}
    if gt.get_rank() == 0:
        torch.save(whole, args.out)


if __name__ == "__main__":
    main()
