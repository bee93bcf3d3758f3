"""gt.nn.to_global in worlds of 2 and 4: values come from the placement's first rank and
each rank receives only its part (peak memory measured); modules built on the meta
device allocate only their parts and are filled by reset_parameters / nn.init with
placement-invariant values, and a meta buffer nothing would fill raises (built under
gt.nn.meta_init() it is real); tied parameters stay one parameter.
gt.nn.full_state_dict gives the whole plain values on the ranks asked for (gathered to
those ranks only), which safetensors saves; safetensors given a GlobalTensor raises an
error naming the function and the fix."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.testing import peak_rise

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
                assert tuple(t.to_local().shape) == t.global_layout.local_shape(rank), name
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


class _Masked(torch.nn.Module):
    """Causal attention over a mask buffer made in __init__ (nanoGPT's), a BatchNorm,
    a tied head, buffers of other dtypes, one of them not persistent."""

    def __init__(self, c: int = 8, t: int = 6):
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(10, c), torch.nn.Linear(c, 3 * c)
        self.norm, self.head = torch.nn.BatchNorm1d(t), torch.nn.Linear(c, 10)
        self.head.weight = self.emb.weight
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, t, t))
        self.register_buffer("scale", torch.full((c,), 0.5, dtype=torch.float64))
        self.register_buffer("steps", torch.arange(4), persistent=False)

    def forward(self, idx):
        q, k, v = self.qkv(self.emb(idx)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = att.masked_fill(self.bias == 0, float("-inf")).softmax(-1)
        return self.head(self.norm(att @ v) * self.scale.float())


def _masked_layout(name, t):
    if name in ("emb.weight", "qkv.weight"):
        return S(0)
    return gt.sbp.partial_sum if name == "qkv.bias" else B


def check_full_state_dict_on_the_ranks_asked():
    n, rank = gt.get_world_size(), gt.get_rank()
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    reference = _Masked()
    model = gt.nn.to_global(copy.deepcopy(reference), p, _masked_layout)
    want = reference.state_dict()
    for ranks in ((0,), (0, 1)):
        with gt.debug.comm_stats() as stats:
            state = gt.nn.full_state_dict(model, ranks=ranks)
        if ranks == (0,):
            to_first = stats
        if rank not in ranks:
            assert state == {}
            continue
        assert list(state) == list(want)                  # "steps" is not persistent
        for name, value in want.items():
            got = state[name]
            assert type(got) is torch.Tensor and got.dtype == value.dtype, name
            assert torch.equal(got, value), name
        assert state["head.weight"] is state["emb.weight"]  # tied: gathered once
    # to rank 0 only: each split weight's parts that rank 0 lacks are sent to it once,
    # nothing is gathered elsewhere; the partial bias is all-reduced (its one collective)
    lacking = sum(t.numel() - math.prod(t.global_layout.local_shape(0))
                  for t in (model.emb.weight, model.qkv.weight)) * 4
    sent = torch.tensor([float(to_first.bytes["send"])])
    torch.distributed.all_reduce(sent)
    assert sent.item() == lacking, (sent.item(), lacking, to_first)
    assert set(to_first.calls) <= {"send", "recv", "all_reduce"}, to_first
    assert to_first.calls["all_reduce"] == 1, to_first
    sharded = gt.nn.fully_shard(copy.deepcopy(reference), p)
    state = gt.nn.full_state_dict(sharded, ranks=(0, 1))
    for name, value in want.items():
        assert rank > 1 or torch.equal(state[name], value), name
    with pytest.raises(ValueError, match="ranks"):
        gt.nn.full_state_dict(model, ranks=(0, n))


def check_saving_for_other_tools():
    import os
    import tempfile

    import safetensors.torch as safetensors  # in the test extra
    p = gt.placement.all("cpu")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.BatchNorm1d(9),
                                torch.nn.Linear(9, 5))
    model = gt.nn.to_global(copy.deepcopy(plain), p, lambda name, t: S(0) if t.dim() == 2 else B)
    with pytest.raises(TypeError, match=r"safetensors\.torch\.storage_ptr\(\) called "
                       r"GlobalTensor\.storage\(\).*gt\.nn\.full_state_dict"):
        safetensors.save_file(model.state_dict(), os.devnull)
    with pytest.raises(TypeError, match=r"check_saving_for_other_tools\(\) called "
                       r"GlobalTensor\.data_ptr\(\)"):
        model[0].weight.data_ptr()
    state = gt.nn.full_state_dict(model)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    model.eval()
    out = model(gt.tensor(x, placement=p, sbp=B)).full()
    if gt.get_rank() == 0:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.safetensors")
            safetensors.save_file(state, path)
            torch.manual_seed(1)
            fresh = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.BatchNorm1d(9),
                                        torch.nn.Linear(9, 5))
            fresh.load_state_dict(safetensors.load_file(path))
        torch.testing.assert_close(fresh.eval()(x), out, rtol=1e-6, atol=1e-6)
    assert isinstance(copy.deepcopy(model)[0].weight, gt.GlobalTensor)   # torch still copies


def check_meta_buffers_raise_or_come_real():
    p = gt.placement.all("cpu")
    with torch.device("meta"):
        meta = _Masked()
    for convert in (lambda m: gt.nn.to_global(m, p, _masked_layout),
                    lambda m: gt.nn.fully_shard(m, p)):
        with gt.debug.comm_stats() as stats, pytest.raises(ValueError) as err:
            convert(meta)
        message = str(err.value)    # every buffer nothing fills; not BatchNorm's statistics
        assert "bias, scale, steps" in message and "gt.nn.meta_init()" in message, message
        assert "running" not in message and stats.total_calls == 0
    with gt.nn.meta_init():
        model = _Masked()
    assert model.qkv.weight.device.type == "meta" and model.bias.device.type == "cpu"
    gt.nn.fully_shard(model, p)                 # docs/memory.md's recipe
    gt.manual_seed(5)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    torch.manual_seed(9)
    reference = _Masked()       # its buffers made as usual; parameters from the global one
    reference.load_state_dict({k: v.full() for k, v in model.state_dict().items()})
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(4))
    for net, x in ((model, gt.tensor(ids, placement=p, sbp=S(0))), (reference, ids)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            net(x).logsumexp(-1).mean().backward()
            opt.step()
    for name, want in reference.state_dict().items():
        got = model.state_dict()[name].full()
        assert torch.isfinite(got.float()).all(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def check_lazy_modules_are_refused_until_run():
    # a lazy module's parameters have no shape before its first forward: torch's own
    # "Can't access the shape of an uninitialized parameter" named neither the module nor
    # what to do
    p = gt.placement.all("cpu")
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.LazyLinear(2))
    for convert in (lambda m: gt.nn.to_global(m, p, B), lambda m: gt.nn.fully_shard(m, p)):
        with gt.debug.comm_stats() as stats, pytest.raises(ValueError) as err:
            convert(lazy)
        message = str(err.value)
        assert "'0.weight' of LazyLinear has no shape yet" in message and "run the model once" in message
        assert stats.total_calls == 0
    x = torch.randn(6, 3)
    want = lazy(x)
    gt.nn.to_global(lazy, p, B)
    torch.testing.assert_close(lazy(gt.tensor(x, placement=p, sbp=S(0))).full(), want)


def check_casting_a_converted_module_then_training():
    """``model.cpu()`` / ``.to("cpu")`` and ``model.bfloat16()`` / ``.double()`` /
    ``.to(dtype)`` of a global module before its first forward, data-parallel training,
    then ``model.float().cpu()`` after training and training on with the same optimizer:
    one process's. nn.Module swaps a GlobalTensor parameter's contents for its cast
    (``torch.utils.swap_tensors``), which refuses a tensor with weak references: gradient
    sync keeps none to its leaves."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    p = gt.placement.all("cpu")
    g = torch.Generator().manual_seed(1)

    def train(model, ref, opts, steps):
        x = torch.randn(6, 8, generator=g).to(ref[0].weight.dtype)
        for _ in range(steps):
            for m, data, opt in zip((model, ref), (gt.tensor(x, placement=p, sbp=S(0)), x), opts):
                m(data).float().square().mean().backward()
                if m is model:   # reduced by gradient sync, in the parameters' layout
                    assert all(q.grad.sbp == (B,) for q in m.parameters())
                opt.step()
                opt.zero_grad()
        for got, want in zip(model.parameters(), ref.parameters()):
            assert type(got) is type(model[0].weight) and got.dtype == want.dtype, got.dtype
            assert got.sbp == (B,), got.sbp
            torch.testing.assert_close(got.full(), want.detach(), rtol=1e-2, atol=1e-3)
    for cast in (lambda m: m.cpu().bfloat16(), lambda m: m.to("cpu").double(),
                 lambda m: m.to(torch.float16)):
        ref, model = cast(copy.deepcopy(plain)), cast(gt.nn.to_global(copy.deepcopy(plain), p, B))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
        train(model, ref, opts, 2)
        for m in (model, ref):
            m.float().cpu()
        train(model, ref, opts, 2)


CHECKS = ["check_memory_is_the_part", "check_values_come_from_the_first_rank",
          "check_lazy_modules_are_refused_until_run",
          "check_tied_parameters_stay_one", "check_meta_modules_allocate_parts_and_init_in_place",
          "check_full_state_dict_on_the_ranks_asked", "check_saving_for_other_tools",
          "check_meta_buffers_raise_or_come_real", "check_casting_a_converted_module_then_training"]

# (the process's resident memory)
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS,
                                            in_processes=["check_memory_is_the_part"])
