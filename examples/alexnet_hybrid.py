"""AlexNet with data-parallel convolutions and model-parallel FC layers (hybrid parallel).

    python -m globaltensor.launch --nproc_per_node 2 examples/alexnet_hybrid.py

A small-image AlexNet (3x32x32 inputs; channel counts divided by ``--width``) on every
rank of a "cpu" placement:

- the five conv layers are **data parallel**: their parameters are broadcast and the
  batch is split(0), so they run locally and their gradients are all-reduced;
- the three FC layers are **model parallel**: each weight (out, in) is split(0), i.e.
  by output features (a column-parallel ``x @ W.t()``), and takes a broadcast input, so
  the features are all-gathered once and each FC output comes out split(1). FC2 and the
  classifier take their input all-gathered as well, so every FC weight gradient is
  computed where its shard lives. The logits stay split(1): the cross-entropy reduces
  per-row statistics and never gathers them.

It trains for ``--steps`` Adam steps on a fixed batch of random images and random labels
(the model memorises it), printing the loss every ``--log_every`` steps and checking that
it falls. Before training it checks that the parallel forward pass equals plain torch.

It also counts the communication of one step with ``gt.debug.comm_stats()`` (bytes each
rank sent, summed over ranks) and compares the FC layers' share with Paddle's
``ModelParallelLinear`` "gather everything" scheme, which all-gathers each FC layer's
input and output in the forward pass and their gradients in the backward pass (computed
analytically from the layer sizes and the batch). The step's backward runs in two pieces
(FC head, then convolutions) so that the two shares are counted apart; the convolutions'
gradient all-reduce is the same in both schemes (on 1 rank there is no communication to
compare). Options: ``--steps``, ``--batch``, ``--width``, ``--lr``, ``--dropout``,
``--log_every``, ``--seed``; ``--save PATH`` writes the final parameters (``torch.save``
of their full values) for comparing runs: the data, the initial weights and the dropout
masks do not depend on the number of ranks, so 1 rank and N ranks train the same model.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split
FLOAT = 4  # bytes


class AlexNet(torch.nn.Module):
    """AlexNet's 5 conv + 3 FC layers, sized for 32x32 images."""

    def __init__(self, width=4, num_classes=10, dropout=0.5):
        super().__init__()
        c1, c2, c3, c4, c5 = (c // width for c in (64, 192, 384, 256, 256))
        hidden = 4096 // width
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, c1, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c1, c2, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c2, c3, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c3, c4, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c4, c5, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.fc1 = torch.nn.Linear(c5 * 4 * 4, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, num_classes)
        self.dropout = torch.nn.Dropout(dropout)
        for conv in self.features:      # He init keeps the signal alive through 5 convs
            if isinstance(conv, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
                torch.nn.init.zeros_(conv.bias)
        torch.nn.init.normal_(self.fc3.weight, std=0.01)   # start near uniform logits
        torch.nn.init.zeros_(self.fc3.bias)

    def fc_layers(self):
        return [self.fc1, self.fc2, self.fc3]

    def head(self, feats):
        """The three FC layers on flattened features (with the gathers they need)."""
        x = gather(feats)
        x = gather(F.relu(self.fc1(self.dropout(x))))
        x = gather(F.relu(self.fc2(self.dropout(x))))
        return self.fc3(x)

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


def gather(x):
    """A broadcast copy of a global tensor; plain tensors pass through (the reference)."""
    return x.to_global(sbp=B) if gt.is_global(x) else x


def param_sbp(name, tensor):
    return S(0) if name.startswith("fc") else B    # FC: split by output features


def summed_over_ranks(n):
    values = [None] * gt.get_world_size()
    dist.all_gather_object(values, int(n))
    return sum(values)


def gather_all_bytes(model, batch, world):
    """Bytes (summed over ranks) that all-gathering each FC layer's input and output,
    forward and backward, moves: each all_gather of a (batch, d) fp32 tensor has every
    rank send its batch * d / world slice to the world - 1 others."""
    per_layer = [2 * (world - 1) * batch * (fc.in_features + fc.out_features) * FLOAT
                 for fc in model.fc_layers()]
    return sum(per_layer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--width", type=int, default=4,
                        help="divide AlexNet's channel and FC sizes by this")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument("--max-loss-ratio", type=float, default=0.7,
                        help="fail unless the mean loss of the last 3 steps is below this "
                             "times the first loss (1e9: no check)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the weights, the data and the dropout masks")
    parser.add_argument("--save", default=None, help="write the final parameters (torch.save)")
    args = parser.parse_args()

    rank, world = gt.get_rank(), gt.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    P = gt.placement.all("cpu")
    gt.manual_seed(args.seed)   # torch's generator (weights) and the dropout generator
    reference = AlexNet(args.width, dropout=args.dropout)
    model = AlexNet(args.width, dropout=args.dropout)
    model.load_state_dict(reference.state_dict())
    gt.nn.to_global(model, P, param_sbp)
    n_params = sum(p.numel() for p in reference.parameters())
    say(f"AlexNet (width 1/{args.width}, {n_params:,} parameters) on {world} ranks: "
        f"conv data parallel, FC model parallel")
    for name in ("features.0.weight", "fc1.weight", "fc2.weight", "fc3.weight"):
        p = dict(model.named_parameters())[name]
        say(f"  {name:<18} shape={tuple(p.shape)!s:<16} sbp={p.sbp}")

    g = torch.Generator().manual_seed(args.seed)   # the global batch, whatever the world
    images_full = torch.randn(args.batch, 3, 32, 32, generator=g)
    labels_full = torch.randint(0, 10, (args.batch,), generator=g)
    images = gt.tensor(images_full, placement=P, sbp=S(0))   # data parallel batch
    labels = gt.tensor(labels_full, placement=P, sbp=B)      # next to split(1) logits

    # The parallel network computes what plain torch computes (dropout off to compare).
    model.eval()
    reference.eval()
    with torch.no_grad():
        logits = model(images)
        expected = reference(images_full)
    if logits.sbp != (S(1),):
        raise AssertionError(f"logits laid out as {logits.sbp}, expected split(1)")
    torch.testing.assert_close(logits.full(), expected, rtol=1e-4, atol=1e-5)
    say(f"  logits {tuple(logits.shape)} sbp={logits.sbp} equal plain torch's")
    model.train()

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, head_bytes, conv_bytes = [], [], []
    for step in range(args.steps):
        feats = model.features(images).flatten(1)            # split(0), no communication
        opt.zero_grad()
        with gt.debug.comm_stats() as head_comm:
            f = feats.detach().requires_grad_()
            loss = F.cross_entropy(model.head(f), labels)
            loss.backward()
        with gt.debug.comm_stats() as conv_comm:
            feats.backward(f.grad)                           # conv grads are all-reduced
        opt.step()
        losses.append(loss.full().item())
        head_bytes.append(summed_over_ranks(head_comm.total_bytes))
        conv_bytes.append(summed_over_ranks(conv_comm.total_bytes))
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:3d}  loss {losses[-1]:.4f}")

    ours, conv = head_bytes[-1], conv_bytes[-1]
    theirs = gather_all_bytes(model, args.batch, world)
    conv_params = sum(p.numel() for p in model.features.parameters())
    conv_expected = world * (2 * conv_params * FLOAT * (world - 1) // world)
    say(f"communication per step (bytes sent, summed over {world} ranks):")
    if world > 1:
        say(f"  FC layers: ours {ours} B < gather-all {theirs} B "
            f"({theirs / max(ours, 1):.1f}x less)")
    else:
        say(f"  FC layers: ours {ours} B, gather-all {theirs} B (1 rank: nothing to send)")
    say(f"  conv gradient all-reduce (the same in both schemes): {conv} B")
    if world > 1 and not ours < theirs:
        raise AssertionError(f"FC communication {ours} B is not below gather-all {theirs} B")
    # The framework records the head's 5th step and plans the steps after it as a whole
    # (which may move a few bytes more where it saves time): from then on, every step
    # is the same.
    if len(set(head_bytes[6:])) > 1:
        raise AssertionError(f"FC communication varies between planned steps: {head_bytes}")
    if abs(conv - conv_expected) > 64 * world:  # rounding per bucket
        raise AssertionError(f"conv all-reduce moved {conv} B, expected ~{conv_expected} B")
    first, last = losses[0], sum(losses[-3:]) / len(losses[-3:])
    if not last < args.max_loss_ratio * first:
        raise AssertionError(f"loss did not decrease clearly: {losses}")
    say(f"loss decreased: {first:.4f} -> {last:.4f} (mean of the last 3 steps)")

    # every parameter and buffer, whole: .full() is a collective, so every rank calls it
    state = {name: t.detach().full().cpu() for name, t in model.state_dict().items()}
    if rank == 0 and args.save:
        torch.save(state, args.save)
        say(f"saved {len(state)} tensors to {args.save}")


if __name__ == "__main__":
    main()
    # Tear the process group down before the interpreter does: gloo can abort at exit
    # otherwise ("terminate called without an active exception").
    torch.distributed.destroy_process_group()
