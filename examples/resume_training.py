"""Save, crash, resume: checkpoints through torch.distributed.checkpoint (DCP).

    python -m globaltensor.launch --nproc_per_node 2 examples/resume_training.py \\
        --layout tp --ckpt ckpt --steps 12 --save-every 3 --crash-at 8
    python -m globaltensor.launch --nproc_per_node 1 examples/resume_training.py \\
        --layout dp --ckpt ckpt --steps 12 --save-every 3

The first run trains a small MLP (with dropout) tensor-parallel on 2 ranks, saves every
3 steps and dies at step 8 (SIGKILL, as a lost node would). The second run, on another
world size and layout, finds the newest complete checkpoint (step 6), loads it into
its own layout (DCP reads each rank's region; nothing builds whole tensors), and ends
with the parameters an uninterrupted run has. A checkpoint holds:

* the model and optimizer state from torch's ``get_state_dict`` (AdamW's moments are
  GlobalTensors with their parameter's layout),
* the LR scheduler's state and the data position (epoch, batch within it),
* the random state (``gt.checkpoint.rng_state()``: dropout continues the same draws).

Each save goes to a new directory ``step_<n>``. DCP writes ``.metadata`` last (to a
temporary name, then renamed), after every rank's data, so a directory without it is a
save that crashed: ``gt.checkpoint.latest`` skips it, and ``dcp.load`` refuses it. Never
save into the directory of the checkpoint you would resume from.
"""
import argparse
import os
import signal

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def checkpoint_state(model, opt, sched, progress):
    """What a checkpoint holds; dcp.load fills it in place (non-tensors are replaced)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
            "progress": dict(progress), "rng": gt.checkpoint.rng_state()}


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
    progress = {"step": 0, "epoch": 0, "batch": 0}

    resume = None if args.no_resume else gt.checkpoint.latest(args.ckpt)
    if resume is not None:
        state = checkpoint_state(model, opt, sched, progress)
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        gt.checkpoint.set_rng_state(state["rng"])
        progress = dict(state["progress"])
        say(f"resumed from {resume} at step {progress['step']} on {gt.get_world_size()} "
            f"rank(s), layout {args.layout}")

    loader.set_epoch(progress["epoch"])
    batches = iter(loader)
    for _ in range(progress["batch"]):  # the data position: skip what was consumed
        next(batches)
    model.train()
    while progress["step"] < args.steps:
        if progress["step"] == args.crash_at and gt.get_rank() == 0:
            say(f"crashing after step {progress['step']}")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x, y = next(batches)
        except StopIteration:
            progress["epoch"], progress["batch"] = progress["epoch"] + 1, 0
            loader.set_epoch(progress["epoch"])
            batches = iter(loader)
            x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        progress["step"] += 1
        progress["batch"] += 1
        say(f"step {progress['step']} loss {float(loss):.6f}")
        if progress["step"] % args.save_every == 0:
            path = os.path.join(args.ckpt, f"step_{progress['step']}")
            dcp.save(checkpoint_state(model, opt, sched, progress), checkpoint_id=path)
            say(f"saved {path}")

    whole = {name: p.full() for name, p in model.named_parameters()}
    if args.out and gt.get_rank() == 0:
        torch.save(whole, args.out)
    say(f"done: {args.steps} steps on {gt.get_world_size()} rank(s), layout {args.layout}, "
        f"parameter checksum {sum(float(w.double().abs().sum()) for w in whole.values()):.8f}")


if __name__ == "__main__":
    main()
