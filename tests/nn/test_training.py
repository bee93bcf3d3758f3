"""Training equivalence: a small transformer-style block trained under several sbp
layouts ends with the same parameters as single-process torch."""
import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt

VOCAB, DIM, HIDDEN, BATCH, STEPS = 11, 8, 12, 6, 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.ln = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return self.head(h)


def _data():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH,), generator=g),
             torch.randint(0, VOCAB, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(model, batches, make_optimizer, wrap=lambda t: t):
    opt = make_optimizer(model.parameters())
    for tokens, target in batches:
        loss = F.cross_entropy(model(wrap(tokens)), wrap(target))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


# Megatron-style tensor parallelism: column-parallel fc1, row-parallel fc2, vocab-parallel
# embedding and head (the loss never gathers the logits).
TENSOR_PARALLEL = {"emb.weight": gt.sbp.split(0), "fc1.weight": gt.sbp.split(0),
                   "fc1.bias": gt.sbp.split(0), "fc2.weight": gt.sbp.split(1),
                   "head.weight": gt.sbp.split(0), "head.bias": gt.sbp.split(0)}


def _check_layout(name, placement, param_sbp, data_sbp, optimizer):
    torch.manual_seed(0)
    reference = Block()
    model = Block()
    model.load_state_dict(reference.state_dict())
    gt.nn.to_global(model, placement, param_sbp)
    intended = {n: p.sbp for n, p in model.named_parameters()}
    batches = _data()
    _train(reference, batches, optimizer)
    _train(model, batches, optimizer,
           wrap=lambda t: gt.tensor(t, placement=placement, sbp=data_sbp))
    for (n, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.sbp == intended[n], f"{name}: {n} changed layout to {p.sbp}"
        torch.testing.assert_close(p.full().detach(), ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=f"{name}: parameter {n} differs")


SGD = lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9)  # noqa: E731
ADAM = lambda params: torch.optim.Adam(params, lr=0.05)  # noqa: E731


def check_data_parallel():
    p = gt.placement.all("cpu")
    _check_layout("data parallel", p, gt.sbp.broadcast, gt.sbp.split(0), SGD)
    _check_layout("data parallel adam", p, gt.sbp.broadcast, gt.sbp.split(0), ADAM)


def check_tensor_parallel():
    p = gt.placement.all("cpu")
    sbp = lambda name, t: TENSOR_PARALLEL.get(name, gt.sbp.broadcast)  # noqa: E731
    _check_layout("tensor parallel", p, sbp, gt.sbp.broadcast, SGD)
    _check_layout("tensor parallel adam", p, sbp, gt.sbp.broadcast, ADAM)


def check_vocab_parallel_loss_does_not_gather_logits():
    p = gt.placement.all("cpu")
    rows, classes = 4, 1000
    logits = gt.randn(rows, classes, placement=p, sbp=gt.sbp.split(1), requires_grad=True)
    target = gt.tensor(torch.arange(rows) * 7, placement=p, sbp=gt.sbp.broadcast)
    with gt.debug.comm_stats() as stats:
        loss = F.cross_entropy(logits, target)
        loss.backward()
    # Row maxima, row sums and the loss move; the logits (16 kB) never do.
    assert stats.total_bytes < rows * classes * 4 / 4, stats
    torch.testing.assert_close(loss.full(), F.cross_entropy(logits.full(), target.full()))
    assert logits.grad.sbp == (gt.sbp.split(1),)


def check_op_without_rule_falls_back():
    import warnings
    p = gt.placement.all("cpu")
    value = torch.arange(15.0).reshape(5, 3)
    x = gt.tensor(value, placement=p, sbp=gt.sbp.split(0), requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.linalg.cross(x, x.flip(1))  # no rule: gathered to broadcast, correct anyway
        torch.linalg.cross(x, x.flip(1))
    named = [w for w in caught if "linalg_cross" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]  # once per op
    assert y.sbp == (gt.sbp.broadcast,)
    torch.testing.assert_close(y.full(), torch.linalg.cross(value, value.flip(1)))
    (y * y).sum().backward()
    reference = value.clone().requires_grad_()
    (torch.linalg.cross(reference, reference.flip(1)) ** 2).sum().backward()
    assert x.grad.sbp == x.sbp
    torch.testing.assert_close(x.grad.full(), reference.grad)


def check_strides_follow_torch():
    # Global strides come from the global metadata (the same on every rank, even where
    # local parts differ in shape), so autograd takes the same path as plain torch.
    p = gt.placement.all("cpu")
    value = torch.arange(15.0).reshape(5, 3)
    views = [lambda t: t.t(), lambda t: t.t().contiguous(),
             lambda t: t.unsqueeze(0).transpose(0, 2), lambda t: t[:, 1:], lambda t: t.t() @ t,
             lambda t: t.t().clone()]
    for sbp in (gt.sbp.split(0), gt.sbp.split(1), gt.sbp.broadcast):
        x = gt.tensor(value, placement=p, sbp=sbp)
        for k, view in enumerate(views):
            y, want = view(x), view(value)
            assert y.stride() == want.stride(), (sbp, k, y.stride(), want.stride())
            torch.testing.assert_close(y.full(), want)
    # mm's backward then gives a transposed weight's gradient in the weight's memory
    # order: no strided copy when it is bucketed for the all-reduce.
    torch.manual_seed(0)
    reference, model = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    model.load_state_dict(reference.state_dict())
    gt.nn.to_global(model, p, gt.sbp.broadcast)
    model(gt.tensor(value, placement=p, sbp=gt.sbp.split(0))).sum().backward()
    reference(value).sum().backward()
    assert model.weight.grad.to_local().is_contiguous()
    torch.testing.assert_close(model.weight.grad.full(), reference.weight.grad)


def check_load_state_dict_after_to_global():
    # A full, plain state dict loads into a global module: each rank copies its part.
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    reference = Block()
    torch.manual_seed(1)
    model = gt.nn.to_global(Block(), p, lambda name, t: TENSOR_PARALLEL.get(name, gt.sbp.broadcast))
    with gt.debug.comm_stats() as stats:
        model.load_state_dict(reference.state_dict())
    assert stats.total_bytes == 0, stats
    for (n, q), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert q.sbp == (TENSOR_PARALLEL.get(n, gt.sbp.broadcast),), n
        assert torch.equal(q.full().detach(), ref.detach()), n
    try:
        model.fc1.weight.data.copy_(torch.ones(3, 3))
    except ValueError as e:
        assert "does not broadcast" in str(e), e
    else:
        raise AssertionError("copy_ from a plain tensor of the wrong shape did not raise")


def check_hybrid_2d():
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])  # axis 0: data, axis 1: tensor
    sbp = lambda name, t: (gt.sbp.broadcast, TENSOR_PARALLEL.get(name, gt.sbp.broadcast))  # noqa
    _check_layout("2-D hybrid", mesh, sbp, (gt.sbp.split(0), gt.sbp.broadcast), SGD)


