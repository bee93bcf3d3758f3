"""gt.pipeline on real processes: training with every schedule equals single-process
training of the whole model on the whole batch (data- and tensor-parallel stages,
uneven micro-batches, 2-4 stages, SGD and Adam), forward-only calls, idle ranks,
errors, and the timeline picture."""
import contextlib
import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.testing import boxing_log

B, S = gt.sbp.broadcast, gt.sbp.split
WIDTHS = (6, 8, 8, 8, 8, 3)


def layers(widths=WIDTHS, seed=0):
    """Linear layers with tanh between them (the same on every rank)."""
    torch.manual_seed(seed)
    mods = []
    for a, b in zip(widths, widths[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return mods[:-1]


def cut(mods, n):
    """``n`` stages of consecutive linear layers (each ends after a linear or tanh)."""
    linears = [i for i, m in enumerate(mods) if isinstance(m, torch.nn.Linear)]
    bounds = [linears[round(k * len(linears) / n)] for k in range(n)] + [len(mods)]
    return [torch.nn.Sequential(*mods[bounds[k]:bounds[k + 1]]) for k in range(n)]


def tensor_parallel(name, t):
    # Megatron's MLP: the first linear column-split, the second row-split
    return {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)}.get(name, B)


def train_and_compare(specs, schedule, micro, rows=7, steps=3, opt="adam", data_sbp=None,
                      loss_fn=F.mse_loss, widths=WIDTHS):
    """Train stages laid out by ``specs`` [(placement, sbp)] with the pipeline and the
    whole model in plain torch, side by side; parameters and losses must agree. Stages
    on this rank alone and data-parallel ones must have run on plain tensors."""
    mods = layers(widths)
    reference = torch.nn.Sequential(*copy.deepcopy(mods))
    stages = cut(mods, len(specs))
    for stage, (placement, sbp) in zip(stages, specs):
        gt.nn.to_global(stage, placement, sbp)
    pipe = gt.pipeline.Pipeline(stages, micro_batches=micro, schedule=schedule,
                                loss_fn=loss_fn)
    params = [p for s in stages for p in s.parameters()]
    make = (lambda ps: torch.optim.Adam(ps, lr=0.05)) if opt == "adam" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9))
    optimizer, ref_optimizer = make(params), make(reference.parameters())
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(rows, widths[0])
        y = torch.randint(0, widths[-1], (rows,)) if loss_fn is F.cross_entropy \
            else torch.randn(rows, widths[-1])
        xg = x if data_sbp is None else gt.tensor(x, placement=specs[0][0], sbp=data_sbp)
        loss = pipe.step(xg, y)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert isinstance(loss, gt.GlobalTensor)
        torch.testing.assert_close(torch.tensor(float(loss)), ref_loss.detach(),
                                   rtol=1e-5, atol=1e-5)
    for p, q in zip(params, reference.parameters()):
        torch.testing.assert_close(p.full(), q.detach(), rtol=1e-5, atol=1e-5)
    # stages alone on this rank and data-parallel ones (linear and tanh treat rows
    # independently) run on plain tensors
    rank = gt.get_rank()
    alone = {k for k, (placement, _) in enumerate(specs) if placement.flat_ranks == (rank,)}
    plain = alone | {k for k, (placement, sbp) in enumerate(specs)
                     if rank in placement and sbp is B}
    assert all(r.local == plain for r in pipe._routes.values())
    assert all(r.local_loss == (len(specs) - 1 in alone) for r in pipe._routes.values())
    # forward only: the whole batch's output, micro-batched
    x = torch.randn(rows, widths[0])
    xg = x if data_sbp is None else gt.tensor(x, placement=specs[0][0], sbp=data_sbp)
    y = pipe(xg)
    assert not y.requires_grad
    torch.testing.assert_close(y.full(), reference(x).detach(), rtol=1e-5, atol=1e-5)
    return pipe


def P(*ranks):
    return gt.placement("cpu", ranks=list(ranks))


# --- world of 2 -----------------------------------------------------------------------

def check_gpipe_two_single_rank_stages():
    train_and_compare([(P(0), B), (P(1), B)], "gpipe", micro=4, rows=8, opt="sgd")


