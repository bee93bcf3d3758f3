"""gt.nn.MoE (issue #48 item 2): experts split(0) across ranks, tokens split(0), two
all-to-alls of data-dependent sizes there and back. In worlds of 2 and 4 the layer
equals the same layer on plain tensors in one process (1e-5, fp32): output, input,
router and expert gradients, dropped assignments and the load-balancing loss; a small
model trains alike with and without fully_shard on its non-expert parameters. Bad
configurations raise ValueError before any communication.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.comm import stats as comm_stats
from globaltensor.comm.stats import CommCounter

S, B = gt.sbp.split, gt.sbp.broadcast
TOL = dict(atol=1e-5, rtol=1e-5)
DIM, HIDDEN, EXPERTS = 8, 16, 4


def _line():
    return gt.placement("cpu", list(range(gt.get_world_size())))


def _close(got, want, what, tol=TOL):
    got = got.full() if isinstance(got, gt.GlobalTensor) else got
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


def _layer(capacity_factor=0.75):
    torch.manual_seed(3)
    return gt.nn.MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=capacity_factor)


def _one_layer_against_one_process(shape, layout, what, capacity_factor=0.75, x_sbp=S(0),
                                   autocast=False):
    P = _line()
    # (bf16 under autocast: each rank's bf16 sums of its rows against the whole batch's)
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else TOL
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    ref = _layer(capacity_factor)
    layer = copy.deepcopy(ref)
    gt.nn.to_global(layer, P, gt.nn.MoE.expert_sbp(layer) if layout == "expert" else B)
    assert layer.w1.sbp == ((S(0),) if layout == "expert" else (B,)), (what, layer.w1.sbp)
    gen = torch.Generator().manual_seed(5)
    x, grad = torch.randn(*shape, DIM, generator=gen), torch.randn(*shape, DIM, generator=gen)
    xr = x.clone().requires_grad_()
    with cast:
        want = ref(xr)
    ((want * grad).sum() + 0.3 * ref.aux_loss).backward()
    xg = gt.tensor(x, placement=P, sbp=x_sbp).requires_grad_()
    with gt.debug.comm_stats() as stats:
        with cast:
            got = layer(xg)
        ((got * gt.tensor(grad, placement=P, sbp=x_sbp)).sum() + 0.3 * layer.aux_loss).backward()
    assert got.dtype == want.dtype == x.dtype, (what, got.dtype, want.dtype)
    if P.shape[0] > 1:
        assert stats.calls["all_to_all"] >= 4, (what, stats)   # there, back; and in backward
        assert stats.calls["all_gather"] >= 1, (what, stats)   # the counts
    assert got.sbp == (x_sbp,) and got.shape == want.shape, (what, got.sbp, got.shape)
    assert ref.last_dropped > 0 or capacity_factor > 1, (what, "nothing dropped")
    assert layer.last_dropped == ref.last_dropped, (what, layer.last_dropped, ref.last_dropped)
    assert isinstance(layer.last_dropped, int)
    assert layer.aux_loss.sbp == (B,), (what, layer.aux_loss.sbp)
    _close(layer.aux_loss, ref.aux_loss.detach(), f"{what}: aux_loss", tol)
    _close(got, want.detach(), f"{what}: output", tol)
    _close(xg.grad, xr.grad, f"{what}: input gradient", tol)
    for name, p in layer.named_parameters():
        _close(p.grad, dict(ref.named_parameters())[name].grad, f"{what}: gradient of {name}", tol)
        assert p.grad.sbp == p.sbp, (what, name, p.grad.sbp, p.sbp)


def check_moe_forward_backward_equals_one_process():
    n = gt.get_world_size()
    _one_layer_against_one_process((2 * n + 1, 3), "expert", "batch x seq, uneven parts")
    _one_layer_against_one_process((4 * n,), "expert", "tokens x dim")
    _one_layer_against_one_process((n - 1, 2), "expert", "a rank without tokens")


def check_moe_other_layouts_equal_one_process():
    n = gt.get_world_size()
    _one_layer_against_one_process((3 * n,), "broadcast", "broadcast expert weights")
    _one_layer_against_one_process((3 * n,), "expert", "nothing dropped", capacity_factor=4.0)
    _one_layer_against_one_process((2, 3 * n), "expert", "input split(1)", x_sbp=S(1))
    # under autocast the experts compute in bf16 and the output stays in the input's
    # dtype (an index_add of bf16 rows into fp32 zeros raised before)
    _one_layer_against_one_process((3 * n,), "expert", "under autocast", capacity_factor=4.0,
                                   autocast=True)


class Tiny(torch.nn.Module):
    """A Linear before, the MoE, a Linear after."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inp = torch.nn.Linear(6, DIM)
        self.moe = gt.nn.MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=1.0)
        self.out = torch.nn.Linear(DIM, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(h + self.moe(h))


def _train(model, batches, P=None):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses, dropped = [], []
    for x, y in batches:
        if P is not None:
            x, y = (gt.tensor(t, placement=P, sbp=S(0)) for t in (x, y))
        loss = F.mse_loss(model(x), y) + 0.01 * model.moe.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        dropped.append(model.moe.last_dropped)
    return losses, dropped


def check_moe_training_equals_one_process():
    P, n = _line(), gt.get_world_size()
    gen = torch.Generator().manual_seed(11)
    batches = [(torch.randn(2 * n + 1, 6, generator=gen), torch.randn(2 * n + 1, 3,
                                                                       generator=gen))
               for _ in range(3)]
    plain = Tiny()
    want, want_dropped = _train(plain, batches)
    for how in ("expert parallel", "fully_shard around it", "fully_shard of everything"):
        model = Tiny()
        if how == "fully_shard of everything":   # experts ZeRO-3 too: gathered, sliced
            gt.nn.fully_shard(model, P)
            assert model.moe.w1.sbp == (S(0),)
            got, dropped = _train(model, batches, P)
            _same_training(how, plain, model, (got, dropped), (want, want_dropped))
            continue
        gt.nn.to_global(model, P, gt.nn.MoE.expert_sbp(model))
        if how == "fully_shard around it":     # ZeRO-3 for the non-expert parameters
            for part in (model.inp, model.out, model.moe.router):
                gt.nn.fully_shard(part, P)
            assert model.inp.weight.sbp == (S(0),) and model.moe.router.weight.sbp == (S(0),)
        assert model.moe.w1.sbp == (S(0),)
        _same_training(how, plain, model, _train(model, batches, P), (want, want_dropped))


def _same_training(how, plain, model, got, want):
    assert got[1] == want[1], (how, got[1], want[1])    # dropped, step by step
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), **TOL,
                               msg=lambda m: f"{how}: losses: {m}")
    whole = gt.nn.full_state_dict(model, ranks=range(gt.get_world_size()))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(whole[name], value, **TOL,
                                   msg=lambda m: f"{how}: {name}: {m}")


