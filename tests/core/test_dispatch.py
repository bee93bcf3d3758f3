"""Dispatch over long runs and in user programs: the decision cache stays bounded,
layouts the dispatcher picks keep annotated weights in place, plain operands under
``gt.implicit_broadcast()``, gradient buffers die with their model."""
from __future__ import annotations

import pytest
from mp import world_test


def check_cache_bounded_over_long_run():
    # AdamW's bias corrections and a scheduler's lr are new floats every step: keyed by
    # value they added one cache entry per parameter per step (864 -> 9384 in 2000 steps;
    # 200 steps show it: ~800 entries after step 20, well under the 4096-entry bound).
    import torch

    import globaltensor as gt
    from globaltensor.propagation import cache
    P = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    gt.nn.to_global(m, P, gt.sbp.broadcast)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999)
    x = gt.randn(4, 6, placement=P, sbp=gt.sbp.split(0))
    cache._cache.clear()     # earlier checks in this process filled it: no eviction here
    cache._by_value.clear()
    sizes = []
    for step in range(200):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        sizes.append(len(cache._cache) + len(cache._by_value))
    assert sizes[-1] == sizes[20], (sizes[20], sizes[-1])


def check_cache_and_layouts_bounded_over_many_shapes():
    import gc
    import importlib

    import globaltensor as gt
    layout = importlib.import_module("globaltensor.layout")   # gt.layout is the text form
    from globaltensor.propagation import cache
    P = gt.placement("cpu", [0, 1])
    saved = cache.CACHE_SIZE
    cache.CACHE_SIZE = 64
    try:
        w = gt.randn(8, 8, placement=P, sbp=gt.sbp.broadcast)
        for length in range(1, 301):  # every sequence length of a run
            x = gt.randn(length, 8, placement=P, sbp=gt.sbp.split(0))
            (x @ w).relu().sum()
        assert len(cache._cache) <= 64 and len(cache._by_value) <= 64
        # The plan caches are LRU caches of fixed size; beyond them (and the decisions
        # kept) nothing holds a layout: the intern table kept one per shape ever seen.
        from globaltensor import cost
        from globaltensor.boxing import plan
        from globaltensor.planner import record as step
        from globaltensor.planner import reuse
        step.clear()   # whole-step plans hold layouts too (at most step.MAX_PLANS),
        reuse.forget()   # as do the steps remembered (at most reuse.MAX_REMEMBERED)
        plan.clear_caches()
        cost._max_local_numel.cache_clear()
        gc.collect()
        assert len(layout._interned) < 300, len(layout._interned)
    finally:
        cache.CACHE_SIZE = saved


def check_gradient_buffers_die_with_their_model():
    """The flat buffers gradient sync keeps for a model's buckets are freed with the
    model, at once (no reference cycle through its parameters for the collector)."""
    import gc
    import weakref

    import torch

    import globaltensor as gt
    from globaltensor import gradsync
    P = gt.placement("cpu", [0, 1])
    x = gt.randn(4, 16, placement=P, sbp=gt.sbp.split(0))
    buffers = []
    gc.disable()
    try:
        for _ in range(5):
            m = gt.nn.to_global(torch.nn.Linear(16, 16), P, gt.sbp.broadcast)
            m(x).sum().backward()
            assert m.weight.grad.sbp == (gt.sbp.broadcast,)
            entries = [q.__dict__.get(gradsync._ENTRY) for q in m.parameters()]
            buffers += [weakref.ref(flat) for e in entries if e is not None
                        for flat, _ in e.buffers.values()]
        assert buffers
        del m, entries
        assert all(b() is None for b in buffers), [b() for b in buffers]
    finally:
        gc.enable()


