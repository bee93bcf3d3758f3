"""Distributed equals single-device: AlexNet (hybrid parallel) and ResNet (data parallel)
train once on 1 process and once on 2 through the launcher, save their final parameters
(and buffers) with ``--save``, and end with the same values. (The digits example has
the same test in test_examples_data_parallel.py.)

The runs are short on purpose. The two worlds sum in different orders (split batches,
all-reduced gradients and BatchNorm statistics, split logits), so their float32 values
differ by ~1e-7 relative; a ReLU input within that distance of zero then lets one run
pass a gradient the other blocks, a discrete ~1e-3 change of the gradient that SGD and
Adam amplify over later steps. A few steps at a moderate learning rate stay far below
the tolerance (measured: at most ~4 % of rtol 1e-4 / atol 1e-5 on any element).
"""
import re

import pytest
import torch
from mp import run_examples_together

pytestmark = pytest.mark.multiprocess  # every test here runs an example through the launcher

def train_on_1_and_2(script, tmp_path, *args):
    """(stdout, saved state) of the 1-process and of the 2-process run (run at once)."""
    outs = run_examples_together([(script, nproc, *args, "--save", str(tmp_path / f"{nproc}.pt"))
                                  for nproc in (1, 2)], tmp_path)
    return [(out, torch.load(tmp_path / f"{nproc}.pt")) for nproc, out in zip((1, 2), outs)]


def assert_same_state(one, two, n_tensors):
    assert one.keys() == two.keys() and len(one) == n_tensors, (sorted(one), sorted(two))
    worst, where = 0.0, None
    for name, ref in one.items():
        got = two[name]
        assert type(got) is torch.Tensor and got.dtype == ref.dtype, name
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        if not ref.is_floating_point():          # num_batches_tracked: exact
            assert torch.equal(got, ref), (name, got, ref)
            continue
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        error = ((got - ref).abs().max() / ref.abs().max()).item()
        if error > worst:
            worst, where = error, name
    print(f"max relative difference (max |2 - 1| / max |1| per tensor): {worst:.1e} ({where})")


@pytest.mark.timeout(150)
def test_alexnet_two_ranks_end_with_the_single_process_parameters(tmp_path):
    # 1/16 width (fc 256 x 256), 10 Adam steps, dropout on: its masks come from the
    # placement-invariant generator, so both runs drop the same units.
    args = ["--width", "16", "--steps", "10", "--log_every", "1", "--dropout", "0.5",
            "--max-loss-ratio", "1"]
    (out1, one), (out2, two) = train_on_1_and_2("alexnet_hybrid.py", tmp_path, *args)
    assert "on 1 ranks" in out1 and "(1 rank: nothing to send)" in out1, out1
    assert re.search(r"FC layers: ours \d+ B < gather-all \d+ B", out2), out2
    assert_same_state(one, two, 16)    # 5 conv + 3 FC layers, weight and bias each
    assert two["fc1.weight"].shape == (256, 256)
    curve1, curve2 = (re.findall(r"step +\d+  loss ([\d.]+)", out) for out in (out1, out2))
    assert len(curve1) == len(curve2) == 10, (out1, out2)
    for loss1, loss2 in zip(curve1, curve2):
        assert abs(float(loss1) - float(loss2)) <= 2e-4, (curve1, curve2)


@pytest.mark.timeout(150)
def test_resnet_two_ranks_end_with_the_single_process_parameters(tmp_path):
    # --small (ResNet-10, width 8, 16x16 images, global batch 32) on 96 samples: 2 epochs
    # of 3 batches (the reshuffle between epochs included), lr 0.05.
    args = ["--small", "--samples", "96", "--epochs", "2", "--lr", "0.05"]
    (out1, one), (out2, two) = train_on_1_and_2("resnet_data_parallel.py", tmp_path, *args)
    assert "1 ranks, global batch 32 (3 batches per epoch)" in out1, out1
    assert "2 ranks, global batch 32 (3 batches per epoch)" in out2, out2
    # the stem and 4 BasicBlocks, 3 with a projection shortcut: 12 convs (no bias), the fc
    # layer and 12 BatchNorms (weight, bias, running_mean, running_var, num_batches_tracked)
    assert_same_state(one, two, 12 + 2 + 12 * 5)
    assert int(one["stem.1.num_batches_tracked"]) == 6
    mean = r"mean loss of the first 5 batches ([\d.]+), of the last 5 ([\d.]+)"
    (first1, last1), (first2, last2) = (re.search(mean, out).groups() for out in (out1, out2))
    assert abs(float(first1) - float(first2)) <= 2e-4 and abs(float(last1) - float(last2)) <= 2e-4
    assert float(last1) < float(first1), out1
