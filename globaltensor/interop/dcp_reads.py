"""Lean loads of GlobalTensors from torch.distributed.checkpoint files.

DCP's ``FileSystemReader`` loads every saved chunk a part overlaps whole
(``torch.load`` of its bytes) and copies the overlap: loading into a new layout holds
a whole saved chunk besides the part (a 1-rank checkpoint loaded on 8 ranks: the whole
tensor, 8 parts). For read items whose target is a GlobalTensor, ``install()`` makes it
read only the overlap instead: the chunk's header (the zip directory and the small
pickle saying dtype, shape and where the storage's bytes start) tells where each row
lies, and the rows land in the part directly when the overlap is whole rows of the
chunk, else through one bounce buffer of at most ``BOUNCE_BYTES`` (or one row of the
chunk). Anything else (objects, plain and DTensor targets, chunks behind stream
transforms such as compression, other storage formats) goes DCP's own way. Stream
transforms still run first, so a checksum check still sees every chunk.

The wrapper also warns (once per checkpoint directory and process) when a checkpoint
whose metadata carries ``gt.checkpoint.ChecksummedWriter``'s CRC-32s is read by a
reader that does not check them (DCP's own ``FileSystemReader``, as
``checkpoint_id=path`` gives): the load is unverified, and
``storage_reader=gt.checkpoint.VerifyingReader(path)`` would verify it. It is installed
by the first load planning into a GlobalTensor; loads of plain tensors before that are
not looked at.

>>> dcp.load({"w": new_layout_w}, checkpoint_id="ckpt")   # part + <= 1 MiB  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import os
import pickle
import sys
import warnings

import torch
from torch.futures import Future

from ..tensor import GlobalTensor

__all__ = ["BOUNCE_BYTES", "install"]

# Bytes read at once when the overlap is not whole rows of the saved chunk.
BOUNCE_BYTES = 1 << 20


def install() -> None:
    """Wrap ``FileSystemReader.read_data`` (once) so that reads into GlobalTensors are
    lean; called by the first load planning of a GlobalTensor (DCP is imported then)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    if getattr(FileSystemReader.read_data, "_globaltensor_lean", False):
        return
    original = FileSystemReader.read_data

    @functools.wraps(original)
    def read_data(self, plan, planner):
        _warn_if_unverified(self)
        lean = [r for r in plan.items if _reads_into_global(self, r, planner)]
        if not lean:
            return original(self, plan, planner)
        chosen = {id(r) for r in lean}
        rest = [r for r in plan.items if id(r) not in chosen]
        if rest:
            original(self, dataclasses.replace(plan, items=rest), planner).wait()
        unread = _read_lean(self, lean, planner)
        if unread:
            return original(self, dataclasses.replace(plan, items=unread), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    read_data._globaltensor_lean = True
    FileSystemReader.read_data = read_data


_WARNED: set = set()  # checkpoint directories warned about in this process


def _warn_if_unverified(reader) -> None:
    from .checksums import UnverifiedLoadWarning, VerifyingReader, carries_checksums
    if isinstance(reader, VerifyingReader):
        return
    path = os.fspath(getattr(reader, "path", ""))
    if path in _WARNED or not carries_checksums(getattr(reader, "storage_data", None)):
        return
    _WARNED.add(path)
    warnings.warn(
        f"checkpoint {path} carries checksums (saved with gt.checkpoint.ChecksummedWriter) "
        f"but is loaded by {type(reader).__name__}, which does not check them: a damaged "
        f"file would load as wrong values. Verify the load with dcp.load(state, "
        f"storage_reader=gt.checkpoint.VerifyingReader(path))",
        UnverifiedLoadWarning, stacklevel=3)


def _reads_into_global(reader, req, planner) -> bool:
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.planner import LoadItemType
    state = getattr(planner, "state_dict", None)
    return (req.type == LoadItemType.TENSOR and type(reader.fs) is FileSystem
            and isinstance(state, dict)
            and isinstance(state.get(req.dest_index.fqn), GlobalTensor))


def _read_lean(reader, reqs: list, planner) -> list:
    """Read ``reqs`` file by file; returns those whose chunk this cannot read (DCP then
    reads them its own way)."""
    per_file: dict = {}
    for req in reqs:
        per_file.setdefault(reader.storage_data[req.storage_index].relative_path, []).append(req)
    unread = []
    for relative_path, file_reqs in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            for req in file_reqs:
                info = reader.storage_data[req.storage_index]
                view = reader._slice_file(stream, info)
                source = reader.transforms.transform_load_stream(
                    req, info.transform_descriptors or (), view)
                header = _header(view) if source is view else None
                if header is None:
                    unread.append(req)
                    continue
                target = planner.resolve_tensor(req).detach()
                _copy_overlap(stream, info.offset, header, req.storage_offsets, req.lengths,
                              target)
                planner.commit_tensor(req, target)
    return unread


@dataclasses.dataclass(frozen=True)
class _Header:
    """Where a saved chunk's values lie in its file slice, and how."""
    data_offset: int
    dtype: torch.dtype
    shape: tuple
    storage_offset: int


_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _HeaderUnpickler(pickle.Unpickler):
    """Reads a saved tensor's pickle into (dtype, storage key, offset, shape, stride)
    without its storage; only the names a plain ``torch.save`` of one tensor uses."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid):
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        return dtype, key


def _rebuilt(storage, storage_offset, size, stride, *rest):
    return storage, storage_offset, tuple(size), tuple(stride)


def _header(view) -> _Header | None:
    """The header of the ``torch.save``'d tensor in ``view`` when its values lie
    contiguously in this machine's byte order; else None."""
    try:
        archive = torch._C.PyTorchFileReader(view)
        names = archive.get_all_records()
        pkl = next(n for n in names if n == "data.pkl" or n.endswith("/data.pkl"))
        prefix = pkl[:-len("data.pkl")]
        if prefix + "byteorder" in names and \
                archive.get_record(prefix + "byteorder").decode() != sys.byteorder:
            return None
        (dtype, key), offset, shape, stride = _HeaderUnpickler(
            io.BytesIO(archive.get_record(pkl))).load()
        data_offset = archive.get_record_offset(prefix + "data/" + key)
    except (pickle.UnpicklingError, StopIteration, RuntimeError, ValueError, TypeError):
        return None
    contiguous = tuple(torch.empty(shape, device="meta").stride())
    if not shape or stride != contiguous:
        return None
    return _Header(data_offset, dtype, shape, offset)


def _copy_overlap(stream, start: int, header: _Header, offsets, lengths, target) -> None:
    """Copy the box (``offsets``, ``lengths``) of the chunk whose slice starts at byte
    ``start`` of ``stream`` into ``target``, reading whole rows (dim 0) of the chunk
    in place or through a bounded buffer."""
    shape, dtype = header.shape, header.dtype
    row = math.prod(shape[1:])
    itemsize = dtype.itemsize
    first = start + header.data_offset + (header.storage_offset + offsets[0] * row) * itemsize
    whole_rows = all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:]))
    if whole_rows and target.is_contiguous() and target.dtype == dtype:
        stream.seek(first)
        _read_into(stream, target)
        return
    rows_at_once = max(1, BOUNCE_BYTES // max(row * itemsize, 1))
    bounce = torch.empty(min(rows_at_once, lengths[0]) * row, dtype=dtype)
    for r in range(0, lengths[0], rows_at_once):
        n = min(rows_at_once, lengths[0] - r)
        block = bounce[:n * row]
        stream.seek(first + r * row * itemsize)
        _read_into(stream, block)
        block = block.view((n,) + tuple(shape[1:]))
        for d in range(1, len(shape)):
            block = block.narrow(d, offsets[d], lengths[d])
        target.narrow(0, r, n).copy_(block)


def _read_into(stream, t: torch.Tensor) -> None:
    """Fill the contiguous ``t`` with the next bytes of ``stream``."""
    memory = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(memory):
        got = stream.readinto(memory[done:])
        if not got:
            raise OSError(f"checkpoint file ends {len(memory) - done} bytes early")
        done += got
