"""Every collective carries a fingerprint (its op, size, program call path and number
in its group: comm/fingerprint.py), compared on arrival with check mode off: a rank
that issues one more collective of the same size raises DivergenceError on every rank,
naming each rank's op and line, where the values used to mix silently."""
from __future__ import annotations

import time

import pytest
import torch
from mp import patched, world_test

BOUND = 10  # seconds: a mismatch is seen as the collective arrives (the world's timeout: 60 s)


def test_a_word_cut_into_slots_survives_a_sum_and_a_max_in_every_dtype():
    # all_reduce and reduce_scatter carry the word in per-rank slots: zero but in the
    # rank's own, where its chunks must be exact in the payload's dtype
    from globaltensor.comm import fingerprint as fp
    words = [(0x7FFFFFFF << 32) | 0xFFFFFFFF, (0x1234567 << 32) | 5, 0]
    for dtype, bits in fp._SLOT_BITS.items():
        k = 64 // bits
        slots = torch.zeros(len(words), len(words) * k, dtype=dtype)
        for r, word in enumerate(words):
            slots[r, r * k:(r + 1) * k] = torch.tensor(fp._chunks(word, bits), dtype=dtype)
        assert fp._words(slots.sum(0).tolist(), len(words), bits) == words, dtype
        if not dtype.is_complex:
            assert fp._words(slots.amax(0).tolist(), len(words), bits) == words, dtype


