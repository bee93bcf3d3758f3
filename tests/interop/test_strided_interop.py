"""Strided splits in DCP checkpoints and as DTensor's _StridedShard, in processes."""
from mp import checks_in_worlds


def check_strided_split_saves_loads_and_converts():
    import os
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    import globaltensor as gt
    P = gt.placement.all("cpu")
    value = torch.arange(96.).reshape(16, 6)
    strided = gt.to_global(value, P, gt.sbp.broadcast).to_global(sbp=gt.sbp.split(0, blocks=2))
    assert strided.sbp == (gt.sbp.split(0, blocks=2),)
    path = f"/tmp/globaltensor-strided-{os.getppid()}"
    try:
        dcp.save({"s": strided, "p": strided.to_global(sbp=gt.sbp.split(1))}, checkpoint_id=path)
        into = {"s": gt.zeros(16, 6, placement=P, sbp=gt.sbp.split(1)),
                "p": gt.zeros(16, 6, placement=P, sbp=gt.sbp.split(0, blocks=4))}
        dcp.load(into, checkpoint_id=path)
        for name, t in into.items():
            torch.testing.assert_close(t.full(), value, rtol=0, atol=0, msg=name)
        assert into["p"].sbp == (gt.sbp.split(0, blocks=4),)
    finally:
        strided.full()               # every rank is done with the files
        if int(os.environ["RANK"]) == 0:
            shutil.rmtree(path, ignore_errors=True)
    d = strided.to_dtensor()
    assert type(d.placements[0]).__name__ == "_StridedShard"
    assert d.placements[0].split_factor == 2
    torch.testing.assert_close(d.full_tensor(), value, rtol=0, atol=0)
    back = gt.from_dtensor(d)
    assert back.sbp == strided.sbp
    torch.testing.assert_close(back.full(), value, rtol=0, atol=0)
    # blocks that do not divide among the ranks: DTensor cuts them otherwise, so the
    # conversion boxes to a plain split first
    uneven = gt.to_global(value[:15], P, gt.sbp.broadcast).to_global(
        sbp=gt.sbp.split(0, blocks=5))
    d = uneven.to_dtensor()
    assert type(d.placements[0]).__name__ == "Shard"
    torch.testing.assert_close(d.full_tensor(), value[:15], rtol=0, atol=0)


CHECKS = ["check_strided_split_saves_loads_and_converts"]

test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