def check_megatron_layout_keeps_weights_in_place():
    # docs/ops.md's recipe: annotate parameters only. The vocab-parallel embedding's
    # partial output reaches LayerNorm, then fc1 (column-split weight): the activation
    # must be gathered, not the weight (which would make the layer data parallel with
    # gathered weights, and reduce their gradients every step).
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import globaltensor as gt
    P, B, S = gt.placement("cpu", [0, 1]), gt.sbp.broadcast, gt.sbp.split
    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln = nn.Embedding(64, 16), nn.LayerNorm(16)
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    m = MLP()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    sbps = {"emb.weight": S(0), "fc1.weight": S(0), "fc1.bias": S(0), "fc2.weight": S(1)}
    gt.nn.to_global(m, P, lambda name, t: sbps.get(name, B))
    ids = torch.randint(0, 64, (64, 64))
    h = m.ln(m.emb(gt.tensor(ids, placement=P, sbp=B)))
    with gt.debug.comm_stats() as stats:
        a = m.fc1(h)
    assert a.sbp == (S(2),), a.sbp
    assert stats.bytes["all_to_all"] == 0, stats
    h_local = h.to_local()
    if h.sbp != (B,):  # the activation was gathered: its bytes, nothing else
        assert stats.bytes["all_gather"] == h_local.numel() * 4, (stats, h.sbp)
    out = m.fc2(F.gelu(a))
    plain = MLP()
    plain.load_state_dict(ref)
    want = plain.fc2(F.gelu(plain.fc1(plain.ln(plain.emb(ids)))))
    torch.testing.assert_close(out.full(), want, rtol=1e-5, atol=1e-5)


def check_implicit_broadcast_of_plain_operands():
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    P = gt.placement("cpu", [0, 1])
    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    emb = gt.tensor(table, placement=P, sbp=gt.sbp.split(0))
    pos = torch.arange(6)
    with pytest.raises(ValueError, match="implicit_broadcast"):
        F.embedding(pos, emb)
    with gt.implicit_broadcast():
        out = F.embedding(pos, emb)
        bias = emb + torch.ones(10, 4)
    torch.testing.assert_close(out.full(), F.embedding(pos, table))
    torch.testing.assert_close(bias.full(), table + 1)
    # a local part that requires grad is a view whose base does not: the same error
    # without the scope, and its gradient back to the GlobalTensor within it
    w = gt.ones(4, placement=P, sbp=gt.sbp.broadcast, requires_grad=True)
    part = (w * 2).to_local()
    with pytest.raises(ValueError, match="implicit_broadcast"):
        part + w
    with gt.implicit_broadcast():
        (part * w).sum().backward()
    torch.testing.assert_close(w.grad.full(), torch.full((4,), 4.0))
    differs = torch.full((10, 4), float(gt.get_rank()))
    with gt.implicit_broadcast(), gt.debug.check_consistency():
        with pytest.raises(gt.debug.DivergenceError, match="plain operand"):
            emb + differs


def check_addmm_partial_bias_on_rank_without_contracted_part():
    # k=1 over 2 ranks: rank 1 holds no column of a and no row of b. Its part of the
    # partial output is its bias addend plus an empty product, not zeros (the shortcut
    # for ranks holding an empty part took the output for the identity).
    import torch

    import globaltensor as gt
    P, S = gt.placement("cpu", [0, 1]), gt.sbp.split
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 1, generator=g), torch.randn(1, 4, generator=g)
    addends = [torch.randn(3, 4, generator=g) for _ in range(2)]
    bias = gt.from_local(addends[gt.get_rank()], placement=P, sbp=gt.sbp.partial_sum)
    ga, gb = gt.tensor(a, placement=P, sbp=S(1)), gt.tensor(b, placement=P, sbp=S(0))
    out = torch.addmm(bias, ga, gb)
    assert out.sbp == (gt.sbp.partial_sum,), out.sbp  # the case: no input was moved
    assert ga.to_local().shape[1] == 1 - gt.get_rank()
    torch.testing.assert_close(out.full(), addends[0] + addends[1] + a @ b)
    # Where no input part is held but the output's (partial), the identity still stands
    # in for kernels that refuse empty parts: a max over no element.
    t = torch.randn(2, 1, generator=g)
    torch.testing.assert_close(gt.tensor(t, placement=P, sbp=S(1)).amax(1).full(), t.amax(1))


