"""Replay by call index (``record.replay_by_index``): a call of a replayed step that is
the one the plan expects next skips the general path (its planned decision runs
directly, or is carried out with its boxing); the step computes exactly what the
general path's replay computes, and a call the plan does not know still goes to the
general path (its look-ahead), after which the replay by index goes on. In a world of 2."""
from __future__ import annotations

from mp import world_test

B, T, C = 4, 6, 8


def _model(seed: int):
    """A Megatron MLP (fc1 split by rows, fc2 by columns) and its plain twin."""
    import copy

    import torch

    import globaltensor as gt
    torch.manual_seed(seed)
    plain = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, 4 * C),
                                torch.nn.GELU(), torch.nn.Linear(4 * C, C))
    S, Bc = gt.sbp.split, gt.sbp.broadcast

    def sbp(name, t):
        return {"1.weight": S(0), "1.bias": S(0), "3.weight": S(1)}.get(name, Bc)
    model = gt.nn.to_global(copy.deepcopy(plain), gt.placement.all("cpu"), sbp)
    return model, plain


def _train(model, x, steps: int, by_index: bool) -> tuple:
    """Losses and parameters after ``steps`` SGD steps; how many calls of the last step
    were replayed by index (``by_index=False``: none may be)."""
    import torch

    from globaltensor.planner import record
    real = record.replay_by_index
    hits = [0]

    def counted(*args):
        found = real(*args) if by_index else None
        hits[0] += found is not None
        return found
    record.replay_by_index = counted
    try:
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
        for _ in range(steps):
            hits[0] = 0
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.full())
    finally:
        record.replay_by_index = real
    return torch.stack(losses), [p.full() for p in model.parameters()], hits[0]


def _scenario(by_index: bool) -> tuple:
    """Train until the step is planned and replayed, then with one call the plan does
    not know in the middle of the step (a forward hook): (losses, parameters, calls
    replayed by index in the last step, whether the plan is still kept)."""
    import torch

    import globaltensor as gt
    from globaltensor.planner import record
    torch.manual_seed(5)
    x = gt.to_global(torch.randn(B, T, C), gt.placement.all("cpu"), gt.sbp.broadcast)
    model, _ = _model(1)
    before = _train(model, x, record.RECORD_AT + 2, by_index)
    model[2].register_forward_hook(lambda m, i, o: o * 1.0)
    after = _train(model, x, 2, by_index)
    kept = bool(record.state.plans)
    record.clear()
    return torch.cat([before[0], after[0]]), after[1], (before[2], after[2]), kept


def check_replay_by_index_computes_what_the_replay_does():
    import torch
    fast, general = _scenario(True), _scenario(False)
    assert min(fast[2]) > 20 and general[2] == (0, 0), (fast[2], general[2])
    assert fast[3] and general[3]   # the unknown call did not end the replay
    assert torch.equal(fast[0], general[0])
    for p, q in zip(fast[1], general[1]):
        assert torch.equal(p, q)


# (each rank counts its own replays through a patched function: the process's)
test_world2 = world_test(__name__, 2, ["check_replay_by_index_computes_what_the_replay_does"],
                         in_processes=["check_replay_by_index_computes_what_the_replay_does"])
