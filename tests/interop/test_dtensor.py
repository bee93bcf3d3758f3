"""DTensor interop: x.to_dtensor() and gt.from_dtensor(d) on worlds of 2 and 4.

Round trips of every sbp (even and uneven splits, 2-D meshes, sub-placements), the
local part shared where DTensor's layout equals ours, uneven splits moved into
torch.chunk's layout (checked against DTensor's own distribute_tensor), gradients
through both conversions.
"""
import pytest
import torch
from mp import checks_in_worlds
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import boxing_log

S, B = gt.sbp.split, gt.sbp.broadcast
PSUM, PMAX = gt.sbp.partial_sum, gt.sbp.partial_max


def value(shape) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel()) % 23 + 1).reshape(shape).float()


def make(v: torch.Tensor, placement, sbp) -> gt.GlobalTensor:
    """``v`` in this layout; partial axes hold real addends (halves, or v - c for max)."""
    layout = Layout.make(v.shape, placement, sbp)
    if not layout.partial_axes:
        return gt.tensor(v, placement=placement, sbp=sbp)
    rank = gt.get_rank()
    if rank not in placement:
        return gt.from_local(torch.empty(0), placement=placement, sbp=sbp, shape=v.shape)
    local = v[layout.region(rank).slices()].clone()
    coord = placement.coord(rank)
    for axis in layout.partial_axes:
        size, c = placement.shape[axis], coord[axis]
        local = local * 2.0 ** -min(c + 1, size - 1) if layout.sbp[axis].reduce == "sum" \
            else local - c
    return gt.from_local(local, placement=placement, sbp=sbp, shape=v.shape)


def _cases():
    n = gt.get_world_size()
    P = gt.placement.all("cpu")
    cases = [(P, sbp, shape) for shape in [(8, 6), (7, 5), (2, 3)]
             for sbp in [S(0), S(1), B, PSUM, PMAX]]
    sub = gt.placement("cpu", list(range(1, n, 2)))
    cases += [(sub, S(0), (5, 2)), (sub, PSUM, (3,))]
    if n == 4:
        mesh = gt.placement("cpu", [[0, 1], [2, 3]])
        cases += [(mesh, sbp, (5, 7)) for sbp in
                  [(S(0), S(1)), (B, S(0)), (PSUM, S(1)), (S(0), S(0)), (S(1), PMAX)]]
    return cases


def _dtensor_placement(s):
    if isinstance(s, gt.sbp.Split):
        return Shard(s.dim)
    return Replicate() if s == B else Partial(s.reduce)


def round_trip_every_layout():
    for placement, sbp, shape in _cases():
        v = value(shape)
        x = make(v, placement, sbp)
        d = x.to_dtensor()
        assert d.placements == tuple(_dtensor_placement(s) for s in x.sbp), (sbp, d.placements)
        assert d.device_mesh.mesh.tolist() == placement.ranks
        assert d.shape == x.shape and d.dtype == x.dtype
        if gt.get_rank() in placement:
            assert torch.equal(d.full_tensor(), v), (placement, sbp, shape)
        y = gt.from_dtensor(d)
        assert y.placement == placement and y.sbp == x.sbp, (y, x)
        assert torch.equal(y.full(), v), (placement, sbp, shape)


def local_part_shared_where_layouts_coincide():
    n = gt.get_world_size()
    P = gt.placement.all("cpu")
    # (8, 6) splits evenly; 5 rows over 2 ranks is 3 + 2 in both layouts.
    for shape, sbp in [((8, 6), S(0)), ((8, 6), B), ((4, 5), PSUM)] + \
            ([((5, 3), S(0))] if n == 2 else []):
        x = make(value(shape), P, sbp)
        d = x.to_dtensor()
        assert d.to_local().data_ptr() == x.to_local().data_ptr(), (shape, sbp)
        y = gt.from_dtensor(d)
        assert y.to_local().data_ptr() == x.to_local().data_ptr(), (shape, sbp)


def uneven_split_moves_into_torch_chunk_layout():
    n = gt.get_world_size()
    P = gt.placement.all("cpu")
    rank = gt.get_rank()
    for shape, dim in [((n + 1, 3), 0), ((3, 2 * n - 1), 1), ((2,), 0)]:
        v = value(shape)
        chunks = torch.chunk(v, n, dim=dim)
        x = gt.tensor(v, placement=P, sbp=S(dim))
        d = x.to_dtensor()
        want = chunks[rank] if rank < len(chunks) else v.narrow(dim, 0, 0)
        assert torch.equal(d.to_local(), want), (shape, rank, d.to_local(), want)
        # DTensor's own sharding of the value converts to our balanced parts.
        theirs = distribute_tensor(v, d.device_mesh, [Shard(dim)])
        assert torch.equal(theirs.to_local(), want)
        y = gt.from_dtensor(theirs)
        assert torch.equal(y.to_local(), x.to_local()) and torch.equal(y.full(), v)
        # A partial uneven tensor: DTensor's partial of the chunk layout, same value.
        p = make(v, P, PSUM).to_global(sbp=S(dim)).to_global(sbp=PSUM)
        assert torch.equal(gt.from_dtensor(p.to_dtensor()).full(), v)