def check_parts_round_trip_with_their_gradients():
    # A partial sum's part is one addend: computed on locally and declared partial again
    # (a linear map, as a user writes around a kernel of their own), the gradient of the
    # input is the map's adjoint of the output's gradient, not that times the ranks (the
    # part's gradient came back labelled partial: each rank's whole gradient counted).
    import torch

    import globaltensor as gt
    P = gt.placement("cpu", [0, 1])
    g = torch.Generator().manual_seed(0)
    addends, weight = [torch.randn(4, 3, generator=g) for _ in range(2)], torch.randn(4, 3, generator=g)
    x = gt.from_local(addends[gt.get_rank()], placement=P, sbp=gt.sbp.partial_sum).requires_grad_()
    y = gt.from_local(x.to_local() * 3, placement=P, sbp=gt.sbp.partial_sum)
    (y * gt.tensor(weight, placement=P, sbp=gt.sbp.broadcast)).sum().backward()
    torch.testing.assert_close(y.full(), 3 * (addends[0] + addends[1]))
    torch.testing.assert_close(x.grad.full(), 3 * weight)
    # On a rank outside the placement the part is empty, and what is made of it requires
    # grad there too (it did not: that rank's backward raised while the members' ran)
    one = gt.placement("cpu", [1])
    for shape in ((4, 3), None):
        x = gt.tensor(weight, placement=one, sbp=gt.sbp.broadcast).requires_grad_()
        y = gt.from_local(x.to_local() * 2, placement=one, sbp=gt.sbp.broadcast, shape=shape)
        assert y.requires_grad, (gt.get_rank(), shape)
        (y * gt.tensor(weight, placement=one, sbp=gt.sbp.broadcast)).sum().backward()
        torch.testing.assert_close(x.grad.full(), 2 * weight)
    # An explicit grad_sbp is kept: a broadcast weight used with each rank's own data
    w = gt.tensor(weight, placement=P, sbp=gt.sbp.broadcast).requires_grad_()
    (w.to_local(grad_sbp=gt.sbp.partial_sum) * (gt.get_rank() + 1)).sum().backward()
    torch.testing.assert_close(w.grad.full(), torch.full((4, 3), 3.0))


CHECKS = ["check_cache_bounded_over_long_run", "check_cache_and_layouts_bounded_over_many_shapes",
          "check_gradient_buffers_die_with_their_model",
          "check_megatron_layout_keeps_weights_in_place",
          "check_implicit_broadcast_of_plain_operands",
          "check_addmm_partial_bias_on_rank_without_contracted_part",
          "check_parts_round_trip_with_their_gradients"]


# (a model's buffers die with it: the process's garbage)
# (the first sizes caches the ranks of a simulated world would share)
test_world2 = world_test(__name__, 2, CHECKS, in_processes=[
    "check_cache_and_layouts_bounded_over_many_shapes", "check_gradient_buffers_die_with_their_model"])


def test_an_op_without_a_rule_warns_a_fallback_warning_once():
    """An op with no sbp rule gathers its inputs and warns ``gt.debug.FallbackWarning``
    (a class to filter on, not a text to match), once per op; the value is torch's."""
    import warnings

    import torch

    import globaltensor as gt
    from globaltensor.propagation import decide
    decide._warned.discard(torch.ops.aten.linalg_cross.default)
    plain = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    x = gt.tensor(plain, placement=gt.placement("cpu", [0]), sbp=gt.sbp.split(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            crossed = torch.linalg.cross(x, x)
    fallbacks = [w for w in caught if issubclass(w.category, gt.debug.FallbackWarning)]
    assert len(fallbacks) == 1 and "no sbp rule" in str(fallbacks[0].message), caught
    torch.testing.assert_close(crossed.full(), torch.linalg.cross(plain, plain))


def _pad_a_partial_sum():
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.from_local(torch.ones(2, 3), placement=p, sbp=gt.sbp.partial_sum)
    return [F.pad(x, (1, 1), value=v).full() for v in (0.0, 1.0, 0.0)]


def test_a_rule_that_reads_a_float_decides_again_for_another_value():
    # constant_pad_nd keeps a partial sum only for zero padding (its rule reads the
    # value): a decision made for 0.0 must not serve 1.0, where the partial is reduced
    # first (else each rank's addend would be padded with ones: 2.0 at the pads)
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    want = [F.pad(2 * torch.ones(2, 3), (1, 1), value=v) for v in (0.0, 1.0, 0.0)]
    for got in gt.testing.simulated_world(2)(_pad_a_partial_sum):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
