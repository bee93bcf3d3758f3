"""``heap.py``: freed heap pages go back to the system (glibc), so fully_shard's
resident memory follows what is live."""
from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from globaltensor import heap
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


@pytest.mark.skipif(heap._MKL_FREE_BUFFERS is None or heap._MALLOPT is None,
                    reason="torch's BLAS is not MKL, or the C library is not glibc")
def test_blas_buffers_kept_after_a_large_product_are_freed():
    kept_bytes = heap._c_function(heap.TORCH_CPU, "mkl_serv_mem_stat",
                                  [ctypes.POINTER(ctypes.c_int)], ctypes.c_int64)
    buffers = ctypes.c_int(0)
    assert heap.map_large_blocks()
    a, b = torch.randn(1024, 768), torch.randn(768, 8192)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # MKL sizes its buffers by the threads that compute
    try:
        product = a @ b
        del product
    finally:
        torch.set_num_threads(threads)
    # packed copies, sized by the CPU's kernels: 16.6 MiB on an AVX-512 Xeon, 5.3 MiB
    # on an AVX2 EPYC
    assert kept_bytes(ctypes.byref(buffers)) > 1 << 20
    assert heap.release_blas_buffers()
    assert kept_bytes(ctypes.byref(buffers)) == 0 and buffers.value == 0
