"""``nn/heap.py``: freed heap pages go back to the system (glibc), so fully_shard's
resident memory follows what is live."""
from __future__ import annotations

import gc

import pytest
import torch

from globaltensor.nn import heap
from globaltensor.testing import _status_mib


@pytest.mark.skipif(heap._MALLOC_TRIM is None, reason="the C library has no malloc_trim")
def test_free_blocks_inside_the_heap_go_back_to_the_system():
    # a freed mapped block of 8 MiB raises glibc's mmap threshold: the 4 MiB blocks after
    # it come from the heap, and the last one, kept, pins the heap's top (free() itself
    # gives back a top block)
    big = torch.ones(2 << 20)
    del big
    blocks = [torch.ones(1 << 20) for _ in range(20)]
    before = _status_mib("VmRSS")
    del blocks[:-1]
    gc.collect()
    kept = _status_mib("VmRSS")
    assert heap.release_free_heap()
    after = _status_mib("VmRSS")
    assert kept > before - 8, (before, kept)        # freeing alone returned (almost) nothing
    assert kept - after > 60, (before, kept, after)  # 19 blocks of 4 MiB: 76 MiB


def test_only_host_memory_is_mapped_and_the_variable_turns_it_off(monkeypatch):
    has = heap._MALLOPT is not None
    assert heap.maps_large_blocks("cpu") is has
    assert not heap.maps_large_blocks("cuda")
    monkeypatch.setenv("GLOBALTENSOR_TRIM_HEAP", "0")
    assert not heap.maps_large_blocks("cpu")