def check_moe_data_x_expert_on_a_2d_placement():
    """[[0, 1], [2, 3]]: tokens split over every rank, the experts split over the
    second axis and copied over the first (each copy takes its row's tokens); equal to
    one process, forward, gradients (the experts' summed over the rows) and 3 AdamW
    steps."""
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    ref = _layer()
    layer = copy.deepcopy(ref)
    gt.nn.to_global(layer, grid, gt.nn.MoE.expert_sbp(layer, placement=grid))
    assert layer.w1.sbp == (B, S(0)) and layer.router.weight.sbp == (B, B), (
        layer.w1.sbp, layer.router.weight.sbp)
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randn(13, DIM, generator=gen) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.02) for m in (ref, layer)]
    for step, x in enumerate(batches):
        want = ref(x)
        (want.square().sum() + 0.3 * ref.aux_loss).backward()
        stats = CommCounter(events=True)   # (with each collective's group)
        comm_stats.push(stats)
        try:
            got = layer(gt.tensor(x, placement=grid, sbp=(S(0), S(0))))
            (got.square().sum() + 0.3 * layer.aux_loss).backward()
        finally:
            comm_stats.pop(stats)
        # tokens meet their experts within a row of the grid: all-to-alls of 2 ranks
        assert stats.calls["all_to_all"] >= 2 and all(
            len(g) == 2 for k, _, g, _ in stats.events if k == "all_to_all"), stats
        assert layer.last_dropped == ref.last_dropped, (step, layer.last_dropped)
        _close(got, want.detach(), f"step {step}: output")
        for name, p in layer.named_parameters():
            _close(p.grad, dict(ref.named_parameters())[name].grad,
                   f"step {step}: gradient of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, p in layer.named_parameters():
        _close(p, dict(ref.named_parameters())[name].detach(), f"after 3 steps: {name}")


CHECKS = ["check_moe_forward_backward_equals_one_process",
          "check_moe_other_layouts_equal_one_process",
          "check_moe_training_equals_one_process"]
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, only_in_4=["check_moe_data_x_expert_on_a_2d_placement"])


def test_moe_bad_configuration_raises_before_any_communication():
    one = gt.placement("cpu", ranks=[0])
    with pytest.raises(ValueError, match="4 experts do not divide evenly over the 3 ranks"):
        gt.nn.MoE(DIM, HIDDEN, 4, placement=gt.placement("cpu", ranks=[0, 1, 2]))
    with pytest.raises(ValueError, match="top_k=5 is more than experts=4"):
        gt.nn.MoE(DIM, HIDDEN, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        gt.nn.MoE(DIM, HIDDEN, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="1-D placement .* or a 2-D one"):
        gt.nn.MoE(DIM, HIDDEN, 4, placement=gt.placement("cpu", ranks=[[[0]]]))
    layer = gt.nn.MoE(DIM, HIDDEN, 4)
    with pytest.raises(ValueError, match=r"need \(\.\.\., 8\)"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="is a GlobalTensor but the expert weights are not"):
        layer(gt.tensor(torch.randn(3, DIM), placement=one, sbp=S(0)))


def test_moe_plain_layer_routes_by_capacity_in_token_order():
    """One process: with capacity 1 per expert, each expert keeps its first token."""
    layer = gt.nn.MoE(DIM, HIDDEN, 4, top_k=1, capacity_factor=1.0)
    x = torch.randn(4, DIM)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = layer.router.weight[1, 1] = 100.0
        x[:, :2] = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 1.0], [1.0, 0.0]])
        # tokens 0, 1, 3 go to expert 0, token 2 to expert 1, each with probability ~1
        out = layer(x)
    assert layer.capacity(4) == 1
    assert layer.last_dropped == 2             # tokens 1 and 3 find expert 0 full
    assert out[1].abs().sum() == 0 and out[3].abs().sum() == 0
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    # f = P = (3/4, 1/4, 0, 0): aux = 4 * (9/16 + 1/16)
    torch.testing.assert_close(layer.aux_loss, torch.tensor(4 * (0.75 * 0.75 + 0.25 * 0.25)),
                               atol=1e-4, rtol=1e-4)
