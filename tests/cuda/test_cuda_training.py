"""Training on cuda placements equals plain torch on one GPU, a few steps each: data
parallel, Megatron tensor parallel, ``fully_shard`` with bf16 parameters and with a
bf16 compute policy (to a bf16 tolerance), a 1F1B pipeline of two stages; and bf16
autocast around a global forward (and backward) equals plain autocast."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from cuda_suite import DEVICE, local_device, place, seeded, world_checks

# tests/nn/test_training.py's model (embedding, pre-norm MLP with a residual, head)
from nn.test_training import BATCH, STEPS, VOCAB, Block

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
BF16 = torch.bfloat16

# Megatron: column-parallel fc1, row-parallel fc2, vocab-parallel embedding and head
MEGATRON = {"emb.weight": S(0), "fc1.weight": S(0), "fc1.bias": S(0), "fc2.weight": S(1),
            "head.weight": S(0), "head.bias": S(0)}


def _batches():
    g = seeded(7)
    return [(torch.randint(0, VOCAB, (BATCH,), generator=g),
             torch.randint(0, VOCAB, (BATCH,), generator=g)) for _ in range(STEPS)]


def _assert_same_parameters(model, reference, what, rtol=1e-4, atol=1e-5):
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert got.is_global and tuple(got.shape) == tuple(want.shape), (what, name)
        assert got.to_local().device == local_device() or got.to_local().numel() == 0, \
            (what, name, got.to_local().device)
        torch.testing.assert_close(got.full().detach().float(), want.detach().float(),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{what}: {name}: {m}")


def _train_block(param_sbp, data_sbp, make_optimizer, what):
    """The block trained globally on the 2 ranks' placement and in plain torch on this
    rank's device, side by side; losses and parameters must agree."""
    dev, p = local_device(), place([0, 1])
    torch.manual_seed(0)
    reference = Block().to(dev)
    model = gt.nn.to_global(copy.deepcopy(reference), p, param_sbp)
    intended = {n: t.sbp for n, t in model.named_parameters()}
    opt, ref_opt = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    for tokens, target in _batches():
        loss = F.cross_entropy(model(gt.tensor(tokens, placement=p, sbp=data_sbp)),
                               gt.tensor(target, placement=p, sbp=data_sbp))
        ref_loss = F.cross_entropy(reference(tokens.to(dev)), target.to(dev))
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l.backward()
            o.step()
        assert loss.to_local().device == dev
        torch.testing.assert_close(loss.full().detach(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for n, t in model.named_parameters():
        assert t.sbp == intended[n], f"{what}: {n} changed layout to {t.sbp}"
    _assert_same_parameters(model, reference, what)


def check_data_parallel():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)       # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=0.05)                   # noqa: E731
    _train_block(B, S(0), sgd, "data parallel, SGD")
    _train_block(B, S(0), adam, "data parallel, Adam")


def check_megatron_tensor_parallel():
    adam = lambda ps: torch.optim.Adam(ps, lr=0.05)                   # noqa: E731
    _train_block(lambda name, t: MEGATRON.get(name, B), B, adam, "Megatron tensor parallel")
    # and with the batch split too (activations move between S(0) and the model's layout)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)       # noqa: E731
    _train_block(lambda name, t: MEGATRON.get(name, B), S(0), sgd,
                 "Megatron tensor parallel, batch split")


# --- fully_shard in bf16 ---------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 7))   # 7 rows: uneven parts


def _mlp_data(rows=8):
    g = seeded(1)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 7, (rows,), generator=g)


SGD_BF16 = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
# bf16 has 8 bits of mantissa (relative step 2**-8 = 0.4 %): the whole batch on one
# device and half batches on two round differently; SGD (not Adam, whose normalisation
# would turn a rounding difference of a near-zero gradient into a whole step) keeps the
# parameters within a few bf16 steps of each other
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def check_fully_shard_bf16_parameters():
    # the parameters themselves bf16: stored split(0) in bf16, gathered, gradients
    # reduce-scattered in bf16; plain torch trains the same bf16 model on the whole batch
    dev, p = local_device(), place([0, 1])
    reference = _mlp().to(dev, BF16)
    model = gt.nn.fully_shard(copy.deepcopy(reference), p)
    for name, t in model.named_parameters():
        assert t.dtype == BF16 and t.sbp == (S(0),), (name, t.dtype, t.sbp)
        assert t.to_local().device == dev or t.to_local().numel() == 0, name
    x, y = _mlp_data()
    opt, ref_opt = SGD_BF16(model.parameters()), SGD_BF16(reference.parameters())
    xg, yg = gt.tensor(x.to(BF16), placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0))
    for _ in range(STEPS):
        loss = F.cross_entropy(model(xg).float(), yg)
        ref_loss = F.cross_entropy(reference(x.to(dev, BF16)).float(), y.to(dev))
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l.backward()
            o.step()
        torch.testing.assert_close(loss.full().detach(), ref_loss.detach(), **BF16_TOL)
    for name, t in model.named_parameters():
        assert t.grad.dtype == BF16 and t.grad.sbp == (S(0),), (name, t.grad.dtype, t.grad.sbp)
    _assert_same_parameters(model, reference, "fully_shard, bf16 parameters", **BF16_TOL)


