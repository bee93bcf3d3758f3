"""gt.debug.simulate_step: one step of a placement of 8 to 1024 ranks, run in this
process as one of its ranks on fake tensors: its collectives, memory by kind and an
estimated time, against what the layouts imply; the caller's world is left as it was."""
from __future__ import annotations

import math
import os

import pytest
import torch
from mp import world_test

import globaltensor as gt
from globaltensor.debug import PROFILES, DeviceProfile, Link

S, B = gt.sbp.split, gt.sbp.broadcast
D, H = 64, 256   # an MLP of D -> H -> D: (D * H + H + H * D + D) parameters
PARAMS = (D * H + H + H * D + D) * 4


def _world(n: int):
    return gt.placement("cpu", ranks=range(n))   # a placement of a bigger world than ours


def _make(layout: str, rows_per_rank: int = 4, unit: str = "module"):
    def make():
        P = gt.placement.all("cpu")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))
        if layout == "tp":
            model = gt.nn.to_global(model, P, lambda name, t: {
                "0.weight": S(0), "0.bias": S(0), "2.weight": S(1)}.get(name, B))
            x = gt.randn(8, D, placement=P, sbp=B)
        else:
            model = gt.nn.to_global(model, P, B)
            if layout == "fs":
                model = gt.nn.fully_shard(model, P, unit=unit)
            x = gt.randn(P.size * rows_per_rank, D, placement=P, sbp=S(0))
        opt = torch.optim.AdamW(model.parameters())

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return step, model, opt
    return make


@pytest.mark.parametrize("world", [8, 64])
def test_data_parallel_reduces_every_gradient_once(world):
    report = gt.debug.simulate_step(_make("dp"), placement=_world(world))
    ring = 2 * (world - 1) / world
    reduced = report.counted.bytes["all_reduce"]
    assert set(report.counted.calls) == {"all_reduce"}, report
    assert ring * PARAMS <= reduced <= ring * PARAMS + 64, (reduced, ring * PARAMS)
    assert report.memory["parameters"] == PARAMS and report.memory["gradients"] == PARAMS
    assert report.memory["optimizer"] >= 2 * PARAMS, report.memory   # Adam's two moments
    assert all(len(ranks) == world for _, _, ranks, _ in report.events)
    assert report.world == world and report.rank == 0


@pytest.mark.parametrize("unit", ["module", "call"])
def test_fully_shard_keeps_a_part_per_rank_and_gathers_it(unit):
    world = 64
    report = gt.debug.simulate_step(_make("fs", unit=unit), placement=_world(world))
    assert report.memory["parameters"] <= PARAMS / world + 4 * 4 * world, report.memory
    assert report.counted.calls["all_gather"] > 0, report
    # all of it gathered for forward; for backward again what backward reads: the
    # second layer's weight (the first's gradient needs the input, not the weight);
    # one unit of the call is gathered whole as its backward begins, as FSDP2's
    again = H * D * 4 if unit == "module" else PARAMS
    assert report.counted.bytes["all_gather"] == (PARAMS + again) * (world - 1) // world
    # a unit per Linear: each gathers in forward, the second again; one unit of the
    # call (its modules' parameters are gathered copies while they run): once each way
    assert report.counted.calls["all_gather"] == (3 if unit == "module" else 2), report


def test_megatron_tensor_parallel_keeps_its_parts():
    world = 8
    report = gt.debug.simulate_step(_make("tp"), placement=_world(world), planned=True)
    split = (D * H + H + H * D) * 4    # fc1 weight and bias, fc2 weight
    assert report.memory["parameters"] == split // world + D * 4, report.memory
    # planned (recorded, planned, replayed): gradients kept in their parameters' parts
    assert report.memory["gradients"] == report.memory["parameters"], report.memory


def test_a_thousand_ranks_and_the_callers_world_is_untouched():
    before = (gt.get_world_size(), os.environ.get("WORLD_SIZE"), os.environ.get("RANK"))
    report = gt.debug.simulate_step(_make("dp", rows_per_rank=1), placement=_world(1024), rank=1000,
                                    device="h100")
    assert report.rank == 1000 and report.memory["parameters"] == PARAMS
    assert (gt.get_world_size(), os.environ.get("WORLD_SIZE"), os.environ.get("RANK")) == before
    x = gt.ones(4, placement=gt.placement("cpu", [0]), sbp=B)   # this process's world of 1
    assert float(x.sum()) == 4.0


