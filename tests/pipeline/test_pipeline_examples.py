"""The pipeline example runs as docs/pipeline.md says, through the launcher: seed 003's
ResNet50 table. (The OneFlow guide's pipelined training, part 5 of
examples/parallelism_guide.py, runs in tests/examples/test_example_models.py.)"""
import re

import pytest
from mp import run_example

pytestmark = pytest.mark.multiprocess  # every test here runs an example through the launcher


@pytest.mark.timeout(300)
def test_resnet_pipeline_prints_the_seed_table(tmp_path):
    out = run_example("resnet_pipeline.py", 2, tmp_path, "--image-size", "16", "--batch-size",
                      "8", "--width", "4", "--steps", "1", "--micro-batches", "1", "2", "4",
                      "--schedule", "1f1b", timeout=280)
    rows = re.findall(r"^\[rank0\]:\s+(\d+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 4], out
    assert rows[0][2] == "1.00"  # the speedup column is relative to one micro-batch
    assert all(float(r[1]) > 0 for r in rows)
