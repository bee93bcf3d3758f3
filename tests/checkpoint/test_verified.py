"""Verified checkpoints: dcp.save with gt.checkpoint.ChecksummedWriter records a CRC-32 per
chunk in .metadata, dcp.load with gt.checkpoint.VerifyingReader checks every chunk it reads
and names the file and the tensor of a damaged one (on every rank); the checkpoint still
loads with plain torch, without globaltensor. DCP's own storage (checkpoint_id=path alone)
is left as torch has it."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp import checks_in_worlds
from torch.distributed.checkpoint.api import CheckpointException

import globaltensor as gt
from globaltensor.checkpoint import ChecksummedWriter, VerifyingReader


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
    with warnings.catch_warnings():  # unverified on purpose
        warnings.simplefilter("ignore", gt.checkpoint.UnverifiedLoadWarning)
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


def fresh_into() -> dict:
    return {"layer.weight": torch.zeros(64, 64), "plain": torch.zeros(8), "extra": {"note": ""}}


def test_a_flipped_byte_in_the_metadata_names_the_metadata_file(tmp_path):
    """.metadata's CRC-32 is saved beside it (.metadata.crc32): a flipped byte anywhere in
    it fails the load saying the metadata file is damaged, naming it."""
    saved(tmp_path)
    assert (tmp_path / ".metadata.crc32").read_text().strip() == \
        f"{__import__('zlib').crc32((tmp_path / '.metadata').read_bytes()):08x}"
    dcp.load(fresh_into(), storage_reader=VerifyingReader(str(tmp_path)))   # intact: loads
    data = bytearray((tmp_path / ".metadata").read_bytes())
    for offset in (len(data) // 2, len(data) - 3, 5):
        damaged = bytearray(data)
        damaged[offset] ^= 0x10
        (tmp_path / ".metadata").write_bytes(bytes(damaged))
        with pytest.raises(gt.checkpoint.ChecksumError,
                           match=rf"its metadata file \.metadata \({tmp_path}/\.metadata\) is "
                                 r"damaged or changed after the save \(crc32 [0-9a-f]{8}, "
                                 r"saved [0-9a-f]{8}\)"):
            VerifyingReader(str(tmp_path)).read_metadata()
        with pytest.raises(CheckpointException, match=r"its metadata file \.metadata .* is "
                                                      r"damaged"):
            dcp.load(fresh_into(), storage_reader=VerifyingReader(str(tmp_path)))


def test_an_unreadable_metadata_without_its_sum_names_the_file(tmp_path):
    """A checkpoint whose .metadata has no sum beside it (DCP's own writer): one that
    cannot be unpickled fails saying the metadata file is damaged, not with pickle's
    error alone."""
    dcp.save({"plain": torch.arange(8.0)}, checkpoint_id=str(tmp_path))
    assert not (tmp_path / ".metadata.crc32").exists()
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[:len(data) // 2])
    with pytest.raises(gt.checkpoint.ChecksumError, match=r"its metadata file \.metadata .* "
                                                          r"is damaged .*: it cannot be read"):
        VerifyingReader(str(tmp_path)).read_metadata()


def test_a_load_of_a_checkpoint_with_sums_by_an_unverifying_reader_warns_once(tmp_path):
    """Loading GlobalTensors from a checkpoint that carries checksums with DCP's own
    reader (checkpoint_id=path, or FileSystemReader) warns that the load is unverified
    and how to verify it, once per checkpoint; VerifyingReader, and checkpoints without
    sums, load without the warning."""
    import warnings
    P = gt.placement("cpu", [0])

    def into():
        return {"layer.weight": gt.zeros(64, 64, placement=P, sbp=gt.sbp.broadcast),
                "plain": torch.zeros(8), "extra": {"note": ""}}

    def unverified_warnings(**storage) -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(into(), **storage)
        return [str(w.message) for w in caught
                if issubclass(w.category, gt.checkpoint.UnverifiedLoadWarning)]

    saved(tmp_path / "sums")
    assert unverified_warnings(storage_reader=VerifyingReader(str(tmp_path / "sums"))) == []
    found = unverified_warnings(checkpoint_id=str(tmp_path / "sums"))
    assert len(found) == 1 and f"checkpoint {tmp_path / 'sums'} carries checksums" in found[0]
    assert "loaded by FileSystemReader, which does not check them" in found[0]
    assert "storage_reader=gt.checkpoint.VerifyingReader(path)" in found[0]
    # once per checkpoint
    assert unverified_warnings(storage_reader=dcp.FileSystemReader(str(tmp_path / "sums"))) == []
    dcp.save({"layer.weight": torch.zeros(64, 64), "plain": torch.zeros(8),
              "extra": {"note": ""}}, checkpoint_id=str(tmp_path / "plain"))
    assert unverified_warnings(checkpoint_id=str(tmp_path / "plain")) == []


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
    assert gt.checkpoint.UnverifiedLoadWarning is checksums.UnverifiedLoadWarning