def test_estimated_time_follows_the_profile_and_the_links():
    make = _make("dp")
    # (op_seconds=0: host time not counted, here the links are what is compared)
    fast = DeviceProfile("in-node", {"float32": 1e14}, 1e12, (Link(None, 100e9, 1e-6),),
                         op_seconds=0.0)
    slow = DeviceProfile("slow links", {"float32": 1e14}, 1e12, (Link(None, 1e9, 1e-4),),
                         op_seconds=0.0)
    a = gt.debug.simulate_step(make, placement=_world(8), device=fast)
    b = gt.debug.simulate_step(make, placement=_world(8), device=slow)
    assert a.compute_seconds == pytest.approx(b.compute_seconds) and a.compute_seconds > 0
    assert b.comm_seconds > 50 * a.comm_seconds > 0
    assert a.step_seconds == pytest.approx(a.compute_seconds + a.comm_seconds)
    # 16 ranks per the H100 profile: 2 nodes of 8, the gradient's all-reduce crosses them
    h100 = gt.debug.simulate_step(make, placement=_world(16), device="h100")
    assert h100.device is PROFILES["h100"] and "step, estimated" in str(h100)
    kind, nbytes, ranks, _ = max(h100.events, key=lambda e: e[1])
    assert PROFILES["h100"].link(ranks, 0).ranks is None   # the slower, inter-node link


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no device profile 'A100'"):
        gt.debug.simulate_step(_make("dp"), placement=_world(8), device="A100")
    with pytest.raises(TypeError, match="placement must be a gt.placement"):
        gt.debug.simulate_step(_make("dp"), placement=8)
    with pytest.raises(ValueError, match="outside the world of 1"):   # ours, not its
        gt.ones(2, placement=_world(8), sbp=B)


def test_a_function_that_is_the_step_and_the_report_as_the_contract_names_it():
    """``fn`` may be the step itself (building its tensors each time); the report has
    ``peak_memory``, ``bytes`` and ``step_seconds``, and prints as a table."""
    def step(rows):
        P = gt.placement.all("cpu")
        w = gt.randn(D, D, placement=P, sbp=B, requires_grad=True)
        x = gt.randn(rows * P.size, D, placement=P, sbp=S(0))
        (x @ w).sum().backward()
    report = gt.debug.simulate_step(step, 4, placement=_world(16))
    grad = D * D * 4
    assert report.bytes == report.counted.total_bytes >= 2 * grad * 15 // 16
    assert report.peak_memory >= grad and report.step_seconds > 0
    assert report.macs[torch.float32] == 2 * 4 * D * D   # forward and weight gradient
    table = str(report)
    assert table.splitlines()[0] == f"rank 0 of 16 on {report.device.name}"
    assert "step, estimated" in table and "all_reduce x" in table


def test_in_place_ops_count_the_elements_they_write():
    """An in-place op (the optimizer's ``mul_``, ``addcdiv_``...) returns its input, as a
    view does, but writes every element of it: its bytes count (they are a tenth of a
    step's time on a CPU and more on a GPU), a view's do not."""
    def step(update):
        P = gt.placement.all("cpu")
        w = gt.randn(D, H, placement=P, sbp=S(1))
        if update:
            w.mul_(0.5).add_(1.0)   # each reads and writes this rank's part
        w.t().view(H, D)          # views: nothing written
    without, update = (gt.debug.simulate_step(step, u, placement=_world(4)) for u in (0, 1))
    part = D * H // 4 * 4   # this rank's part of w in bytes
    assert update.other_bytes - without.other_bytes == 2 * (2 * part), \
        (update.other_bytes, without.other_bytes)


