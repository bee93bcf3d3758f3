"""gt.nn.fully_shard's units in worlds of 2: ``unit="call"`` (FSDP2's: all a call shards
in one unit) gathers once per call and direction and trains equal to one process, also
with a checkpoint inside a unit (torchtitan's activation checkpointing of a block) and
around one (its Linears' weights then gathered once in backward); the next unit's
gather starts ahead across calls, and in backward each regather starts the one before
it in forward order."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from mp import patched, world_test
from test_fully_shard import _assert_same, _data, _train  # the same batch and checks
from torch.utils.checkpoint import checkpoint

import globaltensor as gt
from globaltensor.nn import shard_backward as fs_backward
from globaltensor.nn import sharded as fs_module

S = gt.sbp.split

# rank -> what the units did, in order (a simulated world's ranks share this module)
_EVENTS: dict = {}
_UNIT_START, _REGATHER_START = fs_module._Unit.start, fs_backward._Regather.start


def _logged_start(unit):
    _EVENTS.setdefault(gt.get_rank(), []).append(("gather", unit.module))
    return _UNIT_START(unit)


def _logged_regather(regather):
    started = _REGATHER_START(regather)
    if started:
        _EVENTS.setdefault(gt.get_rank(), []).append(("ahead", regather.unit.module))
    return started


def _trained_in_units_of_calls(model, blocks):
    """``model()`` (seeded) trained in one process and with a unit per call (each of
    ``blocks(it)``, then the rest), the same to 1e-5; (the sharded model, its batch)."""
    p = gt.placement.all("cpu")
    reference, sharded = model(), model()
    for block in blocks(sharded):
        gt.nn.fully_shard(block, p, unit="call")
    gt.nn.fully_shard(sharded, p, unit="call")
    x, y = _data()
    xs, ys = gt.tensor(x, placement=p, sbp=S(0)), gt.tensor(y, placement=p, sbp=S(0))
    _, ref_losses = _train(reference, x, y)
    _, losses = _train(sharded, xs, ys)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    _assert_same(sharded, reference)
    return sharded, xs, ys


def check_a_call_is_one_unit_and_the_next_is_gathered_ahead():
    """``unit="call"`` (FSDP2's units): each call's parameters gather in one collective;
    the next block's gather starts before this one computes, across calls, and in
    backward each regather starts the one before it in forward order; training equals
    one process."""
    def blocks():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
            torch.nn.Linear(32, 12)) for _ in range(2)), torch.nn.Linear(12, 7))
    rank = gt.get_rank()
    model, xs, ys = _trained_in_units_of_calls(blocks, lambda m: m[:2])
    for block in model[:2]:   # (runs after the block's gather)
        block[0].register_forward_pre_hook(
            lambda m, a: _EVENTS.setdefault(rank, []).append(("compute", m)))
    _EVENTS.pop(rank, None)
    with patched(fs_module._Unit, "start", _logged_start), \
            patched(fs_backward._Regather, "start", _logged_regather), \
            gt.debug.comm_stats() as forward:
        loss = F.cross_entropy(model(xs), ys)
    # the model's own (the last Linear's), then one per block: 3, where one unit per
    # module gathers 7 times
    assert forward.calls["all_gather"] == 3, forward
    events = _EVENTS.pop(rank)
    assert events.index(("gather", model[1])) < events.index(("compute", model[0][0])), events
    with patched(fs_backward._Regather, "start", _logged_regather):
        loss.backward()
    # the last Linear's backward comes first, with nothing before it; then the second
    # block's starts the first block's
    assert _EVENTS.pop(rank) == [("ahead", model[0])]
    assert not fs_module._gathered


class _Checkpointed(torch.nn.Module):
    """A block whose forward checkpoints its body (as ``checkpoint_wrapper`` does)."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), \
            torch.nn.Linear(32, 12)

    def body(self, x):
        return x + self.b(F.gelu(self.norm(self.a(x))))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def check_a_checkpoint_inside_a_unit_of_a_call_recomputes_alike():
    """The unit's gather runs before the checkpoint and not in its recompute: its
    parameters are gathered again as its backward begins (FSDP2's pre-backward gather),
    its Linears save alike in both passes, and training equals one process."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(_Checkpointed(), _Checkpointed(), torch.nn.Linear(12, 7))
    sharded, xs, ys = _trained_in_units_of_calls(model, lambda m: m[:2])
    assert not fs_module._gathered
    # before each unit's backward (its recompute included) its parameters are gathered
    # once, as FSDP2's are: the two blocks' and the head's (not one per op read)
    loss = F.cross_entropy(sharded(xs), ys)
    with gt.debug.comm_stats() as backward:
        loss.backward()
    assert backward.calls["all_gather"] == 3, backward
    assert all(q.sbp == (S(0),) for q in sharded.parameters())   # the shards back
    # a frozen block after a trained one: gathered for its backward, no gradient of its
    # own; its shards are back when the backward ends
    for q in sharded[1].parameters():
        q.requires_grad_(False)
    F.cross_entropy(sharded(xs), ys).backward()
    assert all(q.sbp == (S(0),) for q in sharded.parameters())


class _Outer(torch.nn.Module):
    """Blocks each checkpointed from outside (the unit inside the checkpoint)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 12)) for _ in range(2))
        self.head = torch.nn.Linear(12, 7)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def check_a_unit_of_a_call_checkpointed_gathers_its_weights_once_in_backward():
    """Checkpointed from outside, a unit's recompute gathers it once and its Linears'
    weights come back in one gather for them all (not one per Linear); values equal
    one process."""
    def model():
        torch.manual_seed(0)
        return _Outer()
    sharded, xs, ys = _trained_in_units_of_calls(model, lambda m: m.blocks)
    loss = F.cross_entropy(sharded(xs), ys)
    with gt.debug.comm_stats() as backward:
        loss.backward()
    # the head's weight again; per block its recompute's gather and its Linears' one
    assert backward.calls["all_gather"] == 1 + 2 * 2, backward



# (what a world of 4 would add: more ranks of the same messages)
test_world2 = world_test(__name__, 2, ["check_a_call_is_one_unit_and_the_next_is_gathered_ahead",
                                       "check_a_checkpoint_inside_a_unit_of_a_call_recomputes_alike",
                                       "check_a_unit_of_a_call_checkpointed_gathers_its_weights_once_in_backward"])
