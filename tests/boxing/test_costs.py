"""Per-backend cost constants: a placement's device chooses the backend, the backend the
constants; NCCL's partial -> split is one native reduce_scatter (run here on gloo's
reduce_scatter with NCCL's constants: the same code path), and explain names the
constants it priced with."""
import contextlib
import dataclasses

import pytest
import torch
from mp import checks_in_worlds, patched

import globaltensor as gt
from globaltensor import cost
from globaltensor.boxing import plan as boxing_plan
from globaltensor.boxing.steps.collectives import ReduceScatter
from globaltensor.layout import Layout
from globaltensor.nn import shard_comm
from globaltensor.placement import Placement
from globaltensor.sbp import broadcast, partial_sum, split


@contextlib.contextmanager
def _gloo_priced_as_nccl():
    """cpu placements priced, and run, with NCCL's constants (plans made again)."""
    with patched(cost._BY_BACKEND, "gloo", cost.NCCL):
        boxing_plan.clear_caches()
        try:
            yield
        finally:
            boxing_plan.clear_caches()


def test_cpu_is_priced_as_gloo_and_cuda_before_init_as_its_backend():
    assert cost.costs_for("cpu") is cost.GLOO
    expected = cost.NCCL if torch.distributed.is_nccl_available() and torch.cuda.device_count() \
        else cost.GLOO
    if not torch.distributed.is_initialized():
        cuda = cost.costs_for("cuda")
        assert dataclasses.replace(cuda, mac=expected.mac, element=expected.element) == expected
        # a GPU's compute rates, whichever backend carries its collectives
        assert cuda.mac < cost.GLOO.mac / 100 and cuda.element < cost.GLOO.element / 10