def test_attention_is_counted_by_its_products():
    """Fused attention on this rank's heads: q @ k^T and p @ v forward (2 b h t t d
    multiply-adds), two and a half times that in backward (it recomputes the scores)."""
    b, h, t, d, world = 2, 8, 16, 8, 8

    def step():
        P = gt.placement.all("cpu")
        q, k, v = (gt.randn(b, h, t, d, placement=P, sbp=S(1), requires_grad=True)
                   for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    report = gt.debug.simulate_step(step, placement=_world(world))
    local = 2 * b * (h // world) * t * t * d
    assert report.macs[torch.float32] == local + 5 * local // 2, report.macs


def check_predictions_equal_a_real_world_of_two():
    """The same program in a real world of 2 (gloo) and simulated as each of its ranks:
    the bytes each rank sends in the step and the parameters, gradients and optimizer
    state it holds are the same, for data parallel, fully_shard and Megatron's layout."""
    from globaltensor.planner import record
    for layout in ("dp", "fs", "tp"):
        with record.paused():   # (the simulation decides op by op, as these first steps)
            step, model, opt = _make(layout)()
            step()
            with gt.debug.comm_stats() as measured:
                step()
        mine = {"parameters": sum(p.local_part.nbytes for p in model.parameters()),
                "optimizer": sum(t.local_part.nbytes for state in opt.state.values()
                                 for t in state.values() if gt.is_global(t))}
        report = gt.debug.simulate_step(_make(layout), placement=_world(2),
                                        rank=gt.get_rank())
        assert measured.total_bytes > 0
        assert report.counted.bytes == measured.bytes, (layout, report.counted, measured)
        assert report.memory["parameters"] == mine["parameters"], (layout, report.memory)
        assert report.memory["optimizer"] >= mine["optimizer"], (layout, report.memory)
        gt.testing.reset()


# (a real world: a step cannot be simulated inside a simulated world)
test_world2 = world_test(__name__, 2, ["check_predictions_equal_a_real_world_of_two"],
                         in_processes=["check_predictions_equal_a_real_world_of_two"])


def test_a_gpu_profile_chooses_and_prices_collectives_as_nccl():
    """On the H100 profile the program's boxing is chosen as on NCCL (a partial sum to a
    split: one reduce_scatter); on this CPU's, as on gloo (its all-to-all route, a
    message per peer)."""
    def step():
        P = gt.placement.all("cpu")
        x = gt.randn(64, 256, placement=P, sbp=S(1))
        w = gt.randn(256, 64, placement=P, sbp=S(0))
        (x @ w).to_global(sbp=S(0))
    gpu = gt.debug.simulate_step(step, placement=_world(8), device="h100")
    cpu = gt.debug.simulate_step(step, placement=_world(8), device="cpu")
    assert dict(gpu.counted.calls) == {"reduce_scatter": 1}, gpu.counted
    assert dict(cpu.counted.calls) == {"all_to_all": 7}, cpu.counted


def test_fully_shard_reduces_gradients_as_the_backend_does():
    """fully_shard's gradients, partial over the data axis after backward, go to their
    parts a unit at a time, as FSDP2's do on NCCL: one reduce_scatter for a unit's small
    gradients (the H100 profile); on gloo (this CPU's) by an exchange of parts, a round
    of messages per peer for the unit's gradients. The same bytes either way."""
    world, units = 8, 2     # two Linears, each weight and bias small
    gpu = gt.debug.simulate_step(_make("fs"), placement=_world(world), device="h100")
    cpu = gt.debug.simulate_step(_make("fs"), placement=_world(world), device="cpu")
    reduced = PARAMS * (world - 1) // world
    assert gpu.counted.calls["reduce_scatter"] == units and "all_to_all" not in gpu.counted.calls
    assert cpu.counted.calls["all_to_all"] == units * (world - 1), cpu.counted
    assert "reduce_scatter" not in cpu.counted.calls, cpu.counted
    assert gpu.counted.bytes["reduce_scatter"] == cpu.counted.bytes["all_to_all"] == reduced


def test_point_to_point_messages_are_counted_and_priced(monkeypatch):
    """On gloo fully_shard's gathers and gradient exchanges are batches of messages
    posted one by one: each event says how many this rank posts (a unit's small tensors
    packed: one each way per peer and round; above OWN_GATHER_BYTES one per tensor),
    each priced at its link's latency. NCCL's collectives post none of their own."""
    from globaltensor.nn import shard_comm
    from globaltensor.step_simulation import collective_seconds
    world, peers = 4, 3

    def messages(report, kind):
        return sorted(m for k, _, _, m in report.events if k == kind)
    packed = gt.debug.simulate_step(_make("fs"), placement=_world(world), device="cpu")
    gpu = gt.debug.simulate_step(_make("fs"), placement=_world(world), device="h100")
    monkeypatch.setattr(shard_comm, "OWN_GATHER_BYTES", 0)
    alone = gt.debug.simulate_step(_make("fs"), placement=_world(world), device="cpu")
    # two units (Linears) of a weight and a bias; the second Linear's weight again in
    # backward; each unit's gradients in one round per peer
    assert messages(packed, "all_gather") == [2 * peers] * 3
    assert messages(packed, "all_to_all") == [2] * (2 * peers)
    assert messages(alone, "all_gather") == [2 * peers, 4 * peers, 4 * peers]
    assert messages(alone, "all_to_all") == [4] * (2 * peers)
    assert all(m == 0 for *_, m in gpu.events)
    link = Link(None, 1e9, 1e-4, 1e-3)
    # (the exchange's one hop, and each message posted)
    assert collective_seconds(link, "all_to_all", 0, 1, 6) == pytest.approx(1e-3 + 7e-4)
    assert collective_seconds(link, "all_gather", 0, 4) == pytest.approx(1e-3 + 3e-4)
    assert alone.comm_seconds > packed.comm_seconds
    assert packed.comm_seconds == pytest.approx(sum(
        collective_seconds(packed.device.link(r, 0), k, b, len(r), m)
        for k, b, r, m in packed.events))


def test_host_time_per_call_and_ranks_that_share_cores():
    """Each call carried out costs the profile's ``op_seconds`` of host time: on a GPU
    it overlaps the kernels (the longer counts), on a CPU the same core runs both;
    ranks of a node beyond its ``cores`` take turns (compute and host time scale)."""
    rates = ({"float32": 1e11}, 1e10, (Link(None, 1e9, 1e-5, launch=1e-3),))
    gpu = DeviceProfile("gpu", *rates, op_seconds=1e-3)
    cpu = DeviceProfile("cpu, 2 cores", *rates, "gloo", op_seconds=1e-3, cores=2)
    a = gt.debug.simulate_step(_make("dp"), placement=_world(4), device=gpu)
    assert a.ops > 10 and a.host_seconds == pytest.approx(a.ops * 1e-3)
    assert a.step_seconds == pytest.approx(max(a.compute_seconds, a.host_seconds)
                                           + a.comm_seconds)
    # each collective pays the link's launch once, besides its hops and bytes
    assert a.comm_seconds >= len(a.events) * 1e-3 > 0
    two = gt.debug.simulate_step(_make("dp"), placement=_world(4), device=cpu, ranks_per_node=2)
    four = gt.debug.simulate_step(_make("dp"), placement=_world(4), device=cpu, ranks_per_node=4)
    assert two.ops == a.ops and two.compute_seconds == pytest.approx(a.compute_seconds)
    assert two.step_seconds == pytest.approx(two.compute_seconds + two.host_seconds
                                             + two.comm_seconds)
    assert four.compute_seconds == pytest.approx(2 * two.compute_seconds)
    assert four.host_seconds == pytest.approx(2 * two.host_seconds)
    # cores that run at once run slower each (``together``): the ranks of a node that
    # has two, not a rank alone on one
    slow = DeviceProfile("cpu, 2 cores at 0.8", *rates, "gloo", op_seconds=1e-3, cores=2,
                         together=0.8)
    for ranks, scale in ((1, 1.0), (2, 1 / 0.8), (4, 2 / 0.8)):
        got = gt.debug.simulate_step(_make("dp"), placement=_world(4), device=slow,
                                     ranks_per_node=ranks)
        assert got.compute_seconds == pytest.approx(scale * two.compute_seconds), ranks
        assert got.host_seconds == pytest.approx(scale * two.host_seconds), ranks
    assert f"host ({a.ops} calls)" in str(a)
    # a profile that does not say (the H100's) takes this host's time per call, measured
    from globaltensor.device_profile import host_op_seconds
    h100 = gt.debug.simulate_step(_make("dp"), placement=_world(4), device="h100")
    assert PROFILES["h100"].op_seconds is None and h100.ops == a.ops
    assert h100.host_seconds == pytest.approx(h100.ops * host_op_seconds())
    assert h100.host_seconds > 0


def test_fresh_host_blocks_of_a_fully_sharded_program_fault_in(monkeypatch):
    """fully_shard on a "cpu" placement maps every host block of heap.MAPPED_BYTES or
    more on its own, whose pages fault in as each new tensor is written: the estimate
    adds them at the profile's ``fault_seconds``; data parallelism maps nothing, nor
    does fully_shard with GLOBALTENSOR_TRIM_HEAP=0. This process's malloc is left alone."""
    from globaltensor import heap
    rates = ({"float32": 1e11}, 1e10, (Link(None, 1e9, 1e-5),))
    plain, faulting = (DeviceProfile("cpu", *rates, "gloo", op_seconds=0.0, fault_seconds=f)
                       for f in (0.0, 1e-9))
    mapped = heap._mapped

    def rows(n):   # a batch whose activations (n x 256 floats) are fresh mapped blocks
        return _make("fs", rows_per_rank=n)
    fs, fs_faulting = (gt.debug.simulate_step(rows(256), placement=_world(2), device=d)
                       for d in (plain, faulting))
    assert fs.fresh_bytes >= 256 * H * 4 > 0, fs.fresh_bytes   # at least the hidden layer
    assert fs_faulting.compute_seconds == pytest.approx(fs.compute_seconds
                                                        + fs.fresh_bytes * 1e-9)
    dp = gt.debug.simulate_step(_make("dp", rows_per_rank=256), placement=_world(2),
                                device=faulting)
    assert dp.fresh_bytes == 0
    monkeypatch.setenv("GLOBALTENSOR_TRIM_HEAP", "0")
    assert gt.debug.simulate_step(rows(256), placement=_world(2), device=faulting
                                  ).fresh_bytes == 0
    assert heap._mapped == mapped


def test_this_cpu_is_measured_as_one_rank_of_a_world_here_runs():
    """The "cpu" profile: one thread's rates (a launched rank's), a small training
    step's host time per call, this machine's cores; the caller's threads untouched."""
    from globaltensor import device_profile
    from globaltensor.device_profile import cpu_profile
    threads = torch.get_num_threads()
    profile = cpu_profile()
    assert torch.get_num_threads() == threads
    assert profile.cores == os.cpu_count() and profile.backend == "gloo"
    assert 1e-6 < profile.op_seconds < 1e-2          # microseconds to milliseconds
    assert profile.matmul_flops["float32"] > 1e9 and profile.memory_bandwidth > 1e8
    assert profile.links[0].launch > 0               # gloo's start of a collective
    assert 0 < profile.together <= 1                 # cores busy at once: as fast or slower
    assert 0 < profile.fault_seconds < 1e-8          # a fresh page's first touch: GB/s
    # the rates are scaled to what a step's kernels do, at most the kernels' own rates
    # alone (a 512 x 256 x 1024 product, best of a few)
    a, b = torch.randn(512, 256), torch.randn(256, 1024)
    with device_profile._one_thread():
        alone = 2 * 512 * 256 * 1024 / device_profile._best_seconds(lambda: a @ b)
    assert profile.matmul_flops["float32"] < 3 * alone


def test_the_benchmarks_llama_simulates_in_every_layout():
    """``benchmarks/simulate.py --model llama``: the Llama of examples/llama_2d.py
    (rotary positions, grouped-query attention, SwiGLU) at 8 ranks: every rank holds
    its parameters whole under data parallelism, an eighth under fully_shard, the
    Megatron-split weights' eighth under tensor parallelism; data parallelism sends
    its gradients' all-reduce (2 (n - 1) / n of them), fully_shard more (its gathers
    in forward and backward, then the reduction)."""
    from mp import benchmark_module, example_module
    llama = example_module("llama_2d")
    simulate = benchmark_module("simulate")
    cfg = llama.LlamaConfig(dim=64, n_heads=8, n_kv_heads=8, hidden=128, vocab=256, layers=1)
    whole = sum(p.numel() for p in llama.Llama(cfg).parameters()) * 4
    split = sum(p.numel() for name, p in llama.Llama(cfg).named_parameters()
                if name.split(".")[-2] in llama.COLUMN + llama.ROW) * 4
    got = {layout: gt.debug.simulate_step(simulate._make((cfg, 16), layout, rows=2),
                                          placement=_world(8))
           for layout in ("dp", "fs", "tp")}
    assert got["dp"].memory["parameters"] == whole
    assert got["fs"].memory["parameters"] == pytest.approx(whole / 8, rel=0.05)
    assert got["tp"].memory["parameters"] == whole - split + split // 8
    assert got["dp"].bytes == pytest.approx(2 * 7 / 8 * whole, rel=0.01)
    assert got["fs"].bytes > got["dp"].bytes


def test_a_fake_modules_parameters_take_their_parts_without_a_transfer(monkeypatch):
    # a fake tensor holds no values for the first rank to send: each rank makes its own
    # fake part (the scatter to every rank took a fifth of a 1024-rank simulation)
    from globaltensor.boxing.steps import transfer
    started = []
    start = transfer.Transfer.start
    monkeypatch.setattr(transfer.Transfer, "start",
                        lambda self, *a, **k: started.append(self) or start(self, *a, **k))
    for layout in ("dp", "tp"):
        report = gt.debug.simulate_step(_make(layout), placement=_world(64), device="h100")
        assert started == [], layout
        assert report.memory["parameters"] == (PARAMS if layout == "dp" else
                                               (D * H + H + H * D) * 4 // 64 + D * 4)


def test_the_largest_part_is_found_per_dim_not_per_rank(monkeypatch):
    # each placement axis splits at most one dim: the largest local tensor is the product
    # of each dim's longest part, found over the coordinates of the axes splitting it
    import random

    from globaltensor import cost
    from globaltensor.layout import Layout
    monkeypatch.setenv("WORLD_SIZE", "1024")   # layouts of a world this process is not
    rng = random.Random(3)
    sbps = [B, gt.sbp.partial_sum, S(0), S(1), S(2), S(0, blocks=2), S(2, blocks=3)]
    for mesh in ((2, 3), (3, 2, 2), (4,), (1, 5)):
        P = gt.placement("cpu", torch.arange(math.prod(mesh)).reshape(mesh).tolist())
        for _ in range(40):
            shape = (rng.choice([2, 6, 7, 12]), rng.choice([1, 5, 9]), rng.choice([3, 6, 12]))
            sbp = tuple(rng.choice(sbps) for _ in mesh)
            try:
                layout = Layout.make(shape, P, sbp)
            except ValueError:   # a strided split whose blocks do not divide the dim
                continue
            assert cost._max_local_numel(layout) == max(
                math.prod(layout.local_shape(r)) for r in P), (shape, mesh, sbp)
    big = Layout.make((256, 64), gt.placement("cpu", torch.arange(1024).reshape(128, 8).tolist()),
                      (B, S(1)))
    asked = []
    local_shape = Layout.local_shape
    monkeypatch.setattr(Layout, "local_shape", lambda self, r: asked.append(r) or local_shape(self, r))
    assert cost._max_local_numel(big) == 256 * 8 and asked == list(range(8))


def test_an_uneven_all_to_all_is_counted_without_a_view_per_member(monkeypatch):
    # in a simulation nothing travels: each send is counted by its bytes (what the
    # exchange would post), without slicing the fake tensors once per member
    from globaltensor.layout import balanced_split
    R, C = 64 * 3 + 5, 130
    narrowed = []
    narrow = torch.Tensor.narrow
    monkeypatch.setattr(torch.Tensor, "narrow", lambda t, *a: narrowed.append(1) or narrow(t, *a))

    def make():
        x = gt.randn(R, C, placement=gt.placement.all("cpu"), sbp=S(0))
        return (lambda: x.to_global(sbp=S(1))),
    report = gt.debug.simulate_step(make, placement=_world(64), device="cpu")
    rows = balanced_split(R, 64)[0][1]
    sends = [(rows * balanced_split(C, 64)[k][1] * 4, (k,)) for k in range(1, 64)]
    assert [(n, r) for kind, n, r, _ in report.events if kind == "all_to_all"] == sends
    assert len(narrowed) < 16, len(narrowed)   # a few per call, not two per member
