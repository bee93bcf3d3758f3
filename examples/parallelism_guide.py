"""OneFlow's "Global Tensor" parallelism guide, on a "cpu" placement.

    python -m globaltensor.launch --nproc_per_node 4 examples/parallelism_guide.py

Four ways to lay out one small network, each written as a single program for all
ranks and checked, values and gradients, against the same computation on full values
in plain torch (``x.full()`` gathers the whole value on every rank):

1. data parallel:   x (4, 5) split(0) @ w (5, 8) broadcast -> y split(0);
2. model parallel:  x broadcast @ w split(1)               -> y split(1);
3. pipeline:        w0 on ranks [0], w1 on ranks [1]; the activation moves between the
                    stages with ``to_global(placement=...)`` and backward runs through both;
4. hybrid:          stage 0 data parallel on ranks [0, 1], stage 1 model parallel on
                    ranks [2, 3], trained for a few SGD steps next to a plain-torch copy;
5. pipelined training: the guide's PipelineGraph (``set_stage`` on ranks [0] and [1],
                    gradient accumulation over 2 micro-batches) as ``gt.pipeline.Pipeline``.

Parts 1-3 and 5 need at least 2 ranks; part 4 needs 4 (with 2 it is skipped and says
so). Options: ``--steps`` (SGD steps of parts 4 and 5), ``--lr``.
"""
import argparse

import torch
import torch.nn.functional as F

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split


def say(*args):
    if gt.get_rank() == 0:
        print(*args, flush=True)


def show(name, t):
    ranks = t.placement.ranks
    say(f"  {name:<4} shape={tuple(t.shape)!s:<8} sbp={t.sbp!s:<18} placement ranks={ranks}")


def close(actual, expected, what):
    """Raise (on every rank) unless ``actual`` equals ``expected``."""
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def data_parallel(P):
    say("1. data parallel: the batch is split, the weight is broadcast")
    x = gt.randn(4, 5, placement=P, sbp=S(0))
    w = gt.randn(5, 8, placement=P, sbp=B, requires_grad=True)
    y = x @ w
    for name, t in (("x", x), ("w", w), ("y", y)):
        show(name, t)
    if y.sbp != (S(0),):
        raise AssertionError(f"data parallel y.sbp = {y.sbp}, expected split(0)")
    (y * y).sum().backward()
    # The gradient of a broadcast weight used on split data is the all-reduced one.
    if w.grad.sbp != (B,):
        raise AssertionError(f"w.grad.sbp = {w.grad.sbp}, expected broadcast")
    xf, wf = x.full(), w.full().detach().requires_grad_()
    yf = xf @ wf
    (yf * yf).sum().backward()
    close(y.full(), yf, "data parallel y")
    close(w.grad.full(), wf.grad, "data parallel w.grad")
    say("   y and w.grad equal the single-process values")


def model_parallel(P):
    say("2. model parallel: the input is broadcast, the weight split by columns")
    x = gt.randn(4, 5, placement=P, sbp=B, requires_grad=True)
    w = gt.randn(5, 8, placement=P, sbp=S(1), requires_grad=True)
    y = x @ w
    for name, t in (("x", x), ("w", w), ("y", y)):
        show(name, t)
    if y.sbp != (S(1),):
        raise AssertionError(f"model parallel y.sbp = {y.sbp}, expected split(1)")
    (y * y).sum().backward()
    if w.grad.sbp != (S(1),) or x.grad.sbp != (B,):
        raise AssertionError(f"grads laid out as {w.grad.sbp} / {x.grad.sbp}")
    xf = x.full().detach().requires_grad_()
    wf = w.full().detach().requires_grad_()
    yf = xf @ wf
    (yf * yf).sum().backward()
    close(y.full(), yf, "model parallel y")
    close(w.grad.full(), wf.grad, "model parallel w.grad")
    close(x.grad.full(), xf.grad, "model parallel x.grad")
    say("   y, w.grad and x.grad equal the single-process values")


