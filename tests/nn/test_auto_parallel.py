"""gt.nn.auto_parallel: a measured choice among data parallel, Megatron tensor parallel
and fully sharded layouts (and their hybrids on 2-D placements), under a memory budget;
plans edit, save, load and apply."""
from mp import world_test


def _mlp():
    import torch
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))
    return MLP()


def _inputs():
    import torch

    import globaltensor as gt
    torch.manual_seed(1)
    return gt.tensor(torch.randn(8, 16), placement=gt.placement.all("cpu"),
                     sbp=gt.sbp.broadcast)


def check_auto_parallel_chooses_measured_layouts_and_trains_equal():
    import copy

    import torch

    import globaltensor as gt
    from globaltensor.planner import record as step
    step.clear()
    plain, x = _mlp(), _inputs()
    model = copy.deepcopy(plain)
    plan = gt.nn.auto_parallel(model, gt.placement.all("cpu"), (x,))
    assert set(plan.measured) == {"data parallel", "tensor parallel", "fully sharded"}
    assert plan.strategy in plan.measured and set(plan) == {n for n, _ in plain.named_parameters()}
    assert isinstance(model.fc1.weight, gt.GlobalTensor)
    assert model.fc1.weight.sbp == plan["fc1.weight"]
    out = model(x)
    ref = plain(x.full())
    torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Megatron's pattern was found: fc1 column-parallel, fc2 row-parallel
    from globaltensor.nn.auto import _candidates
    tp = _candidates(plain, gt.placement.all("cpu"), (x,))["tensor parallel"]
    assert tp["fc1.weight"] == (gt.sbp.split(0),) and tp["fc2.weight"] == (gt.sbp.split(1),)
    assert tp["fc2.bias"] == (gt.sbp.broadcast,)
    step.clear()


def check_a_candidate_that_fails_is_skipped_with_a_warning_naming_it():
    """A layout some op of the model cannot take costs that candidate, not the call."""
    import copy
    import warnings

    import torch

    import globaltensor as gt
    from globaltensor.planner import record as step
    from globaltensor.sbp import Split
    step.clear()
    plain, x = _mlp(), _inputs()

    class RefusesSplitWeights(type(plain)):
        def forward(self, x):
            if any(isinstance(s, Split) for s in self.fc1.weight.sbp):
                raise NotImplementedError("fc1 cannot be split here")
            return super().forward(x)
    refusing = copy.deepcopy(plain)
    refusing.__class__ = RefusesSplitWeights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = gt.nn.auto_parallel(refusing, gt.placement.all("cpu"), (x,))
    skipped = [str(w.message) for w in caught if "skipping candidate" in str(w.message)]
    assert len(skipped) == 2 and all("fc1 cannot be split here" in m for m in skipped)
    assert any("'tensor parallel'" in m for m in skipped)
    assert any("'fully sharded'" in m for m in skipped)
    assert plan.strategy == "data parallel" and set(plan.measured) == {"data parallel"}
    out = refusing(x)
    torch.testing.assert_close(out.full(), plain(x.full()).detach(), rtol=1e-5, atol=1e-6)
    step.clear()


def check_memory_budget_rules_out_data_parallel_or_raises():
    import copy

    import pytest

    import globaltensor as gt
    from globaltensor.nn.auto import _bytes_per_rank, _candidates
    from globaltensor.planner import record as step
    P, x = gt.placement.all("cpu"), _inputs()
    plain = _mlp()
    sizes = {k: _bytes_per_rank(plain, p) for k, p in _candidates(plain, P, (x,)).items()}
    budget = sizes["data parallel"] - 1            # everything but data parallel fits
    plan = gt.nn.auto_parallel(copy.deepcopy(plain), P, (x,), memory_budget=budget)
    assert plan.strategy != "data parallel" and "data parallel" not in plan.measured
    with pytest.raises(ValueError, match="smallest footprint is"):
        gt.nn.auto_parallel(copy.deepcopy(plain), P, (x,), memory_budget=1000)
    step.clear()


