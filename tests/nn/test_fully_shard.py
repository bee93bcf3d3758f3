"""gt.nn.fully_shard in worlds of 2 and 4: parameters, gradients and AdamW state are
split(0) parts; training equals single-process torch on the whole batch (1e-5); the
gathered copy of a parameter is gone after forward (autograd keeps the part and gathers
again in backward); it composes with tensor parallelism on a 2-D placement, with tied
parameters, with meta-device modules and with activation checkpointing (its recompute
gathers once, a Linear's backward its weight again); reshard_after_forward False / an
int gathers fewer times / in groups; large parameters are gathered in place, uneven
parts included."""
from __future__ import annotations

import copy
import gc
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds, patched

import globaltensor as gt
from globaltensor import heap as fs_heap
from globaltensor.layout import balanced_split
from globaltensor.nn import shard_comm as fs_comm
from globaltensor.nn import sharded as fs_module

B, S = gt.sbp.broadcast, gt.sbp.split


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 7))   # 7 rows: uneven parts


def _data(rows=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 7, (rows,), generator=g)


def _train(model, x, y, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return opt, losses


def _assert_same(model, reference):
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.full(), want.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def check_training_equals_one_process():
    p = gt.placement.all("cpu")
    reference, model = _mlp(), gt.nn.fully_shard(_mlp(), p)
    rank = gt.get_rank()
    for name, t in model.named_parameters():
        assert t.sbp == (S(0),), name
        assert tuple(t.to_local().shape) == t.global_layout.local_shape(rank), name
    x, y = _data()
    _, ref_losses = _train(reference, x, y)
    opt, losses = _train(model, gt.tensor(x, placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0)))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    _assert_same(model, reference)
    for name, t in model.named_parameters():        # gradients and AdamW state are parts
        assert t.grad.sbp == (S(0),), name
        state = opt.state[t]["exp_avg"]
        assert isinstance(state, gt.GlobalTensor) and state.to_local().numel() == t.to_local().numel()


def check_training_under_autocast_follows_torch():
    # A unit's Linear runs its own backward (the weight let go first): under autocast it
    # computes in the forward's dtype, as torch's does (it met a bf16 gradient with the
    # fp32 weight before); bf16 sums of each rank's rows differ from the whole batch's
    p = gt.placement.all("cpu")
    reference, model = _mlp(), gt.nn.fully_shard(_mlp(), p)
    x, y = _data()
    losses, ref_losses = [], []
    for m, xs, ys, out in ((reference, x, y, ref_losses),
                           (model, gt.tensor(x, placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0)),
                            losses)):
        opt = torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):   # (forward only, as torch asks)
                loss = F.cross_entropy(m(xs), ys)
            loss.backward()
            opt.step()
            out.append(float(loss))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 2e-2, (losses, ref_losses)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert got.dtype == got.grad.dtype == torch.float32, name
        torch.testing.assert_close(got.full(), want.detach(), rtol=2e-2, atol=2e-2)


def check_gathered_copy_is_freed_after_forward():
    p = gt.placement.all("cpu")
    model = gt.nn.fully_shard(_mlp(), p)
    seen = []

    def remember(module, args, output):   # runs before the unit puts its shards back
        seen.append(weakref.ref(module.weight._local))
        assert module.weight.sbp == (B,)

    model[0].register_forward_hook(remember, prepend=True)
    x, y = _data()
    loss = F.cross_entropy(model(gt.tensor(x, placement=p, sbp=S(0))), gt.tensor(y, placement=p, sbp=S(0)))
    gc.collect()
    assert seen and seen[0]() is None, "autograd kept the gathered weight"
    assert model[0].weight.sbp == (S(0),) and not fs_module._gathered
    loss.backward()
    reference = _mlp()
    F.cross_entropy(reference(x), y).backward()
    torch.testing.assert_close(model[0].weight.grad.full(), reference[0].weight.grad,
                               rtol=1e-5, atol=1e-6)
    # one all-gather per unit (LayerNorm's weight and bias share a bucket), the next
    # unit's started before this one computes (prefetch) and used, none left over
    with gt.debug.comm_stats() as stats:
        model(gt.tensor(x, placement=p, sbp=S(0)))
    assert stats.calls["all_gather"] == 3, stats
    assert not fs_module._gathered