def check_1f1b_uneven_micro_batches():
    train_and_compare([(P(0), B), (P(1), B)], "1f1b", micro=3, rows=7)


class _Cast(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def check_stages_in_other_dtypes_and_under_autocast():
    # Each hand-off moves its stage's output in that output's dtype, and ranks outside
    # the last stage make the loss in the loss's: a stage ending in bf16 before an fp32
    # one (the hand-off took the last stage's dtype: its fingerprints differed), and
    # under torch.autocast (bf16 activations, an fp32 cross-entropy) train as plain torch
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for autocast in (False, True):
        mods = layers()
        casts = ([], []) if autocast else ([_Cast(torch.bfloat16)], [_Cast(torch.float32)])
        s0 = torch.nn.Sequential(*mods[:3], *casts[0])
        s1 = torch.nn.Sequential(*casts[1], *mods[3:])
        reference = copy.deepcopy(torch.nn.Sequential(s0, s1))
        gt.nn.to_global(s0, P(0), B)
        gt.nn.to_global(s1, P(1), B)
        pipe = gt.pipeline.Pipeline([s0, s1], micro_batches=2, schedule="1f1b",
                                    loss_fn=F.cross_entropy)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = pipe.step(x, y)
            want = F.cross_entropy(reference(x), y)
        want.backward()
        tol = 2e-2 if autocast else 1e-6   # (bf16 sums over each micro-batch's rows)
        assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) < tol, (loss, want)
        for p, q in zip([p for s in (s0, s1) for p in s.parameters()], reference.parameters()):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=tol, atol=tol)


def check_1f1b_one_micro_batch_cross_entropy():
    train_and_compare([(P(0), B), (P(1), B)], "1f1b", micro=1, rows=5,
                      loss_fn=F.cross_entropy)


def check_interleaved_four_stages_on_two_ranks():
    train_and_compare([(P(0), B), (P(1), B), (P(0), B), (P(1), B)], "interleaved_1f1b",
                      micro=3, rows=7)


def check_tensor_parallel_stages_sharing_two_ranks():
    # both stages tensor parallel on [0, 1]: the hand-off between them stays local
    both = P(0, 1)
    train_and_compare([(both, tensor_parallel), (both, tensor_parallel)], "gpipe", micro=2,
                      rows=6, widths=(6, 8, 8, 8, 3))


def check_data_parallel_stages_sharing_two_ranks():
    # gradients are reduced once per step, after each stage's last micro-batch
    train_and_compare([(P(0, 1), B), (P(0, 1), B)], "gpipe", micro=3, rows=10,
                      data_sbp=S(0))


def check_hand_offs_are_boxing_logged_and_checked():
    # Hand-offs run through boxing/run.py as every boxing: named in the debug log and in
    # profiler ranges on both sides, and check mode compares each side's ranks (senders
    # and receivers post at different moments) without a false divergence.
    with boxing_log() as logged:
        with gt.debug.check_consistency(), torch.profiler.profile() as prof:
            train_and_compare([(P(0), B), (P(1), B)], "1f1b", micro=2, rows=4, steps=1)
    forward = "pipeline hand-off: stage 0 output to stage 1"
    backward = "pipeline hand-off: stage 1 input gradient to stage 0"
    if gt.get_rank() in (0, 1):
        names = [e.name for e in prof.events() if e.name.startswith("globaltensor")]
        for why in (forward, backward):
            assert any(f"boxes for {why}:" in m for m in logged), (why, logged)
            assert any(f"globaltensor: {why}: boxing" in m for m in names), (why, names)


