"""Fused optimizers (Adam and AdamW with fused=True), GradScaler with autocast fp16,
and clip_grad_norm_ in one collective (rules/optim.py; issue #10 items 4 and 14), on a
Megatron-style MLP or split gradients. Values are compared with plain torch on the
whole tensors, in worlds of 2 and 4 processes (the optimizers on the op battery's
placements are in test_optim_modules.py).
"""
from __future__ import annotations

import copy
import math

import torch
from check_helpers import B, S, _close, _g, _gen, _line
from mp import checks_in_worlds

import globaltensor as gt


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


CHECKS = ["check_fused_adam_and_adamw", "check_grad_scaler_fp16", "check_clip_grad_norm_reduces_once"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
