"""Seed 003: ResNet50 cut into two pipeline stages on two ranks, trained on synthetic
images; time per step for 1, 2, 4 and 8 micro-batches, and the speedup over 1.

    python -m globaltensor.launch --nproc_per_node 2 examples/resnet_pipeline.py
    # the seed's sizes (224x224 images, batch 64, full width; slow on a CPU):
    python -m globaltensor.launch --nproc_per_node 2 examples/resnet_pipeline.py \\
        --image-size 224 --batch-size 64 --width 64 --classes 1000

Stage 0 (rank 0) is the stem and the first 6 of the 16 bottleneck blocks, stage 1
(rank 1) the other 10 and the classifier (``--cut``: on a CPU this balances the two
ranks' compute); the activation between them moves with boxing between placements,
posted without blocking. With one micro-batch a rank idles while the other computes;
with m micro-batches the idle share falls to about 1 / (m + 1). ResNet50 is defined
here (bottleneck blocks 3-4-6-3), without torchvision. ``--width`` scales the
channels (64 is the real network), ``--timeline out.png`` draws the last step. The
defaults keep micro-batches large enough to compute efficiently on a CPU (smaller
images make 8 micro-batches of 4 slower than one batch of 32 in plain torch too).
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


def layer(cin: int, width: int, blocks: int, stride: int) -> nn.Sequential:
    mods = [Bottleneck(cin, width, stride)]
    mods += [Bottleneck(width * 4, width, 1) for _ in range(blocks - 1)]
    return nn.Sequential(*mods)


def resnet50_stages(width: int = 64, classes: int = 1000, cut: int = 6) -> list:
    """ResNet50 as two stages: the stem and the first ``cut`` of its 16 bottleneck
    blocks, then the other blocks and the head (``cut=7``: layers 1-2 | layers 3-4)."""
    w = width
    stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1))
    blocks = [*layer(w, w, 3, 1), *layer(w * 4, w * 2, 4, 2), *layer(w * 8, w * 4, 6, 2),
              *layer(w * 16, w * 8, 3, 2)]
    if not 0 <= cut <= len(blocks):
        raise ValueError(f"cut must be in [0, {len(blocks)}], got {cut}")
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w * 32, classes)]
    return [nn.Sequential(stem, *blocks[:cut]), nn.Sequential(*blocks[cut:], *head)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--width", type=int, default=16, help="channels of the stem (64: ResNet50)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--cut", type=int, default=6,
                    help="bottleneck blocks (of 16) in stage 0, the rest in stage 1")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schedule", default="1f1b", choices=sorted(gt.pipeline.SCHEDULES))
    ap.add_argument("--steps", type=int, default=3, help="timed steps per micro-batch count")
    ap.add_argument("--timeline", default=None, help="write the last step's timeline PNG")
    args = ap.parse_args()

    gt.init()
    if gt.get_world_size() < 2:
        raise SystemExit("run with 2 ranks: python -m globaltensor.launch --nproc_per_node 2 ...")
    torch.manual_seed(0)
    stages = resnet50_stages(args.width, args.classes, args.cut)
    for k, stage in enumerate(stages):
        gt.nn.to_global(stage, gt.placement("cpu", ranks=[k]), gt.sbp.broadcast)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.classes, (args.batch_size,))

    times, losses = {}, {}
    for m in args.micro_batches:
        pipe = gt.pipeline.Pipeline(stages, micro_batches=m, schedule=args.schedule,
                                    loss_fn=F.cross_entropy)
        for step in range(args.steps + 1):  # the first step learns the shapes: untimed
            t0 = time.perf_counter()
            loss = pipe.step(images, labels)  # plain tensors: the same on every rank
            opt.step()
            opt.zero_grad()
            if step:
                times.setdefault(m, []).append(time.perf_counter() - t0)
        losses[m] = float(loss)  # a collective: every rank
        if args.timeline and m == args.micro_batches[-1]:
            pipe.timeline(args.timeline)
    slowest = torch.tensor([min(times[m]) for m in args.micro_batches], dtype=torch.float64)
    everyone = [torch.zeros_like(slowest) for _ in range(gt.get_world_size())]
    torch.distributed.all_gather(everyone, slowest)
    slowest = torch.stack(everyone).max(0).values.tolist()
    if gt.get_rank() == 0:
        print(f"ResNet50 (width {args.width}), 2 stages on ranks [0] and [1] (blocks "
              f"{args.cut} | {16 - args.cut}), batch {args.batch_size} of "
              f"{args.image_size}x{args.image_size}, {args.schedule}")
        print(f"{'micro-batches':>13} {'s/step':>8} {'speedup':>8} {'loss':>8}")
        for m, t in zip(args.micro_batches, slowest):
            print(f"{m:>13} {t:>8.3f} {slowest[0] / t:>7.2f}x {losses[m]:>8.3f}")


if __name__ == "__main__":
    main()