def check_fully_shard_bf16_compute_policy():
    # fp32 masters, gathered in bf16 for compute, gradients reduced in fp32 (FSDP2's
    # MixedPrecisionPolicy); plain torch: a bf16 copy of fp32 masters computes the whole
    # batch, its gradients step the masters
    dev, p = local_device(), place([0, 1])
    master = _mlp().to(dev)
    model = gt.nn.fully_shard(copy.deepcopy(master), p, param_dtype=BF16,
                              reduce_dtype=torch.float32)
    seen = []
    model[3].register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, out.dtype)),
                                   prepend=True)
    x, y = _mlp_data()
    opt, ref_opt = SGD_BF16(model.parameters()), SGD_BF16(master.parameters())
    xg, yg = gt.tensor(x, placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0))
    for _ in range(STEPS):
        loss = F.cross_entropy(model(xg).float(), yg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        compute = copy.deepcopy(master).to(BF16)
        ref_loss = F.cross_entropy(compute(x.to(dev, BF16)).float(), y.to(dev))
        ref_loss.backward()
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad = c.grad.float()
        ref_opt.step()
        torch.testing.assert_close(loss.full().detach(), ref_loss.detach(), **BF16_TOL)
    assert seen[0] == (BF16, BF16), seen   # the gathered weight computes in bf16
    for name, t in model.named_parameters():   # masters and gradients: fp32 parts
        assert t.dtype == t.grad.dtype == torch.float32, (name, t.dtype, t.grad.dtype)
        assert t.sbp == t.grad.sbp == (S(0),), name
    _assert_same_parameters(model, master, "fully_shard, bf16 compute", **BF16_TOL)


# --- a 1F1B pipeline ---------------------------------------------------------------------

def check_pipeline_1f1b_two_stages():
    dev = local_device()
    P0, P1 = place([0]), place([1])
    torch.manual_seed(0)
    widths = (6, 16, 16, 3)
    mods = []
    for a, b in zip(widths, widths[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    mods = mods[:-1]
    reference = torch.nn.Sequential(*copy.deepcopy(mods)).to(dev)
    s0 = gt.nn.to_global(torch.nn.Sequential(*mods[:3]), P0, B)
    s1 = gt.nn.to_global(torch.nn.Sequential(*mods[3:]), P1, B)
    pipe = gt.pipeline.Pipeline([s0, s1], micro_batches=4, schedule="1f1b",
                                loss_fn=F.cross_entropy)
    params = list(s0.parameters()) + list(s1.parameters())
    opt = torch.optim.Adam(params, lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    g = seeded(1)
    for _ in range(STEPS):
        x, y = torch.randn(10, widths[0], generator=g), torch.randint(0, 3, (10,), generator=g)
        loss = pipe.step(gt.tensor(x, placement=P0, sbp=B), gt.tensor(y, placement=P1, sbp=B))
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x.to(dev)), y.to(dev))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.to_local().device == dev
        torch.testing.assert_close(loss.to_local().detach(), ref_loss.detach(),
                                   rtol=1e-5, atol=1e-5)
    for got, want in zip(params, reference.parameters()):
        torch.testing.assert_close(got.full().detach(), want.detach(), rtol=1e-5, atol=1e-5)
    out = pipe(gt.tensor(x, placement=P0, sbp=B))     # forward only
    torch.testing.assert_close(out.full(), reference(x.to(dev)).detach(), rtol=1e-5, atol=1e-5)


# --- bf16 autocast ----------------------------------------------------------------------

def _autocast_equals_plain(param_sbp, data_sbp, what):
    dev, p = local_device(), place([0, 1])
    torch.manual_seed(0)
    reference = Block().to(dev)
    model = gt.nn.to_global(copy.deepcopy(reference), p, param_sbp)
    tokens, target = _batches()[0]
    with torch.autocast(DEVICE, BF16):
        logits = model(gt.tensor(tokens, placement=p, sbp=data_sbp))
        want = reference(tokens.to(dev))
        loss = F.cross_entropy(logits, gt.tensor(target, placement=p, sbp=data_sbp))
        ref_loss = F.cross_entropy(want, target.to(dev))
    assert logits.dtype == want.dtype == BF16, (what, logits.dtype, want.dtype)
    assert logits.to_local().dtype == BF16 and logits.to_local().device == dev, what
    assert loss.dtype == ref_loss.dtype == torch.float32, (what, loss.dtype, ref_loss.dtype)
    # the local parts compute the same bf16 products (split rows or columns of them)
    torch.testing.assert_close(logits.full().detach(), want.detach(), rtol=1.6e-2, atol=1e-2,
                               msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(loss.full().detach(), ref_loss.detach(), rtol=1.6e-2, atol=1e-2)
    loss.backward()
    ref_loss.backward()
    for (name, got), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert got.grad.dtype == torch.float32 and got.grad.sbp == got.sbp, (what, name)
        torch.testing.assert_close(got.grad.full(), ref.grad, rtol=5e-2, atol=2e-3,
                                   msg=lambda m: f"{what}: gradient of {name}: {m}")


def check_bf16_autocast_around_a_global_forward():
    _autocast_equals_plain(B, S(0), "data parallel under autocast")
    _autocast_equals_plain(lambda name, t: MEGATRON.get(name, B), B,
                           "Megatron tensor parallel under autocast")


test_training_world2 = world_checks(
    __name__, 2, ["check_data_parallel", "check_megatron_tensor_parallel",
                  "check_fully_shard_bf16_parameters", "check_fully_shard_bf16_compute_policy",
                  "check_pipeline_1f1b_two_stages", "check_bf16_autocast_around_a_global_forward"])
