"""``gt.debug.simulate_step`` of a step on cuda placements, as the GPU check's
``benchmarks/simulate.py --measure --device cuda`` simulates it (that script's GPT, made
by its ``_make`` on either device): fake cuda tensors, the same memory and collectives as
the same step on cpu placements, priced on a GPU profile."""
from __future__ import annotations

from cuda_suite import DEVICE, world_checks

import globaltensor as gt

N = 8


def check_a_step_on_cuda_placements_simulates_as_on_cpu():
    from mp import benchmark_module
    simulate = benchmark_module("simulate")
    cfg = simulate._config(simulate._parser().parse_args(
        "--dim 32 --heads 2 --layers 1 --seq 16 --vocab 64".split()))
    got = {}
    for layout in ("dp", "fs"):
        got[layout], want = (gt.debug.simulate_step(
            simulate._make(cfg, layout, 2, device), device="h200",
            placement=gt.placement(device, ranks=range(N))) for device in (DEVICE, "cpu"))
        assert got[layout].memory == want.memory, (layout, got[layout].memory, want.memory)
        assert got[layout].events == want.events, layout
        assert got[layout].seconds == want.seconds > 0, layout
    whole = got["dp"].memory["parameters"]
    # (an eighth of each parameter's rows, rounded up where they do not divide)
    assert whole / N <= got["fs"].memory["parameters"] <= 1.2 * whole / N, got["fs"].memory
    assert got["fs"].counted.calls["reduce_scatter"] > 0, got["fs"].counted   # NCCL's


test_simulate_world1 = world_checks(__name__, 1, ["check_a_step_on_cuda_placements_simulates_as_on_cpu"])
