"""Giving freed host memory back to the system between fully_shard's units.

glibc serves blocks under its mmap threshold from the heap, and raises that threshold
to the size of every mapped block freed (up to 32 MiB), so after the first gathered
unit is freed nearly every parameter, gradient and activation of a CPU model lives in
the heap. Freed heap pages stay resident, and a later block of another size often
cannot reuse them: on ``benchmarks/memory.py``'s GPT under fully_shard the resident
size stayed at 3.5x the parameter bytes with 2.0x live. ``malloc_trim(0)``
returns every free page of every arena (not only the heap's top); called where a unit
starts, it bounds what is resident to what is live plus one unit's churn (that GPT:
3.5x -> 2.65x the parameter bytes). The price is time: pages given back fault in again
when a later block reuses them (+9-19 % per step there). Only host memory is
concerned: a cuda placement's tensors live in torch's caching allocator.

``GLOBALTENSOR_TRIM_HEAP=0`` turns it off (other C libraries have no ``malloc_trim``
and are left alone).
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional

import torch


def _load() -> Optional[Callable[[int], int]]:
    try:
        trim = ctypes.CDLL(None).malloc_trim   # glibc only
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load()

# Units gathering fewer bytes (a layer norm's) start without a trim: the call costs
# about 1.5 ms on a GPT's heap, more than such a unit computes.
MIN_UNIT_BYTES = 1 << 20


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``); False
    where the C library has none. It walks every free chunk: 0.1-2.7 ms on average
    per call in ``benchmarks/memory.py`` (MLP and GPT, 2 and 4 ranks), up to 26 ms.

    >>> release_free_heap()    # doctest: +SKIP
    True
    """
    if _MALLOC_TRIM is None or torch.compiler.is_compiling():   # no trace of it
        return False
    _MALLOC_TRIM(0)
    return True


def trims_between_units(device_type: str) -> bool:
    """Whether fully_shard returns freed memory when a unit starts: host tensors only,
    unless ``GLOBALTENSOR_TRIM_HEAP=0``."""
    return (device_type == "cpu" and _MALLOC_TRIM is not None
            and os.environ.get("GLOBALTENSOR_TRIM_HEAP", "1") != "0")