def check_bad_input_is_refused_before_any_message():
    stage = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not global"):
        gt.pipeline.Pipeline([stage], micro_batches=2)
    a, b = cut(layers((3, 4, 3)), 2)
    gt.nn.to_global(a, P(0, 1), B)
    gt.nn.to_global(b, P(1), B)
    with pytest.raises(ValueError, match="overlaps"):
        gt.pipeline.Pipeline([a, b], micro_batches=2)
    gt.nn.to_global(b, P(0, 1), B)  # now a shared placement: fine for gpipe
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=4, schedule="gpipe",
                                loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="cannot make 4 micro-batches"):
        pipe.step(torch.randn(3, 3), torch.randn(3, 3))
    with pytest.raises(ValueError, match="rows"):
        pipe.step(torch.randn(8, 3), torch.randn(7, 3))
    with pytest.raises(ValueError, match="one stage per placement"):
        gt.pipeline.Pipeline([a, b], micro_batches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="positive"):
        gt.pipeline.Pipeline([a, b], micro_batches=0)


def check_batches_that_differ_between_ranks_raise_on_every_rank():
    # a rank-dependent batch: before, the hand-offs paired messages of different sizes
    # (gloo aborted the process) or mixed values; now every rank raises, naming the shapes
    a, b = cut(layers((3, 4, 3)), 2)
    gt.nn.to_global(a, P(0), B)
    gt.nn.to_global(b, P(1), B)
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, loss_fn=F.mse_loss)
    rank = gt.get_rank()
    rows = 6 if rank == 0 else 5

    def raises(match):  # ranks outside the pipeline (a world of 4) take no part
        return pytest.raises(gt.debug.DivergenceError, match=match) if rank < 2 else contextlib.nullcontext()
    with raises(r"ranks \[0\] a batch \(6, 3\) and target \(6, 3\); ranks \[1\] a batch \(5, 3\) "
                r"and target \(5, 3\)"):
        pipe.step(torch.ones(rows, 3), torch.ones(rows, 3))
    with raises("different batches"):
        pipe(torch.ones(rows, 3))
    # equal shapes, values that differ: found in check mode only (the values are digested)
    x = torch.full((4, 3), float(rank))
    with gt.debug.check_consistency():
        with raises("same shapes, different dtype, layout or values"):
            pipe.step(x, torch.ones(4, 3))
    # the world still works, and so does the pipeline
    loss = pipe.step(torch.ones(4, 3), torch.ones(4, 3))
    assert float(loss) >= 0


def check_micro_batches_that_differ_between_ranks_raise_on_every_rank():
    # a rank-dependent micro_batches: before, rank 1 aborted in gloo (SIGABRT) at the
    # first hand-off without check mode; now every rank raises before any, naming both
    a, b = cut(layers((3, 4, 3)), 2)
    gt.nn.to_global(a, P(0), B)
    gt.nn.to_global(b, P(1), B)
    rank = gt.get_rank()
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2 if rank == 0 else 3, loss_fn=F.mse_loss)
    if rank < 2:   # ranks outside the pipeline (a world of 4) take no part
        with pytest.raises(gt.debug.DivergenceError,
                           match=r"rank 0 2 micro-batches of 2 stages; rank 1 3 micro-batches"):
            pipe.step(torch.ones(6, 3), torch.ones(6, 3))
    else:
        pipe.step(torch.ones(6, 3), torch.ones(6, 3))
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, loss_fn=F.mse_loss)
    assert float(pipe.step(torch.ones(6, 3), torch.ones(6, 3))) >= 0   # the world still works


def check_timeline_picture():
    pipe = train_and_compare([(P(0), B), (P(1), B)], "1f1b", micro=4, rows=8, steps=1)
    x, y = torch.randn(8, WIDTHS[0]), torch.randn(8, WIDTHS[-1])
    pipe.step(x, y)
    path = os.path.join(tempfile.gettempdir(), f"gt_timeline_{os.environ['MASTER_PORT']}.png")
    events = pipe.timeline(path)
    kinds = {(e[0], e[1], e[2], e[3]) for evs in events for e in evs if e[1] in "FB"}
    assert kinds == {(k, c, k, i) for k in (0, 1) for c in "FB" for i in range(4)}
    if gt.get_rank() == 0:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        os.remove(path)


