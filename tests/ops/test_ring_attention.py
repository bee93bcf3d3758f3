"""Attention with the sequence split (rules/ring_attention.py, issue #48 item 1): q, k
and v split on the sequence stay split through ``F.scaled_dot_product_attention``,
computed as ring attention (key/value blocks passed rank to rank, never gathered),
equal to one process forward and backward; causal, padded, uneven splits, and on a
2-D placement (data x context, and the sequence split on both axes). The CUDA flash
kernel's ring, with the CPU kernel standing in behind its signature.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from check_helpers import S, _attention_equal, _close, _g, _gen, _line
from mp import checks_in_worlds, example_module, patched

import globaltensor as gt
from globaltensor.cost import product_macs, ring_seconds
from globaltensor.layout import Layout

TOL = dict(atol=1e-5, rtol=1e-5)


def _against_one_process(shape, causal, mask, placement, sbp, what):
    gen = _gen(48)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*want, is_causal=causal, attn_mask=mask)
    grad = torch.randn(ref.shape, generator=gen)
    ref.backward(grad)
    ins = [_g(t, sbp, grad=True, placement=placement) for t in (q, k, v)]
    gmask = None if mask is None else _g(mask, sbp, placement=placement)
    with gt.debug.comm_stats() as stats:
        out = F.scaled_dot_product_attention(*ins, is_causal=causal, attn_mask=gmask)
        out.backward(_g(grad, sbp, placement=placement))
    assert out.sbp == ins[0].sbp, (what, out.sbp)
    _attention_equal(stats, out, ref, ins, want, what, **TOL)


def check_sequence_split_attention_equals_one_process():
    n = gt.get_world_size()
    # even, uneven, and shorter than the ranks (an empty part, whose rank still passes
    # the ring's blocks on: it returned empty outputs without taking part)
    for length in (4 * n, 4 * n + 3) + ((n - 1,) if n > 2 else ()):
        for causal in (True, False):
            _against_one_process((2, 2, length, 8), causal, None, _line(), S(2),
                                 f"length {length} causal={causal}")
    length = 3 * n + 1
    padded = torch.ones(2, 1, length, length, dtype=torch.bool)
    padded[0, ..., length - 4:] = False   # the first sequence's last 4 keys are padding:
    # a block of only padding keys on some rank
    _against_one_process((2, 2, length, 8), False, padded, _line(), S(2), "padding mask")
    # priced by its hops (per-op choice and the planner), none where nothing is split
    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    split = Layout.make((2, 4, 64, 16), _line(), (S(2),))
    whole = Layout.make((2, 4, 64, 16), _line(), (gt.sbp.broadcast,))
    assert 0.0 < ring_seconds(forward, (split,) * 3) < ring_seconds(backward, (split,) * 6)
    assert ring_seconds(forward, (whole,) * 3) == 0.0
    assert product_macs(forward, (split,) * 3, gt.get_rank()) == 2 * 2 * 4 * 64 // n * 64 * 16


def check_sequence_split_on_a_2d_placement():
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    for sbp in ((S(0), S(2)), (S(2), S(2))):
        for causal in (True, False):
            _against_one_process((2, 2, 10, 8), causal, None, grid, sbp,
                                 f"2x2 {sbp} causal={causal}")


def _packed_reference(q, k, v, offsets, causal):
    """One process: ``F.scaled_dot_product_attention`` with the block-diagonal mask."""
    length = q.shape[2]
    doc = torch.searchsorted(torch.tensor(offsets), torch.arange(length), right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(length, length, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check_packed_documents_never_attend_across():
    n = gt.get_world_size()
    length = 5 * n + 3   # uneven parts; documents that straddle them
    offsets = [0, 3, 4, 11, length]
    gen = _gen(49)
    q, k, v = (torch.randn(2, 2, length, 8, generator=gen) for _ in range(3))
    grad = torch.randn(2, 2, length, 8, generator=gen)
    for causal in (True, False):
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _packed_reference(*want, offsets, causal)
        ref.backward(grad)
        for sbp in (S(2), S(0), S(1)):   # the ring, and batch or head splits (no ring)
            ins = [_g(t, sbp, grad=True) for t in (q, k, v)]
            with gt.debug.comm_stats() as stats:
                out = gt.nn.packed_attention(*ins, offsets, is_causal=causal)
                out.backward(_g(grad, sbp))
            what = f"packed {sbp} causal={causal}"
            assert out.sbp == (sbp,) and stats.calls["all_gather"] == 0, (what, stats)
            _close(out, ref.detach(), what, **TOL)
            for name, x, w in zip("qkv", ins, want):
                _close(x.grad, w.grad, f"{what}: gradient of {name}", **TOL)
    # a sequence shorter than the ring: the last rank holds no part, and passes on
    short = [t[:, :, :n - 1].clone().requires_grad_() for t in (q, k, v)]
    ins = [_g(t.detach(), S(2), grad=True) for t in short]
    out = gt.nn.packed_attention(*ins, [0, n - 1])
    out.sum().backward()
    ref = _packed_reference(*short, [0, n - 1], True)
    ref.sum().backward()
    _close(out, ref.detach(), "a rank with no part", **TOL)
    _close(ins[1].grad, short[1].grad, "a rank with no part: gradient of k", **TOL)


def check_a_zigzag_order_balances_and_equals_one_process():
    """The sequence reordered by gt.nn.zigzag_order and split: each rank holds a chunk
    near the start and one near the end; with positions=order the causal mask and the
    documents follow the original positions, equal to one process in the original
    order; and every rank runs about as many query-key pairs."""
    from unittest import mock

    from globaltensor.rules import ring_attention as ring
    n = gt.get_world_size()
    length = 4 * 2 * n
    order = gt.nn.zigzag_order(length, n)
    gen = _gen(52)
    q, k, v, grad = (torch.randn(2, 2, length, 8, generator=gen) for _ in range(4))
    for offsets in ([0, length], [0, 3, 11, length]):
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _packed_reference(*want, offsets, True)
        ref.backward(grad)
        ins = [_g(t[:, :, order], S(2), grad=True) for t in (q, k, v)]
        work = []   # query-key pairs this rank computes that are not masked

        def counted(query, key, value, causal, explicit, scale):
            rows, cols = query.shape[2], key.shape[2]
            work.append(int((explicit > float("-inf")).sum()) if explicit is not None
                        else rows * (rows + 1) // 2 if causal else rows * cols)
            return ring.math_forward(query, key, value, causal, explicit, scale)
        with mock.patch.object(ring, "_block_forward", counted):
            out = gt.nn.packed_attention(*ins, offsets, positions=order)
        out.backward(_g(grad[:, :, order], S(2)))
        what = f"zigzag offsets={offsets}"
        _close(out, ref.detach()[:, :, order], what, **TOL)
        for name, x, w in zip("qkv", ins, want):
            _close(x.grad, w.grad[:, :, order], f"{what}: gradient of {name}", **TOL)
        if offsets == [0, length]:   # balanced: every rank's chunks r and 2n - 1 - r
            c = length // (2 * n)   # see 2n - 1 whole chunks and two diagonal halves
            assert sum(work) == (2 * n - 1) * c * c + c * (c + 1), (work, n)


def test_packed_attention_in_one_process_and_its_bad_offsets():
    import pytest
    gen = _gen(50)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=gen, requires_grad=True) for _ in range(3))
    out = gt.nn.packed_attention(q, k, v, [0, 5, 12])
    torch.testing.assert_close(out, _packed_reference(q, k, v, [0, 5, 12], True), **TOL)
    out.sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0
    for bad in ([0, 5], [1, 12], [0, 7, 7, 12], [0, 13]):
        with pytest.raises(ValueError, match="offsets must rise from 0 to the sequence length 12"):
            gt.nn.packed_attention(q, k, v, bad)
    with pytest.raises(ValueError, match="must be .batch, heads, sequence, head dim. alike"):
        gt.nn.packed_attention(q, k[:, :, :6], v, [0, 12])


def check_long_context_example_trains_equal_and_keeps_its_share():
    """examples/long_context.py: a GPT with its sequence split trains equal to one
    process, no collective gathers the sequence, and what a rank keeps for backward
    grows with the sequence / the ranks."""
    import copy
    ex, n, seq = example_module("long_context"), gt.get_world_size(), 8 * gt.get_world_size()
    torch.manual_seed(0)
    initial = ex.GPT(2 * seq)
    plain, model = copy.deepcopy(initial), gt.nn.to_global(copy.deepcopy(initial), _line(),
                                                           gt.sbp.broadcast)
    with gt.debug.comm_stats() as stats:
        losses = ex.train(model, seq, 2, _line())
    assert stats.calls["all_gather"] == stats.calls["all_to_all"] == 0, stats
    _close(torch.tensor(losses), torch.tensor(ex.train(plain, seq, 2)), "losses", **TOL)
    one = ex.kept_for_backward(plain, 2 * seq) - ex.kept_for_backward(plain, seq)
    mine = ex.kept_for_backward(model, 2 * seq, _line()) - ex.kept_for_backward(model, seq, _line())
    assert 0.9 / n < mine / one < 1.1 / n, (mine, one)


def _cpu_flash_as_cuda(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                       scale=None):
    """The CUDA flash kernel's signature and outputs (their kinds from its meta
    implementation), computed by the CPU one: the stand-in of a machine without a GPU."""
    aten = torch.ops.aten
    kinds = aten._scaled_dot_product_flash_attention.default(
        *(torch.empty_like(t, device="meta") for t in (q, k, v)), dropout_p, is_causal,
        return_debug_mask, scale=scale)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, scale=scale)
    return (out, lse, *(torch.zeros(o.shape, dtype=o.dtype) if isinstance(o, torch.Tensor)
                        else o for o in kinds[2:]))


def _cpu_flash_backward_as_cuda(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                                is_causal, seed, offset, *, scale=None):
    # what the CUDA kernel reads: no cumulative lengths (no packed batch), the block's
    # lengths, a contiguous log-sum-exp
    assert cum_q is None and cum_k is None and lse.is_contiguous()
    assert (max_q, max_k) == (q.shape[2], k.shape[2]), (max_q, max_k, q.shape, k.shape)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, q, k, v, out, lse, dropout_p, is_causal, scale=scale)


def check_the_cuda_flash_kernel_walks_the_ring():
    """The CUDA flash kernel and its backward (what F.scaled_dot_product_attention runs
    on a GPU in half precision) with q, k, v split on the sequence walk the ring, each
    block on the kernel: here the CPU kernel behind the CUDA one's signature. Outputs
    and gradients equal one process's, the whole call's lengths among the outputs."""
    from globaltensor.rules import ring_attention as ring
    aten = torch.ops.aten
    n = gt.get_world_size()
    with patched(ring, "_CUDA_FORWARD", _cpu_flash_as_cuda), \
            patched(ring, "_CUDA_BACKWARD", _cpu_flash_backward_as_cuda):
        for length in (4 * n, 4 * n + 3):
            for causal in (True, False):
                what = f"length {length} causal={causal}"
                gen = _gen(49)
                q, k, v, g = (torch.randn(2, 2, length, 8, generator=gen) for _ in range(4))
                out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
                    q, k, v, 0.0, causal)
                want = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
                    g, q, k, v, out, lse, 0.0, causal)
                gq, gk, gv, gg = (_g(t, S(2)) for t in (q, k, v, g))
                with gt.debug.comm_stats() as stats:
                    got = aten._scaled_dot_product_flash_attention.default(gq, gk, gv, 0.0, causal)
                    grads = aten._scaled_dot_product_flash_attention_backward.default(
                        gg, gq, gk, gv, *got[:6], 0.0, causal, got[6], got[7])
                assert stats.calls["all_gather"] == stats.calls["all_to_all"] == 0, (what, stats)
                assert stats.calls["send"] > 0, (what, stats)
                assert got[0].sbp == got[1].sbp == (S(2),), (what, got[0].sbp, got[1].sbp)
                assert tuple(got[4:6]) == (length, length), (what, got[4:6])
                _close(got[0], out, what, **TOL)
                _close(got[1], lse, f"{what}: log-sum-exp", **TOL)
                for name, a, b in zip("qkv", grads, want):
                    assert a.sbp == (S(2),), (what, name, a.sbp)
                    _close(a, b, f"{what}: gradient of {name}", **TOL)


CHECKS = ["check_sequence_split_attention_equals_one_process",
          "check_packed_documents_never_attend_across",
          "check_a_zigzag_order_balances_and_equals_one_process",
          "check_long_context_example_trains_equal_and_keeps_its_share",
          "check_the_cuda_flash_kernel_walks_the_ring"]
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, only_in_4=["check_sequence_split_on_a_2d_placement"],
    in_processes=["check_a_zigzag_order_balances_and_equals_one_process"])


def test_ring_attention_is_priced_by_its_hops_and_its_whole_key_sequence():
    """Per-op choice and the planner see a ring's messages, and a rank's queries
    meeting every key (not only its block)."""
    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    line = gt.placement("cpu", [0])
    one = Layout.make((2, 4, 64, 16), line, (S(2),))   # a ring of one rank: no hops
    assert ring_seconds(forward, (one,) * 3) == 0.0
    assert product_macs(forward, (one,) * 3, 0) == 2 * 2 * 4 * 64 * 64 * 16
    assert product_macs(backward, (one,) * 6, 0) == 5 * 2 * 4 * 64 * 64 * 16


def test_the_plain_block_kernels_equal_the_cpu_flash_kernel():
    """Off the CPU the ring's blocks run as plain ops (math_forward, math_backward):
    on the CPU they equal the fused kernel's, forward and backward with the whole
    row's output and log-sum-exp, causal, masked and with rows that see no key; and a
    packed attention walked with them equals F.scaled_dot_product_attention."""
    from unittest import mock

    from globaltensor.rules import ring_attention as ring
    gen = _gen(51)
    q, k, v, g = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(4))
    mask = torch.zeros(6, 6)
    mask[1] = float("-inf")   # a row that sees no key
    mask[3, :2] = float("-inf")
    for causal, m in ((True, None), (False, None), (False, mask)):
        out, lse = ring._FORWARD(q, k, v, 0.0, causal, attn_mask=m)
        mine, my_lse = ring.math_forward(q, k, v, causal, m)
        seen = torch.isfinite(my_lse)
        torch.testing.assert_close(mine, out, **TOL)
        torch.testing.assert_close(my_lse[seen], lse[seen], **TOL)
        want = ring._BACKWARD(g, q, k, v, out, lse, 0.0, causal, attn_mask=m)
        for name, a, b in zip("qkv", ring.math_backward(g, q, k, v, out, lse, causal, m), want):
            torch.testing.assert_close(a, b, **TOL, msg=lambda e: f"{causal} {name}: {e}")
    offsets = [0, 2, 5, 6]
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _packed_reference(*want, offsets, True)
    ref.backward(g)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    with mock.patch.object(ring, "_block_forward", lambda *a: ring.math_forward(*a)), \
            mock.patch.object(ring, "_block_backward", lambda *a: ring.math_backward(*a)):
        out = gt.nn.packed_attention(*mine, offsets)
        out.backward(g)
    torch.testing.assert_close(out, ref, **TOL)
    for name, a, b in zip("qkv", mine, want):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda e: f"packed {name}: {e}")
