"""A training job for test_autosave.py, run through the launcher: data-parallel SGD with
momentum and dropout, an Autosave every ``--every`` steps, and at most one SIGKILL of
one rank per checkpoint directory (a marker file there says it happened): after
``--kill-step`` steps, or with ``--kill-in-save`` in the middle of that step's save
(after the rank wrote its data, before the checkpoint's .metadata exists)."""
import argparse
import os
import signal

import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.interop import checksums


def batch(index: int):
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(8, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


def die_once(ckpt: str, why: str) -> None:
    marker = os.path.join(ckpt, "killed")
    if os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write(why)
    print(f"rank {gt.get_rank()} killed {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_save(ckpt: str, step: int) -> None:
    """SIGKILL this rank inside the save of ``step``, once its data file is written."""
    write_data = checksums.ChecksummedWriter.write_data

    def dying(self, plan, planner):
        done = write_data(self, plan, planner)
        if os.path.basename(os.fspath(self.path)) == f"step_{step}":
            die_once(ckpt, f"in the save of step {step}")
        return done
    checksums.ChecksummedWriter.write_data = dying


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--kill-in-save", action="store_true")
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
    killing = gt.get_rank() == args.kill_rank
    if killing and args.kill_in_save:
        kill_in_save(args.ckpt, args.kill_step)
    start = saver.restore()
    print(f"rank {gt.get_rank()} starts at step {start}, batch {saver.state['batch']}",
          flush=True)
    for step in range(start, args.steps):
        if killing and not args.kill_in_save and step == args.kill_step:
            die_once(args.ckpt, f"after step {step}")
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