def gradients_flow_through_both_conversions():
    n = gt.get_world_size()
    P = gt.placement.all("cpu")
    for shape in [(2 * n, 3), (n + 1, 3)]:  # even, and uneven (moved)
        v = value(shape)
        x = gt.tensor(v, placement=P, sbp=S(0), requires_grad=True)
        d = x.to_dtensor()
        (d * d).sum().backward()
        assert x.grad.sbp == x.sbp and torch.equal(x.grad.full(), 2 * v), shape

        leaf = distribute_tensor(v, d.device_mesh, [Shard(0)]).requires_grad_()
        y = gt.from_dtensor(leaf)
        (y * y * 3).sum().backward()
        assert torch.equal(leaf.grad.full_tensor(), 6 * v), shape
    # A partial sum both ways: each addend's gradient is the whole sum's
    w = value((2, 3))
    x = gt.from_local(torch.ones(2, 3) * (gt.get_rank() + 1), placement=P, sbp=PSUM).requires_grad_()
    d = x.to_dtensor()
    (d * distribute_tensor(w, d.device_mesh, [Replicate()])).sum().backward()
    assert torch.equal(x.grad.full(), w), x.grad.full()
    leaf = DTensor.from_local(torch.ones(2, 3), d.device_mesh, [Partial()]).detach().requires_grad_()
    (gt.from_dtensor(leaf) * gt.tensor(w, placement=P, sbp=B)).sum().backward()
    assert torch.equal(leaf.grad.full_tensor(), w), leaf.grad.full_tensor()
    # Through DTensor and back on a placement that leaves rank 0 out: the gradient there
    # too (DTensor's from_local made a new leaf on that rank: None; its to_local's
    # backward failed there)
    sub = gt.placement("cpu", list(range(1, n, 2)))
    x = gt.tensor(w, placement=sub, sbp=S(0), requires_grad=True)
    (gt.from_dtensor(x.to_dtensor()) * gt.tensor(w, placement=sub, sbp=B)).sum().backward()
    assert torch.equal(x.grad.full(), w), x.grad


def bad_input_raises():
    with pytest.raises(ValueError, match="needs a DTensor"):
        gt.from_dtensor(torch.ones(3))
    P = gt.placement.all("cpu")
    d = gt.zeros(4, placement=P, sbp=B).to_dtensor()
    avg = d.redistribute(d.device_mesh, [Replicate()])
    from torch.distributed.tensor import DTensor
    avg = DTensor.from_local(avg.to_local(), d.device_mesh, [Partial("avg")], run_check=False)
    with pytest.raises(ValueError, match="Partial"):
        gt.from_dtensor(avg)


def rechunking_is_boxing_logged_and_checked():
    # Moving an uneven split into DTensor's layout and back is a boxing as any other:
    # named in the debug log and in profiler ranges, checked in check mode.
    P = gt.placement.all("cpu")
    v = value((5, 3))  # over 4 ranks: 2, 1, 1, 1 rows here, 2, 2, 1, 0 in torch.chunk's
    x = gt.tensor(v, placement=P, sbp=S(0), requires_grad=True)
    with boxing_log() as logged:
        with gt.debug.check_consistency(), torch.profiler.profile() as prof:
            d = x.to_dtensor()
            y = gt.from_dtensor(d)
            (y * y).sum().backward()
    assert torch.equal(y.full(), v) and torch.equal(x.grad.full(), 2 * v)
    names = [e.name for e in prof.events() if e.name.startswith("globaltensor")]
    for why in ("to_dtensor", "from_dtensor", "from_dtensor (backward)",
                "to_dtensor (backward)"):
        assert any(f"boxes for {why}:" in m and "Transfer" in m for m in logged), (why, logged)
        assert any(f"globaltensor: {why}: boxing" in m for m in names), (why, names)


CHECKS = ["round_trip_every_layout", "local_part_shared_where_layouts_coincide",
          "uneven_split_moves_into_torch_chunk_layout", "gradients_flow_through_both_conversions",
          "bad_input_raises"]
# (the profiler is one per process; DTensor's all-gather of uneven parts needs gloo's)
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, ["rechunking_is_boxing_logged_and_checked"],
    in_processes=["rechunking_is_boxing_logged_and_checked", "round_trip_every_layout"])
