"""``gt.debug.simulate_step`` of a step on cuda placements (what the GPU check's
``benchmarks/simulate.py --measure --device cuda`` simulates): fake cuda tensors, the
same memory and collectives as the same step on cpu placements, priced on a GPU
profile."""
from __future__ import annotations

import torch
from cuda_suite import DEVICE, world_checks

import globaltensor as gt

D, H, N = 64, 256, 8
PARAMS = (D * H + H + H * D + D) * 4


def _make(device: str, layout: str):
    def make():
        P = gt.placement.all(device)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))
        gt.nn.to_global(model, P, gt.sbp.broadcast)
        if layout == "fs":
            gt.nn.fully_shard(model, P)
        x = gt.randn(4 * N, D, placement=P, sbp=gt.sbp.split(0))
        opt = torch.optim.AdamW(model.parameters())

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return step, model, opt
    return make


def check_a_step_on_cuda_placements_simulates_as_on_cpu():
    for layout in ("dp", "fs"):
        got, want = (gt.debug.simulate_step(_make(device, layout), device="h200",
                                            placement=gt.placement(device, ranks=range(N)))
                     for device in (DEVICE, "cpu"))
        assert got.memory == want.memory, (layout, got.memory, want.memory)
        assert got.events == want.events, layout
        assert got.seconds == want.seconds > 0, layout
        held = PARAMS if layout == "dp" else PARAMS / N
        assert abs(got.memory["parameters"] - held) <= 4 * 4 * N, (layout, got.memory)
    assert got.counted.calls["reduce_scatter"] > 0, got.counted   # fully_shard on NCCL


test_simulate_world1 = world_checks(__name__, 1, ["check_a_step_on_cuda_placements_simulates_as_on_cpu"])
