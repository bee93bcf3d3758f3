"""On gloo, an all-gather of parts of ``GATHER_BY_MESSAGES_BYTES`` or more goes by
point-to-point messages straight into the output's parts (gloo's own all_gather stages
the whole output in a buffer of its own: 0.65-0.85x its time here); smaller parts, by
gloo's collective. Both give the same values; the messages are counted as one all_gather."""
from __future__ import annotations

import torch
from mp import patched, world_test


def _parts(n: int, numel: int, dtype) -> list:
    return [(torch.arange(numel) + 1000 * k).to(dtype) for k in range(n)]


def check_large_and_small_gathers_give_the_same_values():
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import collectives
    n, r = gt.get_world_size(), gt.get_rank()
    ranks = tuple(range(n))
    limit = collectives.GATHER_BY_MESSAGES_BYTES
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        size = torch.empty(0, dtype=dtype).element_size()
        for numel in (3, limit // size):   # parts under the limit and at it
            parts = _parts(n, numel, dtype)
            out = torch.full((n * numel,), -1, dtype=dtype)
            counter = comm.CommCounter(events=True)
            comm.stats.push(counter)
            try:
                comm.all_gather_into(out, parts[r], ranks)
            finally:
                comm.stats.pop(counter)
            assert torch.equal(out, torch.cat(parts)), (dtype, numel)
            [(kind, nbytes, group, messages)] = counter.events
            assert (kind, nbytes, group) == ("all_gather", numel * size * (n - 1), ranks)
            # by messages: one send to and one receive from each peer
            assert messages == (2 * (n - 1) if numel * size >= limit else 0)


def check_a_boxing_gathers_by_messages():
    # S(0)->B with parts of 1 MiB, uneven ones included (padded, gathered, cut)
    import globaltensor as gt
    n = gt.get_world_size()
    p = gt.placement("cpu", list(range(n)))
    for rows in (1024 * n, 1024 * n - 1):
        full = torch.arange(rows * 256, dtype=torch.float32).view(rows, 256)
        x = gt.tensor(full, placement=p, sbp=gt.sbp.split(0))   # (same on every rank)
        with gt.debug.comm_stats() as counter:
            assert torch.equal(x.to_global(sbp=gt.sbp.broadcast).to_local(), full)
        assert counter.calls["all_gather"] == 1


def check_a_small_gather_by_messages_gives_the_same_values():
    # The way is chosen by the output's bytes alone, which every member shares: with the
    # limit lowered, a gather of 1 KiB parts goes by messages on every rank alike.
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import collectives
    n, r = gt.get_world_size(), gt.get_rank()
    parts = _parts(n, 256, torch.float32)
    for limit in (1 << 40, 1024):
        comm.barrier()
        with patched(collectives, "GATHER_BY_MESSAGES_BYTES", limit):
            out = torch.empty(n * 256)
            comm.all_gather_into(out, parts[r], tuple(range(n)))
            assert torch.equal(out, torch.cat(parts))
        comm.barrier()


def check_large_gathers_of_other_sizes_raise_before_any_message():
    # Compared as gloo's all_gather of that size is, before anything is posted: a rank
    # whose part is one element longer makes every rank raise, and the world goes on.
    import pytest

    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import collectives
    n, r = gt.get_world_size(), gt.get_rank()
    ranks = tuple(range(n))
    numel = collectives.GATHER_BY_MESSAGES_BYTES // 4 + r
    with pytest.raises(gt.debug.DivergenceError, match=f"all_gather of {numel} "):
        comm.all_gather_into(torch.empty(n * numel), torch.ones(numel), ranks)
    y = torch.ones(3)
    comm.all_reduce_(y, "sum", ranks)
    assert y.tolist() == [float(n)] * 3


CHECKS = ["check_large_and_small_gathers_give_the_same_values",
          "check_a_boxing_gathers_by_messages",
          "check_a_small_gather_by_messages_gives_the_same_values",
          "check_large_gathers_of_other_sizes_raise_before_any_message"]

# (on gloo itself: its messages, and no payload posted after a mismatch)
test_world2 = world_test(__name__, 2, CHECKS, in_processes=[
    "check_large_and_small_gathers_give_the_same_values",
    "check_large_gathers_of_other_sizes_raise_before_any_message"])
test_world4 = world_test(__name__, 4, CHECKS)
