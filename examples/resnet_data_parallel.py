"""Collective data-parallel ResNet training (Paddle Fleet's quick start), on CPU.

    python -m globaltensor.launch --nproc_per_node 2 examples/resnet_data_parallel.py
    python -m globaltensor.launch --nproc_per_node 2 examples/resnet_data_parallel.py --small

A ResNet of BasicBlocks (depth 10/18/34) learns a synthetic ImageNet-like task: each of
`--classes` classes has a smooth random prototype image, and a sample is its class's
prototype, randomly shifted and scaled, under heavy noise. Samples are made on demand
from their index, so like files on a shared disk every rank could read any of them, and
`GlobalDataLoader` makes each rank read only its rows of each global batch (`split(0)`).
The parameters and buffers are broadcast GlobalTensors (`gt.nn.to_global`), so the
gradients come out all-reduced, and BatchNorm normalises with the statistics of the
whole global batch (synchronised BatchNorm, for free). SGD with momentum 0.9, L2 weight
decay 1e-4, lr 0.1; rank 0 logs loss and top-1 / top-5 accuracy every 5 batches.
The data, its order and the initial weights do not depend on the number of ranks, so
the run is the single-process run (`--nproc_per_node 1`) whatever the world size;
`--save PATH` writes the final parameters and buffers (`torch.save` of their full
values) for comparing runs.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
import globaltensor.utils.data  # noqa: F401  (until globaltensor/__init__ imports utils)
from globaltensor.utils.data import GlobalDataLoader

BLOCKS = {10: [1, 1, 1, 1], 18: [2, 2, 2, 2], 34: [3, 4, 6, 3]}


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style stem (3x3 conv) and 4 stages of widths w, 2w, 4w, 8w."""

    def __init__(self, depth, width, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        stages, cin = [], width
        for i, blocks in enumerate(BLOCKS[depth]):
            cout = width * 2 ** i
            for j in range(blocks):
                stages.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SyntheticImages(torch.utils.data.Dataset):
    """`size` (image, label) samples, each made from its index alone (deterministic)."""

    def __init__(self, size, classes, image, seed, noise=2.0):
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(classes, 3, 4, 4, generator=g)
        self.prototypes = F.interpolate(coarse, size=(image, image), mode="bilinear",
                                        align_corners=False)
        self.size, self.classes, self.seed, self.noise = size, classes, seed, noise

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * i)
        label = int(torch.randint(self.classes, (), generator=g))
        shift = torch.randint(-4, 5, (2,), generator=g).tolist()
        x = torch.roll(self.prototypes[label], shift, dims=(1, 2))
        x = x * (0.75 + 0.5 * torch.rand((), generator=g))
        return x + self.noise * torch.randn(x.shape, generator=g), label


def accuracy(logits, labels, k):
    top = logits.topk(k, dim=1).indices
    return (top == labels[:, None]).any(1).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=18, choices=sorted(BLOCKS))
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
    ap.add_argument("--image", type=int, default=32, help="image height and width")
    ap.add_argument("--classes", type=int, default=50)
    ap.add_argument("--samples", type=int, default=3200, help="training images")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true",
                    help="a seconds-long run: depth 10, width 8, 16x16 images, 480 samples "
                         "(the options given explicitly still apply)")
    ap.add_argument("--save", default=None,
                    help="write the final parameters and buffers (torch.save)")
    args = ap.parse_args()
    if args.small:   # new defaults: the options given explicitly still win
        ap.set_defaults(depth=10, width=8, image=16, samples=480, batch_size=32, classes=10)
        args = ap.parse_args()

    gt.manual_seed(args.seed)
    rank, world = gt.get_rank(), gt.get_world_size()
    P = gt.placement("cpu", ranks=list(range(world)))
    data = SyntheticImages(args.samples, args.classes, args.image, args.seed)
    loader = GlobalDataLoader(data, args.batch_size, P, shuffle=True, seed=args.seed,
                              drop_last=True)
    model = gt.nn.to_global(ResNet(args.depth, args.width, args.classes), P, gt.sbp.broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"ResNet-{args.depth} (width {args.width}, {params / 1e6:.2f} M params), "
              f"{args.image}x{args.image} images, {args.classes} classes, {world} ranks, "
              f"global batch {args.batch_size} ({len(loader)} batches per epoch)", flush=True)

    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for step, (images, labels) in enumerate(loader, 1):   # split(0) global batches
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()               # gradients all-reduced by the framework
            opt.step()
            losses.append(loss.detach().full().item())
            if step % 5 == 0:
                full, y = logits.detach().full(), labels.full()   # collectives: every rank
                acc1, acc5 = accuracy(full, y, 1), accuracy(full, y, min(5, args.classes))
                if rank == 0:
                    speed = len(losses) * args.batch_size / (time.perf_counter() - start)
                    print(f"[epoch {epoch}, batch {step}] loss: {losses[-1]:.5f}, "
                          f"acc1: {acc1:.5f}, acc5: {acc5:.5f}  ({speed:.0f} images/s)",
                          flush=True)
    if rank == 0:
        first, last = losses[:5], losses[-5:]
        print(f"mean loss of the first 5 batches {sum(first) / len(first):.4f}, "
              f"of the last 5 {sum(last) / len(last):.4f} "
              f"({time.perf_counter() - start:.1f} s)")
    # every parameter and buffer, whole: .full() is a collective, so every rank calls it
    state = {name: t.detach().full().cpu() for name, t in model.state_dict().items()}
    if rank == 0 and args.save:
        torch.save(state, args.save)
        print(f"saved {len(state)} tensors to {args.save}")


if __name__ == "__main__":
    main()
    # Tear the process group down before the interpreter does: gloo can abort at exit
    # otherwise ("terminate called without an active exception").
    torch.distributed.destroy_process_group()
