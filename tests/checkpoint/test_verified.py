"""Verified checkpoints: dcp.save with gt.checkpoint.ChecksummedWriter records a CRC-32 per
chunk in .metadata, dcp.load with gt.checkpoint.VerifyingReader checks every chunk it reads
and names the file and the tensor of a damaged one (on every rank); the checkpoint still
loads with plain torch, without globaltensor. DCP's own storage (checkpoint_id=path alone)
is left as torch has it."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import globaltensor as gt
from globaltensor.checkpoint import ChecksummedWriter, VerifyingReader
from mp import checks_in_worlds


def flip_byte_in_chunk(path, fqn: str, rank_file: int | None = None) -> str:
    """Flip one byte in the middle of ``fqn``'s chunk (in the file of ``rank_file`` if
    given: a split tensor has one chunk per rank); returns the file's name."""
    md = dcp.FileSystemReader(path).read_metadata()
    info = next(info for index, info in md.storage_data.items() if index.fqn == fqn and (
        rank_file is None or info.relative_path.startswith(f"__{rank_file}_")))
    name = os.path.join(path, info.relative_path)
    with open(name, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return info.relative_path


def saved(path) -> dict:
    P = gt.placement("cpu", [0])
    state = {"layer.weight": gt.tensor(torch.arange(4096.0).reshape(64, 64), placement=P,
                                       sbp=gt.sbp.split(0)),
             "plain": torch.arange(8.0), "extra": {"note": "x" * 300}}
    dcp.save(state, storage_writer=ChecksummedWriter(str(path)))
    return state


def test_every_chunk_carries_a_checksum(tmp_path):
    saved(tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert len(md.storage_data) == 3
    assert all(isinstance(getattr(info, "crc32", None), int) for info in md.storage_data.values())


def test_a_flipped_byte_names_the_file_and_the_tensor(tmp_path):
    saved(tmp_path)
    file = flip_byte_in_chunk(tmp_path, "layer.weight")
    # torch's own reader loads the damaged value silently
    into = {"layer.weight": torch.zeros(64, 64), "plain": torch.zeros(8), "extra": {"note": ""}}
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert not torch.equal(into["layer.weight"], torch.arange(4096.0).reshape(64, 64))
    with pytest.raises(CheckpointException, match=rf"{file}, bytes \d+\.\.\d+, holding tensor "
                                        r"'layer\.weight' .*does not hold what was saved"):
        dcp.load(into, storage_reader=VerifyingReader(str(tmp_path)))


def test_a_flipped_byte_in_an_object_names_it(tmp_path):
    saved(tmp_path)
    flip_byte_in_chunk(tmp_path, "extra.note")
    into = {"layer.weight": torch.zeros(64, 64), "plain": torch.zeros(8), "extra": {"note": ""}}
    with pytest.raises(CheckpointException, match=r"holding object 'extra\.note'.*crc32 [0-9a-f]{8}, "
                                        r"saved [0-9a-f]{8}"):
        dcp.load(into, storage_reader=VerifyingReader(str(tmp_path)))


def test_a_clean_checkpoint_loads_with_plain_torch_without_globaltensor(tmp_path):
    saved(tmp_path)
    code = textwrap.dedent(f"""
        import sys, torch
        import torch.distributed.checkpoint as dcp
        into = {{"layer.weight": torch.zeros(64, 64), "plain": torch.zeros(8),
                 "extra": {{"note": ""}}}}
        dcp.load(into, checkpoint_id={str(tmp_path)!r}, no_dist=True)
        assert "globaltensor" not in sys.modules
        assert torch.equal(into["layer.weight"], torch.arange(4096.0).reshape(64, 64))
        assert torch.equal(into["plain"], torch.arange(8.0)) and into["extra"]["note"] == "x" * 300
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr


# --- in a world of processes --------------------------------------------------------------

def check_a_damaged_chunk_fails_the_load_on_every_rank():
    """A clean checkpoint loads into another layout; after one byte of the last rank's
    chunk flips, every rank's load raises naming the file and tensor (only the last rank
    reads that chunk when the layout is the saved one), and none hangs."""
    import shutil
    import torch.distributed as dist
    rank, n = gt.get_rank(), gt.get_world_size()
    P = gt.placement.all("cpu")
    value = torch.arange(n * 256.0).reshape(n * 16, 16)
    path = f"/tmp/globaltensor-verified-{os.getppid()}-{n}"
    try:
        dcp.save({"w": gt.tensor(value, placement=P, sbp=gt.sbp.split(0)),
                  "b": gt.tensor(value[:3], placement=P, sbp=gt.sbp.broadcast)},
                 storage_writer=ChecksummedWriter(path))
        into = {"w": gt.zeros(n * 16, 16, placement=P, sbp=gt.sbp.split(1)),
                "b": gt.zeros(3, 16, placement=P, sbp=gt.sbp.split(0))}
        dcp.load(into, storage_reader=VerifyingReader(path))
        assert torch.equal(into["w"].full(), value) and torch.equal(into["b"].full(), value[:3])
        dist.barrier()
        file = flip_byte_in_chunk(path, "w", rank_file=n - 1) if rank == 0 else None
        holder = [file]
        dist.broadcast_object_list(holder, src=0)
        into = {"w": gt.zeros(n * 16, 16, placement=P, sbp=gt.sbp.split(0)),
                "b": gt.zeros(3, 16, placement=P, sbp=gt.sbp.broadcast)}
        with pytest.raises(CheckpointException) as error:
            dcp.load(into, storage_reader=VerifyingReader(path))
        assert f"file {holder[0]}, bytes" in str(error.value), error.value
        assert "holding tensor 'w' (its chunk at offsets" in str(error.value), error.value
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


CHECKS = ["check_a_damaged_chunk_fails_the_load_on_every_rank"]

test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)


def test_dcp_defaults_are_torch_own(tmp_path):
    """Without the explicit storage, DCP saves and loads as torch does: no checksums, and
    its storage for a path is torch's class."""
    from torch.distributed.checkpoint import _storage_utils, filesystem
    assert _storage_utils.FileSystemWriter is filesystem.FileSystemWriter
    assert _storage_utils.FileSystemReader is filesystem.FileSystemReader
    dcp.save({"plain": torch.arange(8.0)}, checkpoint_id=str(tmp_path))
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert all(getattr(info, "crc32", None) is None for info in md.storage_data.values())
    into = {"plain": torch.zeros(8)}
    dcp.load(into, storage_reader=VerifyingReader(str(tmp_path)))  # no sums: loads as before
    assert torch.equal(into["plain"], torch.arange(8.0))


def test_gt_checkpoint_exports_the_storage():
    from globaltensor.interop import checksums
    assert gt.checkpoint.ChecksummedWriter is checksums.ChecksummedWriter
    assert gt.checkpoint.VerifyingReader is checksums.VerifyingReader
    assert gt.checkpoint.ChecksumError is checksums.ChecksumError
