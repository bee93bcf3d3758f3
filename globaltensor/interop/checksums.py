"""Verified checkpoints: every chunk torch.distributed.checkpoint (DCP) writes to a
file carries a CRC-32 of its bytes, and every chunk read back is checked against it.

DCP records where each chunk lies (file, offset, length) but nothing about its bytes,
so a flipped bit loads silently as a wrong value. ``ChecksummedWriter`` hashes the bytes
on their way to the file (one pass of zlib.crc32 over data already in memory) and
records the sum as an extra ``crc32`` attribute on the chunk's storage entry in
``.metadata``: torch's own reader ignores it, so the checkpoint still loads with plain
torch, without globaltensor. ``VerifyingReader`` reads each chunk's bytes, checks them,
and lets DCP read them again (from the page cache: a second copy in memory would double
a load's peak); a mismatch raises ``ChecksumError`` naming the file, the byte
range and the tensor (its fully qualified name). Inside ``dcp.load`` the error of one
rank reaches every rank (DCP gathers each step's exceptions), so no rank hangs.

``.metadata`` itself (DCP's pickle of the checkpoint's layout, written last) gets its
CRC-32 in a file beside it, ``.metadata.crc32`` (``METADATA_SUM``); ``VerifyingReader``
checks it before unpickling, and a ``.metadata`` that does not match, or cannot be
unpickled, raises ``ChecksumError`` saying the metadata file is damaged (naming it), not
an unpickling error or a silently wrong layout. A checkpoint saved without the file
(by DCP's own writer, or cut short between the two renames) loads as before.

They are DCP storage classes the program passes itself (``gt.checkpoint`` exports
them; ``gt.checkpoint.Autosave`` uses them): importing globaltensor leaves DCP's own
defaults for ``checkpoint_id=<path>`` as they are (docs/torch_changes.md).

>>> from globaltensor.checkpoint import ChecksummedWriter, VerifyingReader  # doctest: +SKIP
>>> dcp.save(state, storage_writer=ChecksummedWriter("ckpt/step_100"))
>>> dcp.load(state, storage_reader=VerifyingReader("ckpt/step_100"))  # ChecksumError if damaged
"""
from __future__ import annotations

import os
import pickle
import zlib
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _StorageReaderTransforms,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

__all__ = ["ChecksumError", "ChecksummedWriter", "VerifyingReader", "CHECKSUM",
           "METADATA_SUM", "carries_checksums", "UnverifiedLoadWarning"]

CHECKSUM = "crc32"  # the attribute of a chunk's storage entry (_StorageInfo) holding it
# beside a metadata file (``.metadata``): the CRC-32 of its bytes, in hex, as text
METADATA_SUM = ".crc32"


class ChecksumError(RuntimeError):
    """A chunk of a checkpoint file does not hold the bytes that were saved."""


class UnverifiedLoadWarning(UserWarning):
    """A checkpoint saved with checksums is loaded by a reader that does not check them
    (``interop/dcp_reads.py`` warns, once per checkpoint directory and process)."""


class _Hashing:
    """Passes writes on to ``raw`` and keeps the CRC-32 of everything written."""

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.raw.write(b)

    def flush(self) -> None:
        self.raw.flush()


class _HashingTransforms(_StorageWriterTransforms):
    # Innermost, under any stream extension (compression...): the sum covers the bytes
    # as they lie in the file, which is what a reader sees first.
    def __init__(self, extensions):
        super().__init__(extensions)
        self.sums: dict = {}  # write item index -> _Hashing

    def transform_save_stream(self, write_item, raw_stream):
        hashing = self.sums[write_item.index] = _Hashing(raw_stream)
        return super().transform_save_stream(write_item, hashing)