def test_a_cross_device_move_goes_at_the_slower_pace(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(cost._BY_BACKEND, "nccl", cost.NCCL)
    monkeypatch.setattr(gt.comm, "backend_of", lambda d: "nccl" if d == "cuda" else "gloo")
    a = Layout.make((8,), Placement("cpu", [0, 1]), split(0))
    b = Layout.make((8,), Placement("cuda", [0, 1]), split(0))
    assert cost.costs_of(b) is cost.NCCL
    assert cost.costs_of(a, b) is cost.GLOO


def test_nccl_prices_reduce_scatter_without_the_local_sum(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    src = Layout.make((1024, 64), Placement("cpu", [0, 1]), partial_sum)
    dst = Layout.make((1024, 64), Placement("cpu", [0, 1]), split(0))
    gloo = ReduceScatter.for_axis(0, src, dst).cost(4)
    with _gloo_priced_as_nccl():
        step = ReduceScatter.for_axis(0, src, dst)
        k = cost.NCCL
        moved = 1024 * 64 * 4
        assert step.cost(4) == pytest.approx(k.launch + k.alpha + k.beta * moved / 2)
        assert step.cost(4) < gloo
        assert "priced for nccl" in str(boxing_plan.plan_route(src, dst))
    text = str(boxing_plan.plan_route(src, dst))
    assert "priced for gloo" in text and "GB/s" in text, text


def test_padded_parts_are_each_part_padded_in_member_order():
    """What one all-gather or reduce_scatter of uneven parts moves, made and undone in a
    few ops: equal to padding each balanced part (lengths under, at and over n)."""
    from globaltensor.layout import balanced_split
    from globaltensor.local_parts import padded_parts, unpadded_parts
    for length, n, dim in [(0, 3, 0), (2, 4, 1), (7, 3, 0), (8, 4, 2), (13, 5, 1), (5, 8, 0)]:
        shape = [3, 4, 2]
        shape[dim] = length
        x = torch.randn(shape)
        parts = balanced_split(length, n)
        biggest = parts[0][1]
        want = [torch.cat([p := x.narrow(dim, o, s).movedim(dim, 0),
                           p.new_zeros((biggest - s,) + tuple(p.shape[1:]))]) for o, s in parts]
        got = padded_parts(x, dim, n)
        assert torch.equal(got, torch.cat(want)), (length, n, dim)
        back = unpadded_parts(got.reshape((n, biggest) + tuple(got.shape[1:])), length)
        assert torch.equal(back, x.movedim(dim, 0)), (length, n, dim)
    empty = torch.zeros(5, 0, 3)   # no elements: sizes stay known
    assert padded_parts(empty, 0, 2).shape == (6, 0, 3)
    assert unpadded_parts(torch.zeros(2, 3, 0, 3), 5).shape == (5, 0, 3)


def test_explain_names_the_backend():
    x = gt.randn(4, 6, placement=gt.placement("cpu", [0]), sbp=broadcast)
    assert "nothing to do" in str(gt.debug.explain(x, sbp=split(0)))


# --------------------------------------------------------------------------------------
# in worlds of 2 and 4: the native reduce_scatter's values
# --------------------------------------------------------------------------------------

def check_native_reduce_scatter_values():
    """partial -> split by one reduce_scatter (even and uneven parts, dim 0 and 1, sum
    and max, a 2-D placement's inner axis) equals the one-process value."""
    n = gt.get_world_size()
    rank = gt.get_rank()
    meshes = [gt.placement("cpu", list(range(n)))]
    if n == 4:
        meshes.append(gt.placement("cpu", [[0, 1], [2, 3]]))
    with _gloo_priced_as_nccl():
        for P in meshes:
            for shape, dim in [((8, 6), 0), ((7, 5), 0), ((6, 9), 1), ((3, 4, 5), 2)]:
                for reduce in (partial_sum, gt.sbp.partial_max):
                    torch.manual_seed(shape[0] * 10 + dim)
                    addends = [torch.randn(shape) for _ in range(n)]
                    whole = torch.stack(addends).sum(0) if reduce == partial_sum else \
                        torch.stack(addends).amax(0)
                    sbp = (reduce,) * P.ndim
                    dst = (split(dim),) * P.ndim if P.ndim == 1 else (broadcast, split(dim))
                    if P.ndim == 2:     # reduce the outer axis first, by an all-reduce
                        sbp = (broadcast, reduce)
                        whole = addends[0] + addends[1] if reduce == partial_sum else \
                            torch.maximum(addends[0], addends[1])
                        mine = addends[P.coord(rank)[1]]
                    else:
                        mine = addends[rank]
                    x = gt.from_local(mine, placement=P, sbp=sbp)
                    with gt.debug.comm_stats() as counted:
                        y = x.to_global(P, dst)
                    assert counted.calls.get("reduce_scatter", 0) == 1, counted.calls
                    torch.testing.assert_close(y.full(), whole)


def check_native_all_to_all_values():
    """split(i) -> split(j) where NCCL serves: one all_to_all_single where the parts
    are even, the exchange of parts where not (i before and after j, a 2-D placement's
    axes); the one-process value either way."""
    from globaltensor.boxing.steps.collectives import AllToAll
    n = gt.get_world_size()
    meshes = [gt.placement("cpu", list(range(n)))]
    if n == 4:
        meshes.append(gt.placement("cpu", [[0, 1], [2, 3]]))
    native, counted_native = AllToAll._native, []

    def counting(self, *args):
        counted_native.append(self)
        return native(self, *args)
    AllToAll._native = counting
    try:
        _all_to_all_cases(meshes)
    finally:
        AllToAll._native = native
    assert counted_native, "no even case took the native path"


def _all_to_all_cases(meshes) -> None:
    with _gloo_priced_as_nccl():
        for P in meshes:
            for shape, i, j in [((8, 12), 0, 1), ((7, 5), 0, 1), ((5, 9), 1, 0),
                                ((3, 6, 5), 2, 0), ((6, 3, 7), 0, 2), ((5, 7, 2), 1, 0)]:
                torch.manual_seed(sum(shape) + i)
                whole = torch.randn(shape)
                other = (broadcast,) * (P.ndim - 1)
                x = gt.tensor(whole, placement=P, sbp=other + (split(i),))
                with gt.debug.comm_stats() as counted:
                    y = x.to_global(P, other + (split(j),))
                assert set(counted.calls) == {"all_to_all"}, (shape, i, j, counted.calls)
                torch.testing.assert_close(y.full(), whole)
                assert y.to_local().shape == y.global_layout.local_shape(gt.get_rank())


def check_a_plans_sent_bytes_are_what_comm_stats_counts():
    """``Step.sent_bytes`` (explain_step's estimate of a plan's bytes) equals the bytes
    ``comm_stats`` counts when the plan runs, for every kind of step (even parts)."""
    from globaltensor.boxing.plan import plan_route
    n = gt.get_world_size()
    P = gt.placement("cpu", list(range(n)))
    half = gt.placement("cpu", list(range(n // 2)))
    cases = [(P, partial_sum, P, broadcast), (P, partial_sum, P, split(0)),
             (P, split(0), P, broadcast), (P, split(0), P, split(1)),
             (P, broadcast, P, split(1)), (P, split(0), half, split(1))]
    for src_p, src_sbp, dst_p, dst_sbp in cases:
        x = gt.to_global(torch.ones(8, 12), src_p, broadcast)
        if src_sbp != broadcast:
            x = x.to_global(sbp=src_sbp) if src_sbp != partial_sum else \
                gt.from_local(torch.ones(8, 12), placement=src_p, sbp=partial_sum)
        plan = plan_route(x.global_layout, Layout.make((8, 12), dst_p, dst_sbp), 4)
        with gt.debug.comm_stats() as counted:
            x.to_global(dst_p, dst_sbp)
        expected = sum(step.sent_bytes(4) for step in plan.steps)
        busiest = gt.from_local(torch.tensor([float(counted.total_bytes)]), placement=P,
                                sbp=gt.sbp.partial_max).to_global(sbp=broadcast).item()
        assert busiest == expected, (src_sbp, dst_sbp, busiest, plan)


def check_fully_shard_reduces_gradients_by_one_reduce_scatter_where_native():
    """fully_shard's gradients reach their parts by reduce_scatters where the backend has
    a native one (FSDP2's way on NCCL): a unit's small ones in one, packed, a large one
    alone; by an exchange of parts on gloo; rows uneven over the ranks too; all equal
    one process's gradients."""
    n = gt.get_world_size()
    P = gt.placement.all("cpu")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 2 * n + 1), torch.nn.Tanh(),
                                   torch.nn.Linear(2 * n + 1, 5))
    reference, x = mlp(), torch.randn(4 * n, 6)
    reference(x).square().mean().backward()
    # (OWN_GATHER_BYTES 0: every gradient large, each alone; else one per unit)
    cases = [(priced, native and (2 if own else 4), own) for priced, native in
             ((contextlib.nullcontext, False), (_gloo_priced_as_nccl, True))
             for own in (shard_comm.OWN_GATHER_BYTES, 0)]   # gathered in a bucket, alone
    for priced, scatters, own in cases:
        with priced(), patched(shard_comm, "OWN_GATHER_BYTES", own):
            model = gt.nn.fully_shard(mlp(), P)
            with gt.debug.comm_stats() as counted:
                model(gt.tensor(x, placement=P, sbp=split(0))).square().mean().backward()
            assert counted.calls.get("reduce_scatter", 0) == scatters, counted.calls
            for (name, t), want in zip(model.named_parameters(), reference.parameters()):
                assert t.grad.sbp == (split(0),), name
                torch.testing.assert_close(t.grad.full(), want.grad, rtol=1e-5, atol=1e-6)


CHECKS = ["check_native_reduce_scatter_values", "check_native_all_to_all_values",
          "check_a_plans_sent_bytes_are_what_comm_stats_counts",
          "check_fully_shard_reduces_gradients_by_one_reduce_scatter_where_native"]
# (the first counts the collectives gloo itself runs, the second its rank's native calls)
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS, in_processes=[
    "check_fully_shard_reduces_gradients_by_one_reduce_scatter_where_native",
    "check_native_all_to_all_values"])