def check_plan_edits_saves_loads_and_applies():
    import copy
    import os
    import shutil

    import torch

    import globaltensor as gt
    from globaltensor.planner import record as step
    P, x = gt.placement.all("cpu"), _inputs()
    plain = _mlp()
    plan = gt.nn.auto_parallel(copy.deepcopy(plain), P, (x,))
    plan["fc1.weight"] = (gt.sbp.split(0),)         # edit it
    plan["fc1.bias"] = (gt.sbp.split(0),)
    folder = f"/tmp/globaltensor-plan-{os.getppid()}-{os.environ['RANK']}"
    os.makedirs(folder, exist_ok=True)
    try:
        plan.save(f"{folder}/plan.json")
        loaded = gt.nn.load_plan(f"{folder}/plan.json")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert dict(loaded) == dict(plan) and loaded.inputs == plan.inputs
    assert loaded.strategy == plan.strategy and "fc1.weight: split(dim=0)" in str(loaded)
    model = loaded.apply(copy.deepcopy(plain))
    assert model.fc1.weight.sbp == (gt.sbp.split(0),)
    torch.testing.assert_close(model(x).full(), plain(x.full()).detach(), rtol=1e-5, atol=1e-6)
    del loaded["fc2.bias"]
    import pytest
    with pytest.raises(ValueError, match="fc2.bias"):
        loaded.apply(copy.deepcopy(plain))
    step.clear()


def check_two_d_placements_offer_hybrids_that_train_equal():
    # On 2 x 2 every axis takes part: data parallel and fully sharded over both axes,
    # the batch split on the outer axis with Megatron on the inner, ZeRO-3 on the outer
    # with Megatron on the inner (auto_parallel's candidates); each trains equal to one
    # process
    import copy

    import torch

    import globaltensor as gt
    from globaltensor.nn.auto import _candidates
    from globaltensor.planner import record as step
    B, S0, S1 = gt.sbp.broadcast, gt.sbp.split(0), gt.sbp.split(1)
    P = gt.placement("cpu", [[0, 1], [2, 3]])
    plain = _mlp()
    torch.manual_seed(1)
    x = gt.tensor(torch.randn(8, 16), placement=P, sbp=(B, B))
    ref = plain(x.full())
    ref.square().mean().backward()
    plans = _candidates(plain, P, (x,))
    assert set(plans) == {"data parallel", "fully sharded", "data x tensor parallel",
                          "fully sharded x tensor parallel"}
    assert plans["data parallel"].inputs == ((S0, S0),)
    assert plans["fully sharded"]["fc1.weight"] == (S0, S0)
    assert plans["data x tensor parallel"]["fc2.weight"] == (B, S1)
    assert plans["data x tensor parallel"].inputs == ((S0, B),)
    assert plans["fully sharded x tensor parallel"]["fc1.weight"] == (S0, S0)
    assert plans["fully sharded x tensor parallel"]["fc2.bias"] == (S0, B)
    for name, plan in plans.items():
        model = plan.apply(copy.deepcopy(plain))
        out = model(x.to_global(sbp=plan.inputs[0]))
        torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
        out.square().mean().backward()
        for (k, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {k}")
    step.clear()   # (choosing among them is auto_parallel's, checked on 2 ranks: timing
    #                all four on 4 oversubscribed ranks costs 10 s of the suite)


def check_sequence_models_get_a_context_parallel_candidate():
    # A model with attention that takes token ids gets the sequence split (inputs
    # split(1), parameters broadcast: context parallel; data x context on 2-D), which
    # trains equal to one process, the sequence never gathered; an MLP on features
    # gets none
    import copy

    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    from globaltensor.nn.auto import _candidates
    from globaltensor.planner import record as step
    B, S0, S1 = gt.sbp.broadcast, gt.sbp.split(0), gt.sbp.split(1)
    n = gt.get_world_size()

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.qkv = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, ids):
            b, t = ids.shape
            q, k, v = self.qkv(self.embed(ids)).view(b, t, 3, 2, 8).unbind(2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            return self.head(out.transpose(1, 2).reshape(b, t, 16))
    torch.manual_seed(0)
    plain = SelfAttention()
    ids = torch.randint(0, 32, (2, 4 * n + 1), generator=torch.Generator().manual_seed(1))
    ref = plain(ids)
    ref.square().mean().backward()
    for P, name, sbp in ((gt.placement.all("cpu"), "context parallel", (S1,)),
                         (gt.placement("cpu", [list(range(n))]), "data x context parallel",
                          (S0, S1))):
        x = gt.tensor(ids, placement=P, sbp=(B,) * P.ndim)
        plan = _candidates(plain, P, (x,))[name]
        assert plan.inputs == (sbp,), plan
        model = plan.apply(copy.deepcopy(plain))
        with gt.debug.comm_stats() as stats:
            out = model(x.to_global(sbp=plan.inputs[0]))
            out.square().mean().backward()
        torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
        for (k, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {k}")
        # never gathered: ring attention, or all-to-all to a head split
        assert stats.calls["all_gather"] == 0, (name, stats)
    assert not any("context" in k for k in _candidates(_mlp(), gt.placement.all("cpu"),
                                                          (_inputs(),)))
    step.clear()


def check_moe_models_get_an_expert_parallel_candidate():
    # A model with gt.nn.MoE layers gets expert parallel: data parallel with the
    # experts split(0); it trains equal to one process
    import copy

    import torch

    import globaltensor as gt
    from globaltensor.nn.auto import _candidates
    S0 = gt.sbp.split(0)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), gt.nn.MoE(8, 16, experts=4))
    P = gt.placement.all("cpu")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    ref = plain(x)
    ref.square().mean().backward()
    plan = _candidates(plain, P, (gt.tensor(x, placement=P, sbp=gt.sbp.broadcast),))[
        "expert parallel"]
    assert plan["1.w1"] == plan["1.w2"] == (S0,) and plan["0.weight"] == (gt.sbp.broadcast,)
    assert plan.inputs == ((S0,),)
    model = plan.apply(copy.deepcopy(plain))
    out = model(gt.tensor(x, placement=P, sbp=S0))
    out.square().mean().backward()
    torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-5, atol=1e-6)
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6, msg=k)


