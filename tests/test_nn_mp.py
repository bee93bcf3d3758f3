"""gt.nn.to_global in worlds of 2 and 4: values come from the placement's first rank and
each rank receives only its part (peak memory measured); modules built on the meta
device allocate only their parts and are filled by reset_parameters / nn.init with
placement-invariant values; tied parameters stay one parameter."""
from __future__ import annotations

import copy

import torch

import globaltensor as gt

from mp import checks_in_worlds
from rss import peak_rise

B, S = gt.sbp.broadcast, gt.sbp.split


def _layouts():
    n = gt.get_world_size()
    every, rev = gt.placement("cpu", list(range(n))), gt.placement("cpu", list(range(n))[::-1])
    out = [(rev, S(0)), (every, B), (gt.placement("cpu", [n - 1]), S(1)),
           (every, gt.sbp.partial_sum)]
    if n == 4:
        out.append((gt.placement("cpu", [[3, 2], [1, 0]]), (S(0), S(1))))
    return out


def _net():
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9),
                               torch.nn.Linear(9, 5), torch.nn.BatchNorm1d(5))


def check_values_come_from_the_first_rank():
    for p, s in _layouts():
        torch.manual_seed(100 + gt.get_rank())          # every rank initialises differently
        net = _net()
        torch.manual_seed(100 + p.flat_ranks[0])
        reference = _net()
        gt.nn.to_global(net, p, lambda name, t: s if t.dim() >= 2 else (B,) * p.ndim)
        for (name, got), (_, want) in zip(net.state_dict().items(), reference.state_dict().items()):
            assert isinstance(got, gt.GlobalTensor), name
            assert torch.equal(got.full(), want), f"{name} on {p.ranks} {s}"


def check_tied_parameters_stay_one():
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(11, 4), "head": torch.nn.Linear(4, 11)})
    m.head.weight = m.emb.weight
    reference = copy.deepcopy(m)
    gt.nn.to_global(m, p, lambda name, t: S(0) if t.dim() == 2 else B)
    assert m.head.weight is m.emb.weight and isinstance(m.emb.weight, gt.GlobalTensor)
    assert len(list(m.parameters())) == 2 and m.emb.weight.sbp == (S(0),)
    ids = torch.tensor([[1, 3, 5], [7, 9, 2]])
    for model, x in ((m, gt.tensor(ids, placement=p, sbp=S(0))), (reference, ids)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            model.head(model.emb(x)).logsumexp(-1).mean().backward()
            opt.step()
    assert torch.equal(reference.head.weight, reference.emb.weight)
    torch.testing.assert_close(m.emb.weight.full(), reference.emb.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.head.bias.full(), reference.head.bias, rtol=1e-5, atol=1e-6)


def check_meta_modules_allocate_parts_and_init_in_place():
    values = []
    rank = gt.get_rank()
    for p, s in _layouts():
        with torch.device("meta"):
            net = _net()
        sbp = lambda name, t: s if t.dim() >= 2 else (B,) * p.ndim   # noqa: E731
        gt.nn.to_global(net, p, sbp)
        for name, t in net.state_dict().items():
            assert isinstance(t, gt.GlobalTensor) and t.to_local().device.type == "cpu", name
            if rank in p:
                assert tuple(t.to_local().shape) == t.layout_.local_shape(rank), name
            else:
                assert t.to_local().numel() == 0, name
        gt.manual_seed(7)
        for module in net:
            module.reset_parameters()
        values.append({k: v.full() for k, v in net.state_dict().items()})
    for got in values[1:]:
        for name, want in values[0].items():
            assert torch.equal(got[name], want), name
    w = values[0]["0.weight"]
    assert w.abs().max() <= 1 / 6 ** 0.5 and w.std() > 0.1     # kaiming_uniform_'s bound
    assert torch.equal(values[0]["1.weight"], torch.ones(9))
    assert torch.equal(values[0]["3.running_var"], torch.ones(5))
    # and it trains: forward and backward through the initialised global module
    p = gt.placement.all("cpu")
    with torch.device("meta"):
        net = _net()
    gt.nn.to_global(net, p, B)
    for module in net:
        module.reset_parameters()
    x = gt.randn(8, 6, placement=p, sbp=S(0))
    net(x).square().mean().backward()
    assert net[0].weight.grad.sbp == (B,)


def check_memory_is_the_part():
    """Peak resident memory rise per rank: converting a plain module to a split layout
    holds only the part beyond the module (the first rank sends parts, no whole copy
    arrives elsewhere); a meta module's to_global + reset_parameters only the part."""
    n = gt.get_world_size()
    p = gt.placement.all("cpu")
    rows, cols = 4096, 2048                        # 32 MiB of fp32 weight
    part_mib = rows * cols * 4 / n / 2 ** 20
    warm = torch.nn.Linear(8, 8)
    gt.nn.to_global(warm, p, S(0))
    with torch.device("meta"):
        meta = torch.nn.Linear(cols, rows)
    with peak_rise() as peak:
        gt.nn.to_global(meta, p, S(0))
        meta.reset_parameters()
    assert peak.mib <= 1.3 * part_mib + 4, ("meta init", peak.mib, part_mib)
    if gt.get_rank() == 0:
        plain = torch.nn.Linear(cols, rows)          # only the first rank's values count
    else:
        with torch.device("meta"):
            plain = torch.nn.Linear(cols, rows)      # (other ranks need no real module)
        plain.to_empty(device="cpu")
    with peak_rise() as peak:
        gt.nn.to_global(plain, p, S(0))
    assert peak.mib <= 1.3 * part_mib + 4, ("to_global", gt.get_rank(), peak.mib, part_mib)


CHECKS = ["check_memory_is_the_part", "check_values_come_from_the_first_rank",
          "check_tied_parameters_stay_one", "check_meta_modules_allocate_parts_and_init_in_place"]

test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
