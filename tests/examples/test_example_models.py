"""The model examples run through the launcher and print what they claim.

Each example checks its own results (it raises, so the launcher exits non-zero, on any
mismatch); these tests also read the key printed numbers back and check them again.
"""
import re

import pytest
from mp import launch_example as launch
from mp import launch_examples_together

pytestmark = pytest.mark.multiprocess  # every test here runs an example through the launcher


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The two 2-rank examples, run at once (AlexNet's ranks wait for each other's
    shards: the other run uses that time)."""
    runs = {"alexnet_hybrid": ("alexnet_hybrid.py", 2, "--steps", "20"),
            "wide_and_deep": ("wide_and_deep.py", 2, "--steps", "60")}
    outs = launch_examples_together(list(runs.values()), tmp_path_factory.mktemp("models"),
                                    timeout=140)
    return dict(zip(runs, outs))


def _output(out):
    text = out.stdout + out.stderr
    # what a user reads as something gone wrong, in a run that ends well
    for sign in ("could not be planned", "No backend of type"):
        assert sign not in text, text
    return text


def _number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the output:\n{text}"
    return [float(g) for g in match.groups()]


@pytest.mark.timeout(150)
def test_parallelism_guide_on_four_ranks(tmp_path):
    out = launch("parallelism_guide.py", 4, tmp_path, "--steps", "3", timeout=140)
    text = _output(out)
    assert out.returncode == 0, text
    assert "x    shape=(4, 5)   sbp=(split(dim=0),)    placement ranks=[0, 1, 2, 3]" in text
    assert "y    shape=(4, 8)   sbp=(split(dim=1),)    placement ranks=[0, 1, 2, 3]" in text
    assert "h1   shape=(4, 8)   sbp=(broadcast,)       placement ranks=[1]" in text
    assert "y, w0.grad (on ranks [0]) and w1.grad (on ranks [1]) equal" in text
    assert "h1   shape=(8, 16)  sbp=(broadcast,)       placement ranks=[2, 3]" in text
    assert "y    shape=(8, 4)   sbp=(split(dim=1),)    placement ranks=[2, 3]" in text
    for step in range(3):
        ours, torch_ = _number(rf"step {step}: loss ([\d.]+) \(plain torch ([\d.]+)\)", text)
        assert ours == torch_
    first, last = _number(r"after 3 SGD steps \(loss ([\d.]+) -> ([\d.]+)\)", text)
    assert last < first
    assert "skipped" not in text
    assert "5. pipelined training" in text      # OneFlow's PipelineGraph with gt.pipeline
    assert "after 3 SGD steps every parameter equals plain torch on the whole batch" in text
    assert "all parts match the single-process values (4 ranks)" in text


@pytest.mark.timeout(150)
def test_alexnet_hybrid_on_two_ranks(two_rank_runs):
    out = two_rank_runs["alexnet_hybrid"]
    text = _output(out)
    assert out.returncode == 0, text
    assert "fc1.weight         shape=(1024, 1024)     sbp=(split(dim=0),)" in text
    assert "features.0.weight  shape=(16, 3, 3, 3)    sbp=(broadcast,)" in text
    assert "logits (16, 10) sbp=(split(dim=1),) equal plain torch's" in text
    ours, theirs = _number(r"FC layers: ours (\d+) B < gather-all (\d+) B", text)
    # 16 x (1024+1024 + 1024+1024 + 1024+10) floats, all-gathered forward and backward
    assert theirs == 2 * 1 * 16 * (2048 + 2048 + 1034) * 4
    assert 0 < ours < theirs
    first, last = _number(r"loss decreased: ([\d.]+) -> ([\d.]+)", text)
    assert last < 0.7 * first
    assert len(re.findall(r"step +\d+  loss", text)) == 5   # steps 0, 5, 10, 15, 19


@pytest.mark.timeout(150)
def test_wide_and_deep_on_two_ranks(two_rank_runs):
    out = two_rank_runs["wide_and_deep"]
    text = _output(out)
    assert out.returncode == 0, text
    assert "embedding.weight    shape=(8000, 8)   sbp=(split(dim=0),)  this rank's rows: 4000" \
        in text
    assert "lookup sbp=(partial_sum,), logits sbp=(split(dim=0),): equal plain torch's" in text
    auc, before, loss, base = _number(
        r"held-out AUC ([\d.]+) \(baseline 0.500, before ([\d.]+)\), "
        r"log-loss ([\d.]+) \(baseline ([\d.]+)\)", text)
    assert auc > 0.6 and auc > before + 0.05
    assert loss < base
    first, last = _number(r"training loss: ([\d.]+) -> ([\d.]+)", text)
    assert last < first
    assert "the model beats the constant-rate baseline on held-out clicks" in text


@pytest.mark.timeout(200)
def test_llama_on_a_2x2_placement_trains_equal_to_one_process(tmp_path):
    """The Llama program of examples/llama_2d.py: data x Megatron tensor parallel and
    fully_shard on 2x2, and the whole train step compiled (2 ranks, compile time), each
    against one plain process (the example raises on a mismatch). auto_parallel on 2x2
    is tests/nn/test_auto_parallel.py's (its timed candidates take minutes here)."""
    runs = [("llama_2d.py", 4, "--parts", "megatron,fully_shard", "--steps", "3"),
            ("llama_2d.py", 2, "--parts", "compiled", "--steps", "2")]
    eager, compiled = launch_examples_together(runs, tmp_path, timeout=190)
    assert eager.returncode == 0, _output(eager)
    assert compiled.returncode == 0, _output(compiled)
    for part, out in (("megatron", eager), ("fully_shard", eager), ("compiled", compiled)):
        assert re.search(rf"{part}: \d+ steps, loss [\d.]+ -> [\d.]+, equal to one process",
                         out.stdout), _output(out)
