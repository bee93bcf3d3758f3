"""The fused attention kernels (rules/attention.py; issue #10 item 15): a batch or
head split stays local, forward and backward, in worlds of 2 and 4 processes; and, in
one process on the meta device, the signatures the rule offers the CUDA flash,
memory-efficient and cuDNN kernels keep batch and head splits.
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


CHECKS = ["check_attention_kernels_keep_head_split"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