def check_moe_models_get_data_x_expert_on_2d():
    # On 2 x 2 a model with gt.nn.MoE layers gets data x expert parallel: the experts
    # split on the inner axis and copied on the outer, the batch split over both; it
    # trains equal to one process (the experts' gradients summed over the rows)
    import copy

    import torch

    import globaltensor as gt
    from globaltensor.nn.auto import _candidates
    B, S0 = gt.sbp.broadcast, gt.sbp.split(0)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), gt.nn.MoE(8, 16, experts=4))
    P = gt.placement("cpu", [[0, 1], [2, 3]])
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref = plain(x)
    ref.square().mean().backward()
    plan = _candidates(plain, P, (gt.tensor(x, placement=P, sbp=(B, B)),))[
        "data x expert parallel"]
    assert plan["1.w1"] == (B, S0) and plan["0.weight"] == (B, B) and plan.inputs == ((S0, S0),)
    model = plan.apply(copy.deepcopy(plain))
    out = model(gt.tensor(x, placement=P, sbp=(S0, S0)))
    out.square().mean().backward()
    torch.testing.assert_close(out.full(), ref.detach(), rtol=1e-5, atol=1e-6)
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6, msg=k)


def check_close_candidates_take_more_turns_and_every_step_starts_together():
    """Candidates within CLOSE of the fastest are timed again, turn by turn, up to
    MAX_TIMED_STEPS; a slow one is not. Rank 1 takes longer on every step: the slowest
    rank's medians count, on every rank. The ranks meet before every step (a step timed
    while a peer still ran the one before it was charged with that wait)."""
    import torch

    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.nn import auto
    met = []
    barrier, comm.barrier = comm.barrier, lambda ranks=None: met.append(ranks) or barrier(ranks)
    try:
        models = {name: torch.nn.Linear(2, 1) for name in "ab"}
        times = {name: [] for name in models}
        auto._take_turns(models, ["a", "b"], 3, times, (torch.ones(4, 2),), None,
                         gt.placement.all("cpu"))
    finally:
        comm.barrier = barrier
    assert met == [tuple(range(gt.get_world_size()))] * 6
    assert [len(t) for t in times.values()] == [3, 3]
    p = gt.placement.all("cpu")
    own = {"fast": 1.0, "near": 1.05, "slow": 2.0}
    turns = []

    def take_turns(models, names, rounds, times, inputs, loss_fn, placement):
        turns.append((tuple(names), rounds, times is not None))
        if times is not None:
            for name in names:
                times[name] += [own[name] * (1 + gt.get_rank())] * rounds
    real, auto._take_turns = auto._take_turns, take_turns
    try:
        plans = {name: auto.AutoPlan({}, p, ()) for name in own}
        for plan in plans.values():
            plan.apply = lambda model: model
        seconds = auto._timed_all(dict.fromkeys(own), plans, (), None)
    finally:
        auto._take_turns = real
    assert seconds == {name: t * gt.get_world_size() for name, t in own.items()}, seconds
    extra = (auto.MAX_TIMED_STEPS - auto.TIMED_STEPS) // auto.TIMED_STEPS
    # Warm-up runs each candidate on its own (a failing one is skipped), then the turns.
    assert turns == [(("fast",), auto.WARM_STEPS, False), (("near",), auto.WARM_STEPS, False),
                     (("slow",), auto.WARM_STEPS, False),
                     (("fast", "near", "slow"), auto.TIMED_STEPS, True)] \
        + [(("fast", "near"), auto.TIMED_STEPS, True)] * extra, turns