def check_gradient_accumulation_with_no_sync():
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    reference, model = Block(), Block()
    model.load_state_dict(reference.state_dict())
    gt.nn.to_global(model, p, gt.sbp.broadcast)
    (t1, y1), (t2, y2), _ = _data()
    wrap = lambda t: gt.tensor(t, placement=p, sbp=gt.sbp.split(0))  # noqa: E731
    with gt.debug.comm_stats() as stats:
        with gt.no_sync():
            F.cross_entropy(model(wrap(t1)), wrap(y1)).backward()
    assert stats.calls["all_reduce"] == 0 or stats.bytes["all_reduce"] < 64, stats
    assert model.fc1.weight.grad.sbp == (gt.sbp.partial_sum,)  # kept local, unreduced
    F.cross_entropy(model(wrap(t2)), wrap(y2)).backward()
    F.cross_entropy(reference(t1), y1).backward()
    F.cross_entropy(reference(t2), y2).backward()
    for (n, p_), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p_.grad.sbp == p_.sbp, n
        torch.testing.assert_close(p_.grad.full(), ref.grad, rtol=1e-5, atol=1e-6, msg=n)
    # gradients kept (zeroed, not None): accumulating into them stays local too
    model.zero_grad(set_to_none=False)
    reference.zero_grad(set_to_none=False)
    with gt.debug.comm_stats() as stats:
        with gt.no_sync():
            F.cross_entropy(model(wrap(t1)), wrap(y1)).backward()
            F.cross_entropy(model(wrap(t2)), wrap(y2)).backward()
    assert stats.calls["all_reduce"] == 0 or stats.bytes["all_reduce"] < 128, stats  # losses
    F.cross_entropy(model(wrap(t1)), wrap(y1)).backward()
    for t, y in ((t1, y1), (t2, y2), (t1, y1)):
        F.cross_entropy(reference(t), y).backward()
    for (n, p_), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert p_.grad.sbp == p_.sbp, n
        torch.testing.assert_close(p_.grad.full(), ref.grad, rtol=1e-5, atol=1e-6, msg=n)