def pipeline():
    say("3. pipeline: stage 0 on rank 0, stage 1 on rank 1")
    P0 = gt.placement("cpu", ranks=[0])
    P1 = gt.placement("cpu", ranks=[1])
    x0 = gt.randn(4, 5, placement=P0, sbp=B)
    w0 = gt.randn(5, 8, placement=P0, sbp=B, requires_grad=True)
    w1 = gt.randn(8, 3, placement=P1, sbp=B, requires_grad=True)
    h = x0 @ w0                               # runs on rank 0 only
    h1 = h.to_global(placement=P1, sbp=B)     # rank 0 sends the activation to rank 1
    y = h1 @ w1                               # runs on rank 1 only
    for name, t in (("x0", x0), ("w0", w0), ("h", h), ("h1", h1), ("w1", w1), ("y", y)):
        show(name, t)
    # Every rank runs this line; ranks outside a placement hold an empty part.
    y.relu().sum().backward()                 # the gradient of h goes back to rank 0
    if w0.grad.placement != P0 or w1.grad.placement != P1:
        raise AssertionError("pipeline gradients left their stage's placement")
    xf = x0.full()
    w0f = w0.full().detach().requires_grad_()
    w1f = w1.full().detach().requires_grad_()
    yf = (xf @ w0f) @ w1f
    yf.relu().sum().backward()
    close(y.full(), yf, "pipeline y")
    close(w0.grad.full(), w0f.grad, "pipeline w0.grad")
    close(w1.grad.full(), w1f.grad, "pipeline w1.grad")
    say(f"   y, w0.grad (on ranks {w0.grad.placement.ranks}) and w1.grad "
        f"(on ranks {w1.grad.placement.ranks}) equal the single-process values")


class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 16)

    def forward(self, x):
        return F.relu(self.fc(x))


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, h):
        return self.fc(h)


