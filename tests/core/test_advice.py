"""torch's own distributed tools on GlobalTensors answer with what to use instead: FSDP2's
fully_shard, parallelize_module, and ops mixing a DTensor with a GlobalTensor.

One fresh process (a world of one), so the import order is known: tensor.parallel is
imported before globaltensor (wrapped when globaltensor is imported), fsdp after it
(wrapped by the import hook, so that ``from ... import fully_shard`` gets the wrapper)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import pytest
    import torch
    import torch.distributed.tensor.parallel as tp
    import globaltensor as gt
    from torch.distributed.fsdp import fully_shard
    from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    P = gt.placement.all("cpu")
    model = gt.nn.to_global(torch.nn.Sequential(torch.nn.Linear(4, 4)), P, gt.sbp.broadcast)
    for shard in (fully_shard, composable_fully_shard):
        with pytest.raises(TypeError, match=r"fully_shard: parameter '0.weight' is a "
                                            r"GlobalTensor.*gt\\.nn\\.fully_shard\\(module, "
                                            r"placement\\)"):
            shard(model)
    assert not hasattr(model, "reshard")  # raised before FSDP2 touched the module
    with pytest.raises(TypeError, match=r"parallelize_module: .*gt\\.nn\\.to_global\\(module, "
                                        r"placement, sbp_fn\\).*split\\(0\\).*split\\(1\\)"):
        tp.parallelize_module(model, None, {"0": tp.ColwiseParallel()})
    plain = torch.nn.Linear(4, 4)  # plain modules still go to FSDP2
    fully_shard(plain, mesh=init_device_mesh("cpu", (1,)))
    assert hasattr(plain, "reshard")

    x = gt.randn(4, 4, placement=P, sbp=gt.sbp.split(0))
    d = gt.randn(4, 4, placement=P, sbp=gt.sbp.split(0)).to_dtensor()
    advice = r"DTensor.*gt\\.from_dtensor\\(d\\).*x\\.to_dtensor\\(\\)"
    for op in (lambda: x + d, lambda: x @ d, lambda: torch.cat([x, d]),
               lambda: d * x.sum(), lambda: x * d.sum()):
        with pytest.raises(ValueError, match=advice):
            op()
        with pytest.raises(ValueError, match=advice), gt.implicit_broadcast():
            op()
    print("ok")
''')


def test_torch_tools_on_global_models_say_what_to_use():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
