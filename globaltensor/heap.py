"""Host memory resident only while it is live, under fully_shard.

glibc serves blocks under its mmap threshold from the heap, and raises that threshold
to the size of every mapped block freed (up to 32 MiB), so after the first gathered
unit is freed nearly every parameter, gradient and activation of a CPU model lives in
the heap. Freed heap pages stay resident, and a later block of another size often
cannot reuse them: ``benchmarks/memory.py``'s GPT under fully_shard holds 3.7x the
parameter bytes resident with at most 2.4x live. Fixing the threshold at glibc's own
starting value (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, which also stops its raising)
maps every block of 128 KiB or more on its own, and freeing one gives it back at once:
that GPT then peaks at 2.5x. Trimming the heap where each unit starts (``malloc_trim``,
done before) held 2.7x and cost as much time.

The price is page faults: a mapped block's pages fault in at each allocation (that GPT
+13-16 % per step over leaving malloc alone, 0-3 % over the trims; torch's
``THP_MEM_ALLOC_ENABLE=1``, set before torch is imported, asks for huge pages and wins
most of it back). Only host memory is concerned: a cuda placement's
tensors live in torch's caching allocator. MKL's packing buffers for large matrix
products, which it keeps for reuse, are freed where each unit starts
(``release_blas_buffers``). ``GLOBALTENSOR_TRIM_HEAP=0`` leaves malloc and MKL as they
are; other C libraries than glibc are left alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Callable, Iterator, Optional

import torch

from . import env

M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
MAPPED_BYTES = 128 << 10    # blocks of this size or more are mapped on their own (glibc's
                            # starting threshold, which it then no longer raises)


def _c_function(library: Optional[str], name: str, argtypes: list,
                restype=ctypes.c_int) -> Optional[Callable]:
    """``name`` from a loaded library (None: the C library), or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_MALLOC_TRIM = _c_function(None, "malloc_trim", [ctypes.c_size_t])
_MALLOPT = _c_function(None, "mallopt", [ctypes.c_int, ctypes.c_int])
_mapped = False
# Whether this rank's program maps its large host blocks (fully_shard on a "cpu"
# placement; inside ``left_alone`` it would have): a simulated step prices the page
# faults of every fresh block (``gt.debug.simulate_step``).
faulting = False


# MKL's service functions: torch builds that link MKL into libtorch_cpu export them
# (``mkl_free_buffers`` as ``mkl_serv_free_buffers``)
TORCH_CPU = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
_MKL_FREE_BUFFERS = _c_function(TORCH_CPU, "mkl_serv_free_buffers", [], None)


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``); False
    where the C library has none. For measurements that must start from what is live
    (``gt.testing.peak_rise``).

    >>> release_free_heap()    # doctest: +SKIP
    True
    """
    if _MALLOC_TRIM is None or torch.compiler.is_compiling():   # no trace of it
        return False
    _MALLOC_TRIM(0)
    return True


def maps_large_blocks(device_type: str) -> bool:
    """Whether fully_shard on ``device_type`` fixes malloc's mmap threshold: host
    tensors under glibc, unless ``GLOBALTENSOR_TRIM_HEAP=0`` (or inside
    ``left_alone``, where it only notes that it would: ``faulting``)."""
    global faulting
    would = device_type == "cpu" and _MALLOPT is not None and env.trim_heap_enabled()
    faulting = faulting or would
    return would and not _left_alone


_left_alone = 0   # open ``left_alone`` blocks


@contextlib.contextmanager
def left_alone() -> Iterator[None]:
    """Inside, fully_shard leaves malloc's settings as they are (``gt.debug.
    simulate_step``: the simulated program's process is not this one)."""
    global _left_alone
    _left_alone += 1
    try:
        yield
    finally:
        _left_alone -= 1


def map_large_blocks() -> bool:
    """From now on this process maps every block of ``MAPPED_BYTES`` or more on its own,
    so a freed tensor's memory goes back to the system at once; True once it is so.

    >>> map_large_blocks()     # doctest: +SKIP
    True
    """
    global _mapped
    if not _mapped and _MALLOPT is not None:
        _mapped = _MALLOPT(M_MMAP_THRESHOLD, MAPPED_BYTES) == 1
    return _mapped


def release_blas_buffers() -> bool:
    """Once large blocks are mapped (``map_large_blocks``): free the packing buffers MKL
    keeps after a large matrix product (its ``mkl_free_buffers``); False where there are
    none to free. MKL keeps them for the next product of any shape: after a GPT's
    vocabulary head they held 17-37 MiB through the whole backward. fully_shard calls
    this where each unit starts; the next product allocates what it needs again.

    >>> release_blas_buffers()    # doctest: +SKIP
    True
    """
    if not _mapped or _MKL_FREE_BUFFERS is None or torch.compiler.is_compiling():
        return False
    _MKL_FREE_BUFFERS()
    return True