def hybrid(steps, lr):
    say("4. hybrid: stage 0 data parallel on ranks [0, 1], "
        "stage 1 model parallel on ranks [2, 3]")
    P01 = gt.placement("cpu", ranks=[0, 1])
    P23 = gt.placement("cpu", ranks=[2, 3])
    torch.manual_seed(0)
    ref0, ref1 = Stage0(), Stage1()
    stage0, stage1 = Stage0(), Stage1()
    stage0.load_state_dict(ref0.state_dict())
    stage1.load_state_dict(ref1.state_dict())
    gt.nn.to_global(stage0, P01, B)       # data parallel: the Linear is broadcast
    gt.nn.to_global(stage1, P23, S(0))    # model parallel: weight (out, in) and bias split
                                          # on the output dim -> output split(1)
    params = list(stage0.parameters()) + list(stage1.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    ref_opt = torch.optim.SGD(list(ref0.parameters()) + list(ref1.parameters()), lr=lr)

    g = torch.Generator().manual_seed(1)
    xb, yb = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)  # one batch
    x = gt.tensor(xb, placement=P01, sbp=S(0))             # batch split over [0, 1]
    target = gt.tensor(yb, placement=P23, sbp=B)
    losses = []
    for step in range(steps):
        h = stage0(x)                                      # split(0) on [0, 1]
        h1 = h.to_global(placement=P23, sbp=B)             # to stage 1, broadcast
        y = stage1(h1)                                     # split(1) on [2, 3]
        loss = F.mse_loss(y, target)
        if step == 0:
            show("x", x)
            show("h", h)
            show("h1", h1)
            show("W1", stage1.fc.weight)
            show("y", y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            layouts = [(p.grad.placement, p.grad.sbp) for p in params]
            if layouts != [(p.placement, p.sbp) for p in params]:
                raise AssertionError(f"gradient layouts {layouts} differ from the params'")
        opt.step()

        ref_loss = F.mse_loss(ref1(ref0(xb)), yb)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        close(loss.full(), ref_loss.detach(), f"hybrid loss at step {step}")
        losses.append(loss.full().item())
        say(f"   step {step}: loss {loss.full().item():.4f} (plain torch {ref_loss.item():.4f})")
    for name, p, ref in (("stage0.fc.weight", stage0.fc.weight, ref0.fc.weight),
                         ("stage0.fc.bias", stage0.fc.bias, ref0.fc.bias),
                         ("stage1.fc.weight", stage1.fc.weight, ref1.fc.weight),
                         ("stage1.fc.bias", stage1.fc.bias, ref1.fc.bias)):
        close(p.full().detach(), ref.detach(), f"hybrid {name} after {steps} steps")
    if steps > 1 and not losses[-1] < losses[0]:
        raise AssertionError(f"hybrid loss did not decrease: {losses}")
    say(f"   after {steps} SGD steps (loss {losses[0]:.4f} -> {losses[-1]:.4f}) "
        "every parameter equals the plain-torch one")


class GuideStage0(torch.nn.Module):
    """The guide's Stage0Module: flatten a 28x28 image, Linear(784, 512), ReLU."""

    def __init__(self):
        super().__init__()
        self.flatten = torch.nn.Flatten()
        self.linear0 = torch.nn.Linear(28 * 28, 512)
        self.relu0 = torch.nn.ReLU()

    def forward(self, x):
        return self.relu0(self.linear0(self.flatten(x)))


class GuideStage1(torch.nn.Module):
    """The guide's Stage1Module: Linear(512, 512), ReLU, Linear(512, 10), ReLU."""

    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(512, 512)
        self.relu1 = torch.nn.ReLU()
        self.linear2 = torch.nn.Linear(512, 10)
        self.relu2 = torch.nn.ReLU()

    def forward(self, x):
        return self.relu2(self.linear2(self.relu1(self.linear1(x))))


def pipelined_training(steps, lr):
    say("5. pipelined training: the guide's PipelineGraph (set_stage, gradient accumulation "
        "of 2) as gt.pipeline.Pipeline")
    P0 = gt.placement("cpu", ranks=[0])
    P1 = gt.placement("cpu", ranks=[1])
    torch.manual_seed(0)
    ref0, ref1 = GuideStage0(), GuideStage1()
    stage0, stage1 = GuideStage0(), GuideStage1()
    stage0.load_state_dict(ref0.state_dict())
    stage1.load_state_dict(ref1.state_dict())
    gt.nn.to_global(stage0, P0, B)   # OneFlow: m_stage0.to_global(P0, BROADCAST); set_stage(0, P0)
    gt.nn.to_global(stage1, P1, B)   # OneFlow: m_stage1.to_global(P1, BROADCAST); set_stage(1, P1)
    # OneFlow: config.set_gradient_accumulation_steps(2) -> 2 micro-batches per step
    pipe = gt.pipeline.Pipeline([stage0, stage1], micro_batches=2, schedule="1f1b",
                                loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(list(stage0.parameters()) + list(stage1.parameters()), lr=lr)
    ref_opt = torch.optim.SGD(list(ref0.parameters()) + list(ref1.parameters()), lr=lr)
    g = torch.Generator().manual_seed(2)
    xb, yb = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    x = gt.tensor(xb, placement=P0, sbp=B)   # the batch lives on stage 0's rank
    y = gt.tensor(yb, placement=P1, sbp=B)   # the labels on stage 1's rank
    for step in range(steps):
        loss = pipe.step(x, y)               # OneFlow: loss = graph_pipeline(x, y)
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref1(ref0(xb)), yb)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        close(loss.full(), ref_loss.detach(), f"pipelined loss at step {step}")
        say(f"   step {step}: loss {loss.full().item():.4f} (plain torch, whole batch "
            f"{ref_loss.item():.4f})")
    for (name, p), ref in zip(list(stage0.named_parameters()) + list(stage1.named_parameters()),
                              list(ref0.parameters()) + list(ref1.parameters())):
        close(p.full().detach(), ref.detach(), f"pipelined {name} after {steps} steps")
    say(f"   after {steps} SGD steps every parameter equals plain torch on the whole batch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="SGD steps of parts 4 and 5")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    world = gt.get_world_size()
    if world < 2:
        raise SystemExit("run with --nproc_per_node 2 or more (4 for the hybrid part)")
    gt.manual_seed(0)
    P = gt.placement.all("cpu")
    say(f"world of {world} ranks, P = {P}")
    data_parallel(P)
    model_parallel(P)
    pipeline()
    if world >= 4:
        hybrid(args.steps, args.lr)
    else:
        say("4. hybrid: skipped, it needs 4 ranks (run with --nproc_per_node 4)")
    pipelined_training(args.steps, args.lr)
    say(f"all parts match the single-process values ({world} ranks)")


if __name__ == "__main__":
    main()