CHECKS = ["check_auto_parallel_chooses_measured_layouts_and_trains_equal",
          "check_a_candidate_that_fails_is_skipped_with_a_warning_naming_it",
          "check_memory_budget_rules_out_data_parallel_or_raises",
          "check_plan_edits_saves_loads_and_applies",
          "check_sequence_models_get_a_context_parallel_candidate",
          "check_moe_models_get_an_expert_parallel_candidate",
          "check_close_candidates_take_more_turns_and_every_step_starts_together"]

# (timed candidates: each rank's own clock; warnings are the process's)
test_world2 = world_test(__name__, 2, CHECKS, in_processes=[
    "check_a_candidate_that_fails_is_skipped_with_a_warning_naming_it",
    "check_close_candidates_take_more_turns_and_every_step_starts_together"])
test_world4 = world_test(__name__, 4, ["check_two_d_placements_offer_hybrids_that_train_equal",
                                       "check_moe_models_get_data_x_expert_on_2d"])


def test_simulate_proposes_a_layout_for_a_cluster_it_cannot_see():
    """auto_parallel(..., simulate=placement of 8 ranks) in a world of one: every
    candidate's step simulated on the device profile, the fastest predicted within the
    memory budget proposed (not applied); a budget rules out the fastest."""
    import re

    import pytest
    import torch

    import globaltensor as gt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 128))
    x, cluster = torch.randn(4096, 128), gt.placement("cpu", ranks=range(8))

    def predicted(plan) -> dict:
        return {name: (float(m[1]), int(m[2])) for name, text in plan.measured.items()
                for m in [re.search(r"predicted ([\d.]+) ms per step, peak (\d+) bytes", text)]}
    plan = gt.nn.auto_parallel(model, gt.placement.all("cpu"), (x,), simulate=cluster,
                               device="h100")
    seen = predicted(plan)
    assert plan.placement == cluster and set(seen) == {"data parallel", "tensor parallel",
                                                       "fully sharded"}, plan.measured
    assert seen[plan.strategy][0] == min(ms for ms, _ in seen.values()), seen
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())   # not applied
    budget = seen[plan.strategy][1] - 1
    other = gt.nn.auto_parallel(model, gt.placement.all("cpu"), (x,), simulate=cluster,
                                device="h100", memory_budget=budget)
    assert other.strategy != plan.strategy and predicted(other)[other.strategy][1] <= budget
    with pytest.raises(ValueError, match="the smallest simulated peak is"):
        gt.nn.auto_parallel(model, gt.placement.all("cpu"), (x,), simulate=cluster,
                            device="h100", memory_budget=1000)
    with pytest.raises(TypeError, match="simulate must be a gt.placement"):
        gt.nn.auto_parallel(model, gt.placement.all("cpu"), (x,), simulate=[0, 1])
