"""Ops that failed or gave silently wrong values (issues #10 items 4, 14, 15 and #16
item 1): fused optimizers and GradScaler, one_hot / embedding_bag, rules for
interpolate / pixel_shuffle / unfold / repeat, metadata queries, clip_grad_norm_ in one
collective, attention with dropout, out-of-range indices. Values and gradients are
compared with plain torch on the whole tensors, in worlds of 2 and 4 processes.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.testing import no_fallback

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _line():
    return gt.placement("cpu", list(range(gt.get_world_size())))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _g(value, sbp, grad=False, placement=None):
    x = gt.tensor(value, placement=placement or _line(), sbp=sbp)
    return x.requires_grad_() if grad else x


def _close(got, want, what, **tol):
    got = got.full() if isinstance(got, gt.GlobalTensor) else got
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


def _raises(error, fn, what):
    with pytest.raises(error):
        fn()


# --- #10.4: fused optimizers, GradScaler ------------------------------------------------

def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _megatron(name, t):
    return S(0) if name in ("0.weight", "0.bias") else (S(1) if name == "2.weight" else B)


def check_fused_adam_and_adamw():
    x = torch.randn(8, 6, generator=_gen(1))
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        plain = _mlp(0)
        model = gt.nn.to_global(copy.deepcopy(plain), _line(), _megatron)
        opt_plain = cls(plain.parameters(), lr=0.01, fused=True)
        opt = cls(model.parameters(), lr=0.01, fused=True)
        for _ in range(3):
            plain(x).square().mean().backward()
            model(_g(x, S(0))).square().mean().backward()
            opt_plain.step(), opt.step()
            opt_plain.zero_grad(), opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert p.sbp == (_megatron(name, p),), name
            _close(p, q.detach(), f"{cls.__name__}(fused=True) {name}")


def check_grad_scaler_fp16():
    """autocast fp16 + GradScaler: the same steps as plain torch; an inf in one rank's
    part of a gradient makes every rank skip the step and halve the scale."""
    x = torch.randn(8, 6, generator=_gen(2))
    plain = _mlp(1)
    model = gt.nn.to_global(copy.deepcopy(plain), _line(), _megatron)
    runs = []
    for m, inp in ((plain, x), (model, _g(x, S(0)))):
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        runs.append((m, inp, scaler, opt))
    for step in range(3):
        for m, inp, scaler, opt in runs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(inp).float().square().mean()
            scaler.scale(loss).backward()
            if step == 1:  # an overflow in one element (on the last rank's part)
                w = m[0].weight
                if isinstance(w, gt.GlobalTensor):
                    if gt.get_rank() == gt.get_world_size() - 1:
                        w.grad._local[-1, 0] = math.inf
                else:
                    w.grad[-1, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert runs[0][2].get_scale() == runs[1][2].get_scale(), f"step {step}: scale"
    assert runs[1][2].get_scale() == 128.0  # halved once (the overflow), never grown
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        _close(p, q.detach(), f"GradScaler step {name}", rtol=1e-3, atol=1e-3)


# --- #10.4: composites with plain helpers; rules instead of the broadcast fallback -------

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


def _against_torch(fn, value, sbps, what, expect=None, grad=True):
    """fn on each sbp of value: no fallback, output sbp as expected, value and gradient
    equal to plain torch."""
    want_x = value.clone().requires_grad_(grad)
    ref = fn(want_x)
    if grad:
        ref.square().sum().backward()
    for sbp in sbps:
        x = _g(value, sbp, grad=grad)
        out = no_fallback(lambda: fn(x), f"{what} {sbp}")
        if expect is not None:
            assert out.sbp == (expect(sbp),), f"{what} {sbp}: output {out.sbp}"
        _close(out, ref.detach(), f"{what} {sbp}")
        if grad:
            no_fallback(lambda: out.square().sum().backward(), f"{what} {sbp} backward")
            _close(x.grad, want_x.grad, f"{what} {sbp} gradient")


def check_resampling_rules():
    same = lambda s: s  # noqa: E731
    img = torch.randn(4, 16, 6, 6, generator=_gen(5))  # channel counts divide by 4 ranks
    for mode, kw in [("nearest", {}), ("bilinear", {"align_corners": False}),
                     ("bicubic", {"align_corners": True})]:
        _against_torch(lambda x: F.interpolate(x, scale_factor=2, mode=mode, **kw), img,
                       (S(0), S(1), B), f"interpolate {mode}", same)
    _against_torch(lambda x: F.interpolate(x, size=(5,), mode="linear"), img[:, :, 0],
                   (S(0), S(1)), "interpolate linear 1d", same)
    _against_torch(lambda x: F.pixel_shuffle(x, 2), img, (S(0), S(1), B), "pixel_shuffle", same)
    _against_torch(lambda x: F.pixel_unshuffle(x, 2), img, (S(0), S(1), B), "pixel_unshuffle",
                   same)
    _against_torch(lambda x: F.unfold(x, 3, padding=1), img, (S(0), S(1), B), "F.unfold", same)
    cols = torch.randn(4, 16 * 4, 25, generator=_gen(6))
    _against_torch(lambda x: F.fold(x, (6, 6), 2), cols, (S(0), S(1)), "F.fold", same)
    t = torch.randn(4, 10, 3, generator=_gen(7))
    _against_torch(lambda x: x.unfold(1, 3, 2), t, (S(0), S(2)), "Tensor.unfold", same)
    _against_torch(lambda x: x.repeat(1, 2, 1), t, (S(0), S(2)), "repeat", same)
    _against_torch(lambda x: x.repeat(2, 1, 1, 1), t, (S(1), S(2)),
                   "repeat with a new dim", lambda s: S(s.dim + 1))
    # A dim repeated more than once cannot stay split: the value is still right.
    _against_torch(lambda x: x.repeat(2, 1, 1), t, (S(0),), "repeat of a split dim")


def check_metadata_queries():
    x = _g(torch.randn(4, 4), S(0))
    assert no_fallback(lambda: x.is_pinned(), "is_pinned") is False
    assert no_fallback(lambda: x.is_same_size(_g(torch.randn(4, 4), B)), "is_same_size")


# --- #10.14: clip_grad_norm_ --------------------------------------------------------------

def check_clip_grad_norm_reduces_once():
    gen = _gen(8)
    values = [torch.randn(6, 5, generator=gen) for _ in range(16)]
    grads = [torch.randn(6, 5, generator=gen) for _ in range(16)]
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        plain = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(plain, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(plain, 0.5, norm_type=norm_type)
        params = [torch.nn.Parameter(_g(v, S(k % 2))) for k, v in enumerate(values)]
        for k, (p, g) in enumerate(zip(params, grads)):
            p.grad = _g(g, S(k % 2))
        foreach = norm_type != 1.0   # the per-tensor path (foreach=False) too
        with gt.debug.comm_stats() as stats:
            total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type,
                                                   foreach=foreach)
        # One all-reduce of the 16 partial norms per layout kind (split dim 0 and
        # split dim 1 both cut the placement's one axis: one kind).
        assert stats.calls["all_reduce"] == 1, f"norm {norm_type}: {stats}"
        assert stats.total_calls == 1, f"norm {norm_type}: {stats}"
        _close(total, want, f"clip_grad_norm_ total norm {norm_type}")
        for p, q in zip(params, plain):
            _close(p.grad, q.grad, f"clipped gradient, norm {norm_type}")


# --- #10.15: attention ----------------------------------------------------------------

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


def check_attention_kernels_keep_head_split():
    gen = _gen(10)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    for causal in (True, False):
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*want, is_causal=causal)
        ref.square().sum().backward()
        for sbp in (S(0), S(1)):
            ins = [_g(t, sbp, grad=True) for t in (q, k, v)]
            with gt.debug.comm_stats() as stats:
                out = F.scaled_dot_product_attention(*ins, is_causal=causal)
                out.square().sum().backward()
            assert out.sbp == (sbp,)
            assert stats.calls["all_gather"] == 0, stats
            _close(out, ref.detach(), f"attention causal={causal} {sbp}")
            for x, w in zip(ins, want):
                _close(x.grad, w.grad, f"attention causal={causal} {sbp} gradient")


# --- #16.1: out-of-range indices ----------------------------------------------------------

def check_out_of_range_indices_raise_everywhere():
    w = torch.randn(10, 3, generator=_gen(12))
    for bad in ([1, 99, 2, 3], [-1, 2, 0, 0]):
        for w_sbp in (S(0), S(1), B):
            for i_sbp in (S(0), B):
                with pytest.raises(IndexError):
                    F.embedding(_g(torch.tensor(bad), i_sbp), _g(w, w_sbp))
    good = torch.tensor([9, 0, 4, 3])
    _close(F.embedding(_g(good, S(0)), _g(w, S(0))), F.embedding(good, w), "embedding")
    logits = torch.randn(4, 3, generator=_gen(13))
    for x_sbp, t_sbp in [(S(1), B), (S(0), S(0)), (B, B), (S(0), B)]:
        for bad in ([0, 1, 2, 7], [0, -5, 1, 1]):
            with pytest.raises(IndexError):
                F.cross_entropy(_g(logits, x_sbp), _g(torch.tensor(bad), t_sbp))
        ok = torch.tensor([0, -100, 2, 1])
        _close(F.cross_entropy(_g(logits, x_sbp), _g(ok, t_sbp)), F.cross_entropy(logits, ok),
               f"cross_entropy with an ignored target {x_sbp}")


def check_index_check_stays_on_the_placement():
    """Indices on ranks [0, 1] of a world of 4: its members raise; the ranks outside hold
    no index and take no part in the check (in a pipeline they run another stage)."""
    if gt.get_world_size() < 4:
        return
    part = gt.placement("cpu", [0, 1])
    w = _g(torch.randn(10, 3), S(0), placement=part)
    ids = _g(torch.tensor([3, 10]), S(0), placement=part)
    if gt.get_rank() in part:
        with pytest.raises(IndexError):
            F.embedding(ids, w)
    else:
        with gt.debug.comm_stats() as stats:
            out = F.embedding(ids, w)
        assert stats.total_calls == 0 and out.to_local().numel() == 0, stats


def _kernel_signatures(func, *args):
    """The rule's signatures for a kernel, its tensors given on the meta device (the
    CUDA kernels have meta implementations, so their output shapes are real)."""
    from globaltensor.dispatch.call import Call, flatten_args
    from globaltensor.rules.registry import lookup
    p = gt.placement("cpu", [0])
    leaves = [gt.from_local(torch.empty(a.shape), placement=p, sbp=B)
              if isinstance(a, torch.Tensor) else a for a in args]
    out = func(*args)
    outs = [tuple(o.shape) for o in (out if isinstance(out, tuple) else (out,))
            if isinstance(o, torch.Tensor)]
    flat, spec = flatten_args(tuple(leaves), {})
    inputs = [x for x in flat if isinstance(x, gt.GlobalTensor)]
    rule, _ = lookup(func)
    assert rule is not None, f"{func} has no rule"
    call = Call(func, inputs, [tuple(x.shape) for x in inputs], outs, flat, spec, (2,))
    return rule(call, 0) if rule.per_axis else rule(call)


def test_cuda_attention_kernels_keep_batch_and_head_splits():
    aten = torch.ops.aten
    q = torch.empty(2, 4, 8, 16, device="meta")
    bias = torch.empty(1, 4, 8, 8, device="meta")  # broadcast over the batch
    flash = aten._scaled_dot_product_flash_attention.default(q, q, q)
    eff = aten._scaled_dot_product_efficient_attention.default(q, q, q, bias, True)
    cudnn = aten._scaled_dot_product_cudnn_attention.default(q, q, q, None, True)
    cases = {
        "flash": (aten._scaled_dot_product_flash_attention.default, (q, q, q)),
        "efficient": (aten._scaled_dot_product_efficient_attention.default,
                      (q, q, q, bias, True)),
        "cudnn": (aten._scaled_dot_product_cudnn_attention.default, (q, q, q, None, True)),
        "flash backward": (aten._scaled_dot_product_flash_attention_backward.default,
                           (q, q, q, q, flash[0], flash[1], None, None, 8, 8, 0.0, False,
                            flash[6], flash[7])),
        "efficient backward": (aten._scaled_dot_product_efficient_attention_backward.default,
                               (q, q, q, q, bias, eff[0], eff[1], eff[2], eff[3], 0.0,
                                [True, True, True, True])),
        "cudnn backward": (aten._scaled_dot_product_cudnn_attention_backward.default,
                           (q, q, q, q, cudnn[0], cudnn[1], cudnn[6], cudnn[7], None, None,
                            None, 8, 8, 0.0, False)),
    }
    for name, (func, args) in cases.items():
        cands = _kernel_signatures(func, *args)
        for d in (0, 1):
            found = [c for c in cands if c[0][0] == S(d)]
            assert found, f"{name}: no signature for a split on dim {d}: {cands}"
            ins, outs = found[0]
            # every 4-D q/k/v/out/gradient, and the log-sum-exp, keep the split
            assert outs[0] == S(d), (name, d, outs)
            if name.endswith("backward"):
                assert outs[:3] == (S(d),) * 3, (name, d, outs)
            if name == "efficient backward":  # the bias broadcast over the batch
                assert outs[3] == (P if d == 0 else S(1)), (name, d, outs)
            if name == "efficient":
                assert ins[3] == (B if d == 0 else S(1)), (name, d, ins)


CHECKS = ["check_fused_adam_and_adamw", "check_grad_scaler_fp16",
          "check_one_hot_and_embedding_bag", "check_resampling_rules", "check_metadata_queries",
          "check_clip_grad_norm_reduces_once", "check_attention_with_dropout",
          "check_attention_kernels_keep_head_split",
          "check_out_of_range_indices_raise_everywhere", "check_index_check_stays_on_the_placement"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