def check_tied_and_meta_modules():
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(9, 6), "head": torch.nn.Linear(6, 9)})
    tied.head.weight = tied.emb.weight
    reference = copy.deepcopy(tied)
    gt.nn.fully_shard(tied, p)
    assert tied.head.weight is tied.emb.weight and len(list(tied.parameters())) == 2
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for model, x in ((tied, gt.tensor(ids, placement=p, sbp=S(0))), (reference, ids)):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for _ in range(2):
            opt.zero_grad()
            model.head(model.emb(x)).logsumexp(-1).mean().backward()
            opt.step()
    _assert_same(tied, reference)
    # a meta module: parts allocated, then filled placement-invariantly
    with torch.device("meta"):
        meta = _mlp()
    gt.nn.fully_shard(meta, p)
    gt.manual_seed(3)
    for m in meta:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    whole = gt.nn.to_global(torch.nn.utils.skip_init(torch.nn.Linear, 12, 32), gt.placement("cpu", [0]), B)
    gt.manual_seed(3)
    whole.reset_parameters()
    assert torch.equal(meta[0].weight.full(), whole.weight.full())


def check_tensor_parallel_on_a_2d_placement():
    """Data axis 0 sharded by fully_shard, axis 1 a Megatron MLP (column then row split)."""
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 7))
    model = copy.deepcopy(reference)
    megatron = {"0.weight": (B, S(0)), "0.bias": (B, S(0)), "2.weight": (B, S(1))}
    gt.nn.to_global(model, mesh, lambda name, t: megatron.get(name, (B, B)))
    gt.nn.fully_shard(model, mesh, data_axis=0)
    assert model[0].weight.sbp == (S(0), S(0)) and model[2].weight.sbp == (S(0), S(1))
    assert model[2].bias.sbp == (S(0), B)
    x, y = _data()
    _, ref_losses = _train(reference, x, y, steps=2)
    _, losses = _train(model, gt.tensor(x, placement=mesh, sbp=(S(0), B)),
                       gt.tensor(y, placement=mesh, sbp=(S(0), B)), steps=2)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    _assert_same(model, reference)


def _counted_backward(model, p, x, y):
    """(all-gathers in forward, in backward, bytes they sent in backward, gradients)."""
    with gt.debug.comm_stats() as forward:
        loss = F.cross_entropy(model(gt.tensor(x, placement=p, sbp=S(0))),
                               gt.tensor(y, placement=p, sbp=S(0)))
    with gt.debug.comm_stats() as backward:
        loss.backward()
    grads = [t.grad.full() for t in model.parameters()]
    return forward.calls["all_gather"], backward.calls["all_gather"], \
        backward.bytes["all_gather"], grads


def check_reshard_after_forward():
    """False keeps the gathered copies for backward: the two units whose weights autograd
    saves (LayerNorm, the last Linear; the first Linear's input needs no gradient) are
    not gathered again. An int g (world of 4: 2) gathers them again from the 1/g kept,
    within g ranks, sending less. Gradients are the same."""
    p = gt.placement.all("cpu")
    x, y = _data()
    runs = {}
    choices = (True, False, 2) if gt.get_world_size() == 4 else (True, False)
    for reshard in choices:
        model = gt.nn.fully_shard(_mlp(), p, reshard_after_forward=reshard)
        runs[reshard] = _counted_backward(model, p, x, y)
        assert not fs_module._gathered
    counts = {k: v[:3] for k, v in runs.items()}
    assert counts[True][:2] == (3, 2) and counts[False][:2] == (3, 0), counts
    for reshard in choices[1:]:
        for got, want in zip(runs[reshard][3], runs[True][3]):
            assert torch.equal(got, want), reshard
    if 2 in runs:
        # one gather per saved parameter (LayerNorm saves its bias too), within 2 ranks
        assert counts[2][:2] == (3, 3) and counts[2][2] < counts[True][2], counts


def _wide_mlp():
    torch.manual_seed(0)   # 10 and 6 rows: on 4 ranks parts 3,3,2,2 and 2,2,1,1
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))


