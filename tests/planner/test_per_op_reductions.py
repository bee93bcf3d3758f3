"""Choosing op by op (the steps before a plan, inference, ``generate()``), a reduction
keeps the layout of the stream it joins: a row-parallel projection's partial output
added to a broadcast residual is all-reduced once (Megatron's collective), not
reduce-scattered and gathered again by each reader (so too a norm's variance over a
split dim); and a plan recorded from such steps still reduces a gradient that arrives
in its parameter's layout with the others, in the bucket."""
from mp import checks_in_worlds
from test_step_plans import B, C, T, _fresh, _megatron


def check_a_megatron_block_op_by_op_all_reduces_once_per_projection():
    """The first step of Megatron's block (q/k/v/fc1 split(0), proj/fc2 split(1)),
    op by op: the forward all-reduces the two row-parallel outputs at the residual adds
    and sends nothing else; the backward gathers nothing (it reduce-scattered the
    residual's gradient at each add and gathered it again at each layer norm). Values
    and gradients equal one process."""
    import torch

    P, plain, model = _fresh()
    data = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1))
    forward, backward = step_counted(model, plain, data, P)
    assert dict(forward.calls) == {"all_reduce": 2}, forward
    assert backward.calls["all_gather"] == 0, backward


def step_counted(model, plain, data, P) -> tuple:
    """The global ``model``'s forward and backward (of its output's mean square) on
    ``data`` broadcast, and ``plain``'s: values and gradients checked equal; what the
    forward and the backward sent (``CommCounter`` each)."""
    import torch

    import globaltensor as gt
    x = gt.to_global(data, P, gt.sbp.broadcast)
    with gt.debug.comm_stats() as forward:
        y = model(x)
    with gt.debug.comm_stats() as backward:
        y.square().mean().backward()
    want = plain(data)
    want.square().mean().backward()
    torch.testing.assert_close(y.full(), want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return forward, backward


def _rms_mlp_net():
    """An untied embedding, then two blocks ``x + fc2(gelu(fc1(rms_norm(x))))`` with a
    norm of pointwise ops, as Llama's (its weight's gradient is a partial sum where its
    output's gradient is: the column-parallel fc1's input gradient)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.Parameter(torch.ones(C))
            self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            h = self.norm * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return x + self.fc2(F.gelu(self.fc1(h)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(32, C)
            self.h = nn.ModuleList(Block() for _ in range(2))

        def forward(self, idx):
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return x.square().mean()

    torch.manual_seed(3)
    return Net()


def check_a_plan_from_such_steps_buckets_a_gradient_that_arrived_whole():
    """Op by op the embedding's gradient arrives broadcast (its input's gradient was
    all-reduced at the last residual add), so no reduction of it was seen. The plan
    still prices reducing it in the bucket with the norms' partial gradients, and leaves
    the embedding's input gradient partial: the planned step all-reduces Megatron's
    two forward and one backward activations, and one bucket. (It priced a partial
    gradient there as a boxing of its own, and the optimizer's read of it as another,
    and kept the all-reduce at the last add: one collective more.)"""
    import copy

    import torch

    import globaltensor as gt
    from globaltensor.planner import record as step
    step.clear()
    plain = _rms_mlp_net()
    P = gt.placement.all("cpu")
    model = gt.nn.to_global(copy.deepcopy(plain), P, _megatron)
    idx = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(4))
    gidx = gt.to_global(idx, P, gt.sbp.broadcast)
    opt, ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    for _ in range(step.RECORD_AT + 2):
        with gt.debug.comm_stats() as stats:
            loss = model(gidx)
            loss.backward()
        opt.step()
        opt.zero_grad()
        want = plain(idx)
        want.backward()
        ref.step()
        ref.zero_grad()
        torch.testing.assert_close(loss.full(), want.detach(), rtol=1e-5, atol=1e-6)
    assert step.state.last is not None
    assert set(stats.calls) == {"all_reduce"} and stats.calls["all_reduce"] <= 4, stats
    step.clear()


def _norms_of_split_values():
    """Olmo 2's block: norms of the whole query and key projections (their outputs
    column-split: the variance sums over the split dim), and post-norms (the norm of
    the row-parallel output, partial, before its residual add)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.proj = (nn.Linear(C, C) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.q_norm, self.k_norm, self.post_attn, self.post_mlp = (
                nn.Parameter(torch.rand(C) + 0.5) for _ in range(4))

        def forward(self, x):
            q, k = rms(self.q(x), self.q_norm), rms(self.k(x), self.k_norm)
            q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, self.v(x)))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + rms(self.proj(y.transpose(1, 2).reshape(B, T, C)), self.post_attn)
            return x + rms(self.fc2(F.gelu(self.fc1(x))), self.post_mlp)

    torch.manual_seed(5)
    return Block()


def check_norms_of_split_values_op_by_op_all_reduce():
    """Olmo 2's block op by op, Megatron's layout: the query and key norms' variances
    (partial sums over the split dim) and the post-norms' inputs (row-parallel outputs)
    are all-reduced, and nothing else is sent in the forward. Reduce-scattering them,
    cheapest priced alone, left each for an all-gather by the next reader (the norm's
    product with the split projection, the next layer): 8 all-to-alls (gloo's
    reduce-scatter) and 8 all-gathers in a 2-layer Olmo 2's first forward."""
    import copy

    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    plain = _norms_of_split_values()
    model = gt.nn.to_global(copy.deepcopy(plain), P, _megatron)
    data = torch.randn(B, T, C, generator=torch.Generator().manual_seed(6))
    forward, _ = step_counted(model, plain, data, P)
    # 2 variances, and each post-norm's input twice: its pow reads it whole, and the
    # (partial) normed value is reduced again at the residual add (Megatron: once)
    assert dict(forward.calls) == {"all_reduce": 6}, forward


CHECKS = ["check_a_megatron_block_op_by_op_all_reduces_once_per_projection",
          "check_norms_of_split_values_op_by_op_all_reduce",
          "check_a_plan_from_such_steps_buckets_a_gradient_that_arrived_whole"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
