"""The fused attention kernels (rules/attention.py; issue #10 item 15): a batch or
head split stays local, forward and backward, in worlds of 2 and 4 processes; and, in
one process on the meta device, the signatures the rule offers the CUDA flash,
memory-efficient and cuDNN kernels keep batch and head splits. torch's inference fast
path (rules/fast_path.py): nn.MultiheadAttention's and nn.TransformerEncoderLayer's
fused kernels run on each rank's samples.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from check_helpers import B, P, S, _close, _g, _gen
from mp import checks_in_worlds

import globaltensor as gt


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


def check_grouped_query_attention_keeps_a_head_split():
    """``enable_gqa``: query head h reads key/value head h // (query heads / key heads).
    A head split of all three stays local where each rank's query heads go with the
    key heads it holds (even parts), and with one key head (multi-query) held whole;
    the rule skipped every head split with differing head counts (all-to-alls). Two key
    heads on 3 or 4 ranks do not line up: right values, with communication."""
    gen, n = _gen(12), gt.get_world_size()
    for kv_heads in (n, 1, 2 * n, 2):
        q = torch.randn(2, 4 * n, 6, 4, generator=gen)
        k, v = (torch.randn(2, kv_heads, 6, 4, generator=gen) for _ in range(2))
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*want, is_causal=True, enable_gqa=True)
        ref.square().sum().backward()
        kv_sbp = B if kv_heads == 1 else S(1)
        ins = [_g(q, S(1), grad=True), _g(k, kv_sbp, grad=True), _g(v, kv_sbp, grad=True)]
        with gt.debug.comm_stats() as stats:
            out = F.scaled_dot_product_attention(*ins, is_causal=True, enable_gqa=True)
            out.square().sum().backward()
        if kv_heads % n == 0 or kv_heads == 1:
            assert out.sbp == (S(1),), out.sbp
            assert stats.calls.keys() <= {"all_reduce"}, (kv_heads, stats)   # (the 0-d sum)
        _close(out, ref.detach(), f"grouped-query attention, {kv_heads} key heads")
        for x, w in zip(ins, want):
            _close(x.grad, w.grad, f"grouped-query attention, {kv_heads} key heads, gradient")


def _kernel_signatures(func, *args):
    """The rule's signatures for a kernel, its tensors given on the meta device (the
    CUDA kernels have meta implementations, so their output shapes are real)."""
    from globaltensor.propagation.call import Call, flatten_args
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


def _fused_kernels_run(fn) -> tuple:
    """``fn()``'s result, the fast path's fused kernels it ran, and its communication."""
    with torch.profiler.profile() as prof, gt.debug.comm_stats() as stats:
        out = fn()
    ran = {e.name for e in prof.events() if e.name in (
        "aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd")}
    return out, ran, stats


def check_inference_fast_paths_run_on_each_ranks_samples():
    """In eval mode without gradients nn.MultiheadAttention runs one fused kernel
    (torch's fast path); on a split batch it failed (an undefined weights output) or
    gathered. Now it runs on the parts, with each kind of mask, communicating nothing;
    nn.TransformerEncoder's padded fast path (nested tensors) and a direct call of the
    encoder layer's fused kernel give one process's values too."""
    import torch.nn as nn
    gen, p = _gen(11), gt.placement.all("cpu")
    x = torch.randn(6, 5, 16, generator=gen)
    pad = torch.zeros(6, 5, dtype=torch.bool)
    pad[1, 3:], pad[4, 1:] = True, True
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    attention = gt.nn.to_global(nn.MultiheadAttention(16, 4, batch_first=True).eval(), p, B)
    attention.load_state_dict(plain.state_dict())
    X, PAD = _g(x, S(0)), _g(pad, S(0))
    for masks in ({"key_padding_mask": PAD}, {"attn_mask": causal},
                  {"key_padding_mask": PAD, "attn_mask": causal}, {}):
        want = plain(x, x, x, need_weights=False, **{k: pad if k == "key_padding_mask" else v
                                                      for k, v in masks.items()})[0]
        with torch.inference_mode():
            (out, weights), ran, stats = _fused_kernels_run(
                lambda: attention(X, X, X, need_weights=False, **masks))
        assert ran == {"aten::_native_multi_head_attention"} and weights is None, ran
        assert out.sbp == (S(0),) and stats.calls == {}, (masks.keys(), stats)
        _close(out, want.detach(), f"fused attention {list(masks)}", atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True),
                                    2).eval()
    g = gt.nn.fully_shard(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).eval(), p)
    g.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        want, got = encoder(x, src_key_padding_mask=pad), g(X, src_key_padding_mask=PAD)
    keep = ~pad[..., None].expand_as(want)    # (the nested path leaves padding at 0)
    torch.testing.assert_close(got.full()[keep], want[keep], atol=1e-5, rtol=1e-5)
    layer = encoder.layers[0]
    weights = [layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias,
               layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias, True, False,
               1e-5, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight, layer.norm2.bias,
               layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias]
    with torch.no_grad():
        want = torch._transformer_encoder_layer_fwd(x, 16, 4, *weights, pad, 1)
        out, ran, stats = _fused_kernels_run(lambda: torch._transformer_encoder_layer_fwd(
            X, 16, 4, *[_g(w, B) if isinstance(w, torch.Tensor) else w for w in weights], PAD, 1))
    assert "aten::_transformer_encoder_layer_fwd" in ran and stats.calls == {}, (ran, stats)
    assert out.sbp == (S(0),)
    keep = ~pad[..., None].expand_as(want)
    torch.testing.assert_close(out.full()[keep], want[keep], atol=1e-5, rtol=1e-5)


CHECKS = ["check_attention_kernels_keep_head_split",
          "check_grouped_query_attention_keeps_a_head_split",
          "check_inference_fast_paths_run_on_each_ranks_samples"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