def check_a_units_gradients_are_reduced_together():
    """Each unit's gradients (weight and bias) are reduced to their parts in one round of
    messages per peer (gloo; the native reduce_scatter's packing is test_costs.py's); a
    frozen parameter gets no gradient."""
    p, n = gt.placement.all("cpu"), gt.get_world_size()
    x, y = _data()
    reference, model = _mlp(), gt.nn.fully_shard(_mlp(), p)
    for m in (reference, model):
        m[0].bias.requires_grad_(False)
    with gt.debug.comm_stats() as stats:
        F.cross_entropy(model(gt.tensor(x, placement=p, sbp=S(0))),
                        gt.tensor(y, placement=p, sbp=S(0))).backward()
    F.cross_entropy(reference(x), y).backward()
    # three units: Linear (its bias frozen), LayerNorm, Linear
    assert stats.calls["all_to_all"] == 3 * (n - 1), stats
    assert model[0].bias.grad is None
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        if want.grad is not None:
            assert got.grad.sbp == (S(0),), name
            torch.testing.assert_close(got.grad.full(), want.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


def check_an_exchange_sums_packed_and_own_gradients_exactly():
    """A unit's gradient exchange (gloo) gives each rank its rows of the sum, exactly
    (integer values), whether its gradients travel packed (small), in messages of their
    own (large) or both; uneven and empty parts, reduction dtypes other than the
    gradients' own."""
    n, me = gt.get_world_size(), gt.get_rank()
    shapes = [(7, 3), (2,), (1, 5), (9,), (0, 4), (3 * n, 2), (5, 1, 2)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32,
              torch.float64, torch.float32]
    rdtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32,
               torch.float64, torch.bfloat16]

    def grads(r):   # integers up to 8: every sum exact, in bf16 too
        g = torch.Generator().manual_seed(100 + r)
        return [torch.randint(-8, 9, s, generator=g).to(d) for s, d in zip(shapes, dtypes)]
    total = [sum(t.to(torch.float64) for t in ts) for ts in zip(*map(grads, range(n)))]
    for own in (1 << 30, 20, 0):   # all packed, the larger alone, all alone
        with patched(fs_comm, "OWN_GATHER_BYTES", own):
            got = fs_comm._exchange(grads(me), tuple(range(n)), rdtypes)
        gt.comm.barrier()   # (every rank out of the patch before the next one's)
        for i, (g, want, rdtype) in enumerate(zip(got, total, rdtypes)):
            rows = balanced_split(want.shape[0], n)[me]
            assert g.dtype == rdtype and torch.equal(g.double(), want.narrow(0, *rows)), (own, i)


def check_large_parameters_gather_in_place():
    """Above OWN_GATHER_BYTES a parameter is gathered into its gathered storage (uneven
    parts included), with its unit's others in one batch of messages on gloo, and again
    in the backward; training equals one process."""
    p = gt.placement.all("cpu")
    for own in (0, 200):   # every parameter alone; the weights alone, the biases bucketed
        with patched(fs_comm, "OWN_GATHER_BYTES", own):
            model, reference = gt.nn.fully_shard(_wide_mlp(), p), _wide_mlp()
            x = _data()[0]
            y = torch.randint(0, 6, (8,), generator=torch.Generator().manual_seed(2))
            gathers = _counted_backward(model, p, x, y)[:2]
            # each unit's parameters in one batch of messages (gloo); the last weight again
            assert gathers == (2, 1), (own, gathers)
            _, losses = _train(model, gt.tensor(x, placement=p, sbp=S(0)),
                               gt.tensor(y, placement=p, sbp=S(0)))
        _, ref_losses = _train(reference, x, y)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        _assert_same(model, reference)