def _bucket_buffers(model):
    """Weak references to the flat buffers gradient sync keeps for ``model``'s buckets."""
    from globaltensor import gradsync
    entries = [q.__dict__.get(gradsync._ENTRY) for q in model.parameters()]
    return [weakref.ref(flat) for entry in entries if entry is not None
            for flat, _ in entry.buffers.values()]


def _same_buffers(model, refs):
    return [r() for r in refs] == [r() for r in _bucket_buffers(model)]


def check_kept_gradients_stay():
    # A .grad the user took stays as it was, as in torch: the next backward after
    # zero_grad() (set_to_none) must not write into it. Gradient sync still reuses its
    # bucket's memory when no one holds the previous gradients.
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    model = gt.nn.to_global(Block(), p, gt.sbp.broadcast)  # every parameter: one bucket
    (t1, y1), (t2, y2), (t3, y3) = _data()
    wrap = lambda t: gt.tensor(t, placement=p, sbp=gt.sbp.split(0))  # noqa: E731
    step = lambda t, y: F.cross_entropy(model(wrap(t)), wrap(y)).backward()  # noqa: E731
    step(t1, y1)
    buffers = _bucket_buffers(model)
    assert len(buffers) == 1
    model.zero_grad()
    step(t2, y2)
    assert _same_buffers(model, buffers)  # nothing kept: reused
    kept = {n: q.grad for n, q in model.named_parameters()}
    kept_local = {n: g.to_local() for n, g in kept.items()}
    want = {n: (g.to_local().clone(), g.full().clone()) for n, g in kept.items()}
    model.zero_grad()
    step(t1, y1)
    assert any(not torch.equal(q.grad.full(), want[n][1]) for n, q in model.named_parameters())
    for n in kept:
        assert torch.equal(kept[n].to_local(), want[n][0]), n
        assert torch.equal(kept_local[n], want[n][0]), n
        assert torch.equal(kept[n].full(), want[n][1]), n
    # zero_grad(set_to_none=False) zeroes the same tensor in place, as torch does: a
    # reference to it sees the zeros and then the next gradient (with no_sync too)
    kept = {n: q.grad for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=False)
    assert all(not g.full().any() for g in kept.values())
    step(t3, y3)
    for n, q in model.named_parameters():
        assert torch.equal(kept[n].full(), q.grad.full()), n
    model.zero_grad(set_to_none=False)
    with gt.no_sync():
        step(t1, y1)
    step(t2, y2)
    for n, q in model.named_parameters():
        assert kept[n] is q.grad, n
        assert torch.equal(kept[n].full(), q.grad.full()), n



