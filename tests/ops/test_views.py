"""Views and shape ops: view/reshape (merging and splitting dims), flatten, transpose,
permute, unsqueeze/squeeze, expand, indexing and slicing, split/chunk/unbind, cat,
stack, contiguous, and in-place writes through views.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
from ops_battery import B, P, S, battery_tests, case, checked, mesh, placements, randn

import globaltensor as gt


@checked
def check_views():
    x = randn((5, 4), "vx")
    x3 = randn((2, 3, 4), "vx3")
    unary = [
        ("view(4,5)", lambda x: x.view(4, 5), x),
        ("reshape(2,10) (5,4)", lambda x: x.reshape(2, 10), x),
        ("reshape(-1)", lambda x: x.reshape(-1), x),
        ("reshape(5,2,2) split dim", lambda x: x.reshape(5, 2, 2), x),
        ("view(6,4) merge dims", lambda x: x.view(6, 4), x3),
        ("reshape(2,12) merge dims", lambda x: x.reshape(2, 12), x3),
        ("view(2,3,2,2) split last", lambda x: x.view(2, 3, 2, 2), x3),
        ("flatten()", lambda x: x.flatten(), x3),
        ("flatten(1)", lambda x: torch.flatten(x, 1), x3),
        ("transpose(0,1)", lambda x: x.transpose(0, 1), x),
        ("transpose(1,2) 3-D", lambda x: torch.transpose(x, 1, 2), x3),
        ("permute(2,0,1)", lambda x: x.permute(2, 0, 1), x3),
        ("t()", lambda x: x.t(), x),
        ("t().reshape(-1)", lambda x: x.t().reshape(-1), x),
        ("unsqueeze(0)", lambda x: x.unsqueeze(0), x),
        ("unsqueeze(-1)", lambda x: x.unsqueeze(-1), x),
        ("squeeze(1)", lambda x: x.squeeze(1), randn((5, 1, 3), "vsq")),
        ("squeeze()", lambda x: x.squeeze(), randn((1, 5, 1), "vsq2")),
        ("sum().squeeze(0) of a 0-d", lambda x: x.sum().squeeze(0), x),
        ("expand(5,4)", lambda x: x.expand(5, 4), randn((5, 1), "vex")),
        ("expand(3,5,4)", lambda x: x.expand(3, -1, -1), x),
        ("x[1:4]", lambda x: x[1:4], x),
        ("x[:, 0]", lambda x: x[:, 0], x),
        ("x[:, 1:3]", lambda x: x[:, 1:3], x),
        ("x[::2]", lambda x: x[::2], x),
        ("x[-1]", lambda x: x[-1], x),
        ("select(1,2)", lambda x: x.select(1, 2), x),
        ("narrow(0,1,3)", lambda x: x.narrow(0, 1, 3), x),
        ("split(2) tuple", lambda x: x.split(2), x),
        ("split(3,dim=1)", lambda x: torch.split(x, 3, dim=1), x),
        ("chunk(2,dim=1)", lambda x: x.chunk(2, dim=1), x),
        ("unbind(0) 3-D", lambda x: x.unbind(0), x3),
        ("t().contiguous()", lambda x: x.t().contiguous(), x),
        ("contiguous()", lambda x: x.contiguous(), x),
        # in-place view ops change the tensor's own shape
        ("squeeze_(1)", lambda x: (x * 1).squeeze_(1), randn((5, 1, 3), "vsq_")),
        ("unsqueeze_(0)", lambda x: (x * 1).unsqueeze_(0), x),
        ("t_()", lambda x: (x * 1).t_(), x),
        ("transpose_(0,2)", lambda x: (x * 1).transpose_(0, 2), x3),
    ]
    for name, op, v in unary:
        case(name, op, [v], places=placements(4, 1, 3))
    y = randn((3, 4), "vy")
    z = randn((5, 4), "vz")
    case("cat dim 0 (5,4)+(3,4)", lambda a, b: torch.cat([a, b]), [x, y],
         places=placements(8, 1, 4))
    case("cat dim 1 (5,4)+(5,4)", lambda a, b: torch.cat([a, b], dim=1), [x, z],
         places=placements(8, 0, 4))
    # A zero-size input among partial sums used to make the output zeros.
    empty = randn((5, 0), "vempty")
    for name, op in (("cat dim 1 (5,0)+(5,4)", lambda a, b: torch.cat([a, b], dim=1)),
                     ("cat dim 1 (5,4)+(5,0)", lambda a, b: torch.cat([b, a], dim=1))):
        case(name, op, [empty, z], choices=[[P, B, S(0)], [P, B, S(0)]], must=[(P, P)],
             places=placements(9, 1, 4))
    case("stack dim 0", lambda a, b: torch.stack([a, b]), [x, z], places=placements(8, 1, 4))
    case("stack dim 2", lambda a, b: torch.stack((a, b), dim=2), [x, z],
         places=placements(6, 0, 3))
    # A dim split on both axes of the 2x2 mesh: the second axis cuts the first one's
    # part, so its parts line up with a split of another output dim.
    if gt.get_world_size() == 4:
        x816 = randn((8, 16, 16), "vnested")
        for name, op in (("view(8,16,2,8) nested", lambda x: x.view(8, 16, 2, 8)),
                         ("view(2,4,16,16) nested", lambda x: x.view(2, 4, 16, 16)),
                         ("reshape(8,256) nested", lambda x: x.reshape(8, 256))):
            case(name, op, [x816], choices=[[S(0), S(2)]], places=[(mesh(), 4)])
    case("view then add", lambda a, b: a.view(4, 5) + b.reshape(4, 5), [x, z],
         places=placements(6, 0, 3))
    # In-place writes through views: where a view needs its dim gathered (a select or
    # slice of a split dim), it is a copy on each rank, and the write must still reach
    # the tensor (it was lost: w[1] = 0 left w unchanged).
    for name, write in _WRITES:
        case(name, lambda x, write=write: _written(x, write), [x], places=placements(6, 1, 3))
    # (autograd refuses writes to the views of unbind)
    case("unbind rows mul_", lambda x: _written(x, _add_to_rows), [x], grad=False,
         places=placements(6, 1, 3))
    case("y[2] = x2[0] * 3", lambda a, b: _written(a, lambda y: y.__setitem__(2, b[0] * 3)),
         [x, z], places=placements(6, 1, 3))


def check_cat_with_an_empty_start_keeps_the_split():
    """torch's cat skips a 1-D tensor of no elements, as a key-value cache's empty start
    (``torch.cat([torch.tensor([]), k], dim=-2)``, Hugging Face's cache in every forward
    with use_cache): the others' split stays, with no communication. The list's empty
    plain tensor made the output broadcast (an all-gather of keys and values per layer)."""
    placement = gt.placement.all("cpu")
    k = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).view(2, 4, 6, 3)
    for start in (torch.tensor([]), gt.tensor(torch.tensor([]), placement=placement, sbp=B)):
        for sbp in (S(0), S(1), S(3)):
            key = gt.tensor(k, placement=placement, sbp=sbp, requires_grad=True)
            with gt.implicit_broadcast(), gt.debug.comm_stats() as stats:
                out = torch.cat([start, key], dim=-2)
                more = torch.cat([out, start, key], dim=-2)
            assert out.sbp == (sbp,) and more.sbp == (sbp,) and not stats.calls, (sbp, stats)
            torch.testing.assert_close(more.full(), torch.cat([k, k], dim=-2))
            more.square().sum().backward()
            torch.testing.assert_close(key.grad.full(), 4 * k)


def check_narrow_by_a_start_tensor_under_inference_mode():
    """``x.narrow(dim, start, length)`` with a 0-d tensor start reads the start's value
    (torch defines it by ``narrow`` with an int). Under ``torch.inference_mode()`` it
    reaches dispatch whole, where narrow's rule sent it to the meta run, which raised
    (``Tensor.item() cannot be called on meta tensors``)."""
    placement = gt.placement.all("cpu")
    x = torch.arange(60.0).view(5, 12)
    for sbp in (S(0), S(1), B):
        with torch.inference_mode():
            g = gt.tensor(x, placement=placement, sbp=sbp)
            for start in (torch.tensor(1), gt.tensor(torch.tensor(1), placement=placement, sbp=B)):
                torch.testing.assert_close(g.narrow(1, start, 3).full(), x[:, 1:4])
                torch.testing.assert_close(g.narrow(0, start, 2).full(), x[1:3])


def _written(x, write):
    y = x * 1          # (a non-leaf of x's layout, which autograd lets be written)
    write(y)
    return y


def _add_to_rows(y):
    for row in y.unbind(0):    # views of one copy, written one after another
        row.mul_(2)


_WRITES = [
    ("y[1] = 0", lambda y: y.__setitem__(1, 0.0)),
    ("y[1, 2] = 7", lambda y: y.__setitem__((1, 2), 7.0)),
    ("y[:, 2] = -5", lambda y: y.__setitem__((slice(None), 2), -5.0)),
    ("y[1:4] *= 2", lambda y: y[1:4].mul_(2)),
    ("y[::2, 1:3].zero_()", lambda y: y[::2, 1:3].zero_()),
    ("y.narrow(0,1,3).add_(1)", lambda y: y.narrow(0, 1, 3).add_(1)),
    ("y.diagonal().fill_(3)", lambda y: y.diagonal().fill_(3)),
    ("y.t()[1] = y.t()[0]", lambda y: y.t().__setitem__(1, y.t()[0] * 1)),
    ("y[-1][0] = 4 (a view of a view)", lambda y: y[-1].__setitem__(0, 4.0)),
]


@checked
def check_writes_through_copied_views():
    p = gt.placement.all("cpu")
    split = gt.sbp.split
    # a view taken before its tensor changed: a copy would be stale, so the write raises
    w = gt.zeros(6, 3, placement=p, sbp=split(0))
    row = w[1]
    w.add_(1)
    try:
        row.fill_(0)
    except RuntimeError as e:
        assert "out of date" in str(e), e
    else:
        raise AssertionError("a write through a stale copy did not raise")
    # where the view shares the part (no copy), torch's semantics hold
    w = gt.zeros(6, 3, placement=p, sbp=split(1))
    row = w[1]
    w.add_(1)
    row.fill_(5)
    torch.testing.assert_close(w.full(), torch.ones(6, 3).index_fill_(0, torch.tensor([1]), 5))
    # torch's initialisers write through such views: a vocabulary-parallel embedding's
    # padding row, nn.init.dirac_ on a convolution split over output channels
    with torch.device("meta"):
        emb = torch.nn.Embedding(10, 4, padding_idx=7)
    gt.nn.to_global(emb, p, split(0))
    emb.reset_parameters()
    torch.testing.assert_close(emb.weight.full()[7], torch.zeros(4))
    conv = gt.empty(4, 4, 3, 3, placement=p, sbp=split(0))
    torch.nn.init.dirac_(conv)
    torch.testing.assert_close(conv.full(), torch.nn.init.dirac_(torch.empty(4, 4, 3, 3)))
    # composite out= ops that write their result through a view of out: kron's
    # _unsafe_view of a split out, whose copy was written and the out left zeros
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 5, generator=gen), torch.randn(2, 4, generator=gen)
    for sbp in (split(0), split(1), gt.sbp.broadcast):
        out = gt.zeros(10, 20, placement=p, sbp=sbp)
        assert torch.kron(gt.tensor(a, placement=p, sbp=split(0)), gt.tensor(b, placement=p, sbp=split(1)),
                          out=out) is out
        torch.testing.assert_close(out.full(), torch.kron(a, b), msg=lambda m: f"kron out= {sbp}: {m}")


CHECKS = ["check_views", "check_writes_through_copied_views", "check_cat_with_an_empty_start_keeps_the_split",
          "check_narrow_by_a_start_tensor_under_inference_mode"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