def _large_collectives():
    # Payloads over PACK_LIMIT compare tags before they travel; rank 0 then issues one
    # all-reduce more, from another line: every rank raises, naming both.
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import fingerprint as fp
    r, n = gt.get_rank(), gt.get_world_size()
    ranks = tuple(range(n))
    t = torch.full((fp.PACK_LIMIT // 2,), 1.0 + r)
    comm.all_reduce_(t, "sum", ranks)
    assert t.eq(n * (n + 1) / 2).all()
    try:
        if r == 0:
            comm.all_reduce_(t, "sum", ranks)  # EXTRA_LARGE
        comm.all_reduce_(t, "max", ranks)
    except gt.debug.DivergenceError as error:
        return str(error)
    return None


def test_a_large_group_compares_tags_in_log_rounds():
    # More than RING_RANKS ranks compare by recursive doubling (5: one rank past the
    # power of two, 8: three rounds), not around gloo's ring; a mismatch still names
    # every rank's collective on every rank.
    import globaltensor as gt
    from globaltensor.comm import fingerprint as fp
    calls = []
    real = fp._agree
    with patched(fp, "_agree", lambda tag: calls.append(len(tag.members)) or real(tag)):
        for n in (5, 8):
            errors = gt.testing.simulated_world(n, timeout=60)(_large_collectives)
            line = f"{__file__}:{_lines(_large_collectives, 'EXTRA_LARGE')[0]}"
            assert all(e is not None and line in e and "max" in e for e in errors), errors
    assert set(calls) == {5, 8}


def test_packing_buffers_are_reused_within_bounds(monkeypatch):
    from globaltensor.comm import tagged
    monkeypatch.setattr(tagged, "_free", {})
    monkeypatch.setattr(tagged, "_kept", 0)
    first = tagged._take(100, torch.float32)
    tagged._give(first)
    assert tagged._take(100, torch.float32) is first and not tagged._free   # none kept empty
    tagged._give(*[torch.empty(2**20 + k) for k in range(3)])   # 4 MiB each: 8 MiB kept
    assert tagged._kept == 4 * 2**20 == sum(b.numel() * 4 for v in tagged._free.values()
                                            for b in v)
    for n in range(1, 2000):   # sizes come and go: a bounded number kept
        tagged._give(torch.empty(n, dtype=torch.uint8))
    assert len(tagged._free) == tagged._SIZES


def test_a_headed_receive_into_a_strided_tensor_is_refused_before_anything_is_sent():
    from globaltensor.comm import tagged
    x, y = torch.ones(4), torch.empty(4, 2)[:, 0]   # (the receive: every other float)
    with pytest.raises(ValueError, match="contiguous"):
        tagged.post_p2p([(x, 1)], [(y, 1)], 0)   # an exchange: no word message to post


def _log(t):
    return t.sum().item()  # a logging helper: its line is the same for every tensor logged


LOG_LINE = _log.__code__.co_firstlineno + 1


def _move(t, placement):
    return t.to_global(placement=placement)  # from rank 0 to rank 1: point-to-point


def check_one_more_collective_of_the_same_size_on_one_rank():
    # Step 0 meets at each call path (their first time); at step 1 rank 0 logs `a` once
    # more: its all-reduce of one float met rank 1's of `b` and both got 33 + 66 = 99
    # (`a` sums to 66, `b` to 132). Check mode is off.
    import globaltensor as gt
    from globaltensor import comm
    assert not comm.check_mode()
    r = gt.get_rank()
    p = gt.placement("cpu", [0, 1])
    a = gt.tensor([11.0, 22.0, 33.0], placement=p, sbp=gt.sbp.split(0))
    b = gt.tensor([22.0, 44.0, 66.0], placement=p, sbp=gt.sbp.split(0))
    for step in range(2):
        start = time.monotonic()
        try:
            if step == 0 or r == 0:
                assert _log(a) == 66.0  # EXTRA
            assert _log(b) == 132.0     # EVERY
        except gt.debug.DivergenceError as error:
            assert step == 1 and time.monotonic() - start < BOUND
            text = str(error)
            for words in ("rank 0: all_reduce sum of 1 torch.float32", "rank 1: all_reduce sum of 1",
                          "aten.sum.default", f"{__file__}:{LOG_LINE} <- {__file__}:{EXTRA}",
                          f"{__file__}:{LOG_LINE} <- {__file__}:{EVERY}", "would have mixed"):
                assert words in text, (words, text)
        else:
            assert step == 0, "no DivergenceError"
    assert _log(b) == 132.0 and _log(a) == 66.0   # the world goes on, with right values
    # A direct boxing: rank 0 moves `x` to rank 1 once more (a send that met rank 1's
    # receive of `y`, of the same size): both raise, naming both lines.
    q = gt.placement("cpu", [1])
    x = gt.tensor([1.0, 2.0], placement=gt.placement("cpu", [0]), sbp=gt.sbp.broadcast)
    y = gt.tensor([3.0, 4.0], placement=gt.placement("cpu", [0]), sbp=gt.sbp.broadcast)
    for step in range(2):
        try:
            if step == 0 or r == 0:
                _move(x, q)  # MOVE_X
            moved = _move(y, q)  # MOVE_Y
        except gt.debug.DivergenceError as error:
            assert step == 1
            for words in (f"{__file__}:{MOVE_LINE} <- {__file__}:{MOVE_X}",
                          f"{__file__}:{MOVE_LINE} <- {__file__}:{MOVE_Y}", "point-to-point"):
                assert words in str(error), (words, str(error))
        else:
            assert step == 0, "no DivergenceError"
    moved = _move(y, q)
    assert r == 0 or moved.to_local().tolist() == [3.0, 4.0]


def _lines(function, *marks):
    import inspect
    lines, first = inspect.getsourcelines(function)
    return [first + next(i for i, text in enumerate(lines) if text.rstrip().endswith(f"# {m}"))
            for m in marks]


EXTRA, EVERY, MOVE_X, MOVE_Y = _lines(check_one_more_collective_of_the_same_size_on_one_rank,
                                      "EXTRA", "EVERY", "MOVE_X", "MOVE_Y")
MOVE_LINE = _move.__code__.co_firstlineno + 1


def _one_of(run):
    run()  # every kind below, issued from here: the call path tells them apart


def check_every_kind_of_collective_carries_it():
    # Each kind of collective comm issues, packed in the payload (1 KiB) and in an
    # all-gather of its own before it (over PACK_LIMIT): rank 0 issues one more, both raise.
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import fingerprint
    r, ranks = gt.get_rank(), (0, 1)
    for n in (256, fingerprint.PACK_LIMIT // 2):   # (floats: 1 KiB and twice the limit)
        x = torch.full((n,), 1.0 + r)
        kinds = {
            "all_gather": lambda: comm.all_gather_into(torch.empty(2 * n), x, ranks),
            "all_reduce sum": lambda: comm.all_reduce_(x.clone(), "sum", ranks),
            "all_reduce max": lambda: comm.all_reduce_(x.bfloat16(), "max", ranks),
            "reduce_scatter sum": lambda: comm.reduce_scatter_into(torch.empty(n // 2), x, "sum", ranks),
            "all_to_all": lambda: comm.all_to_all_single(torch.empty(n), x, [n // 2] * 2, [n // 2] * 2, ranks),
            "broadcast from rank 0": lambda: comm.broadcast_(x.clone(), 0, ranks),
            "point-to-point": lambda: _exchange(x, 1 - r),
        }
        for kind, run in kinds.items():
            with pytest.raises(gt.debug.DivergenceError, match=kind) as info:
                if r == 0:
                    _one_of(run)  # ONE_MORE
                _one_of(run)  # EVERY_RANK
            for line in (ONE_MORE, EVERY_RANK):
                where = f"{__file__}:{ONE_OF_LINE} <- {__file__}:{line}"
                assert where in str(info.value), (where, str(info.value))
            y = torch.full((3,), 1.0 + r)
            comm.all_reduce_(y, "sum", ranks)   # and the next collective is right
            assert y.tolist() == [3.0] * 3


def _exchange(x, peer, into=None):
    # Point-to-point messages count the program's line inside a named work (a boxing's
    # sender and receiver run one line); outside one, each side's own code sends or
    # receives (comm.start_p2p from two lines, as tests/core/test_comm_backend.py does).
    from globaltensor import comm
    with comm.activity("an exchange"):
        comm.batched_p2p([(x, peer)], [(torch.empty_like(x) if into is None else into, peer)])


def check_small_payloads_carry_their_tags_and_values_in_every_dtype():
    # Up to PACK_LIMIT on the host the words travel inside the payload (copied in and out
    # of a buffer): every dtype's values come out as the collective makes them, sizes
    # that leave padding included, and an exchange of small messages posts no message
    # of its own for its words (a one-way transfer one: the receiver's word back).
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import fingerprint as fp
    from globaltensor.comm import tagged
    r, ranks, n = gt.get_rank(), (0, 1), 6
    for dtype in [d for d in (*fp._SLOT_BITS, torch.bool) if d is not torch.int16]:  # (not in gloo)
        def full(v, k=n):
            return torch.full((k,), v, dtype=dtype)
        mine = full(1 + r) if dtype is not torch.bool else full(r == 0)
        other = full(2 - r) if dtype is not torch.bool else full(r == 1)
        if dtype is not torch.bool:
            t = mine.clone()
            comm.all_reduce_(t, "sum", ranks)
            assert t.equal(full(3)), (dtype, t)
            if not dtype.is_complex:
                t = mine.clone()
                comm.all_reduce_(t, "max", ranks)
                assert t.equal(full(2)), (dtype, t)
            t = mine.clone()
            comm.all_reduce_async(t, ranks).wait()
            assert t.equal(full(3)), (dtype, t)
            out = full(0, n // 2)
            comm.reduce_scatter_into(out, mine, "sum", ranks)
            assert out.equal(full(3, n // 2)), (dtype, out)
        t = mine.clone()
        comm.broadcast_(t, 1, ranks)
        assert t.equal(full(2) if dtype is not torch.bool else full(False)), (dtype, t)
        out = torch.empty(2 * (n - 1), dtype=dtype)
        comm.all_gather_into(out, mine[:n - 1], ranks)
        first = full(1, n - 1) if dtype is not torch.bool else full(True, n - 1)
        assert out.equal(torch.cat([first, first.logical_not().to(dtype) if dtype is torch.bool
                                    else full(2, n - 1)])), (dtype, out)
        out = torch.empty(n, dtype=dtype)   # (3 elements of 2 bytes: padded rows)
        comm.all_to_all_single(out, mine, [3, 3], [3, 3], ranks)
        assert out.equal(torch.cat([(mine if r == 0 else other)[:3],
                                    (other if r == 0 else mine)[:3]])), (dtype, out)
        y = torch.empty(n, dtype=dtype)
        _exchange(mine, 1 - r, y)
        assert y.equal(other), (dtype, y)
    x, y = torch.ones(4), torch.empty(4)
    exchange, one_way = ([(x, 1 - r)], [(y, 1 - r)]), (([(x, 1)], []) if r == 0 else ([], [(y, 0)]))
    tags = tagged.post_p2p(*exchange, r)
    assert not tags._pending and exchange[0][0][0].numel() == tagged._HEAD + 16
    # the first small message carries them where a large one comes first (a unit's
    # weight, then its bias)
    m = fp.PACK_LIMIT // 4 + 1000
    big, y_big = torch.full((m,), 1.0 + r), torch.empty(m)
    mixed = ([(big, 1 - r), (x, 1 - r)], [(y_big, 1 - r), (y, 1 - r)])
    tags = tagged.post_p2p(*mixed, r)
    assert not tags._pending and mixed[0][0][0] is big and mixed[1][0][0] is y_big
    assert mixed[0][1][0].numel() == tagged._HEAD + 16
    y = torch.empty(4)
    with comm.activity("a weight and a bias"):
        comm.batched_p2p([(big, 1 - r), (x, 1 - r)], [(y_big, 1 - r), (y, 1 - r)])
    assert y_big.equal(torch.full((m,), 2.0 - r)) and y.equal(torch.ones(4))
    tags = tagged.post_p2p(*one_way, r)
    assert len(tags._pending) == 1
    tags.wait()   # rank 1's word back to rank 0 (their payload is not posted here)


def check_buffers_made_in_inference_mode_serve_outside_it():
    # The packing buffers are reused; one made under inference mode must still take a
    # collective's in-place write outside it (a simulated world's backend writes with
    # torch ops, which refuse an inference tensor there).
    import globaltensor as gt
    from globaltensor import comm
    r, ranks = gt.get_rank(), (0, 1)
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            t, y = torch.ones(5), torch.empty(5)
            comm.all_reduce_(t, "sum", ranks)
            _exchange(t, 1 - r, y)
            assert t.tolist() == y.tolist() == [2.0] * 5


ONE_OF_LINE = _one_of.__code__.co_firstlineno + 1
ONE_MORE, EVERY_RANK = _lines(check_every_kind_of_collective_carries_it, "ONE_MORE", "EVERY_RANK")

CHECKS = ["check_one_more_collective_of_the_same_size_on_one_rank",
          "check_every_kind_of_collective_carries_it",
          "check_small_payloads_carry_their_tags_and_values_in_every_dtype",
          "check_buffers_made_in_inference_mode_serve_outside_it"]

# (after a mismatch, gloo's own handling of the payloads still posted; packed payloads of
# every dtype gloo has)
test_world2 = world_test(__name__, 2, CHECKS, in_processes=[
    "check_one_more_collective_of_the_same_size_on_one_rank",
    "check_small_payloads_carry_their_tags_and_values_in_every_dtype"])
