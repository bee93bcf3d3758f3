"""Composites written with global ops (rules/functional.py; issue #10 items 4 and 15):
F.one_hot, F.embedding_bag (sum, mean, max; offsets, padding_idx, per-sample weights)
F.scaled_dot_product_attention with dropout or causal on torch's math path, and
torch.stft of a batch. Values and gradients are compared
with plain torch on the whole tensors, in worlds of 2 and 4 processes.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from check_helpers import B, S, _close, _g, _gen, _line
from mp import checks_in_worlds

import globaltensor as gt


def check_one_hot_and_embedding_bag():
    idx = torch.tensor([0, 3, 2, 1, 4, 4])
    for sbp in (S(0), B):
        out = F.one_hot(_g(idx, sbp), 5)
        assert out.sbp == (S(0) if sbp == S(0) else B,)
        _close(out, F.one_hot(idx, 5), f"one_hot {sbp}")
        _close(F.one_hot(_g(idx, sbp)), F.one_hot(idx), f"one_hot {sbp}, classes counted")
    with pytest.raises(RuntimeError):
        F.one_hot(_g(idx, S(0)), 3)
    w = torch.randn(10, 4, generator=_gen(3))
    bags2d = torch.tensor([[0, 3, 9], [2, 1, 1], [5, 5, 7], [8, 0, 6]])
    flat = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 2, 2, 5])
    psw = torch.rand(8, generator=_gen(4))
    for mode in ("sum", "mean", "max"):
        for w_sbp in (S(0), S(1), B):
            cases = [(lambda i, t, **k: F.embedding_bag(i, t, mode=mode, **k), bags2d, S(0), {}),
                     (lambda i, t, **k: F.embedding_bag(i, t, offsets, mode=mode, **k), flat,
                      S(0), {"padding_idx": 4})]
            if mode == "sum":
                cases.append((lambda i, t, **k: F.embedding_bag(
                    i, t, offsets, mode="sum", per_sample_weights=psw, **k), flat, B, {}))
            for fn, ind, ind_sbp, kw in cases:
                want_w = w.clone().requires_grad_()
                ref = fn(ind, want_w, **kw)
                ref.square().sum().backward()
                gw = _g(w, w_sbp, grad=True)
                what = f"embedding_bag {mode} table {w_sbp} {tuple(ind.shape)} {kw}"
                out = fn(_g(ind, ind_sbp), gw, **kw)
                _close(out, ref.detach(), what)
                out.square().sum().backward()
                _close(gw.grad, want_w.grad, what + " gradient")
    # the per-sample weights' own gradient (it was None: they were laid out as a copy)
    for sbp in (S(0), B):
        ref_w, ref_p = w.clone().requires_grad_(), psw.clone().requires_grad_()
        F.embedding_bag(flat, ref_w, offsets, per_sample_weights=ref_p, mode="sum").square().sum().backward()
        gw, gp = _g(w, S(1), grad=True), _g(psw, sbp, grad=True)
        out = F.embedding_bag(_g(flat, sbp), gw, offsets, per_sample_weights=gp, mode="sum")
        out.square().sum().backward()
        _close(gp.grad, ref_p.grad, f"embedding_bag per_sample_weights {sbp} gradient")
        _close(gw.grad, ref_w.grad, f"embedding_bag table, per_sample_weights {sbp}, gradient")


def _attention_reference(q, k, v, keep, causal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, -math.inf)
    return (torch.softmax(scores, -1) * keep) @ v


def check_attention_with_dropout():
    gen = _gen(9)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    p = 0.25
    for causal in (True, False):
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        gt.manual_seed(11)
        keep = F.dropout(gt.ones(2, 4, 6, 6, placement=_line(), sbp=B), p).full()
        ref = _attention_reference(*ref_in, keep, causal)
        ref.square().sum().backward()
        for sbp in (S(1), S(0), B):
            ins = [_g(t, sbp, grad=True) for t in (q, k, v)]
            gt.manual_seed(11)
            out = F.scaled_dot_product_attention(*ins, dropout_p=p, is_causal=causal)
            what = f"attention dropout causal={causal} {sbp}"
            assert out.sbp == (sbp,), f"{what}: output {out.sbp}"
            _close(out, ref.detach(), what)
            out.square().sum().backward()
            for x, want in zip(ins, ref_in):
                _close(x.grad, want.grad, what + " gradient")


def check_causal_attention_on_the_math_path():
    # torch's math path (inputs other than 4-D, or the fused kernels turned off) builds a
    # plain causal mask inside the composite: it used to fail with the plain-operand error.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = _gen(10)
    shapes = [((6, 3, 8), (6, 5, 8)), ((3, 8), (5, 8)), ((2, 2, 2, 3, 8), (2, 2, 2, 5, 8)),
              ((2, 4, 3, 8), (2, 4, 5, 8))]
    for qs, ks in shapes:
        q, k, v = torch.randn(qs, generator=gen), torch.randn(ks, generator=gen), torch.randn(ks, generator=gen)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
        weight = torch.linspace(-1.0, 1.0, ref.numel()).reshape(ref.shape)
        (ref * weight).sum().backward()
        for sbp in ((S(0), B) if len(qs) > 2 else (B,)):
            ins = [_g(t, sbp, grad=True) for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):  # a 4-D input takes the math path too
                out = F.scaled_dot_product_attention(*ins, is_causal=True)
            what = f"causal attention {qs} on {sbp}"
            assert out.sbp == (sbp,), f"{what}: output {out.sbp}"
            _close(out, ref.detach(), what)
            (out * gt.tensor(weight, placement=_line(), sbp=B)).sum().backward()
            for x, want in zip(ins, ref_in):
                _close(x.grad, want.grad, what + " gradient")


def check_stft_of_a_batch():
    # torch frames the signal with as_strided, which gathered the batch: each rank now
    # transforms its own rows (or its addend of a partial sum), forward and backward
    gen = _gen(12)
    n = gt.get_world_size()
    window = torch.hann_window(16)
    for rows in (2 * n, n - 1):   # (fewer rows than ranks: an empty part)
        signal = torch.randn(rows, 64, generator=gen)
        ref_in = signal.clone().requires_grad_()
        ref = torch.stft(ref_in, 16, hop_length=4, window=window, return_complex=True)
        weight = torch.linspace(-1.0, 1.0, ref.numel()).reshape(ref.shape)
        (ref.abs() * weight).sum().backward()
        for sbp, win in ((S(0), window), (S(0), _g(window, B)), (gt.sbp.partial_sum, window)):
            x = _g(signal, sbp, grad=True)
            what = f"stft of {rows} rows on {sbp}"
            with gt.debug.comm_stats() as stats:
                out = x.stft(16, hop_length=4, window=win, return_complex=True)
            assert out.sbp == (sbp,), f"{what}: {out.sbp}"
            assert stats.total_bytes == 0, f"{what}: sent {stats}"
            _close(out, ref.detach(), what)
            (out.abs() * _g(weight, B)).sum().backward()
            _close(x.grad, ref_in.grad, what + " gradient")


CHECKS = ["check_one_hot_and_embedding_bag", "check_attention_with_dropout",
          "check_causal_attention_on_the_math_path", "check_stft_of_a_batch"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