class ToGlobalInside(torch.nn.Module):
    """A layer that uses the global API in forward: its stage must stay global."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x.to_global(sbp=x.sbp))


def check_stages_alone_on_a_rank_keep_gradient_semantics():
    # plain-tensor stages hand gradients to .grad as torch would: accumulated over
    # steps without zero_grad, fresh after set_to_none, none for frozen parameters,
    # one for tied weights; split sbp on one rank is the whole tensor
    mods = layers((4, 6, 6, 6, 3))
    mods[4].weight = mods[2].weight
    reference = torch.nn.Sequential(*copy.deepcopy(mods))
    a, b = torch.nn.Sequential(*mods[:2]), torch.nn.Sequential(*mods[2:])
    a[0].bias.requires_grad_(False)
    reference[0].bias.requires_grad_(False)
    gt.nn.to_global(a, P(0), B)
    gt.nn.to_global(b, P(1), lambda name, t: S(0))
    def loss_fn(out, target):  # calls the global API: runs on global tensors
        return F.mse_loss(out.to_global(sbp=out.sbp), target)

    pipe = gt.pipeline.Pipeline([a, b], micro_batches=3, schedule="1f1b", loss_fn=loss_fn)
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    for _ in range(2):  # no zero_grad in between: gradients add up
        pipe.step(x, y)
        F.mse_loss(reference(x), y).backward()
    mine = {gt.get_rank()} & {0, 1}  # ranks 2 and 3 of a world of 4 hold no stage
    assert all(r.local == mine and not r.local_loss for r in pipe._routes.values())
    # gradients exist on the stage's rank only (torch's pipelining has the same)
    mine = [(p, q) for p, q in zip(list(a.parameters()) + list(b.parameters()),
                                   reference.parameters()) if gt.get_rank() in p.placement]
    assert len(list(b.parameters())) == 5  # the tied weight counts once
    for p, q in mine:
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-5, atol=1e-6)
    for p, _ in mine:
        p.grad = None
    reference.zero_grad(set_to_none=True)
    pipe.step(x, y)
    F.mse_loss(reference(x), y).backward()
    for p, q in mine:
        if q.grad is not None:
            torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-5, atol=1e-6)
    # a parameter with a hook of its own: that step runs global, and the hook runs
    calls = []

    def doubled(g):
        calls.append(1)
        return g * 2
    hooks = [b[0].bias.register_hook(doubled), reference[2].bias.register_hook(doubled)]
    pipe.step(x, y)
    F.mse_loss(reference(x), y).backward()
    for p, q in mine:
        if q.grad is not None:
            torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-5, atol=1e-6)
    assert len(calls) == (1 + 3 if gt.get_rank() == 1 else 1)  # reference: 1 backward
    for h in hooks:
        h.remove()


def check_batch_norm_in_a_plain_tensor_stage():
    # running statistics update in place through the plain run, once per micro-batch
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    b = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(5, 2))
    reference = torch.nn.Sequential(*copy.deepcopy(list(a) + list(b)))
    gt.nn.to_global(a, P(0), B)
    gt.nn.to_global(b, P(1), B)
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, schedule="1f1b", loss_fn=F.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(2):
        pipe.step(x, y)
        for xs, ys in zip(x.split(4), y.split(4)):
            (F.mse_loss(reference(xs), ys) / 2).backward()
    assert all(r.local == {gt.get_rank()} & {0, 1} for r in pipe._routes.values())
    if gt.get_rank() == 0:
        bn, ref_bn = a[1], reference[1]
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(bn, name).to_local(), getattr(ref_bn, name))
        torch.testing.assert_close(a[0].weight.grad.to_local(), reference[0].weight.grad,
                                   rtol=1e-5, atol=1e-6)


def check_data_parallel_plain_stages_accumulate_and_reduce_once():
    # data-parallel stages run on plain tensors, all but their last micro-batch: the
    # contributions join .grad as partial sums before it (also onto a .grad kept from
    # the previous step) and gradient sync reduces them once
    mods = layers((4, 6, 6, 3))
    reference = torch.nn.Sequential(*copy.deepcopy(mods))
    a, b = torch.nn.Sequential(*mods[:2]), torch.nn.Sequential(*mods[2:])
    everyone = P(0, 1)
    for stage in (a, b):
        gt.nn.to_global(stage, everyone, B)
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=3, schedule="gpipe", loss_fn=F.mse_loss)
    x, y = torch.randn(9, 4), torch.randn(9, 3)
    xg = gt.tensor(x, placement=everyone, sbp=S(0))
    params = list(a.parameters()) + list(b.parameters())
    for step in range(3):  # no zero_grad, then zero_grad(set_to_none=False)
        if step == 2:
            for p in params:
                if p.grad is not None:  # None on ranks outside the stages
                    p.grad.zero_()
            reference.zero_grad(set_to_none=False)
        kept = [p.grad for p in params]
        pipe.step(xg, y)
        F.mse_loss(reference(x), y).backward()
        for p, q, g in zip(params, reference.parameters(), kept):
            if gt.get_rank() in everyone:  # a world of 4 has ranks outside
                assert g is None or g is p.grad  # a kept .grad stays .grad, as in torch
                assert p.grad.sbp == (B,)
                torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-5, atol=1e-6)
    assert all(r.local == ({0, 1} if gt.get_rank() in everyone else set())
               for r in pipe._routes.values())


def check_data_parallel_stage_that_mixes_rows_stays_global():
    # batch norm in training mode computes statistics over the whole micro-batch
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    b = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = torch.nn.Sequential(*copy.deepcopy(list(a) + list(b)))
    everyone = P(0, 1)
    gt.nn.to_global(a, everyone, B)
    gt.nn.to_global(b, everyone, B)
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, schedule="gpipe", loss_fn=F.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe.step(gt.tensor(x, placement=everyone, sbp=S(0)), y)
    for xs, ys in zip(x.split(4), y.split(4)):
        (F.mse_loss(reference(xs), ys) / 2).backward()
    torch.testing.assert_close(a[1].running_mean.full(), reference[1].running_mean)
    if gt.get_rank() in everyone:  # a world of 4 has ranks outside
        assert all(r.local == {1} for r in pipe._routes.values())  # the tanh stage: plain
        for p, q in zip(list(a.parameters()) + list(b.parameters()), reference.parameters()):
            torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-5, atol=1e-6)


def check_stages_that_draw_or_use_the_global_api_stay_global():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.5))
    b = ToGlobalInside(6)
    gt.nn.to_global(a, P(0), B)
    gt.nn.to_global(b, P(1), B)
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, schedule="gpipe", loss_fn=F.mse_loss)
    x, y = torch.randn(6, 4), torch.randn(6, 6)
    pipe.step(x, y)
    assert all(r.local == set() for r in pipe._routes.values())
    a.eval()  # no draws now, but the stage next to it still calls to_global
    expected = b(a(gt.tensor(x, placement=P(0), sbp=B)).to_global(P(1), B)).full()
    torch.testing.assert_close(pipe(x).full(), expected)


def check_the_code_of_a_plain_step_runs_on_every_rank_after_pipe_step():
    # After pipe.step every rank runs what it would run after loss.backward():
    # clip_grad_norm_ over every stage's parameters (the whole model's norm, on every
    # rank), optimizers, zero_grad, get_state_dict and dcp.save/load. On a rank outside
    # a stage, that stage's .grad are empty GlobalTensors, as a backward leaves them.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if gt.get_world_size() == 2:
        specs = [(P(0), B), (P(1), B)]
    else:  # tensor-parallel first stage; rank 3 holds no stage
        specs = [(P(0, 1), tensor_parallel), (P(2), B)]
    mods = layers((4, 6, 6, 3))
    reference = torch.nn.Sequential(*copy.deepcopy(mods))
    stages = cut(mods, 2)
    for stage, (placement, sbp) in zip(stages, specs):
        gt.nn.to_global(stage, placement, sbp)
    pipe = gt.pipeline.Pipeline(stages, micro_batches=2, schedule="1f1b", loss_fn=F.mse_loss)
    model = torch.nn.ModuleList(stages)
    torch.manual_seed(3)
    batches = [(torch.randn(6, 4), torch.randn(6, 3)) for _ in range(4)]
    optimizers = [lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                  lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
                  lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False)]
    for make, (x, y) in zip(optimizers, batches):  # one step with each
        opt, ref_opt = make(model.parameters()), make(reference.parameters())
        pipe.step(x, y)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        F.mse_loss(reference(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        assert abs(norm.item() - want.item()) <= 1e-5 * want.item(), (norm, want)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.grad is not None and p.grad.global_layout == p.global_layout
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-7)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full(), q.detach(), rtol=1e-5, atol=1e-6)
    # the last optimizer's state is saved and loaded on every rank
    path = os.path.join(tempfile.gettempdir(), f"gt_pipe_ckpt_{os.environ['MASTER_PORT']}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = [p.full().clone() for p in model.parameters()]
    pipe.step(*batches[3])
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for p, value in zip(model.parameters(), saved):
        torch.testing.assert_close(p.full(), value, rtol=0, atol=0)
        assert float(opt.state[p]["step"]) == 1
    torch.distributed.barrier()  # every rank has read the checkpoint
    if gt.get_rank() == 0:
        shutil.rmtree(path)


# --- world of 4 -----------------------------------------------------------------------

def check_data_parallel_stage_into_tensor_parallel_stage():
    # the activation leaves [0, 1] split(0) and enters [2, 3] whatever the TP stage needs
    train_and_compare([(P(0, 1), B), (P(2, 3), tensor_parallel)], "1f1b", micro=3, rows=10,
                      data_sbp=S(0), widths=(6, 8, 8, 8, 3))


def check_four_single_rank_stages_1f1b():
    train_and_compare([(P(0), B), (P(1), B), (P(2), B), (P(3), B)], "1f1b", micro=5,
                      rows=9, opt="sgd")


def check_ranks_outside_every_stage_return_at_once():
    # ranks 2 and 3 hold no stage: they get the loss's metadata and agree on its value
    train_and_compare([(P(0), B), (P(1), B)], "1f1b", micro=2, rows=5)


def check_data_parallel_stage_on_a_2d_placement():
    # rows split over axis 0 only: contributions are partial over that axis
    mesh = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    mods = layers((4, 6, 6, 3))
    reference = torch.nn.Sequential(*copy.deepcopy(mods))
    a, b = torch.nn.Sequential(*mods[:2]), torch.nn.Sequential(*mods[2:])
    for stage in (a, b):
        gt.nn.to_global(stage, mesh, (B, B))
    pipe = gt.pipeline.Pipeline([a, b], micro_batches=2, schedule="gpipe", loss_fn=F.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for _ in range(2):
        pipe.step(gt.tensor(x, placement=mesh, sbp=(S(0), B)), y)
        F.mse_loss(reference(x), y).backward()
    assert all(r.local == {0, 1} for r in pipe._routes.values())
    for p, q in zip(list(a.parameters()) + list(b.parameters()), reference.parameters()):
        torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-5, atol=1e-6)


def check_interleaved_on_two_data_parallel_placements():
    train_and_compare([(P(0, 1), B), (P(2, 3), B), (P(0, 1), B), (P(2, 3), B)],
                      "interleaved_1f1b", micro=4, rows=12, data_sbp=S(0))


ONLY_IN_4 = ["check_data_parallel_stage_into_tensor_parallel_stage",
             "check_data_parallel_stage_on_a_2d_placement",
             "check_four_single_rank_stages_1f1b", "check_ranks_outside_every_stage_return_at_once",
             "check_interleaved_on_two_data_parallel_placements"]
# Cross-entropy runs last, in the world of 4 (ranks 2 and 3 outside every stage): a loss
# that talked to ranks outside the last stage would fail it, and a world stops at its
# first failure.
ONLY_IN_4.append("check_1f1b_one_micro_batch_cross_entropy")
CHECKS = [name for name in dir() if name.startswith("check_") and name not in ONLY_IN_4]

# (the profiler is one per process; the others time their stages on each rank's clock)
IN_PROCESSES = ["check_hand_offs_are_boxing_logged_and_checked",
                "check_interleaved_four_stages_on_two_ranks",
                "check_interleaved_on_two_data_parallel_placements",
                "check_the_code_of_a_plain_step_runs_on_every_rank_after_pipe_step",
                "check_timeline_picture"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, ONLY_IN_4, in_processes=IN_PROCESSES)