def check_recompute_gathers_once_and_each_weight_again_in_its_backward():
    """A forward recomputed in backward (activation checkpointing) gathers each unit once
    and keeps no gathered Linear weight: the one Linear whose backward needs its weight
    (the first one's input needs no gradient) gathers it again there. 3 + 1 gathers in
    backward. Gradients equal one process, and in bf16 those of no recompute."""
    from torch.utils.checkpoint import checkpoint
    p = gt.placement.all("cpu")
    model, reference = gt.nn.fully_shard(_mlp(), p), _mlp()
    x, y = _data()
    with gt.debug.comm_stats() as forward:
        out = checkpoint(model, gt.tensor(x, placement=p, sbp=S(0)), use_reentrant=False)
    loss = F.cross_entropy(out, gt.tensor(y, placement=p, sbp=S(0)))
    with gt.debug.comm_stats() as backward:
        loss.backward()
    assert (forward.calls["all_gather"], backward.calls["all_gather"]) == (3, 4), \
        (forward, backward)
    assert not fs_module._gathered
    F.cross_entropy(reference(x), y).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad.full(), want.grad, rtol=1e-5, atol=1e-6)
    # in bf16 (the weight gathered again in that dtype): the gradients of no recompute
    grads = []
    for recompute in (True, False):
        bf16 = gt.nn.fully_shard(_mlp(), p, param_dtype=torch.bfloat16)
        xs = gt.tensor(x, placement=p, sbp=S(0))
        out = checkpoint(bf16, xs, use_reentrant=False) if recompute else bf16(xs)
        F.cross_entropy(out.float(), gt.tensor(y, placement=p, sbp=S(0))).backward()
        grads.append([q.grad.full() for q in bf16.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _resident_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(field))


def check_linear_backward_lets_the_weight_go_before_its_gradient():
    """A Linear unit's backward computes the input's gradient, drops the weight gathered
    again, then computes the weight's full-size gradient: the backward's peak is lower
    by about one weight than autograd's linear (which holds the weight to its end)."""
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    model = gt.nn.fully_shard(torch.nn.Sequential(
        torch.nn.Linear(8, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)), p)
    x = gt.tensor(torch.randn(8, 8), placement=p, sbp=S(0))
    weight_mib = 4096 * 4096 * 4 // 2**20
    rises = {True: [], False: []}
    grads = {}
    for weight_last in (True, False, True, False):
        if weight_last:
            model[2].forward = types.MethodType(fs_module._linear_forward, model[2])
        else:
            del model[2].forward      # nn.Linear.forward: autograd's own linear
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        gc.collect()
        before = _resident_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")              # the high-water mark starts again from now
        loss.backward()
        rises[weight_last].append(_resident_mib("VmHWM") - before)
        grads[weight_last] = [q.grad.to_local().clone() for q in model.parameters()]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert min(rises[False]) - min(rises[True]) >= weight_mib // 4, rises
    # a graph kept for a second backward gathers the dropped weight again
    model[2].forward = types.MethodType(fs_module._linear_forward, model[2])
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for q, once in zip(model.parameters(), grads[True]):
        torch.testing.assert_close(q.grad.to_local(), 2 * once, rtol=1e-5, atol=1e-7)


def check_host_blocks_go_back_to_the_system_when_freed():
    """fully_shard on a cpu placement maps every host block of 128 KiB or more on its own
    (glibc), so freeing one gives it back at once, also after glibc would have raised its
    mmap threshold; GLOBALTENSOR_TRIM_HEAP=0 leaves malloc alone."""
    import os

    from globaltensor.testing import _status_mib
    p = gt.placement.all("cpu")
    calls = []
    mapping = fs_heap.map_large_blocks
    user = os.environ.get("GLOBALTENSOR_TRIM_HEAP")
    try:
        fs_heap.map_large_blocks = lambda: calls.append(1)
        os.environ["GLOBALTENSOR_TRIM_HEAP"] = "0"
        gt.nn.fully_shard(_mlp(), p)
        assert calls == []
        os.environ["GLOBALTENSOR_TRIM_HEAP"] = "1"
        gt.nn.fully_shard(_mlp(), p)
        assert calls == ([1] if fs_heap._MALLOPT is not None else [])
    finally:
        fs_heap.map_large_blocks = mapping
        if user is None:
            os.environ.pop("GLOBALTENSOR_TRIM_HEAP", None)
        else:
            os.environ["GLOBALTENSOR_TRIM_HEAP"] = user
    if fs_heap._MALLOPT is None:
        return
    gt.nn.fully_shard(_mlp(), p)
    assert fs_heap.map_large_blocks()
    # an 8 MiB block freed raised glibc's own threshold to 8 MiB: 4 MiB blocks would then
    # come from the heap and stay resident when freed below a kept one
    big = torch.ones(2 << 20)
    del big
    blocks = [torch.ones(1 << 20) for _ in range(20)]
    before = _status_mib("VmRSS")
    del blocks[:-1]
    after = _status_mib("VmRSS")
    assert before - after > 60, (before, after)     # 19 blocks of 4 MiB: 76 MiB


_MAPPED: list = []   # the ranks of a simulated world share the patch, so one recorder


def _map_large_blocks():
    _MAPPED.append(gt.get_rank())


def check_a_data_axis_of_one_rank_hands_on_the_parts():
    # sharded over an axis of one rank (a program tried on one device before many, or
    # a 2-D placement's axis of one): a part is the whole, so a unit's forward computes
    # on the stored part itself (no gathered copy), nothing is gathered again in
    # backward, and training equals plain torch as elsewhere (at a world of one a GPT
    # step took 1.7-2.0x that of broadcast parameters before, 1.02-1.03x now)
    p = gt.placement("cpu", [[r] for r in range(gt.get_world_size())])
    rank = gt.get_rank()
    mapped = _MAPPED.count(rank)   # nor does it map each large host block (heap.py)
    with patched(fs_heap, "map_large_blocks", _map_large_blocks):
        reference, model = _mlp(), gt.nn.fully_shard(_mlp(), p, data_axis=1)
        assert _MAPPED.count(rank) == mapped
        gt.nn.fully_shard(_mlp(), p, data_axis=0)
        assert _MAPPED.count(rank) > mapped or not fs_heap.maps_large_blocks("cpu")
    seen = []

    def remember(module, args, output):   # runs before the unit puts its shards back
        seen.append((module.weight.to_local().data_ptr(), module._gt_shard_unit.saved[-1][1]))

    model[0].register_forward_hook(remember, prepend=True)
    x, y = _data()
    _, ref_losses = _train(reference, x, y)
    rows = (S(0), B)
    _, losses = _train(model, gt.tensor(x, placement=p, sbp=rows), gt.tensor(y, placement=p, sbp=rows))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    _assert_same(model, reference)
    stored = model[0].weight.to_local().data_ptr()
    assert seen == [(stored, None)] * 3, (seen, stored)   # the part itself, no regather
    assert not fs_module._gathered


class _MatmulNet(torch.nn.Module):
    """A parameter used by a matmul (not nn.Linear): saved by autograd, gathered again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(12, 5))

    def forward(self, x):
        return torch.tanh(x @ self.w)


def check_double_backward_is_refused_before_it_differentiates():
    # A gradient penalty differentiates backward's own gathered copies, which have no
    # history to the shards: refused with advice (nn.Linear's own backward, and a saved
    # parameter gathered again), where it would miss terms; a first-order
    # torch.autograd.grad still equals torch's
    p = gt.placement.all("cpu")
    x, _ = _data()
    for make in (_mlp, _MatmulNet):
        reference, model = make(), gt.nn.fully_shard(make(), p)
        gx = gt.tensor(x, placement=p, sbp=S(0)).requires_grad_()
        px = x.clone().requires_grad_()
        got, = torch.autograd.grad(model(gx).square().sum(), gx)
        want, = torch.autograd.grad(reference(px).square().sum(), px)
        torch.testing.assert_close(got.full(), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match=r"create_graph=True.*gt\.nn\.to_global"):
            torch.autograd.grad(model(gx).square().sum(), gx, create_graph=True)


CHECKS = ["check_training_equals_one_process", "check_training_under_autocast_follows_torch",
          "check_gathered_copy_is_freed_after_forward",
          "check_tied_and_meta_modules", "check_reshard_after_forward",
          "check_large_parameters_gather_in_place", "check_a_units_gradients_are_reduced_together",
          "check_an_exchange_sums_packed_and_own_gradients_exactly",
          "check_recompute_gathers_once_and_each_weight_again_in_its_backward",
          "check_host_blocks_go_back_to_the_system_when_freed",
          "check_a_data_axis_of_one_rank_hands_on_the_parts",
          "check_double_backward_is_refused_before_it_differentiates"]

test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, only_in_4=["check_tensor_parallel_on_a_2d_placement"],
    only_in_2=["check_linear_backward_lets_the_weight_go_before_its_gradient",
               "check_double_backward_is_refused_before_it_differentiates"],
    # (the process's resident memory, and gathers counted per process)
    in_processes=["check_linear_backward_lets_the_weight_go_before_its_gradient",
                  "check_host_blocks_go_back_to_the_system_when_freed",
                  "check_recompute_gathers_once_and_each_weight_again_in_its_backward"])