class ChecksummedWriter(FileSystemWriter):
    """DCP's FileSystemWriter that records each chunk's CRC-32 in ``.metadata``.

    >>> dcp.save(state, storage_writer=ChecksummedWriter("ckpt/step_1"))  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.transforms = _HashingTransforms(self.transforms.extensions)

    def write_data(self, plan, planner) -> Future:
        self.transforms.sums.clear()
        results = super().write_data(plan, planner).wait()
        # safetensors writes the tensors after the items, in one block: no sum per item
        if self.serialization_format == SerializationFormat.TORCH_SAVE:
            for result in results:
                setattr(result.storage_data, CHECKSUM, self.transforms.sums[result.index].crc)
        self.transforms.sums.clear()
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        # the metadata file's own sum, beside it (after it: a save cut short in between
        # leaves a checkpoint that loads unverified at that level, never a wrong sum)
        if not self.use_collectives and self.rank is not None:
            path = self._get_metadata_path(self.rank)
        else:
            path = self._get_metadata_path()
        with self.fs.create_stream(path, "rb") as f:
            crc = _crc32_of(f, 1 << 62)[0]
        sum_path = self.fs.concat_path(self.path, os.path.basename(str(path)) + METADATA_SUM)
        tmp = self.fs.concat_path(self.path, os.path.basename(str(path)) + METADATA_SUM + ".tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(f"{crc:08x}\n".encode())
        if self.fs.exists(sum_path):
            self.fs.rm_file(sum_path)
        self.fs.rename(tmp, sum_path)


class _VerifyingTransforms(_StorageReaderTransforms):
    def __init__(self, reader: "VerifyingReader", registry):
        super().__init__(registry)
        self.reader = reader

    def transform_load_stream(self, read_item, transform_descriptors, raw_stream):
        index = read_item.storage_index
        info = self.reader.storage_data[index]
        want = getattr(info, CHECKSUM, None)
        if want is not None and index not in self.reader.verified:
            got, length = _crc32_of(raw_stream, info.length)
            if length != info.length or got != want:
                raise ChecksumError(_mismatch(self.reader.path, info, read_item, length,
                                              got, want))
            self.reader.verified.add(index)
            raw_stream.seek(0)
        return super().transform_load_stream(read_item, transform_descriptors, raw_stream)


def _crc32_of(stream, length: int, block: int = 1 << 20) -> tuple:
    """(CRC-32, bytes read) of the next ``length`` bytes of ``stream``, read a block at a
    time: a load into a small part holds no whole saved chunk for its check."""
    crc, done = 0, 0
    while done < length:
        data = stream.read(min(block, length - done))
        if not data:
            break
        crc, done = zlib.crc32(data, crc), done + len(data)
    return crc, done


def _mismatch(path, info, read_item, length: int, got: int, want: int) -> str:
    index = read_item.storage_index
    if read_item.type == LoadItemType.BYTE_IO:
        what = f"object '{index.fqn}'"
    else:
        what = f"tensor '{index.fqn}' (its chunk at offsets {tuple(index.offset or ())})"
    found = (f"only {length} of its {info.length} bytes are there" if length != info.length
             else f"crc32 {got:08x}, saved {want:08x}")
    return (f"checkpoint {path}: file {info.relative_path}, bytes {info.offset}.."
            f"{info.offset + info.length}, holding {what}, does not hold what was saved "
            f"({found}): the file was damaged or changed after the save; load another "
            f"checkpoint")


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader that checks each chunk it reads against the CRC-32 saved
    with it (chunks saved without one load as before).

    >>> dcp.load(state, storage_reader=VerifyingReader("ckpt/step_1"))  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.transforms = _VerifyingTransforms(self, self.transforms.extension_registry)
        self.verified: set = set()  # chunks checked in this load (a chunk may be read twice)

    def read_metadata(self, *args: Any, **kwargs: Any):
        """DCP's metadata, after checking ``.metadata`` against the CRC-32 saved beside
        it; a damaged metadata file raises ChecksumError naming it."""
        path = self._get_metadata_path(kwargs.get("rank"))
        name = os.path.basename(str(path))
        sum_path = self.fs.concat_path(self.path, name + METADATA_SUM)
        damaged = (f"checkpoint {self.path}: its metadata file {name} ({path}) is damaged "
                   f"or changed after the save")
        want = None
        if self.fs.exists(path) and self.fs.exists(sum_path):
            with self.fs.create_stream(sum_path, "rb") as f:
                text = f.read(64).decode(errors="replace").strip()
            try:
                want = int(text, 16)
            except ValueError:
                raise ChecksumError(f"checkpoint {self.path}: the checksum file of its "
                                    f"metadata, {name + METADATA_SUM}, is damaged (holds "
                                    f"{text[:20]!r}): load another checkpoint") from None
            with self.fs.create_stream(path, "rb") as f:
                got = _crc32_of(f, 1 << 62)[0]
            if got != want:
                raise ChecksumError(f"{damaged} (crc32 {got:08x}, saved {want:08x}): load "
                                    f"another checkpoint")
        try:
            return super().read_metadata(*args, **kwargs)
        except FileNotFoundError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError,
                KeyError, TypeError, ValueError, MemoryError, UnicodeDecodeError) as e:
            raise ChecksumError(f"{damaged}: it cannot be read ({type(e).__name__}: {e}); "
                                f"load another checkpoint") from e

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.verified = set()


def carries_checksums(storage_data) -> bool:
    """Whether a checkpoint's storage entries (DCP's ``metadata.storage_data``) carry
    the CRC-32s ``ChecksummedWriter`` records."""
    return any(getattr(info, CHECKSUM, None) is not None
               for info in (storage_data or {}).values())
