"""Save, crash, resume: checkpoints through torch.distributed.checkpoint (DCP).

    python -m globaltensor.launch --nproc_per_node 2 examples/resume_training.py \\
        --layout tp --ckpt ckpt --steps 12 --save-every 3 --crash-at 8
    python -m globaltensor.launch --nproc_per_node 1 examples/resume_training.py \\
        --layout dp --ckpt ckpt --steps 12 --save-every 3

The first run trains a small MLP (with dropout) tensor-parallel on 2 ranks, saves every
3 steps and dies at step 8 (SIGKILL, as a lost node would). The second run, on another
world size and layout, finds the newest complete checkpoint (step 6), loads it into
its own layout (DCP reads each rank's region; nothing builds whole tensors), and ends
with the parameters an uninterrupted run has. Resuming is one line:

    saver = gt.checkpoint.Autosave(args.ckpt, model, opt, every=3, keep=2)
    saver.state.update(sched=sched, data=progress)   # besides model, optimizer, RNG
    for step in range(saver.restore(), steps): ...; saver.step(step + 1)

A checkpoint holds the model and optimizer state (torch's ``get_state_dict``: AdamW's
moments are GlobalTensors with their parameter's layout), the random state (dropout
continues the same draws), the step, and ``saver.state``: here the LR scheduler and the
data position (epoch, batch within it). Each save goes to a new directory
``step_<n>``; DCP writes ``.metadata`` last, after every rank's data, so a directory
without it is a save that crashed and is never restored. With ``--max_restarts`` the
launcher restarts a job whose rank died and it continues from there.
"""
import argparse
import os
import signal

import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.utils.data import GlobalDataLoader

S, B = gt.sbp.split, gt.sbp.broadcast
LAYOUTS = {
    "dp": lambda name, t: B,  # data parallel: parameters broadcast, batches split(0)
    # tensor parallel: fc1 column-split, fc2 row-split (its output is partial, then summed)
    "tp": lambda name, t: {"0.weight": S(0), "0.bias": S(0), "3.weight": S(1)}.get(name, B),
}


def make_model():
    torch.manual_seed(0)  # the same initial values in every run
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(64, 4))


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def say(text: str) -> None:
    if gt.get_rank() == 0:
        print(text, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp")
    ap.add_argument("--ckpt", required=True, help="directory of step_<n> checkpoints")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--crash-at", type=int, default=None,
                    help="SIGKILL rank 0 after this many steps (and their saves)")
    ap.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    ap.add_argument("--out", default=None, help="torch.save the final whole parameters here")
    args = ap.parse_args()

    gt.manual_seed(1234)
    P = gt.placement.all("cpu")
    model = gt.nn.to_global(make_model(), P, LAYOUTS[args.layout])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    loader = GlobalDataLoader(dataset(), batch_size=16, placement=P, shuffle=True, seed=0)
    saver = gt.checkpoint.Autosave(args.ckpt, model, opt, every=args.save_every, keep=2)
    saver.state.update(sched=sched, data={"epoch": 0, "batch": 0})
    start = 0 if args.no_resume else saver.restore()
    if start:
        say(f"resumed from {os.path.join(args.ckpt, f'step_{start}')} at step {start} on "
            f"{gt.get_world_size()} rank(s), layout {args.layout}")

    data = saver.state["data"]
    loader.set_epoch(data["epoch"])
    batches = iter(loader)
    for _ in range(data["batch"]):  # the data position: skip what was consumed
        next(batches)
    model.train()
    for step in range(start, args.steps):
        if step == args.crash_at and gt.get_rank() == 0:
            say(f"crashing after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x, y = next(batches)
        except StopIteration:
            data["epoch"], data["batch"] = data["epoch"] + 1, 0
            loader.set_epoch(data["epoch"])
            batches = iter(loader)
            x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        data["batch"] += 1
        say(f"step {step + 1} loss {loss.item():.6f}")
        if saver.step(step + 1):
            say(f"saved {os.path.join(args.ckpt, f'step_{step + 1}')}")

    whole = {name: p.detach().full() for name, p in model.named_parameters()}
    if args.out and gt.get_rank() == 0:
        torch.save(whole, args.out)
    say(f"done: {args.steps} steps on {gt.get_world_size()} rank(s), layout {args.layout}, "
        f"parameter checksum {sum(float(w.double().abs().sum()) for w in whole.values()):.8f}")


if __name__ == "__main__":
    main()