def check_clip_grad_norm_across_placements():
    # Two layers on two placements (no pipeline): clip_grad_norm_ over all of them gives
    # the whole model's norm on every rank, with one all-reduce besides the reduction of
    # the split gradients' statistics inside their placement, and clips every gradient.
    world = gt.get_world_size()
    first = gt.placement("cpu", list(range(world // 2)))
    second = gt.placement("cpu", list(range(world // 2, world)))
    rank = gt.get_rank()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                    torch.nn.Linear(6, 3))
    x = torch.randn(5, 4)
    for norm_type, foreach in ((2.0, None), (1.0, False), (math.inf, True), (3.0, None)):
        model = copy.deepcopy(reference)
        gt.nn.to_global(model[0], first, gt.sbp.split(0))
        gt.nn.to_global(model[2], second, gt.sbp.broadcast)
        h = torch.tanh(model[0](gt.tensor(x, placement=first, sbp=gt.sbp.broadcast)))
        model[2](h.to_global(second, gt.sbp.broadcast)).square().sum().backward()
        plain = copy.deepcopy(reference)
        plain(x).square().sum().backward()
        with gt.debug.comm_stats() as stats:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type,
                                                  foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type)
        assert norm.placement == gt.placement.all("cpu"), norm.placement
        assert abs(norm.item() - want.item()) <= 1e-5 * want.item(), (norm_type, norm, want)
        inside = 1 if rank in first and first.size > 1 else 0  # the split layer's reduction
        assert stats.calls["all_reduce"] == 1 + inside == stats.total_calls, (norm_type, stats)
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-7)
    if rank in second:  # an infinite gradient on one placement: every rank refuses
        model[2].bias.grad.local_part[0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, error_if_nonfinite=True)


class _Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.adapter = self.scale = None

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.adapter is not None:
            h = h + self.adapter(h) * self.scale * 2.0   # (scale * 2.0 made each step)
        return self.b(h)


def check_plain_parameters_added_after_to_global_train_alike():
    # A plain adapter and a one-element plain scale added to a global model (its own
    # layers frozen): their gradients come back plain, the sum over the ranks (they
    # were GlobalTensors, which AdamW's lerp_ refused to mix with its plain state), in
    # accumulation too, and every rank's copy trains to one process's.
    p = gt.placement.all("cpu")
    reference, model = _Adapted(), _Adapted()
    gt.nn.to_global(model, p, gt.sbp.broadcast)
    for m in (reference, model):
        for q in m.parameters():
            q.requires_grad_(False)
        torch.manual_seed(1)
        m.adapter, m.scale = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.tensor([0.5]))
    g, rows = torch.Generator().manual_seed(2), 2 * gt.get_world_size() + 1   # (uneven)
    x, y = torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)
    split = gt.sbp.split(0)
    losses = []
    for m, xs, ys in ((reference, x, y), (model, gt.tensor(x, placement=p, sbp=split),
                                          gt.tensor(y, placement=p, sbp=split))):
        trained = [m.adapter.weight, m.adapter.bias, m.scale]
        opt = torch.optim.AdamW(trained, lr=0.05)
        for _ in range(3):
            opt.zero_grad()
            for _ in range(2):   # two backward passes accumulate
                F.cross_entropy(m(xs), ys).backward()
            assert all(type(t.grad) is torch.Tensor for t in trained)
            opt.step()
        losses.append(float(F.cross_entropy(m(xs), ys)))
    for got, want in zip((model.adapter.weight, model.adapter.bias, model.scale),
                         (reference.adapter.weight, reference.adapter.bias, reference.scale)):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    assert abs(losses[0] - losses[1]) < 1e-5, losses


def check_assigning_data_keeps_layouts():
    # p.data = value (torch's vector_to_parameters, older init and EMA code) was
    # ignored: torch's setter changed the wrapper's shape and dtype, not its part. A
    # value of p's shape takes p's layout (plain: the whole value); training goes on
    # equal to one process's.
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    p, S, B = gt.placement.all("cpu"), gt.sbp.split, gt.sbp.broadcast
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    sbps = {"0.weight": S(0), "2.weight": S(1)}
    gt.nn.to_global(model, p, lambda name, t: sbps.get(name, B))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    for m, xs, ys in ((model, gt.tensor(x, placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0))),
                      (reference, x, y)):
        vector_to_parameters(parameters_to_vector(m.parameters()) * 2, m.parameters())
        m[0].weight.data = m[0].weight.data * 0.5
        m[2].bias.data = torch.tensor([0.1, 0.2, 0.3])
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            opt.step()
    assert [q.sbp for q in model.parameters()] == [(S(0),), (B,), (S(1),), (B,)]
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.full(), want.detach())
    with pytest.raises(TypeError, match="plain value of shape"):
        model[0].weight.data = torch.zeros(2, 2)


CHECKS = ["check_data_parallel", "check_tensor_parallel", "check_assigning_data_keeps_layouts",
          "check_plain_parameters_added_after_to_global_train_alike",
          "check_vocab_parallel_loss_does_not_gather_logits", "check_op_without_rule_falls_back",
          "check_gradient_accumulation_with_no_sync", "check_strides_follow_torch",
          "check_load_state_dict_after_to_global", "check_kept_gradients_stay",
          "check_clip_grad_norm_across_placements"]


# (warnings are the process's: a simulated rank's would reach another's catch)
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, ["check_hybrid_2d"],
                                            in_processes=["check_op_without_rule_falls_back"])
